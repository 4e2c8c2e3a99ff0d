"""Time to first token (TTFT) and time per output token (TPOT) of a streaming model.

perf_analyzer's ``--streaming`` mode (the 2.41 build we install) drives a decoupled model but
times only its first response ("using the first response for measuring latency"), has no
per-token timings, and did not reach a stable measurement against the CPU streaming model on
our machines. So this module is its own load generator over Triton's gRPC streaming API
(:mod:`loader.streaming`) with a bounded request count and time: at each concurrency level
``C`` it keeps ``C`` streams busy (one gRPC connection each, reused for its requests), each
sending the request again as soon as its previous one ended, until ``requests`` requests have
been sent or ``max_seconds`` have passed (the requests in flight then finish). One warm-up request precedes the sweep and is not counted.

Per request it records TTFT (send -> first token), TPOT (first token -> last token, divided by
the tokens after the first) and latency (send -> final response); per level it reports their
mean and p95 (nearest rank), throughput (completed requests / wall time) and output tokens/s.

The results are written in the bench's style (:mod:`loader.bench.report`): a table per
configuration printed as levels are measured (``ttft_tpot.txt``), a CSV (``ttft_tpot.csv``)
and a PNG (``ttft_tpot_vs_concurrency.png``: mean and p95 TTFT and TPOT against concurrency).
:meth:`StreamSweep.as_sweep` gives the throughput / p95-latency view, so ``scripts/bench`` also
writes its usual ``tables.txt``, ``results.csv``, throughput plot and summary.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loader.bench import variants
from loader.bench.compare import Target
from loader.bench.report import bullet, write_text
from loader.bench.results import Measurement, Sweep, format_number
from loader.bench.sweep import announce_levels
from loader.errors import LoaderError, MeasurementError
from loader.streaming import StreamedCompletion, StreamingClient, collect, stream_completion

log = logging.getLogger(__name__)

TABLE_HEADER = "Time to first token and time per output token vs. concurrency (client, streaming)"
TABLES_FILE = "ttft_tpot.txt"
CSV_FILE = "ttft_tpot.csv"
PLOT_FILE = "ttft_tpot_vs_concurrency.png"

#: Columns of :func:`levels_to_csv` (times in microseconds).
CSV_COLUMNS: tuple[str, ...] = (
    "configuration",
    "concurrency",
    "requests",
    "throughput_infer_per_sec",
    "output_tokens_per_sec",
    "ttft_mean_us",
    "ttft_p95_us",
    "tpot_mean_us",
    "tpot_p95_us",
    "latency_mean_us",
    "latency_p95_us",
)

DEFAULT_REQUESTS = 32
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
DEFAULT_MAX_SECONDS = 30.0


@dataclass(frozen=True)
class Sample:
    """One streamed request's client-side timings (seconds)."""

    ttft_s: float
    tpot_s: float | None
    latency_s: float
    output_tokens: int

    @classmethod
    def of(cls, completion: StreamedCompletion) -> Sample:
        return cls(
            completion.ttft_s, completion.tpot_s, completion.latency_s, completion.output_tokens
        )


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (the smallest value with ``pct`` % of the values at or below):
    numpy's ``inverted_cdf`` method."""
    if not values:
        raise ValueError("no values")
    return float(np.percentile(values, pct, method="inverted_cdf"))


#: The fewest samples whose 95th percentile (nearest rank) is not simply their maximum: with
#: fewer, "p95" is the slowest one, and the tables, CSV readers and plot are told so.
MIN_P95_SAMPLES = 20


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


