"""`model-loader plan`: GPUs per replica, replicas per node and GPU memory, as a table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loader.cli import limit_argument
from loader.errors import LoaderError, SourceError
from loader.limits import GPU_MEMORY_GIB, GPUS_PER_NODE_MOST
from loader.parallel import Parallelism
from loader.plan import MODEL_PRESETS, ModelShape, Topology, format_table, plan_row

#: Explicit model numbers: option -> ModelShape field.
_SHAPE_OPTIONS = {
    "n_embd": "hidden size",
    "n_layer": "layers",
    "n_head": "attention heads",
    "vocab_size": "vocabulary size",
    "n_inner": "MLP width (default 4 x n_embd)",
    "n_positions": "maximum sequence length of the model",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="show how a model fits a GPU node: placement and GPU memory per GPU",
        description="Evaluate tensor-parallel sizes and instance counts against FasterTransformer's "
        "placement rules and a GPU's memory, and print one row per candidate. Exits 2 when no "
        "candidate fits.",
    )
    model = p.add_argument_group("model (one of --source, --model or the explicit numbers)")
    model.add_argument("--source", help="checkpoint directory or file:// URI with config.json")
    model.add_argument(
        "--model",
        type=str.lower,
        choices=sorted(MODEL_PRESETS),
        help="a known model's shape (any letter case)",
    )
    for field, text in _SHAPE_OPTIONS.items():
        model.add_argument(f"--{field.replace('_', '-')}", type=int, dest=field, help=text)
    p.add_argument(
        "--tp-size",
        type=int,
        nargs="+",
        default=None,
        metavar="T",
        help="tensor-parallel sizes to evaluate (default: 1 2 4 8 up to the node)",
    )
    p.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel size P (default 1)")
    p.add_argument(
        "--instance-count",
        type=int,
        nargs="+",
        default=[1],
        metavar="I",
        help="FT instances per replica to evaluate (default 1)",
    )
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs of one node")
    p.add_argument(
        "--replicas-per-node",
        type=int,
        default=None,
        help="Triton replicas per node (default: as many as fit)",
    )
    p.add_argument(
        "--gpus-per-replica", type=int, default=None, help="GPUs one replica sees (default: T x P)"
    )
    limit_argument(
        p,
        "--gpu-memory-gib",
        GPU_MEMORY_GIB,
        help="memory of one GPU (default: not checked, the verdict is `unchecked`)",
    )
    p.add_argument(
        "--dtype",
        choices=("fp16", "fp32"),
        default=None,
        help="weight dtype (default: config.json's, fp16 for --model)",
    )
    p.add_argument(
        "--max-batch-size", type=int, default=8, help="requests one instance batches (default 8)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the rows as JSON (one object per candidate) instead of the table",
    )
    p.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="tokens per sequence the KV cache holds (default: the model's n_positions)",
    )
    p.set_defaults(func=main)


def _shape(args: argparse.Namespace) -> tuple[ModelShape, str, str]:
    """The model's shape, its dtype and a description of where it came from."""
    explicit = {f: getattr(args, f) for f in _SHAPE_OPTIONS if getattr(args, f) is not None}
    chosen = [bool(args.source), bool(args.model), bool(explicit)]
    if sum(chosen) != 1:
        raise LoaderError(
            "Give the model exactly one way.",
            "Pass --source PATH (a checkpoint with config.json), --model NAME, or --n-embd "
            "--n-layer --n-head --vocab-size [--n-inner] [--n-positions].",
        )
    if args.model:
        return MODEL_PRESETS[args.model], "fp16", f"preset {args.model}"
    if explicit:
        config = dict(explicit)
        config.setdefault("n_positions", 2048)
        return ModelShape.from_hf_config(config), "fp16", "the numbers given"
    from loader.sources import parse_uri

    uri = parse_uri(args.source)
    if uri.scheme != "file":
        raise SourceError(
            f"`plan` reads config.json from local checkpoints only, not {uri.scheme}://.",
            "Download the checkpoint's config.json and pass --source with its directory, "
            "or pass --model / the model's numbers.",
        )
    from loader.checkpoint import read_hf_config

    config = read_hf_config(Path(uri.location))
    from loader.formats.huggingface import config_dtype

    return ModelShape.from_hf_config(config), config_dtype(config), str(uri.location)


