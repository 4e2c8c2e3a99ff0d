"""Command-line pieces shared by ``scripts/bench`` and ``model-loader tune``.

The measurement flags map one to one onto perf_analyzer's own; :func:`options_from_args` builds
the :class:`~loader.bench.perf_analyzer.PerfAnalyzerOptions`. :class:`TablePrinter` prints the
seed's table lines to stdout while a sweep runs (logs go to stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import IO

from loader.bench.compare import Target
from loader.bench.perf_analyzer import PROJECT_ROOT, PerfAnalyzerOptions
from loader.bench.report import bullet
from loader.bench.results import TABLE_HEADER, Measurement, format_line
from loader.bench.sweep import parse_concurrency_range
from loader.errors import LoaderError

#: The request our users send (the production merge request's perf_analyzer input).
DEFAULT_INPUT_DATA = PROJECT_ROOT / "bench" / "test.json"
DEFAULT_CONCURRENCY_RANGE = "1:16:5"


def add_measurement_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("measurement (perf_analyzer)")
    group.add_argument(
        "--concurrency-range",
        default=None,
        metavar="START:END:STEP",
        help=f"concurrency levels, END included (default {DEFAULT_CONCURRENCY_RANGE}; "
        "1:16:3 for --serving-experiment)",
    )
    group.add_argument(
        "--input-data",
        type=Path,
        default=None,
        metavar="JSON",
        help="requests in perf_analyzer's JSON format (default: bench/test.json, the "
        "production request)",
    )
    group.add_argument(
        "--measurement-mode",
        choices=("time_windows", "count_windows"),
        default=None,
        help="perf_analyzer's stabilisation windows (default: time_windows)",
    )
    group.add_argument(
        "--measurement-interval-ms",
        type=int,
        default=None,
        metavar="MS",
        help="length of a time window (perf_analyzer default 5000)",
    )
    group.add_argument(
        "--measurement-request-count",
        type=int,
        default=None,
        metavar="N",
        help="requests per count window (perf_analyzer default 50)",
    )
    group.add_argument(
        "--stability-percentage",
        type=float,
        default=None,
        metavar="PCT",
        help="how far 3 windows may differ to count as stable (perf_analyzer default 10)",
    )
    group.add_argument(
        "--max-trials",
        type=int,
        default=None,
        metavar="N",
        help="windows before a level counts as unstable (perf_analyzer default 10)",
    )
    group.add_argument(
        "--streaming",
        action="store_true",
        help="stream responses (decoupled models; gRPC only)",
    )
    group.add_argument(
        "--protocol",
        choices=("http", "grpc"),
        default=None,
        help="protocol perf_analyzer speaks (default http, or the scheme of --url)",
    )
    group.add_argument(
        "--perf-analyzer",
        default=None,
        metavar="PATH",
        help="the perf_analyzer binary (default: on PATH, else .tools/bin/perf_analyzer)",
    )
    group.add_argument(
        "--max-p95-ms",
        type=float,
        default=None,
        metavar="MS",
        help="latency budget: the best configuration must keep p95 latency within it",
    )
    group.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="N",
        help="sweep every configuration N times, round after round, and report each level's "
        "median (default 1; 5 for --serving-experiment)",
    )


def concurrencies_from_args(args: argparse.Namespace) -> list[int]:
    return parse_concurrency_range(args.concurrency_range or DEFAULT_CONCURRENCY_RANGE)


def input_data_path(args: argparse.Namespace) -> Path:
    path = Path(args.input_data) if args.input_data is not None else DEFAULT_INPUT_DATA
    if not path.is_file():
        raise LoaderError(
            f"input data file {path} does not exist",
            "Pass --input-data with a JSON file in perf_analyzer's format "
            "(bench/test.json in the project is the production request).",
        )
    return path.resolve()


def options_from_args(
    args: argparse.Namespace, *, extra_args: tuple[str, ...] = ()
) -> PerfAnalyzerOptions:
    for name in ("measurement_interval_ms", "measurement_request_count", "max_trials"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise LoaderError(f"{flag} must be at least 1, got {value}", f"Pass {flag} 1 or more.")
    return PerfAnalyzerOptions(
        input_data=input_data_path(args),
        measurement_mode=args.measurement_mode,
        measurement_interval_ms=args.measurement_interval_ms,
        measurement_request_count=args.measurement_request_count,
        stability_percentage=args.stability_percentage,
        max_trials=args.max_trials,
        streaming=args.streaming,
        extra_args=extra_args,
    )


class TablePrinter:
    """Prints a heading per configuration and the table lines as they are measured."""

    def __init__(
        self, stream: IO[str] | None = None, *, rounds: int = 1, per_round: int = 1
    ) -> None:
        self.stream = stream or sys.stdout
        self.count = 0
        self.rounds = rounds
        self.per_round = per_round

    def _print(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def start(self, target: Target) -> None:
        self.count += 1
        if self.count > 1:
            self._print()
        heading = f"Benchmark {self.count}: {target.label}"
        if self.rounds > 1:
            heading += f" (round {(self.count - 1) // self.per_round + 1} of {self.rounds})"
        self._print(heading)
        if target.settings:
            self._print()
            for key, value in target.settings.items():
                self._print(bullet(key, value))
        self._print()
        self._print(TABLE_HEADER)

    def measurement(self, target: Target | None, m: Measurement) -> None:
        self._print(format_line(m))
