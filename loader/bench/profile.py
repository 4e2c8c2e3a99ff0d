"""perf_analyzer's structured output: the ``--profile-export-file`` JSON, read into windows.

perf_analyzer (2.41, the ``tritonclient`` wheel's) exports every request it sent: its send
time and the times its responses arrived (nanoseconds), with the boundaries of the measurement
windows::

    {"version": "2.41.0",
     "experiments": [{"experiment": {"mode": "concurrency", "value": 4},
                      "requests": [{"timestamp": 17..., "response_timestamps": [17...]}, ...],
                      "window_boundaries": [17..., 17..., 17..., 17...]}]}

A request belongs to the window its last response arrived in, as perf_analyzer counts it.
:func:`read_windows` gives one :class:`Window` per pair of boundaries (throughput, latency
percentiles); :func:`measurement` merges the windows into one
:class:`~loader.bench.results.Measurement`; :func:`stability` is perf_analyzer's own test
(the largest of the windows' throughputs, and of their p95 latencies, within the percentage of
the smallest), applied by us because perf_analyzer writes no export for a level it gives up
on.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loader.bench.results import Measurement
from loader.errors import MeasurementError

#: Percentiles the results carry (the client's latency, microseconds).
PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Window:
    """One measurement window: requests completed in it, its length and their latencies."""

    start_ns: int
    end_ns: int
    latencies_us: tuple[float, ...]

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def throughput(self) -> float:
        return len(self.latencies_us) / self.seconds if self.seconds > 0 else 0.0

    @property
    def p95_us(self) -> float:
        return float(np.percentile(self.latencies_us, 95)) if self.latencies_us else 0.0


def read_windows(path: Path, concurrency: int) -> list[Window]:
    """The windows of the experiment at ``concurrency`` in an export file."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        experiments = document["experiments"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MeasurementError(
            f"perf_analyzer's profile export {path} is unreadable ({exc})",
            "Check that the installed perf_analyzer is 2.41 or newer (it writes "
            "--profile-export-file) and that the disk is not full.",
        ) from exc
    found = [e for e in experiments if e.get("experiment", {}).get("value") == concurrency]
    if not found:
        raise MeasurementError(f"perf_analyzer's profile export has no level {concurrency}")
    experiment = found[-1]
    bounds = [int(b) for b in experiment.get("window_boundaries", [])]
    done = []
    for request in experiment.get("requests", []):
        responses = request.get("response_timestamps") or []
        if responses:
            done.append((int(responses[-1]), (int(responses[-1]) - int(request["timestamp"]))))
    windows = []
    for start, end in itertools.pairwise(bounds):
        latencies = tuple(lat / 1e3 for at, lat in done if start <= at < end)
        windows.append(Window(start, end, latencies))
    return windows


def completed_requests(path: Path, concurrency: int) -> int:
    """Requests of the level that got their responses, inside the windows or not."""
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    return sum(
        1
        for e in document.get("experiments", [])
        if e.get("experiment", {}).get("value") == concurrency
        for r in e.get("requests", [])
        if r.get("response_timestamps")
    )


def stability(windows: list[Window], percentage: float) -> str | None:
    """``None`` when the windows' throughputs and p95 latencies each stay within
    ``percentage`` of one another (largest / smallest <= 1 + percentage / 100, and no window
    without a completed request: perf_analyzer's test, ``InferenceProfiler::
    IsInferWindowStable`` and ``IsLatencyWindowStable``), else what differs, in words."""
    if len(windows) < 2:
        return f"only {len(windows)} measurement window(s)"
    if any(not w.latencies_us for w in windows):
        return "a measurement window completed no request"
    for name, values in (
        ("throughput", [w.throughput for w in windows]),
        ("p95 latency", [w.p95_us for w in windows]),
    ):
        spread = (max(values) / min(values) - 1) * 100 if min(values) > 0 else float("inf")
        if spread > percentage:
            shown = ", ".join(f"{v:.4g}" for v in values)
            return (
                f"the {len(windows)} windows' {name} ({shown}) differ by {spread:.0f} % "
                f"(limit {percentage:g} %)"
            )
    return None


def measurement(
    concurrency: int, windows: list[Window], *, stable: bool = True, note: str = ""
) -> Measurement:
    """The windows as one level: throughput over their whole length, latency percentiles over
    all their requests."""
    latencies = [lat for w in windows for lat in w.latencies_us]
    seconds = sum(w.seconds for w in windows)
    if not latencies or seconds <= 0:
        raise MeasurementError(
            f"no request completed at concurrency {concurrency} within the measurement windows",
            "Pass longer windows (--measurement-request-count) and check that the server "
            "answers requests (scripts/complete).",
        )
    p50, p90, p95, p99 = (round(float(v)) for v in np.percentile(latencies, PERCENTILES))
    return Measurement(
        concurrency=concurrency,
        throughput=len(latencies) / seconds,
        p95_us=p95,
        p50_us=p50,
        p90_us=p90,
        p99_us=p99,
        stable=stable,
        note=note,
    )
