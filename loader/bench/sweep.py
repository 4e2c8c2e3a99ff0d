"""Sweep one model over a range of concurrency levels with perf_analyzer, one level at a time.

Each level is one perf_analyzer run (:func:`loader.bench.perf_analyzer.measure_level`, widened
when unstable), so a level that never stabilises is reported, marked unstable, and the sweep goes
on. Progress is a log line per level; ``on_measurement`` receives each level's result as soon as
it is known (``scripts/bench`` prints the table line there).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from loader.bench.perf_analyzer import PerfAnalyzerOptions, find_perf_analyzer, measure_level
from loader.bench.results import Measurement, Sweep
from loader.endpoint import Endpoint
from loader.errors import LoaderError

log = logging.getLogger(__name__)

#: The most requests in flight a sweep asks for, and the most levels it measures: each level
#: takes a measurement of its own (seconds to minutes), so beyond these a range is a typo.
MAX_CONCURRENCY = 1024
MAX_LEVELS = 64

_RANGE = re.compile(r"^(\d+)(?::(\d+)(?::(\d+))?)?$")


def parse_concurrency_range(text: str) -> list[int]:
    """``start:end:step`` (perf_analyzer's form; ``end`` inclusive), ``start:end`` or ``n``."""
    match = _RANGE.match(text.strip())
    if not match:
        raise LoaderError(
            f"not a concurrency range: {text!r}",
            "Pass --concurrency-range START:END:STEP, e.g. 1:16:5 (END is included).",
        )
    start = int(match[1])
    end = int(match[2]) if match[2] else start
    step = int(match[3]) if match[3] else 1
    if start < 1 or end < start or step < 1:
        raise LoaderError(
            f"empty or invalid concurrency range: {text!r}",
            "START must be at least 1, END at least START, and STEP at least 1.",
        )
    levels = (end - start) // step + 1
    if end > MAX_CONCURRENCY or levels > MAX_LEVELS:
        raise LoaderError(
            f"concurrency range {text!r} asks for {levels} levels up to {end} requests at once",
            f"Keep END at most {MAX_CONCURRENCY} and the levels at most {MAX_LEVELS} (a larger "
            "STEP): each level is a measurement of its own, and each request in flight a "
            "client thread.",
        )
    return list(range(start, end + 1, step))


def announce_levels(label: str, concurrencies: Sequence[int]) -> Iterator[int]:
    """Each concurrency level in turn, logging which one starts and the time spent so far."""
    started = time.monotonic()
    for index, concurrency in enumerate(concurrencies, start=1):
        log.info(
            "%s: concurrency %s (%s/%s), %.0f s so far",
            label,
            concurrency,
            index,
            len(concurrencies),
            time.monotonic() - started,
        )
        yield concurrency


def sweep(
    endpoint: Endpoint,
    model: str,
    concurrencies: list[int],
    *,
    options: PerfAnalyzerOptions,
    label: str | None = None,
    settings: Mapping[str, object] | None = None,
    workload: str = "",
    perf_analyzer: str | Path | None = None,
    on_measurement: Callable[[Measurement], None] | None = None,
    cpu_seconds: Callable[[], float | None] | None = None,
    model_counts: Callable[[], tuple[int, int] | None] | None = None,
    deadline: float | None = None,
    into: Sweep | None = None,
) -> Sweep:
    """Measure ``model`` at every level; unstable levels are kept, marked unstable.

    ``cpu_seconds`` reads the server's CPU clock and ``model_counts`` Triton's request and
    execution counts of the generating model (a local server); no level starts after
    ``deadline`` (``time.monotonic()``), so a capped run keeps the levels it measured. The
    measurements go into ``into`` when given (a caller watching a run as it goes)."""
    binary = find_perf_analyzer(perf_analyzer)
    result = into or Sweep(label=label or model, settings=dict(settings or {}), workload=workload)
    for concurrency in announce_levels(result.label, concurrencies):
        if deadline is not None and time.monotonic() >= deadline:
            log.warning(
                "%s: the time is up; concurrency %s and above not measured",
                result.label,
                concurrency,
            )
            break
        level = measure_level(
            endpoint, model, concurrency, options=options, binary=binary,
            cpu_seconds=cpu_seconds, model_counts=model_counts,
        )  # fmt: skip
        if not level.measurement.stable:
            log.warning(
                "%s: concurrency %s did not settle with windows of %s; reported as unstable (%s)",
                result.label,
                concurrency,
                level.window,
                level.measurement.note,
            )
        result.measurements.append(level.measurement)
        if on_measurement is not None:
            on_measurement(level.measurement)
    return result
