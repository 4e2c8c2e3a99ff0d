"""``scripts/bench``: perf_analyzer sweeps printed as our production benchmark tables.

Four modes, one per flag, each a function of :data:`MODES` that returns a
:class:`~loader.bench.report.Report`:

* ``--url HOST:PORT --model NAME``: sweep one served model;
* ``--compare TARGET ...``: sweep several model repositories (each served in turn by the local
  CPU Triton) or endpoints, print one table each and the best under ``--max-p95-ms``;
* ``--serving-experiment``: the experiment behind ``make bench-serving``
  (:mod:`loader.bench.experiment`);
* ``--ttft TARGET ...``: time to first token and time per output token of streaming
  repositories or endpoints (:mod:`loader.bench.stream`; also writes ``ttft_tpot.*``).

Tables go to stdout as levels are measured; logs go to stderr. Every mode writes
``tables.txt``, ``results.csv``, ``throughput_vs_p95_latency.png`` and ``summary.txt`` into
``--output-dir``; ``--serving-experiment`` also ``README.md``, from those files
(:mod:`loader.bench.serving_readme`). Arguments after ``--`` are passed to perf_analyzer unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from loader.bench.compare import Comparison, Target, compare, parse_target
from loader.bench.report import (
    Report,
    TablePrinter,
    check_output_dir,
    summary_text,
    tables_text,
    write_report,
)
from loader.bench.stream import DEFAULT_MAX_SECONDS, DEFAULT_REQUESTS
from loader.cli import (
    Parser,
    add_log_options,
    configure_logging,
    directory_path,
    limit_argument,
    report,
    require_extra,
    run_command,
)
from loader.cli.measurement import (
    add_measurement_arguments,
    demo_request_files,
    production_request_file,
    settings_from_args,
)
from loader.endpoint import parse_endpoint
from loader.errors import LoaderError
from loader.limits import REQUESTS_PER_LEVEL, SECONDS_PER_LEVEL

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    from loader.bench import experiment

    parser = Parser(
        prog="scripts/bench",
        description="Measure Triton throughput and p95 latency with perf_analyzer over a range "
        "of concurrency levels; print the tables, write CSV and a PNG plot.",
        epilog="Arguments after `--` go to perf_analyzer unchanged. Examples:\n"
        "  scripts/bench --url 127.0.0.1:8001 --model codegen   # gRPC; http://HOST:8000 for HTTP\n"
        "  scripts/bench --compare i1=/models/a i2=/models/b --max-p95-ms 500\n"
        "  scripts/bench --serving-experiment --output-dir bench/results/serving\n"
        "  scripts/bench --ttft grpc://127.0.0.1:8001 --model codegen --concurrency-range 1:8:1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--url",
        help="sweep the model served at this endpoint: HOST:PORT (gRPC), grpc://HOST:PORT or "
        "http://HOST:PORT",
    )
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
        help="instance count 1/2 x dynamic batching off/on on a small model, local CPU Triton, "
        "with the production request and the mix of prompt lengths",
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
    parser.add_argument("--label", help="name of the configuration in --url and --ttft modes")
    parser.add_argument(
        "--output-dir",
        type=directory_path,
        default=None,
        help="where tables.txt, results.csv, the PNG and summary.txt go "
        "(default <work-dir>/<UTC time>)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results an earlier run left in --output-dir (refused otherwise)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="LABEL",
        help="configuration the summary compares the best one against "
        f"(default: none; {experiment.BASELINE} for --serving-experiment)",
    )
    parser.add_argument(
        "--work-dir",
        type=directory_path,
        default=Path("bench/work"),
        help="scratch space: the experiment's checkpoint and variants, default output "
        "(default bench/work)",
    )
    add_log_options(parser)
    add_measurement_arguments(
        parser,
        default_rounds=f"1; {experiment.ROUNDS} for --serving-experiment",
        default_range=f"1:16:5; {experiment.CONCURRENCY_RANGE} for --serving-experiment",
        default_inputs="bench/test.json, the production request; for --serving-experiment "
        "bench/demo/test.json and bench/demo/mixed.json, the production request and a mix of "
        "prompt lengths with the demo model's ids",
        default_minutes=f"no cap; {experiment.MAX_MINUTES:g} for --serving-experiment",
    )
    group = parser.add_argument_group("TTFT / TPOT (--ttft, streaming models)")
    limit_argument(
        group,
        "--requests-per-level",
        REQUESTS_PER_LEVEL,
        type=int,
        default=DEFAULT_REQUESTS,
        metavar="N",
        help="requests sent per concurrency level",
    )
    limit_argument(
        group,
        "--max-seconds-per-level",
        SECONDS_PER_LEVEL,
        default=DEFAULT_MAX_SECONDS,
        metavar="S",
        help="stop sending new requests at a level after this long",
    )
    return parser


def _split_extra(argv: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    argv = list(argv)
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], tuple(argv[index + 1 :])
    return argv, ()


def output_dir(args: argparse.Namespace) -> Path:
    if args.output_dir is not None:
        return Path(args.output_dir)
    return Path(args.work_dir) / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def _printer(settings, per_round: int = 1) -> TablePrinter:
    return TablePrinter(rounds=settings.rounds, per_round=per_round * len(settings.workloads))


def run_url(args: argparse.Namespace, extra: tuple[str, ...], out: Path) -> Report:
    if not args.model:
        raise LoaderError("--url needs --model", "Pass --model NAME (e.g. the ensemble, codegen).")
    endpoint = parse_endpoint(args.url, protocol=args.protocol)
    settings = settings_from_args(
        args, extra_args=extra, request_files=production_request_file,
        default_protocol=endpoint.protocol,
    )  # fmt: skip
    target = Target(label=args.label or args.model, endpoint=endpoint)
    return _compared(
        [target], settings, args, out, notes={"endpoint": str(endpoint), "model": args.model}
    )


def run_compare(args: argparse.Namespace, extra: tuple[str, ...], out: Path) -> Report:
    targets = [parse_target(t, protocol=args.protocol) for t in args.compare]
    settings = settings_from_args(args, extra_args=extra, request_files=production_request_file)
    return _compared(targets, settings, args, out)


def _compared(
    targets: list[Target],
    settings,
    args: argparse.Namespace,
    out: Path,
    notes: dict[str, str] | None = None,
) -> Report:
    """Sweep the targets (:func:`~loader.bench.compare.compare`), writing partial results."""
    printer = _printer(settings, per_round=len(targets))

    def report(comparison: Comparison, *, final: bool) -> Report:
        done = f"{comparison.measured} of {comparison.planned} measurements"
        status = (
            f"PARTIAL: {done} so far; the run goes on."
            if not final
            else f"Complete: {done}."
            if comparison.complete
            else f"CUT SHORT by the time cap: {done}."
        )
        return Report(
            sweeps=comparison.sweeps,
            baseline=args.baseline,
            rounds=settings.rounds,
            by_round=comparison.by_round,
            status=status,
            notes=notes or {},
            request_files=settings.request_files(),
        )

    comparison = compare(
        targets,
        settings,
        log_dir=out / "logs",
        on_start=lambda t, workload: printer.start(t.label, t.settings, workload),
        on_measurement=lambda t, m: printer.measurement(m),
        on_partial=lambda c: PARTIAL.write(report(c, final=False)),
    )
    return report(comparison, final=True)


def run_experiment(args: argparse.Namespace, extra: tuple[str, ...], out: Path) -> Report:
    require_extra("bench", "matplotlib", "tokenizers", "transformers", "pytriton")
    from loader.bench import experiment

    settings = settings_from_args(
        args,
        extra_args=extra,
        defaults=experiment.MEASUREMENT_DEFAULTS,
        default_rounds=experiment.ROUNDS,
        default_range=experiment.CONCURRENCY_RANGE,
        default_minutes=experiment.MAX_MINUTES,
        request_files=demo_request_files,
    )
    printer = _printer(settings, per_round=len(experiment.INSTANCE_COUNTS) * 2)
    report = experiment.run_experiment(
        Path(args.work_dir),
        settings,
        concurrency_range=args.concurrency_range or experiment.CONCURRENCY_RANGE,
        command=getattr(args, "command_line", ""),
        on_start=lambda t, workload: printer.start(t.label, t.settings, workload),
        on_measurement=lambda t, m: printer.measurement(m),
        on_partial=PARTIAL.write,
    )
    return dataclasses.replace(
        report, baseline=args.baseline or report.baseline, rounds=settings.rounds
    )


def run_ttft(args: argparse.Namespace, extra: tuple[str, ...], out: Path) -> Report:
    from loader.bench.stream import format_line, heading, stream_targets, write_stream_report
    from loader.bench.sweep import parse_concurrency_range
    from loader.completion import load_request

    if extra:
        raise LoaderError(
            "--ttft does not run perf_analyzer, so it takes no arguments after --",
            "Drop the arguments after --.",
        )
    REQUESTS_PER_LEVEL.check(args.requests_per_level)
    SECONDS_PER_LEVEL.check(args.max_seconds_per_level)
    targets = [parse_target(t, protocol=args.protocol or "grpc") for t in args.ttft]
    if len(targets) == 1 and args.label:
        targets = [dataclasses.replace(targets[0], label=args.label)]
    [request_file] = (args.input_data or production_request_file())[:1]
    results = stream_targets(
        targets,
        load_request(request_file),
        parse_concurrency_range(args.concurrency_range or "1:16:5"),
        model=args.model,
        requests=args.requests_per_level,
        max_seconds=args.max_seconds_per_level,
        log_dir=out / "logs",
        on_start=lambda n, t, s: print(heading(n, t.label, s), flush=True),
        on_level=lambda level: print(format_line(level), flush=True),
    )
    return Report(
        sweeps=[r.as_sweep() for r in results],
        title="Streaming: throughput vs. client p95 latency",
        baseline=args.baseline,
        files=write_stream_report(results, out),
    )


#: Mode flag (its argparse ``dest``) -> the function that runs it.
MODES: dict[str, Callable[[argparse.Namespace, tuple[str, ...], Path], Report]] = {
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
    # What the summary and the README name as the command that made the results.
    args.command_line = shlex.join(["scripts/bench", *own, *(["--", *extra] if extra else [])])
    try:
        configure_logging(args.verbose, args.quiet)
    except LoaderError as exc:
        return report(exc)
    return run_command(lambda a: _run_mode(a, extra), args)


class PartialResults:
    """Writes the report so far (tables, CSV, summary; the plot only at the end) after every
    level, so a run that is interrupted or cut short leaves what it measured."""

    def __init__(self) -> None:
        self.out: Path | None = None
        self.max_p95_ms: float | None = None
        self.latest: Report | None = None

    def write(self, report: Report) -> None:
        self.latest = report
        if self.out is not None:
            write_report(report, self.out, max_p95_ms=self.max_p95_ms, plot=False)

    def interrupted(self) -> None:
        if self.out is not None and self.latest is not None:
            status = self.latest.status.replace("PARTIAL", "INTERRUPTED", 1).replace(
                "; the run goes on.", "; the run was interrupted."
            )
            report = dataclasses.replace(self.latest, status=status)
            write_report(report, self.out, max_p95_ms=self.max_p95_ms)
            print(f"\ninterrupted; the results so far are in {self.out}", file=sys.stderr)


PARTIAL = PartialResults()


def _run_mode(args: argparse.Namespace, extra: tuple[str, ...]) -> int:
    mode = next(name for name in MODES if getattr(args, name))
    out = output_dir(args)
    check_output_dir(out, overwrite=args.overwrite)
    PARTIAL.out, PARTIAL.max_p95_ms, PARTIAL.latest = out, args.max_p95_ms, None
    try:
        report = MODES[mode](args, extra, out)
    except KeyboardInterrupt:
        PARTIAL.interrupted()
        raise
    if report.rounds > 1:
        print(f"\nMedian of {report.rounds} rounds per level\n")
        print(tables_text(report.sweeps), end="")
    print()
    if report.status:
        print(report.status)
    summary = summary_text(
        report.sweeps, max_p95_ms=args.max_p95_ms, baseline=report.baseline,
        by_round=report.by_round,
    )  # fmt: skip
    print(summary, end="")
    paths = {**report.files, **write_report(report, out, max_p95_ms=args.max_p95_ms)}
    for key, value in report.notes.items():
        print(f"{key}: {value}")
    if report.values:
        print(f"values:\n{report.values}", end="")
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0
