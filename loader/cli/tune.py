"""`model-loader tune`: measure instance count x dynamic batching, print the values to use."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loader.bench.tune import DEFAULT_TOLERANCE
from loader.cli import directory_path
from loader.errors import LoaderError

#: Rounds by default: a choice is certain only when at least two rounds agree.
ROUNDS = 2
#: The run's cap by default (each level of each variant and request file takes a while).
MAX_MINUTES = 20.0


def register(subparsers: argparse._SubParsersAction) -> None:
    from loader.cli.measurement import add_measurement_arguments

    p = subparsers.add_parser(
        "tune",
        help="measure instance counts and dynamic batching; print the values to use",
        description="Serve variants of a published repository (instance count 1..K x dynamic "
        "batching off/on) one after the other with the local CPU Triton, sweep each with "
        "perf_analyzer and every request file, and print the best stable one under the "
        "latency budget as the lines to paste into values/<cluster>.yaml. Needs the [serve] "
        "and [bench] extras and perf_analyzer.",
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
        "--instance-counts",
        type=int,
        nargs="+",
        default=None,
        metavar="I",
        help="try exactly these instance counts (instead of 1..K)",
    )
    p.add_argument(
        "--preferred-batch-size",
        type=int,
        nargs="+",
        default=[4, 8],
        metavar="N",
        help="preferred batch sizes with dynamic batching on (default 4 8)",
    )
    p.add_argument(
        "--max-queue-delay-us",
        type=int,
        default=100,
        metavar="US",
        help="how long the dynamic batcher waits to fill a batch (default 100)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="scores within this fraction of the best count as a tie, which goes to fewer "
        f"instances (default {DEFAULT_TOLERANCE})",
    )
    p.add_argument(
        "--work-dir",
        type=directory_path,
        default=None,
        help="where the variants and server logs go (default bench/work/tune-<UTC time>)",
    )
    p.add_argument(
        "--output-dir",
        type=directory_path,
        default=None,
        help="tables, CSV, plot and summary (default: <work-dir>/results)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results an earlier run left in --output-dir (refused otherwise)",
    )
    add_measurement_arguments(p, default_rounds=str(ROUNDS), default_minutes=f"{MAX_MINUTES:g}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loader.cli import require_extra

    require_extra("serve", "pytriton")
    require_extra("bench", "matplotlib")
    from loader.bench.report import Report, TablePrinter, check_output_dir, write_report
    from loader.bench.tune import TuneResult, plan_variants, tune, values_snippet
    from loader.cli.measurement import settings_from_args
    from loader.limits import INSTANCE_COUNT_MOST

    if not 1 <= args.max_instances <= INSTANCE_COUNT_MOST:
        raise LoaderError(
            f"--max-instances must be from 1 to {INSTANCE_COUNT_MOST} (the chart's bound for "
            f"triton.instanceCount), got {args.max_instances}",
            f"Pass --max-instances 1 to {INSTANCE_COUNT_MOST}.",
        )
    if not 0 <= args.tolerance < 1:
        raise LoaderError(
            f"--tolerance must be in [0, 1), got {args.tolerance}", "Pass e.g. --tolerance 0.05."
        )
    from loader.bench.experiment import MEASUREMENT_DEFAULTS

    # The serving experiment's windows: counted requests, the stability test at 25 %.
    settings = settings_from_args(
        args, defaults=MEASUREMENT_DEFAULTS, default_rounds=ROUNDS, default_minutes=MAX_MINUTES
    )
    counts = args.instance_counts or list(range(1, args.max_instances + 1))
    planned = plan_variants(
        counts,
        preferred_batch_sizes=args.preferred_batch_size,
        max_queue_delay_us=args.max_queue_delay_us,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    work_dir = args.work_dir or Path("bench/work") / f"tune-{stamp}"
    out = args.output_dir or work_dir / "results"
    check_output_dir(out, overwrite=args.overwrite)
    printer = TablePrinter(rounds=settings.rounds, per_round=len(planned) * len(settings.workloads))

    def report(result: TuneResult, status: str) -> Report:
        return Report(
            sweeps=result.sweeps,
            title=f"model-loader tune: {args.repository.name}",
            baseline=planned[0].label,
            rounds=settings.rounds,
            by_round=result.by_round,
            status=f"{status}\nRecommendation: {result.verdict}",
            request_files=settings.request_files(),
        )

    latest: list[TuneResult] = []

    def partial(result: TuneResult) -> None:
        latest[:] = [result]
        write_report(report(result, "PARTIAL: the run goes on."), out, plot=False)

    try:
        result = tune(
            args.repository,
            settings,
            work_dir=work_dir,
            planned=planned,
            tolerance=args.tolerance,
            on_start=lambda t, workload: printer.start(t.label, t.settings, workload),
            on_measurement=lambda t, m: printer.measurement(m),
            on_partial=partial,
        )
    except KeyboardInterrupt:
        if latest:
            write_report(report(latest[0], "INTERRUPTED: the results so far."), out)
            print(f"\ninterrupted; the results so far are in {out}", file=sys.stderr)
        raise
    status = "Complete." if result.complete else "CUT SHORT by the time cap (--max-minutes)."
    paths = write_report(report(result, status), out, max_p95_ms=args.max_p95_ms)
    print()
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    if result.unstable:
        print(f"\nUnstable levels (reported, not considered): {len(result.unstable)}")
        for sweep, m in result.unstable:
            print(f"  {sweep.name} at concurrency {m.concurrency}: {m.note}")
    if result.choice is None:
        budget = f"{args.max_p95_ms:g} ms" if args.max_p95_ms is not None else "the budget"
        raise LoaderError(
            f"no configuration has a stable level with p95 latency within {budget}; every "
            f"result is in {paths['tables']}",
            "Raise --max-p95-ms, lower --concurrency-range, or measure longer "
            "(--measurement-request-count, --widenings) on a quieter machine.",
        )
    print(f"\nRecommendation: {result.verdict}")
    if not result.certain:
        print(
            "No values to paste: the measurements cannot tell the configurations apart on "
            "this machine now. Measure on a quieter machine, with more --rounds (and "
            "--max-minutes), or keep the chart's defaults."
        )
        return 0
    print()
    print(values_snippet(result.choice, max_p95_ms=args.max_p95_ms), end="")
    return 0