@dataclass(frozen=True)
class StreamLevel:
    """One concurrency level: rates per second, times in microseconds."""

    concurrency: int
    requests: int
    throughput: float
    output_tokens_per_s: float
    ttft_mean_us: int
    ttft_p95_us: int
    tpot_mean_us: int | None
    tpot_p95_us: int | None
    latency_mean_us: int
    latency_p95_us: int
    #: Requests that generated two tokens or more (TPOT's samples); ``requests`` are TTFT's.
    tpot_requests: int = 0

    @classmethod
    def of(cls, concurrency: int, samples: Sequence[Sample], wall_s: float) -> StreamLevel:
        ttft = [s.ttft_s for s in samples]
        tpot = [s.tpot_s for s in samples if s.tpot_s is not None]
        latency = [s.latency_s for s in samples]
        return cls(
            concurrency=concurrency,
            requests=len(samples),
            throughput=len(samples) / wall_s,
            output_tokens_per_s=sum(s.output_tokens for s in samples) / wall_s,
            ttft_mean_us=_us(sum(ttft) / len(ttft)),
            ttft_p95_us=_us(percentile(ttft, 95)),
            tpot_mean_us=_us(sum(tpot) / len(tpot)) if tpot else None,
            tpot_p95_us=_us(percentile(tpot, 95)) if tpot else None,
            latency_mean_us=_us(sum(latency) / len(latency)),
            latency_p95_us=_us(percentile(latency, 95)),
            tpot_requests=len(tpot),
        )


@dataclass
class StreamSweep:
    """One configuration's levels, and the settings that describe it."""

    label: str
    levels: list[StreamLevel] = field(default_factory=list)
    settings: Mapping[str, object] = field(default_factory=dict)

    def sorted(self) -> list[StreamLevel]:
        return sorted(self.levels, key=lambda level: level.concurrency)

    def as_sweep(self) -> Sweep:
        """The throughput / p95-latency view the rest of the bench reports."""
        return Sweep(
            label=self.label,
            settings=dict(self.settings),
            measurements=[
                Measurement(
                    concurrency=level.concurrency,
                    throughput=level.throughput,
                    p95_us=level.latency_p95_us,
                )
                for level in self.levels
            ],
        )


def _time_text(mean: int | None, p95: int | None, samples: int) -> str:
    if mean is None or p95 is None:
        return "n/a"
    few = f" (max of {samples}: too few for a p95)" if samples < MIN_P95_SAMPLES else ""
    return f"mean {mean} usec p95 {p95} usec{few}"


def format_line(level: StreamLevel) -> str:
    tpot_samples = level.tpot_requests or level.requests
    return (
        f"Concurrency: {level.concurrency}, throughput: {format_number(level.throughput)} "
        f"infer/sec, TTFT {_time_text(level.ttft_mean_us, level.ttft_p95_us, level.requests)}, "
        f"TPOT {_time_text(level.tpot_mean_us, level.tpot_p95_us, tpot_samples)}, "
        f"latency {level.latency_p95_us} usec"
    )


def table_text(sweep: StreamSweep, *, number: int | None = None) -> str:
    title = f"Benchmark {number}: {sweep.label}" if number is not None else sweep.label
    lines = [title, ""]
    lines.extend(bullet(k, v) for k, v in sweep.settings.items())
    if sweep.settings:
        lines.append("")
    lines.append(TABLE_HEADER)
    lines.extend(format_line(level) for level in sweep.sorted())
    return "\n".join(lines) + "\n"


