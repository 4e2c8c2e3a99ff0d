"""`model-loader convert`: Hugging Face checkpoint directory -> FasterTransformer files."""

from __future__ import annotations

import argparse

from loader.cli import limit_argument, nonempty
from loader.limits import WORKERS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a checkpoint to the FasterTransformer format",
        description="Convert a Hugging Face checkpoint directory to "
        "OUTPUT_DIR/<T>-gpu/ in the FasterTransformer GPT-J format.",
    )
    p.add_argument("source_dir", metavar="SOURCE_DIR", type=nonempty)
    p.add_argument("output_dir", metavar="OUTPUT_DIR", type=nonempty)
    p.add_argument("--tp-size", type=int, required=True, help="tensor-parallel size T")
    p.add_argument(
        "--pp-size",
        type=int,
        default=1,
        help="pipeline-parallel size the model will run with (checked only)",
    )
    p.add_argument("--dtype", default=None, help="fp16 or fp32 (default: the source's dtype)")
    limit_argument(
        p, "--workers", WORKERS, type=int, help="worker threads (default: CPU count, at most 4)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUTPUT_DIR/<T>-gpu if it exists and holds only a conversion's files "
        "(config.ini, *.bin), atomically",
    )
    p.set_defaults(func=run, writes_below="OUTPUT_DIR")


def run(args: argparse.Namespace) -> int:
    from loader import fs
    from loader.cli import one_line_path, print_path
    from loader.convert import convert_checkpoint

    one_line_path("OUTPUT_DIR", args.output_dir)

    # SIGTERM unwinds like Ctrl-C (loader.cli.run_command), so temp files are removed.
    with fs.confined(args.output_dir), fs.followed(args.source_dir):
        result = convert_checkpoint(
            args.source_dir,
            args.output_dir,
            tp_size=args.tp_size,
            pp_size=args.pp_size,
            dtype=args.dtype,
            workers=args.workers,
            overwrite=args.force,
        )
    print_path(result.output_path.resolve())
    return 0
