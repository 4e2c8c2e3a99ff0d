"""Run the real ``perf_analyzer`` for one concurrency level and turn its failures into typed errors.

perf_analyzer stops a ``--concurrency-range`` at the first level it cannot measure stably, so a
sweep runs it once per level (:mod:`loader.bench.sweep`). Every run uses ``--percentile=95``
(latencies and stabilisation on the client's p95, as in our production tables), ``-f`` to get
the CSV and ``-v`` to get every measurement window (``Pass [n] throughput: ... p95 latency:``).

A level whose windows do not agree within the stability percentage is measured again with
windows twice as long, at most ``widenings`` times (a busy machine settles over longer windows).
If it still does not settle, its last three windows are reported (throughput and p95 latency
averaged), marked unstable, with perf_analyzer's own words: a measurement is never thrown away.

The binary is looked up as: an explicit path, then ``perf_analyzer`` on ``PATH``, then the
project's ``.tools/bin/perf_analyzer`` (``scripts/tools/install-perf-analyzer.sh``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loader.bench.endpoint import Endpoint
from loader.bench.results import Measurement, parse_csv
from loader.errors import (
    EndpointError,
    LoaderError,
    MeasurementError,
    ModelNotFoundError,
    ToolMissingError,
)

log = logging.getLogger(__name__)

#: The project's own install location of the wrapper.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROJECT_PERF_ANALYZER = PROJECT_ROOT / ".tools" / "bin" / "perf_analyzer"
INSTALL_COMMAND = "TOOLS_DIR=$PWD/.tools scripts/tools/install-perf-analyzer.sh"

#: Lines of perf_analyzer's output quoted in an error.
OUTPUT_TAIL_LINES = 15

#: perf_analyzer's own window sizes, the base when an unstable level is widened.
DEFAULT_MEASUREMENT_INTERVAL_MS = 5000
DEFAULT_MEASUREMENT_REQUEST_COUNT = 50
#: How often an unstable level is measured again with windows twice as long.
DEFAULT_WIDENINGS = 2
#: perf_analyzer compares this many windows; an unstable level reports the last ones.
STABLE_WINDOWS = 3


def find_perf_analyzer(
    explicit: str | Path | None = None, *, project_binary: Path = PROJECT_PERF_ANALYZER
) -> Path:
    """The perf_analyzer to run; :class:`ToolMissingError` with the install command if none."""
    remediation = (
        f"Run `make install` (or `{INSTALL_COMMAND}` in the project), or pass --perf-analyzer PATH."
    )
    if explicit is not None:
        path = Path(explicit)
        if path.is_file() and path.stat().st_mode & 0o111:
            return path
        raise ToolMissingError(f"perf_analyzer not found at {path}", remediation)
    on_path = shutil.which("perf_analyzer")
    if on_path:
        return Path(on_path)
    if project_binary.is_file():
        return project_binary
    raise ToolMissingError(
        f"perf_analyzer is not installed (not on PATH, not at {project_binary})", remediation
    )


@dataclass(frozen=True)
class PerfAnalyzerOptions:
    """How perf_analyzer measures; ``None`` keeps perf_analyzer's own default.

    ``measurement_mode`` is ``time_windows`` (windows of ``measurement_interval_ms``) or
    ``count_windows`` (windows of ``measurement_request_count`` requests). A level is stable
    when 3 consecutive windows agree within ``stability_percentage``; perf_analyzer gives up
    after ``max_trials`` windows.
    """

    input_data: Path | None = None
    measurement_mode: str | None = None
    measurement_interval_ms: int | None = None
    measurement_request_count: int | None = None
    stability_percentage: float | None = None
    max_trials: int | None = None
    streaming: bool = False
    timeout_s: float = 900.0
    extra_args: tuple[str, ...] = ()
    widenings: int = DEFAULT_WIDENINGS

    def widened(self) -> PerfAnalyzerOptions:
        """The same measurement with windows twice as long (time or request count)."""
        if self.measurement_mode == "count_windows":
            count = self.measurement_request_count or DEFAULT_MEASUREMENT_REQUEST_COUNT
            return dataclasses.replace(self, measurement_request_count=2 * count)
        interval = self.measurement_interval_ms or DEFAULT_MEASUREMENT_INTERVAL_MS
        return dataclasses.replace(self, measurement_interval_ms=2 * interval)

    def window(self) -> str:
        """The window size in words (for logs and reports)."""
        if self.measurement_mode == "count_windows":
            count = self.measurement_request_count or DEFAULT_MEASUREMENT_REQUEST_COUNT
            return f"{count} requests"
        return f"{self.measurement_interval_ms or DEFAULT_MEASUREMENT_INTERVAL_MS} ms"

    def arguments(self) -> list[str]:
        args: list[str] = []
        if self.input_data is not None:
            args.append(f"--input-data={self.input_data}")
        if self.measurement_mode is not None:
            args.append(f"--measurement-mode={self.measurement_mode}")
        if self.measurement_interval_ms is not None:
            args.append(f"--measurement-interval={self.measurement_interval_ms}")
        if self.measurement_request_count is not None:
            args.append(f"--measurement-request-count={self.measurement_request_count}")
        if self.stability_percentage is not None:
            args.append(f"--stability-percentage={self.stability_percentage:g}")
        if self.max_trials is not None:
            args.append(f"--max-trials={self.max_trials}")
        if self.streaming:
            args.append("--streaming")
        args.extend(self.extra_args)
        return args


def command(
    binary: Path,
    endpoint: Endpoint,
    model: str,
    concurrency: int,
    csv_path: Path,
    options: PerfAnalyzerOptions,
) -> list[str]:
    if options.streaming and endpoint.protocol != "grpc":
        raise LoaderError(
            "perf_analyzer streams (decoupled models) only over gRPC",
            "Pass a gRPC endpoint (--url grpc://host:8001) together with --streaming.",
        )
    return [
        str(binary),
        "-m",
        model,
        "-u",
        endpoint.address,
        "-i",
        endpoint.protocol,
        f"--concurrency-range={concurrency}:{concurrency}",
        "--percentile=95",
        "-v",
        "-f",
        str(csv_path),
        *options.arguments(),
    ]


# --- what perf_analyzer's output means --------------------------------------------------------


def _tail(output: str) -> str:
    return "\n".join(output.strip().splitlines()[-OUTPUT_TAIL_LINES:])


def _unreachable(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    return EndpointError(
        f"cannot reach Triton at {endpoint} ({endpoint.protocol}): {_tail(output)}",
        f"Check --url and that the server is up (curl http://<host>:<http port>/v2/health/ready); "
        f"gRPC is usually port 8001 and HTTP 8000, and --url {endpoint.protocol}://... must match.",
    )


def _restricted(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    return EndpointError(
        f"Triton at {endpoint} restricts what perf_analyzer reads first (model metadata, "
        f"configuration, statistics) to callers with its admin header: {_tail(output)}",
        "perf_analyzer sends no header over gRPC (its -H is HTTP only). Measure over HTTP "
        "where the chart serves it, the pod's loopback: `kubectl port-forward "
        "deploy/<release>-model-triton 8000` and --url http://127.0.0.1:8000; or, on a staging "
        "release, leave metadata, model-config and statistics out of "
        "triton.security.restrictedGrpcProtocols (SECURITY.md). TTFT (--ttft) needs no header.",
    )


def _unknown_model(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    return ModelNotFoundError(f"Triton at {endpoint} does not serve a model named {model!r}")


def _bad_input_data(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    return MeasurementError(
        f"perf_analyzer rejected the input data for {model!r}: {_tail(output)}",
        "Give --input-data in perf_analyzer's JSON format with every required input of the "
        "model (bench/test.json fits the ensemble our loader publishes).",
    )


def _window_too_short(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    return MeasurementError(
        f"no request of {model!r} completed within a measurement window: {_tail(output)}",
        "Pass a longer --measurement-interval-ms (a window must hold several requests), or "
        "--measurement-mode count_windows.",
    )


#: Output pattern -> the typed error it means; the first match wins.
ERROR_PATTERNS: tuple[tuple[re.Pattern[str], Callable[[Endpoint, str, str], LoaderError]], ...] = (
    (re.compile(r"This protocol is restricted, expecting header"), _restricted),
    (
        re.compile(
            r"Couldn't connect to server|failed to connect to all addresses|Connection refused"
            r"|Could not resolve host|Timeout was reached|Deadline Exceeded",
            re.IGNORECASE,
        ),
        _unreachable,
    ),
    (re.compile(r"unknown model|is not found|is not ready", re.IGNORECASE), _unknown_model),
    (re.compile(r"No valid requests recorded", re.IGNORECASE), _window_too_short),
    (
        re.compile(
            r"Failed to init manager inputs|missing tensor|input data|Failed to parse",
            re.IGNORECASE,
        ),
        _bad_input_data,
    ),
)

_UNSTABLE = re.compile(r"Failed to obtain stable measurement")
_UNSTABLE_WORDS = re.compile(r"^Failed to obtain stable measurement within .*$", re.MULTILINE)
_PASS = re.compile(
    r"^\s*Pass \[(?P<number>\d+)\] throughput: (?P<throughput>[0-9.eE+-]+) infer/sec\. "
    r"p95 latency: (?P<latency>\d+) usec",
    re.MULTILINE,
)


def error_for(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    """The typed error a failed perf_analyzer run stands for."""
    for pattern, make in ERROR_PATTERNS:
        if pattern.search(output):
            return make(endpoint, model, output)
    return MeasurementError(f"perf_analyzer failed: {_tail(output)}")


def is_unstable(output: str) -> bool:
    return bool(_UNSTABLE.search(output))


@dataclass(frozen=True)
class Window:
    """One measurement window (perf_analyzer's ``-v`` line ``Pass [n] ...``)."""

    throughput: float
    p95_us: int


def parse_windows(output: str) -> list[Window]:
    """Every window perf_analyzer printed with ``-v``, in order."""
    return [Window(float(m["throughput"]), int(m["latency"])) for m in _PASS.finditer(output)]


def unstable_words(output: str) -> str:
    """perf_analyzer's sentence about an unstable level (``Failed to obtain ... within ...``)."""
    match = _UNSTABLE_WORDS.search(output)
    return match[0].strip() if match else "Failed to obtain stable measurement."


def unstable_measurement(concurrency: int, output: str) -> Measurement | None:
    """The last :data:`STABLE_WINDOWS` windows of an unstable run, averaged and marked unstable
    (``None`` if perf_analyzer printed no window)."""
    windows = parse_windows(output)[-STABLE_WINDOWS:]
    if not windows:
        return None
    return Measurement(
        concurrency=concurrency,
        throughput=sum(w.throughput for w in windows) / len(windows),
        p95_us=round(sum(w.p95_us for w in windows) / len(windows)),
        stable=False,
        note=unstable_words(output),
    )


# --- one level ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LevelResult:
    """A level's measurement (``stable`` or not), perf_analyzer's last output and the window
    size it was measured with."""

    concurrency: int
    measurement: Measurement
    output: str
    window: str = ""


def run_process(cmd: Sequence[str], timeout_s: float) -> tuple[int, str]:
    """Run ``cmd``; its exit code and its stdout and stderr together."""
    try:
        done = subprocess.run(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise MeasurementError(
            f"perf_analyzer did not finish within {timeout_s:.0f} s",
            "Shorten the measurement (--measurement-interval-ms, --max-trials) or check that "
            "the server still answers.",
        ) from exc
    return done.returncode, done.stdout


def _run_once(
    endpoint: Endpoint,
    model: str,
    concurrency: int,
    *,
    options: PerfAnalyzerOptions,
    binary: Path,
) -> tuple[Measurement | None, str]:
    """One perf_analyzer run: the stable measurement (``None`` if unstable) and its output."""
    with tempfile.TemporaryDirectory(prefix="perf-analyzer-") as tmp:
        csv_path = Path(tmp) / "level.csv"
        cmd = command(binary, endpoint, model, concurrency, csv_path, options)
        log.debug("running %s", " ".join(cmd))
        code, output = run_process(cmd, options.timeout_s)
        if is_unstable(output):
            return None, output
        if code != 0:
            raise error_for(endpoint, model, output)
        if not csv_path.is_file():
            raise MeasurementError(f"perf_analyzer wrote no CSV: {_tail(output)}")
        rows = parse_csv(csv_path.read_text(encoding="utf-8"))
    found = [m for m in rows if m.concurrency == concurrency]
    if not found:
        raise MeasurementError(f"perf_analyzer's CSV has no row for concurrency {concurrency}")
    return found[0], output


def measure_level(
    endpoint: Endpoint,
    model: str,
    concurrency: int,
    *,
    options: PerfAnalyzerOptions,
    binary: Path,
) -> LevelResult:
    """Measure one concurrency level, widening the windows of an unstable one (see the module
    docstring); raise the typed error of any failure other than instability."""
    attempt = options
    for widening in range(options.widenings + 1):
        measurement, output = _run_once(
            endpoint, model, concurrency, options=attempt, binary=binary
        )
        if measurement is not None:
            return LevelResult(concurrency, measurement, output, attempt.window())
        if widening < options.widenings:
            wider = attempt.widened()
            log.info(
                "concurrency %s: no stable measurement with windows of %s; measuring again "
                "with windows of %s",
                concurrency,
                attempt.window(),
                wider.window(),
            )
            attempt = wider
    unstable = unstable_measurement(concurrency, output)
    if unstable is None:
        raise MeasurementError(
            f"perf_analyzer measured no window at concurrency {concurrency}: {_tail(output)}",
            "Check that the server answers requests (scripts/complete), then pass longer "
            "windows (--measurement-interval-ms or --measurement-request-count).",
        )
    return LevelResult(concurrency, unstable, output, attempt.window())