def levels_to_csv(sweeps: Sequence[StreamSweep]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for sweep in sweeps:
        for level in sweep.sorted():
            writer.writerow(
                (
                    sweep.label,
                    level.concurrency,
                    level.requests,
                    format_number(level.throughput),
                    format_number(level.output_tokens_per_s),
                    level.ttft_mean_us,
                    level.ttft_p95_us,
                    "" if level.tpot_mean_us is None else level.tpot_mean_us,
                    "" if level.tpot_p95_us is None else level.tpot_p95_us,
                    level.latency_mean_us,
                    level.latency_p95_us,
                )
            )
    return buffer.getvalue()


def write_plot(sweeps: Sequence[StreamSweep], path: Path) -> Path:
    """A PNG: TTFT (left) and TPOT (right) in ms against concurrency, mean solid, p95 dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 5), dpi=110)
    FigureCanvasAgg(figure)
    panels = (
        (figure.add_subplot(1, 2, 1), "ttft", "time to first token (ms)"),
        (figure.add_subplot(1, 2, 2), "tpot", "time per output token (ms)"),
    )
    few = 0
    for axes, metric, ylabel in panels:
        for sweep in sweeps:
            points = [lv for lv in sweep.sorted() if getattr(lv, f"{metric}_mean_us") is not None]
            xs = [lv.concurrency for lv in points]
            mean = [getattr(lv, f"{metric}_mean_us") / 1000 for lv in points]
            p95 = [getattr(lv, f"{metric}_p95_us") / 1000 for lv in points]
            (line,) = axes.plot(xs, mean, marker="o", label=f"{sweep.label} mean")
            axes.plot(
                xs,
                p95,
                marker="^",
                linestyle="--",
                color=line.get_color(),
                label=f"{sweep.label} p95",
            )
            # A "p95" of fewer than MIN_P95_SAMPLES requests is their maximum: drawn hollow.
            for x, y, level in zip(xs, p95, points, strict=True):
                samples = level.tpot_requests if metric == "tpot" else level.requests
                if samples < MIN_P95_SAMPLES:
                    axes.plot(
                        x, y, marker="^", linestyle="", color=line.get_color(),
                        markerfacecolor="white", markersize=9,
                    )  # fmt: skip
            few += sum(
                1
                for lv in points
                if (lv.tpot_requests if metric == "tpot" else lv.requests) < MIN_P95_SAMPLES
            )
        levels = sorted({lv.concurrency for sweep in sweeps for lv in sweep.levels})
        if levels:
            axes.set_xticks(levels)
        axes.set_xlabel("concurrency (streams in flight)")
        axes.set_ylabel(ylabel)
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    note = (
        f"\nhollow p95: fewer than {MIN_P95_SAMPLES} requests at that level, so it is their "
        "maximum (--requests-per-level for more)"
        if few
        else ""
    )
    figure.suptitle(f"Streaming: TTFT and TPOT vs. concurrency (client side){note}", fontsize=10)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    figure.savefig(partial, format="png")
    os.replace(partial, path)  # never a half-written plot under the final name
    return path


def write_stream_report(sweeps: Sequence[StreamSweep], output_dir: Path) -> dict[str, Path]:
    """Write the TTFT/TPOT tables, CSV and plot into ``output_dir``; their paths by kind."""
    output_dir = Path(output_dir)
    tables = "\n".join(table_text(s, number=i) for i, s in enumerate(sweeps, start=1))
    return {
        "ttft_tables": write_text(output_dir / TABLES_FILE, tables),
        "ttft_csv": write_text(output_dir / CSV_FILE, levels_to_csv(sweeps)),
        "ttft_plot": write_plot(sweeps, output_dir / PLOT_FILE),
    }


# --- measuring -------------------------------------------------------------------------------


def measure_level(
    url: str,
    model: str,
    request: dict[str, list[Any]],
    concurrency: int,
    *,
    requests: int = DEFAULT_REQUESTS,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    timeout_s: float = 120.0,
) -> StreamLevel:
    """Keep ``concurrency`` streams busy until ``requests`` were sent or ``max_seconds`` passed.

    The first failed request ends the level with a :class:`MeasurementError` (its message).
    """
    if concurrency < 1 or requests < 1 or max_seconds <= 0:
        raise MeasurementError(
            f"invalid level: concurrency {concurrency}, requests {requests}, "
            f"max_seconds {max_seconds}",
            "Pass a concurrency and a request count of at least 1 and a positive time limit.",
        )
    lock = threading.Lock()
    samples: list[Sample] = []
    errors: list[LoaderError] = []
    sent = 0
    started = time.perf_counter()
    deadline = started + max_seconds

    def worker() -> None:
        nonlocal sent
        with StreamingClient(url, timeout_s=timeout_s) as client:  # one connection per stream
            while True:
                with lock:
                    if errors or sent >= requests or time.perf_counter() >= deadline:
                        return
                    sent += 1
                try:
                    completion = collect(client.stream(model, request))
                except LoaderError as exc:
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    samples.append(Sample.of(completion))

    threads = [
        threading.Thread(target=worker, name=f"stream-{i}", daemon=True) for i in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise MeasurementError(
            f"streaming request failed at concurrency {concurrency}: {errors[0].message}",
            errors[0].remediation,
        )
    return StreamLevel.of(concurrency, samples, wall)


def stream_sweep(
    url: str,
    model: str,
    request: dict[str, list[Any]],
    concurrencies: Sequence[int],
    *,
    label: str | None = None,
    settings: Mapping[str, object] | None = None,
    requests: int = DEFAULT_REQUESTS,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    timeout_s: float = 120.0,
    on_level: Callable[[StreamLevel], None] | None = None,
) -> StreamSweep:
    """One warm-up request, then :func:`measure_level` at every concurrency level."""
    result = StreamSweep(label=label or model, settings=dict(settings or {}))
    log.info("%s: warm-up request", result.label)
    try:
        collect(stream_completion(url, model, request, timeout_s=timeout_s))
    except LoaderError as exc:
        raise MeasurementError(
            f"{result.label}: the warm-up request failed: {exc.message}", exc.remediation
        ) from exc
    for concurrency in announce_levels(result.label, concurrencies):
        level = measure_level(
            url,
            model,
            request,
            concurrency,
            requests=requests,
            max_seconds=max_seconds,
            timeout_s=timeout_s,
        )
        result.levels.append(level)
        if on_level is not None:
            on_level(level)
    return result


# --- several targets ------------------------------------------------------------------------


def heading(number: int, label: str, settings: Mapping[str, object]) -> str:
    """The heading printed before a configuration's levels."""
    lines = [f"Benchmark {number}: {label}", ""]
    if settings:
        lines += [bullet(k, v) for k, v in settings.items()] + [""]
    if number > 1:
        lines.insert(0, "")
    return "\n".join([*lines, TABLE_HEADER])


def stream_targets(
    targets: Sequence[Target],
    request: dict[str, list[Any]],
    concurrencies: Sequence[int],
    *,
    model: str | None = None,
    requests: int = DEFAULT_REQUESTS,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    log_dir: Path | None = None,
    on_start: Callable[[int, Target, Mapping[str, object]], None] | None = None,
    on_level: Callable[[StreamLevel], None] | None = None,
) -> list[StreamSweep]:
    """Sweep each target in turn: a streaming repository (served by the local CPU Triton,
    stopped before the next) or a gRPC endpoint (then ``model`` is needed)."""
    from loader.serving import TritonServer

    for target in targets:
        if target.endpoint is not None and target.endpoint.protocol != "grpc":
            raise LoaderError(
                f"--ttft streams over gRPC, not {target.endpoint.protocol} ({target.label})",
                "Pass the gRPC endpoint, e.g. --ttft grpc://127.0.0.1:8001.",
            )
        if target.endpoint is not None and not model:
            raise LoaderError(
                f"which model should be measured at {target.endpoint}?",
                "Pass --model NAME (the streaming model, e.g. codegen).",
            )
    results = []
    for number, target in enumerate(targets, start=1):
        settings: dict[str, object] = {"request_output_len": request.get("request_output_len")}
        if target.repository is not None:
            configs = variants.read_configs(target.repository)
            name = model or variants.ensemble_name(configs)
            settings.update(variants.describe(configs))
        else:
            name = model or ""
            settings["endpoint"] = str(target.endpoint)
        if on_start is not None:
            on_start(number, target, settings)

        def measure(url: str, target: Target = target, name: str = name, settings=settings):
            return stream_sweep(
                url, name, request, concurrencies, label=target.label, settings=settings,
                requests=requests, max_seconds=max_seconds, on_level=on_level,
            )  # fmt: skip

        if target.repository is None:
            assert target.endpoint is not None  # parse_target gives one or the other
            results.append(measure(target.endpoint.address))
            continue
        log_path = None
        if log_dir is not None:
            log_path = log_dir / f"tritonserver-{_SAFE.sub('_', target.label)}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("%s: serving %s with the local Triton", target.label, target.repository)
        with TritonServer(target.repository, log_path=log_path) as server:
            results.append(measure(server.grpc_url))
    return results
