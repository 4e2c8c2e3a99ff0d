"""`model-loader tune`: measure instance count x dynamic batching, print the values to use."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loader.bench.arguments import (
    TablePrinter,
    add_measurement_arguments,
    concurrencies_from_args,
    options_from_args,
)
from loader.bench.report import tables_text, write_report
from loader.errors import LoaderError
from loader.tune import DEFAULT_TOLERANCE, tune, values_snippet


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune",
        help="measure instance counts and dynamic batching; print the values to use",
        description="Serve variants of a published repository (instance count 1..K x dynamic "
        "batching off/on) one after the other with the local CPU Triton, sweep each with "
        "perf_analyzer, and print the best one under the latency budget as the lines to paste "
        "into values/<cluster>.yaml.",
    )
    p.add_argument(
        "--repository",
        required=True,
        type=Path,
        metavar="DIR",
        help="a published repository (the path `model-loader run` printed)",
    )
    p.add_argument("--model", default=None, help="model to measure (default: the ensemble)")
    counts = p.add_mutually_exclusive_group()
    counts.add_argument(
        "--max-instances", type=int, default=2, metavar="K", help="try 1..K instances (default 2)"
    )
    counts.add_argument(
        "--instance-counts", type=int, nargs="+", default=None, metavar="I", help="try these"
    )
    p.add_argument(
        "--preferred-batch-size",
        type=int,
        nargs="+",
        default=[4, 8],
        metavar="N",
        help="preferred batch sizes with dynamic batching on (default 4 8)",
    )
    p.add_argument("--max-queue-delay-us", type=int, default=100, metavar="US")
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="throughputs within this fraction of the best count as a tie, which goes to fewer "
        f"instances (default {DEFAULT_TOLERANCE})",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where the variants and server logs go (default bench/work/tune-<UTC time>)",
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="tables, CSV, plot and summary (default: <work-dir>/results)",
    )
    add_measurement_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_instances < 1:
        raise LoaderError(
            f"--max-instances must be at least 1, got {args.max_instances}",
            "Pass --max-instances 1 or more.",
        )
    if not 0 <= args.tolerance < 1:
        raise LoaderError(
            f"--tolerance must be in [0, 1), got {args.tolerance}", "Pass e.g. --tolerance 0.05."
        )
    counts = args.instance_counts or list(range(1, args.max_instances + 1))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    work_dir = args.work_dir or Path("bench/work") / f"tune-{stamp}"
    rounds = args.rounds or 1
    printer = TablePrinter(rounds=rounds, per_round=2 * len(set(counts)))
    result = tune(
        args.repository,
        work_dir=work_dir,
        instance_counts=counts,
        concurrencies=concurrencies_from_args(args),
        options=options_from_args(args),
        preferred_batch_sizes=args.preferred_batch_size,
        max_queue_delay_us=args.max_queue_delay_us,
        max_p95_ms=args.max_p95_ms,
        tolerance=args.tolerance,
        model=args.model,
        protocol=args.protocol or "http",
        perf_analyzer=args.perf_analyzer,
        on_start=printer.start,
        on_measurement=printer.measurement,
        rounds=rounds,
    )
    paths = write_report(
        result.sweeps,
        args.output_dir or work_dir / "results",
        max_p95_ms=args.max_p95_ms,
        baseline=result.sweeps[0].label,
        title=f"model-loader tune: {args.repository.name}",
    )
    print()
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    variant = result.winning_variant
    if variant is None or result.winner is None:
        budget = f"{args.max_p95_ms:g} ms" if args.max_p95_ms is not None else "the budget"
        raise LoaderError(
            f"no configuration kept p95 latency within {budget}:\n{tables_text(result.sweeps)}",
            "Raise --max-p95-ms, lower --concurrency-range, or give the model more resources.",
        )
    print()
    print(
        values_snippet(
            variant,
            result.winner.measurement,
            label=variant.label,
            max_p95_ms=args.max_p95_ms,
        ),
        end="",
    )
    return 0
