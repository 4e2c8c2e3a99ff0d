"""Run the real ``perf_analyzer`` for one concurrency level and turn its failures into typed errors.

perf_analyzer stops a ``--concurrency-range`` at the first level it cannot measure stably, so a
sweep runs it once per level (:mod:`loader.bench.sweep`). Every run uses ``--percentile=95``,
``-f`` for the server-side times and ``--profile-export-file`` for every request's timestamps
(:mod:`loader.bench.profile`), from which the level's throughput and latencies are computed.

Stability is judged here, on the exported windows, with perf_analyzer's own test (three
windows whose throughput and p95 latency lie within the stability percentage of their mean):
perf_analyzer 2.41 writes no export for a level it gives up on, so it is asked for three
windows with its own check off (``--stability-percentage=999 --max-trials=3``). A level whose
windows do not agree is measured again with windows twice as long, at most ``widenings``
times (a busy machine settles over longer windows); if it still does not settle, its last
windows are reported, marked unstable, with what differed: a measurement is never thrown away.

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

from loader.bench import profile
from loader.bench.results import Measurement, parse_csv
from loader.endpoint import Endpoint
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
#: Windows measured per run and compared (perf_analyzer's own number).
STABLE_WINDOWS = 3
#: perf_analyzer's default stability percentage, our test's default.
DEFAULT_STABILITY_PERCENTAGE = 10.0


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
    when its 3 windows agree within ``stability_percentage`` (judged here, see the module
    docstring).
    """

    input_data: Path | None = None
    measurement_mode: str | None = None
    measurement_interval_ms: int | None = None
    measurement_request_count: int | None = None
    stability_percentage: float | None = None
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
    export_path: Path | None = None,
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
        "-f",
        str(csv_path),
        f"--profile-export-file={export_path or csv_path.with_suffix('.json')}",
        # Stability is judged on the exported windows (see the module docstring).
        "--stability-percentage=999",
        f"--max-trials={STABLE_WINDOWS}",
        *(arg for name, value in endpoint.headers for arg in ("-H", f"{name}:{value}")),
        *options.arguments(),
    ]


# --- what perf_analyzer's output means --------------------------------------------------------


def _tail(output: str) -> str:
    return "\n".join(output.strip().splitlines()[-OUTPUT_TAIL_LINES:])


