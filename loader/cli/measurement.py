"""Measurement flags shared by ``scripts/bench`` and ``model-loader tune``, and the
:class:`~loader.bench.settings.SweepSettings` they build.

The perf_analyzer flags map one to one onto perf_analyzer's own; an unset flag keeps the
default of the command (perf_analyzer's, or the serving experiment's).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

from loader.bench.perf_analyzer import DEFAULT_WIDENINGS, PerfAnalyzerOptions
from loader.bench.settings import (
    MIXED_REQUESTS,
    PRODUCTION_REQUEST,
    SweepSettings,
    find_request_file,
    workloads_from_paths,
)
from loader.bench.sweep import parse_concurrency_range
from loader.cli import limit_argument
from loader.errors import LoaderError
from loader.limits import STABILITY_PERCENTAGE

DEFAULT_CONCURRENCY_RANGE = "1:16:5"


#: What --input-data defaults to, in words, per default.
BOTH_REQUEST_FILES = (
    f"bench/{PRODUCTION_REQUEST}, the production request, and bench/{MIXED_REQUESTS}, "
    "a mix of prompt lengths"
)


def add_measurement_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_rounds: str = "1",
    default_range: str = DEFAULT_CONCURRENCY_RANGE,
    default_inputs: str = BOTH_REQUEST_FILES,
    default_minutes: str = "no cap",
) -> None:
    group = parser.add_argument_group("measurement (perf_analyzer)")
    group.add_argument(
        "--concurrency-range",
        default=None,
        metavar="START:END:STEP",
        help="concurrency levels, END included "
        f"(default {default_range or DEFAULT_CONCURRENCY_RANGE})",
    )
    group.add_argument(
        "--input-data",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="request files in perf_analyzer's JSON format; every configuration is measured "
        f"with each (default: {default_inputs})",
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
    limit_argument(
        group,
        "--stability-percentage",
        STABILITY_PERCENTAGE,
        metavar="PCT",
        help="how far the 3 windows of a level may differ to count as stable, in percent of "
        "their mean (default 10, perf_analyzer's)",
    )
    group.add_argument(
        "--widenings",
        type=int,
        default=None,
        metavar="N",
        help="measure an unstable level again up to N times, each time with windows twice as "
        f"long, before reporting it as unstable (default {DEFAULT_WIDENINGS})",
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
        help="protocol of an endpoint without a scheme (default grpc, as every client's --url); "
        "repositories the bench serves itself are measured over http unless this says grpc",
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
        help="latency budget: the best configuration must keep p95 latency within it "
        "(default: none)",
    )
    group.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="N",
        help="sweep every configuration N times, round after round, and report each level's "
        f"median; a gain or a choice is certain only when every round agrees (default "
        f"{default_rounds})",
    )
    group.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        metavar="MIN",
        help="cap on the whole run: no level starts after it, and the results say what was "
        f"left unmeasured (default {default_minutes})",
    )


def both_request_files() -> list[Path]:
    """bench/test.json and bench/mixed.json."""
    return [find_request_file(PRODUCTION_REQUEST), find_request_file(MIXED_REQUESTS)]


#: The same requests for the demo model (``make demo``, the serving experiment): start and end
#: ids inside its vocabulary of 512, which the repository's bounds require (CodeGen's 50256 is
#: outside it); 511, a merge the demo model practically never emits, so the requests keep their
#: lengths as 50256 does for CodeGen.
DEMO_REQUEST_FILES = ("demo/" + PRODUCTION_REQUEST, "demo/" + MIXED_REQUESTS)


def demo_request_files() -> list[Path]:
    """bench/demo/test.json and bench/demo/mixed.json."""
    return [find_request_file(name) for name in DEMO_REQUEST_FILES]


def production_request_file() -> list[Path]:
    """bench/test.json."""
    return [find_request_file(PRODUCTION_REQUEST)]


def options_from_args(
    args: argparse.Namespace,
    *,
    extra_args: tuple[str, ...] = (),
    defaults: PerfAnalyzerOptions | None = None,
) -> PerfAnalyzerOptions:
    """perf_analyzer's options: the flags given, else ``defaults``, else perf_analyzer's own."""
    for name in ("measurement_interval_ms", "measurement_request_count"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise LoaderError(f"{flag} must be at least 1, got {value}", f"Pass {flag} 1 or more.")
    STABILITY_PERCENTAGE.check(args.stability_percentage)
    if args.widenings is not None and args.widenings < 0:
        raise LoaderError(
            f"--widenings must be 0 or more, got {args.widenings}", "Pass --widenings 0, 1 or 2."
        )
    base = defaults or PerfAnalyzerOptions()
    given = {
        name: getattr(args, name)
        for name in (
            "measurement_mode",
            "measurement_interval_ms",
            "measurement_request_count",
            "stability_percentage",
            "widenings",
        )
        if getattr(args, name) is not None
    }
    return dataclasses.replace(
        base, streaming=args.streaming, extra_args=tuple(extra_args), **given
    )


def settings_from_args(
    args: argparse.Namespace,
    *,
    extra_args: tuple[str, ...] = (),
    defaults: PerfAnalyzerOptions | None = None,
    default_rounds: int = 1,
    default_range: str = DEFAULT_CONCURRENCY_RANGE,
    default_protocol: str = "http",
    request_files: Callable[[], list[Path]] = both_request_files,
    default_minutes: float | None = None,
) -> SweepSettings:
    """The run's :class:`SweepSettings` from the flags (the namespace is left as it is)."""
    files = args.input_data or request_files()
    minutes = args.max_minutes if args.max_minutes is not None else default_minutes
    if minutes is not None and not 0 < minutes < math.inf:
        raise LoaderError(
            f"--max-minutes must be a positive, finite number, got {minutes:g}",
            "Pass e.g. --max-minutes 15.",
        )
    budget = args.max_p95_ms
    if budget is not None and not 0 < budget < math.inf:  # NaN passed every level's check
        raise LoaderError(
            f"--max-p95-ms must be a positive number of milliseconds, got {budget:g}",
            "Pass e.g. --max-p95-ms 1500, or leave it out for no latency budget.",
        )
    return SweepSettings(
        concurrencies=tuple(parse_concurrency_range(args.concurrency_range or default_range)),
        workloads=workloads_from_paths(files),
        options=options_from_args(args, extra_args=extra_args, defaults=defaults),
        model=getattr(args, "model", None),
        protocol=args.protocol or default_protocol,
        perf_analyzer=args.perf_analyzer,
        rounds=args.rounds if args.rounds is not None else default_rounds,
        max_p95_ms=args.max_p95_ms,
        max_seconds=None if minutes is None else minutes * 60,
    )
