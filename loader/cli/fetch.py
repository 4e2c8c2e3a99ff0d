"""`model-loader fetch URI DEST`: download a checkpoint (verified, resumable) on its own."""

from __future__ import annotations

import argparse
import logging

from loader.cli import limit_argument, nonempty, one_line_path, print_path
from loader.errors import LoaderError
from loader.limits import RETRY_DEADLINE_S, SLICE_MIB, WORKERS
from loader.progress import human_bytes

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fetch",
        help="download a checkpoint from gs://, hf:// or a local path",
        description="Fetch the checkpoint at URI into DEST: objects under the URI's prefix land "
        "under DEST with their paths relative to the prefix. Every file is verified before it "
        "is moved into place; a rerun skips verified files and fetches only what is missing. "
        "Prints the local checkpoint directory as the last line.",
    )
    p.add_argument(
        "uri",
        metavar="URI",
        help="gs://BUCKET/PREFIX, hf://ORG/NAME[@REVISION], file:///PATH or a path",
    )
    p.add_argument(
        "dest",
        metavar="DEST",
        type=nonempty,
        nargs="?",
        default=None,
        help="destination directory (not needed for a local source used in place)",
    )
    p.add_argument(
        "--copy",
        action="store_true",
        help="copy a local source into DEST instead of using it in place",
    )
    limit_argument(
        p, "--workers", WORKERS, type=int, help="parallel downloads (default: chosen per source)"
    )
    p.add_argument(
        "--hf-token-file",
        default=None,
        type=token_file,
        help="file holding a Hugging Face token (default: $HF_TOKEN, else the file named by "
        "$HF_TOKEN_PATH or $HF_TOKEN_FILE, else the token `hf auth login` stored)",
    )
    limit_argument(
        p,
        "--retry-deadline",
        RETRY_DEADLINE_S,
        metavar="SECONDS",
        help="total time to keep retrying transient failures",
    )
    limit_argument(
        p,
        "--slice-mib",
        SLICE_MIB,
        type=int,
        help="byte-range slice size for large gs:// objects, in MiB (each of the --workers "
        "downloads holds one slice in memory)",
    )
    p.set_defaults(func=run, writes_below="DEST")


def token_file(value: str) -> str:
    """An argparse ``type`` for ``--hf-token-file``: an empty name (an unset variable in a
    script) is refused, never taken for no file (the fetch would go on with another token)."""
    if not value:
        raise argparse.ArgumentTypeError(
            "an empty name names no token file (is a variable in the command unset?); drop "
            "the option to use $HF_TOKEN or the stored login"
        )
    return value


def _is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def run(args: argparse.Namespace) -> int:
    from loader.sources import fetch

    SLICE_MIB.check(args.slice_mib)
    one_line_path("DEST", args.dest)
    if _is_local(args.uri) and not args.copy:
        one_line_path("URI", args.uri)  # printed as the result: used in place
    if args.dest is not None and not args.copy and _is_local(args.uri):
        raise LoaderError(
            f"{args.uri} is a local checkpoint, used in place: DEST ({args.dest}) would be ignored",
            "Pass --copy to copy it into DEST, or drop DEST to use it where it is.",
        )

    from loader import fs

    with fs.confined(args.dest):  # below DEST, no link is followed
        result = fetch(
            args.uri,
            args.dest,
            copy=args.copy,
            workers=args.workers,
            hf_token_file=args.hf_token_file,
            retry_deadline_s=args.retry_deadline,
            slice_bytes=args.slice_mib * 1024 * 1024,
        )
    log.info(
        "fetched %s files (%s, %s downloaded now) from %s, revision %s",
        len(result.files),
        human_bytes(result.bytes),
        human_bytes(result.downloaded_bytes),
        args.uri,
        result.revision or "-",
    )
    print_path(result.path)
    return 0