#: plan's counts: each, when given, at least 1 (0 or less printed rows of negative memory).
_COUNTS = ("gpus_per_node", "gpus_per_replica", "replicas_per_node", "max_batch_size",
           "max_sequence_length")  # fmt: skip


def _check_counts(args: argparse.Namespace) -> None:
    for name in _COUNTS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise LoaderError(f"{flag} must be at least 1, got {value}.", f"Pass {flag} 1 or more.")
    if args.gpus_per_node > GPUS_PER_NODE_MOST:
        raise LoaderError(
            f"--gpus-per-node must be at most {GPUS_PER_NODE_MOST} (the chart's bound), got "
            f"{args.gpus_per_node}.",
            f"Pass the GPUs of one node, 1 to {GPUS_PER_NODE_MOST}.",
        )


def main(args: argparse.Namespace) -> int:
    GPU_MEMORY_GIB.check(args.gpu_memory_gib)
    _check_counts(args)
    shape, source_dtype, origin = _shape(args)
    dtype = args.dtype or source_dtype
    node = args.gpus_per_node
    tps = args.tp_size or [t for t in (1, 2, 4, 8, 16) if t * args.pp_size <= node]
    rows = []
    for tp in tps:
        for count in args.instance_count:
            par = Parallelism(tp, args.pp_size, count)
            per_replica = args.gpus_per_replica or par.gpus_per_instance
            replicas = args.replicas_per_node or max(node // per_replica, 1)
            rows.append(
                plan_row(
                    shape,
                    par,
                    Topology(per_replica, replicas, node),
                    dtype=dtype,
                    max_batch_size=args.max_batch_size,
                    gpu_memory_gib=args.gpu_memory_gib,
                    max_seq_len=args.max_sequence_length,
                )
            )
    seq = args.max_sequence_length or shape.n_positions
    usable = [r for r in rows if r.verdict in USABLE]
    if args.json:
        print(json.dumps([_row_json(r) for r in rows], indent=2))
    else:
        _print_table(args, shape, origin, dtype, seq, rows)
    if not usable:
        raise LoaderError(
            f"no candidate fits a node of {node} GPUs"
            + (f" of {args.gpu_memory_gib:g} GiB" if args.gpu_memory_gib else "")
            + " (every row is invalid or does not fit)",
            "Follow the row's advice above: raise --tp-size (fewer weights per GPU), lower "
            "--max-batch-size or --instance-count, or plan for GPUs with more memory.",
        )
    return 0


#: Verdicts of a candidate that can be deployed.
USABLE = frozenset({"fits", "tight", "unchecked"})


def _row_json(row) -> dict:
    est = row.estimate
    return {
        "tp": row.parallelism.tp,
        "pp": row.parallelism.pp,
        "instance_count": row.parallelism.instance_count,
        "gpus_per_replica": row.topology.gpus_per_replica,
        "replicas_per_node": row.topology.replicas_per_node,
        "weights_bytes_per_gpu": est.weights if est else None,
        "working_bytes_per_gpu": est.working if est else None,
        "total_bytes_per_gpu": est.total if est else None,
        "gpu_memory_gib": row.gpu_memory_gib,
        "headroom_bytes": row.headroom_bytes,
        "verdict": row.verdict,
        "problem": row.problem,
    }


def _print_table(args, shape, origin, dtype, seq, rows) -> None:
    node = args.gpus_per_node
    print(
        f"model: {origin}: {_count(shape.parameters())} parameters "
        f"(n_embd {shape.n_embd}, n_layer {shape.n_layer}, n_head {shape.n_head}, "
        f"vocab {shape.vocab_size}, n_inner {shape.n_inner}); weights {dtype}; "
        f"working memory for batch {args.max_batch_size} x {seq} tokens per instance"
    )
    print(
        f"node: {node} GPUs" + (f" of {args.gpu_memory_gib:g} GiB" if args.gpu_memory_gib else "")
    )
    print()
    print(format_table(rows))


def _count(n: int) -> str:
    """A parameter count for people: 16.03B, 350.1M, 412.3K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)
