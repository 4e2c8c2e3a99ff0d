"""``scripts/bench``: perf_analyzer sweeps printed as our production benchmark tables.

Four modes, one per flag:

* ``--url HOST:PORT --model NAME``: sweep one served model;
* ``--compare TARGET ...``: sweep several model repositories (each served in turn by the local
  CPU Triton) or endpoints, print one table each and the best under ``--max-p95-ms``;
* ``--serving-experiment``: the experiment behind ``make bench-serving``
  (:mod:`loader.bench.experiment`);
* ``--ttft TARGET ...``: time to first token and time per output token of streaming
  repositories or endpoints (:mod:`loader.bench.stream`; also writes ``ttft_tpot.*``).

Tables go to stdout as levels are measured; logs go to stderr. Every mode writes
``tables.txt``, ``results.csv``, ``throughput_vs_p95_latency.png`` and ``summary.txt`` into
``--output-dir``. Arguments after ``--`` are passed to perf_analyzer unchanged.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from loader.bench.arguments import (
    TablePrinter,
    add_measurement_arguments,
    concurrencies_from_args,
    options_from_args,
)
from loader.bench.compare import Target, compare, parse_target
from loader.bench.endpoint import parse_endpoint
from loader.bench.report import summary_text, tables_text, write_report
from loader.bench.results import Sweep, median_sweeps
from loader.bench.stream import add_stream_arguments
from loader.bench.sweep import sweep
from loader.cli import configure_logging, run_command
from loader.errors import LoaderError

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Measure Triton throughput and p95 latency with perf_analyzer over a range "
        "of concurrency levels; print the tables, write CSV and a PNG plot.",
        epilog="Arguments after `--` go to perf_analyzer unchanged. Examples:\n"
        "  scripts/bench --url 127.0.0.1:8001 --protocol grpc --model codegen\n"
        "  scripts/bench --compare i1=/models/a i2=/models/b --max-p95-ms 500\n"
        "  scripts/bench --serving-experiment --output-dir bench/results\n"
        "  scripts/bench --ttft grpc://127.0.0.1:8001 --model codegen --concurrency-range 1:8:1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--url", help="sweep the model served at this endpoint (host:port)")
    mode.add_argument(
        "--compare",
        nargs="+",
        metavar="TARGET",
        help="sweep each [LABEL=]DIR (a model repository, served by the local CPU Triton) or "
        "[LABEL=]HOST:PORT (an endpoint) in turn",
    )
    mode.add_argument(
        "--serving-experiment",
        action="store_true",
        help="instance count 1/2 x dynamic batching off/on on a small model, local CPU Triton",
    )
    mode.add_argument(
        "--ttft",
        nargs="+",
        metavar="TARGET",
        help="time to first token and time per output token (mean, p95) of streaming models, "
        "with a gRPC-stream load generator (not perf_analyzer): each [LABEL=]DIR (a streaming "
        "repository, served by the local CPU Triton) or [LABEL=][grpc://]HOST:PORT in turn",
    )
    parser.add_argument("--model", help="model to measure (default: a repository's ensemble)")
    parser.add_argument("--label", help="name of the configuration in --url mode")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="where tables.txt, results.csv, the PNG and summary.txt go "
        "(default <work-dir>/<UTC time>)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="LABEL",
        help="configuration the summary compares the best one against",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("bench/work"),
        help="scratch space: the experiment's checkpoint and variants, default output "
        "(default bench/work)",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    add_measurement_arguments(parser)
    add_stream_arguments(parser)
    return parser


def _split_extra(argv: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    argv = list(argv)
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], tuple(argv[index + 1 :])
    return argv, ()


def _output_dir(args: argparse.Namespace) -> Path:
    if args.output_dir is not None:
        return Path(args.output_dir)
    return Path(args.work_dir) / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def run_url(args: argparse.Namespace, extra: tuple[str, ...]) -> tuple[list[Sweep], dict]:
    if not args.model:
        raise LoaderError("--url needs --model", "Pass --model NAME (e.g. the ensemble, codegen).")
    endpoint = parse_endpoint(args.url, protocol=args.protocol)
    options = options_from_args(args, extra_args=extra)
    concurrencies = concurrencies_from_args(args)
    args.rounds = args.rounds or 1
    if args.rounds < 1:
        raise LoaderError(f"--rounds must be at least 1, got {args.rounds}", "Pass --rounds 1.")
    printer = TablePrinter(rounds=args.rounds)
    label = args.label or args.model
    rounds = []
    for _ in range(args.rounds):
        printer.start(Target(label=label, endpoint=endpoint))
        result = sweep(
            endpoint,
            args.model,
            concurrencies,
            options=options,
            label=label,
            perf_analyzer=args.perf_analyzer,
            on_measurement=lambda m: printer.measurement(None, m),
        )
        rounds.append([result])
    return median_sweeps(rounds), {"endpoint": str(endpoint), "model": args.model}


def run_compare(args: argparse.Namespace, extra: tuple[str, ...]) -> tuple[list[Sweep], dict]:
    targets = [parse_target(t, protocol=args.protocol) for t in args.compare]
    options = options_from_args(args, extra_args=extra)
    args.rounds = args.rounds or 1
    printer = TablePrinter(rounds=args.rounds, per_round=len(targets))
    sweeps = compare(
        targets,
        concurrencies=concurrencies_from_args(args),
        options=options,
        model=args.model,
        protocol=args.protocol or "http",
        perf_analyzer=args.perf_analyzer,
        log_dir=args.output_dir / "logs",
        on_start=printer.start,
        on_measurement=printer.measurement,
        rounds=args.rounds,
    )
    return sweeps, {}


def run_experiment(args: argparse.Namespace, extra: tuple[str, ...]) -> tuple[list[Sweep], dict]:
    from loader.bench import experiment

    return experiment.run_from_args(args, extra)


def run_ttft(args: argparse.Namespace, extra: tuple[str, ...]) -> tuple[list[Sweep], dict]:
    from loader.bench import stream

    return stream.run_from_args(args, extra)


#: Mode flag (its argparse ``dest``) -> the function that runs it.
MODES: dict[str, Callable[[argparse.Namespace, tuple[str, ...]], tuple[list[Sweep], dict]]] = {
    "url": run_url,
    "compare": run_compare,
    "serving_experiment": run_experiment,
    "ttft": run_ttft,
}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM (and SIGINT, which a shell ignores for background jobs) stops the sweep through
    # KeyboardInterrupt, so the local Triton and perf_analyzer are stopped on the way out.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _main(argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(argv: Sequence[str] | None) -> int:
    own, extra = _split_extra(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    configure_logging(args.verbose, args.quiet)
    args.output_dir = _output_dir(args)
    return run_command(lambda a: _run_mode(a, extra), args)


def _run_mode(args: argparse.Namespace, extra: tuple[str, ...]) -> int:
    mode = next(name for name in MODES if getattr(args, name))
    sweeps, notes = MODES[mode](args, extra)
    baseline = args.baseline or notes.pop("baseline", None)
    if (args.rounds or 1) > 1:
        print(f"\nMedian of {args.rounds} rounds per level\n")
        print(tables_text(sweeps), end="")
    print()
    print(summary_text(sweeps, max_p95_ms=args.max_p95_ms, baseline=baseline), end="")
    paths = write_report(
        sweeps,
        args.output_dir,
        max_p95_ms=args.max_p95_ms,
        baseline=baseline,
        title=notes.pop("title", "Throughput vs. client p95 latency"),
        notes=notes,
    )
    for key, value in notes.items():
        print(f"{key}: {value}")
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0