def _unreachable(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    return EndpointError(
        f"cannot reach Triton at {endpoint} ({endpoint.protocol}): {_tail(output)}",
        "Check --url and that the server is up (curl http://<host>:<http port>/v2/health/ready). "
        "A --url without a scheme is gRPC (Triton's port 8001); the HTTP port (8000) needs "
        "http://HOST:PORT.",
    )


def _restricted(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    return EndpointError(
        f"Triton at {endpoint} restricts what perf_analyzer reads first (model metadata, "
        f"configuration, statistics) to callers with its admin header: {_tail(output)}",
        "Pass the admin header to perf_analyzer after `--` (it sends -H over gRPC and HTTP): "
        '-- -H triton-grpc-protocol-admin-key:"$(kubectl get secret <release>-model-triton-admin '
        "-o jsonpath='{.data.token}' | base64 -d)\" (SECURITY.md). TTFT (--ttft) needs no header.",
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


def _decoupled_over_http(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    return MeasurementError(
        f"{model!r} streams its responses (a decoupled model), which perf_analyzer can drive "
        f"only over gRPC with --streaming, not {endpoint.protocol}: {_tail(output)}",
        "Measure the model of a key published without --streaming, or pass a gRPC --url with "
        "-- --streaming (it times the first response alone; scripts/bench --ttft times every "
        "token).",
    )


#: Output pattern -> the typed error it means; the first match wins.
ERROR_PATTERNS: tuple[tuple[re.Pattern[str], Callable[[Endpoint, str, str], LoaderError]], ...] = (
    (re.compile(r"This protocol is restricted, expecting header"), _restricted),
    (re.compile(r"doesn't support models with decoupled transaction policy"), _decoupled_over_http),
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


_GAVE_UP = re.compile(r"Failed to obtain stable measurement within .*")


def error_for(endpoint: Endpoint, model: str, output: str) -> LoaderError:
    """The typed error a failed perf_analyzer run stands for."""
    for pattern, make in ERROR_PATTERNS:
        if pattern.search(output):
            return make(endpoint, model, output)
    return MeasurementError(f"perf_analyzer failed: {_tail(output)}")


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
            errors="backslashreplace",  # it quotes a file name given in any bytes
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise MeasurementError(
            f"perf_analyzer did not finish within {timeout_s:.0f} s",
            "Shorten the measurement (--measurement-interval-ms, --measurement-request-count) or "
            "check that "
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
    cpu_seconds: Callable[[], float | None] | None = None,
    model_counts: Callable[[], tuple[int, int] | None] | None = None,
) -> tuple[Measurement, str]:
    """One perf_analyzer run: the level measured from its exported windows (``stable`` by our
    test) and perf_analyzer's output; with ``cpu_seconds`` (the server's CPU clock), the
    server's CPU time per request over the whole run; with ``model_counts`` (Triton's
    ``inference_count`` and ``execution_count`` of the generating model), how many requests
    that model served during the run and in how many executions."""
    with tempfile.TemporaryDirectory(prefix="perf-analyzer-") as tmp:
        csv_path = Path(tmp) / "level.csv"
        export_path = Path(tmp) / "level.json"
        cmd = command(binary, endpoint, model, concurrency, csv_path, options, export_path)
        hidden = ["", *cmd][:-1]  # the argument before each: a header's value is not logged
        shown = [
            f"{a.split(':', 1)[0]}:***" if b == "-H" else a
            for b, a in zip(hidden, cmd, strict=True)
        ]
        log.debug("running %s", " ".join(shown))
        counts_before = model_counts() if model_counts is not None else None
        cpu_before = cpu_seconds() if cpu_seconds is not None else None
        code, output = run_process(cmd, options.timeout_s)
        cpu_after = cpu_seconds() if cpu_seconds is not None else None
        counts_after = model_counts() if model_counts is not None else None
        if code != 0 and _GAVE_UP.search(output):
            # Even with its check off, perf_analyzer gives up when a window completed no
            # request (InferenceProfiler::DetermineStability); it exports nothing then.
            note = "a measurement window completed no request (perf_analyzer: " + (
                _GAVE_UP.search(output)[0].strip() + ")"
            )
            return Measurement(concurrency, 0.0, 0, stable=False, note=note), output
        if code != 0:
            raise error_for(endpoint, model, output)
        if not export_path.is_file():
            raise MeasurementError(
                f"perf_analyzer wrote no profile export: {_tail(output)}",
                "Check that the installed perf_analyzer is 2.41 or newer (`make install`).",
            )
        windows = profile.read_windows(export_path, concurrency)
        completed = profile.completed_requests(export_path, concurrency)
        server = (
            [
                m
                for m in parse_csv(csv_path.read_text(encoding="utf-8"))
                if m.concurrency == concurrency
            ]
            if csv_path.is_file()
            else []
        )
    percentage = options.stability_percentage
    if percentage is None:
        percentage = DEFAULT_STABILITY_PERCENTAGE
    problem = profile.stability(windows, percentage)
    measured = profile.measurement(concurrency, windows, stable=problem is None, note=problem or "")
    if cpu_before is not None and cpu_after is not None and completed:
        measured = dataclasses.replace(
            measured, cpu_ms_per_request=(cpu_after - cpu_before) * 1000 / completed
        )
    if counts_before is not None and counts_after is not None:
        measured = dataclasses.replace(
            measured,
            inference_count=counts_after[0] - counts_before[0],
            execution_count=counts_after[1] - counts_before[1],
        )
    if server:
        measured = dataclasses.replace(
            measured,
            server_queue_us=server[0].server_queue_us,
            server_compute_infer_us=server[0].server_compute_infer_us,
        )
    return measured, output


def measure_level(
    endpoint: Endpoint,
    model: str,
    concurrency: int,
    *,
    options: PerfAnalyzerOptions,
    binary: Path,
    cpu_seconds: Callable[[], float | None] | None = None,
    model_counts: Callable[[], tuple[int, int] | None] | None = None,
) -> LevelResult:
    """Measure one concurrency level, widening the windows of an unstable one (see the module
    docstring); raise the typed error of any failure other than instability. The server's CPU
    time and Triton's counts (``cpu_seconds``, ``model_counts``) are those of the last run."""
    attempt = options
    for widening in range(options.widenings + 1):
        measured, output = _run_once(
            endpoint, model, concurrency, options=attempt, binary=binary,
            cpu_seconds=cpu_seconds, model_counts=model_counts,
        )  # fmt: skip
        if measured.stable or widening == options.widenings:
            return LevelResult(concurrency, measured, output, attempt.window())
        wider = attempt.widened()
        log.info(
            "concurrency %s: no stable measurement with windows of %s (%s); measuring again "
            "with windows of %s",
            concurrency,
            attempt.window(),
            measured.note,
            wider.window(),
        )
        attempt = wider
    raise AssertionError("unreachable")
