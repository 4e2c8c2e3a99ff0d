"""Clear errors of the bench: perf_analyzer missing, endpoint unreachable, bad arguments.

perf_analyzer's own failure messages are recorded in tests/data/perf_analyzer/error_*.txt; the
unreachable-endpoint cases also run the real perf_analyzer against a port nobody listens on.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loader.bench.perf_analyzer import (
    PerfAnalyzerOptions,
    command,
    error_for,
    find_perf_analyzer,
    measure_level,
)
from loader.bench.sweep import parse_concurrency_range
from loader.endpoint import Endpoint, parse_endpoint
from loader.errors import (
    EndpointError,
    EndpointSyntaxError,
    LoaderError,
    MeasurementError,
    ModelNotFoundError,
    ToolMissingError,
)
from loader.serving import free_port

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data" / "perf_analyzer"
BENCH = [sys.executable, str(ROOT / "scripts" / "bench")]
COMPLETE = ROOT / "scripts" / "complete"
ENDPOINT = Endpoint("127.0.0.1:8000", "http")


def read(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("recording", "error"),
    [
        ("error_unreachable_http.txt", EndpointError),
        ("error_unreachable_grpc.txt", EndpointError),
        ("error_model_not_found.txt", ModelNotFoundError),
        ("error_missing_input.txt", MeasurementError),
        ("error_restricted_grpc.txt", EndpointError),
        ("error_decoupled_http.txt", MeasurementError),
    ],
)
def test_recorded_perf_analyzer_failures_become_typed_errors(recording, error):
    exc = error_for(ENDPOINT, "codegen", read(recording))
    assert type(exc) is error
    assert exc.remediation


def test_a_decoupled_model_over_http_says_it_streams_and_what_to_measure_instead():
    exc = error_for(ENDPOINT, "codegen", read("error_decoupled_http.txt"))
    assert "streams its responses" in exc.message and "not http" in exc.message
    assert "without --streaming" in exc.remediation


def test_missing_input_error_says_which_tensor_and_how_to_fix_it():
    exc = error_for(ENDPOINT, "codegen", read("error_missing_input.txt"))
    assert "missing tensor prompt" in exc.message
    assert "--input-data" in exc.remediation


def test_a_restricted_endpoint_says_how_to_measure_anyway():
    exc = error_for(
        Endpoint("127.0.0.1:8001", "grpc"), "codegen", read("error_restricted_grpc.txt")
    )
    assert type(exc) is EndpointError
    assert "triton-grpc-protocol-admin-key" in exc.message
    # perf_analyzer sends -H over gRPC too: the remediation is the header, not a loosening.
    assert "-- -H triton-grpc-protocol-admin-key:" in exc.remediation


def test_perf_analyzer_exports_its_windows_and_leaves_the_stability_test_to_us(tmp_path):
    """perf_analyzer 2.41 writes no export for a level it gives up on: its own test is off."""
    options = PerfAnalyzerOptions(stability_percentage=25, measurement_mode="count_windows")
    cmd = command(Path("pa"), ENDPOINT, "codegen", 4, tmp_path / "l.csv", options, tmp_path / "e")
    assert f"--profile-export-file={tmp_path / 'e'}" in cmd
    assert "--stability-percentage=999" in cmd and "--max-trials=3" in cmd
    assert "-v" not in cmd and not any(a.startswith("--stability-percentage=25") for a in cmd)


def test_missing_perf_analyzer_names_the_install_command(tmp_path, monkeypatch):
    with pytest.raises(ToolMissingError) as excinfo:
        find_perf_analyzer(tmp_path / "perf_analyzer")
    assert "install-perf-analyzer.sh" in excinfo.value.remediation
    assert "make install" in excinfo.value.remediation
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissingError, match="not installed"):
        find_perf_analyzer(project_binary=tmp_path / "nope")


def test_the_installed_perf_analyzer_is_found():
    binary = find_perf_analyzer()
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    assert "Perf Analyzer Version 2.41.0" in version.stdout + version.stderr


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_real_perf_analyzer_against_a_closed_port_is_an_endpoint_error(protocol):
    endpoint = Endpoint(f"127.0.0.1:{free_port()}", protocol)
    with pytest.raises(EndpointError) as excinfo:
        measure_level(
            endpoint,
            "codegen",
            1,
            options=PerfAnalyzerOptions(input_data=ROOT / "bench" / "test.json"),
            binary=find_perf_analyzer(),
        )
    assert not isinstance(excinfo.value, ModelNotFoundError)
    assert str(endpoint) in excinfo.value.message


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=120)


def test_bench_cli_unreachable_endpoint_exits_2_with_a_hint():
    done = run_bench(
        "--url", f"127.0.0.1:{free_port()}", "--model", "codegen", "--concurrency-range", "1", "-q"
    )
    assert done.returncode == 2, done.stderr
    assert "error: cannot reach Triton at grpc://127.0.0.1:" in done.stderr
    assert "hint: Check --url" in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_cli_missing_perf_analyzer_exits_2_with_the_install_command(tmp_path):
    done = run_bench(
        "--url",
        "127.0.0.1:8000",
        "--model",
        "codegen",
        "--perf-analyzer",
        str(tmp_path / "perf_analyzer"),
    )
    assert done.returncode == 2
    assert "error: perf_analyzer not found at" in done.stderr
    assert "install-perf-analyzer.sh" in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_help_lists_the_modes():
    done = run_bench("--help")
    assert done.returncode == 0
    for flag in ("--url", "--compare", "--serving-experiment", "--max-p95-ms", "--input-data"):
        assert flag in done.stdout


def test_tune_on_a_missing_repository_exits_2(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loader",
            "tune",
            "--repository",
            str(tmp_path / "missing"),
            "--work-dir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2
    assert "does not exist" in done.stderr and "hint:" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("text", "levels"),
    [("1:16:5", [1, 6, 11, 16]), ("1:4", [1, 2, 3, 4]), ("8", [8]), ("2:9:3", [2, 5, 8])],
)
def test_concurrency_ranges_include_the_end_like_perf_analyzer(text, levels):
    assert parse_concurrency_range(text) == levels


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-p95-ms", "nan"], "--max-p95-ms must be a positive number"),  # it was taken
        (["--max-p95-ms", "-5"], "--max-p95-ms must be a positive number"),
        (["--max-minutes", "inf"], "--max-minutes must be a positive, finite number"),
        (["--input-data", "{fifo}"], "is a FIFO"),  # it was said not to exist
        (["--input-data", "{dir}"], "is a directory"),
        (["--concurrency-range", "1:5000"], "asks for 5000 levels"),
        # The stability test compared every window against NaN or a negative spread.
        (["--stability-percentage", "nan"], "--stability-percentage must be a finite number"),
        (["--stability-percentage", "0"], "--stability-percentage must be more than 0"),
        # --ttft's own waits went to the load generator as they were.
        (["--ttft", "--max-seconds-per-level", "nan"], "--max-seconds-per-level must be a fin"),
        (["--ttft", "--max-seconds-per-level", "inf"], "--max-seconds-per-level must be a fin"),
        (["--ttft", "--max-seconds-per-level", "-1"], "--max-seconds-per-level must be more"),
        (["--ttft", "--requests-per-level", "0"], "--requests-per-level must be at least 1"),
    ],
)
def test_scripts_bench_refuses_a_bad_setting_before_measuring(tmp_path, argv, needle):
    os.mkfifo(tmp_path / "fifo")
    argv = [a.format(fifo=tmp_path / "fifo", dir=tmp_path) for a in argv]
    mode, argv = (argv[0], argv[1:]) if argv[0] == "--ttft" else ("--url", argv)
    done = subprocess.run(
        [*BENCH, mode, "127.0.0.1:1", "--model", "codegen", *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and needle in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "cannot reach Triton" not in done.stderr


@pytest.mark.parametrize("text", ["0:4", "4:1", "1:4:0", "a:b", "", "1:2:3:4"])
def test_bad_concurrency_ranges_are_user_errors(text):
    with pytest.raises(LoaderError, match="concurrency range"):
        parse_concurrency_range(text)


@pytest.mark.parametrize(
    ("url", "protocol", "expected"),
    [
        ("127.0.0.1:8001", None, Endpoint("127.0.0.1:8001", "grpc")),  # the one default
        ("127.0.0.1:8000", "http", Endpoint("127.0.0.1:8000", "http")),
        ("grpc://triton.svc:8001", None, Endpoint("triton.svc:8001", "grpc")),
        ("GRPC://triton.svc:8001", "grpc", Endpoint("triton.svc:8001", "grpc")),
        ("localhost:8001", "grpc", Endpoint("localhost:8001", "grpc")),
        ("http://10.0.0.5:8000/", None, Endpoint("10.0.0.5:8000", "http")),
        (" [::1]:8001 ", None, Endpoint("[::1]:8001", "grpc")),
        (None, None, Endpoint("127.0.0.1:8001", "grpc")),
        (None, "http", Endpoint("127.0.0.1:8000", "http")),
    ],
)
def test_endpoints_parse(url, protocol, expected):
    assert parse_endpoint(url, protocol=protocol) == expected


@pytest.mark.parametrize(
    ("url", "protocol"),
    [("127.0.0.1", None), ("ftp://h:1", None), ("grpc://h:8001", "http"), ("h:70000", None),
     ("grpc://grpc://h:8001", None), ("https://h:443", None), ("http://h:8000/v2", None),
     ("", None), ("h:0", None), ("h:80x", None), ("h:8001", "tcp")],
)  # fmt: skip
def test_bad_endpoints_are_user_errors(url, protocol):
    with pytest.raises(EndpointSyntaxError) as excinfo:
        parse_endpoint(url, protocol=protocol)
    assert excinfo.value.exit_code == 2 and excinfo.value.remediation


def _scripts_complete():
    """scripts/complete as a module (it has no .py suffix), without re-executing itself."""
    loader = importlib.machinery.SourceFileLoader("complete_script", str(COMPLETE))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


#: Every form the clients were ever given in their --url, good and bad.
URL_FORMS = [
    None, "127.0.0.1:8001", "localhost:8000", "grpc://h:8001", "http://h:8000", "HTTP://h:8000/",
    "[::1]:8001", "grpc://[fe80::1]:8001", "h", "h:", ":8001", "grpc://h", "https://h:443",
    "grpcs://h:8001", "ftp://h:1", "grpc://grpc://h:8001", "http://h:8000/v2/models", "h:0",
    "h:65536", "h:65535", "h:8001/", "h 8001", "", "http://", "user@h:8001", "a..b:8001",
    ".:8001", "http://" + "a" * 64 + ":8000", "a" * 63 + ".b:8001",
]  # fmt: skip


@pytest.mark.parametrize("protocol", [None, "grpc", "http"])
def test_scripts_complete_parses_url_exactly_as_the_loader_does(protocol):
    """scripts/complete keeps its own copy of the rules (users copy the script alone): both
    accept the same forms with the same address and protocol, and refuse the same ones."""
    script = _scripts_complete()
    for url in URL_FORMS:
        try:
            endpoint = parse_endpoint(url, protocol=protocol)
            expected = (endpoint.address, endpoint.protocol)
        except EndpointSyntaxError:
            expected = None
        try:
            got = script.parse_url(url, protocol)
        except script.ClientError:
            got = None
        assert got == expected, url


@pytest.mark.parametrize(
    "url",
    ["http://user:s3cret@h:8000", "ftp://user:s3cret@h:1", "grpc://user:s3cret@", "user:s3cret@h"],
)
def test_both_clients_refuse_a_url_with_credentials_without_showing_them(url):
    script = _scripts_complete()
    with pytest.raises(EndpointSyntaxError) as ours:
        parse_endpoint(url)
    with pytest.raises(script.ClientError) as theirs:
        script.parse_url(url)
    for said in (str(ours.value), str(theirs.value)):
        assert "s3cret" not in said, said


#: Values a request file or an option may hold for the numeric inputs, good and bad.
VALUE_FORMS = [
    0, 1, 2**32 - 1, 2**32, 2**64 - 1, 2**64, -1, 1.0, 1.5, -0.0, 1e38, 1e39, 3.5e38,
    float("nan"), float("inf"), True, False, "1", "abc", None, [1],
]  # fmt: skip


def test_scripts_complete_refuses_the_same_input_values_as_the_loader():
    """scripts/complete keeps its own copy of the value rules: for every numeric input, both
    clients accept the same values as the same numbers and refuse the same ones, with the
    same message."""
    from loader.completion import check_inputs
    from loader.errors import InvalidRequestError

    script = _scripts_complete()
    for name in set(script.INPUT_TYPES) - {"prompt"}:
        for value in VALUE_FORMS:
            try:
                check_inputs({name: [value]})
                expected = None
            except InvalidRequestError as exc:
                expected = exc.message
            try:
                got = script.checked(name, value)
                refused = None
            except script.ClientError as exc:
                refused = str(exc)
            assert refused == expected, (name, value)
            if refused is None and value == value:  # accepted alike (NaN is not equal to itself)
                assert got == value, (name, value, got)


def test_streaming_needs_grpc(tmp_path):
    with pytest.raises(LoaderError, match="only over gRPC"):
        measure_level(
            ENDPOINT,
            "codegen",
            1,
            options=PerfAnalyzerOptions(streaming=True),
            binary=find_perf_analyzer(),
        )


def test_compare_targets_are_directories_or_endpoints(tmp_path):
    from loader.bench.compare import parse_target

    repo = parse_target(f"i2={tmp_path}")
    assert (repo.label, repo.repository, repo.endpoint) == ("i2", tmp_path.resolve(), None)
    assert parse_target(str(tmp_path)).label == tmp_path.name
    remote = parse_target("prod=grpc://triton.prod:8001")
    assert (remote.label, remote.endpoint) == ("prod", Endpoint("triton.prod:8001", "grpc"))
    assert parse_target("10.0.0.1:8000").label == "10.0.0.1:8000"
    with pytest.raises(LoaderError, match="neither a directory nor an endpoint"):
        parse_target(str(tmp_path / "missing"))


def test_compare_rejects_duplicate_labels(tmp_path):
    from loader.bench.compare import compare, parse_target
    from loader.bench.settings import SweepSettings, Workload

    targets = [parse_target(f"x={tmp_path}"), parse_target("x=127.0.0.1:1")]
    settings = SweepSettings(concurrencies=(1,), workloads=(Workload(ROOT / "bench/test.json"),))
    with pytest.raises(LoaderError, match="share the label"):
        compare(targets, settings)


def test_a_recorded_export_gives_its_windows_and_our_stability_verdict():
    from loader.bench import profile

    path = DATA / "export_http_c2.json"
    windows = profile.read_windows(path, 2)
    assert len(windows) == 3
    assert [len(w.latencies_us) for w in windows] == [11, 10, 10]  # by arrival of the response
    assert profile.completed_requests(path, 2) == 31
    m = profile.measurement(2, windows)
    assert m.throughput == pytest.approx(31 / sum(w.seconds for w in windows))
    assert m.p50_us <= m.p90_us <= m.p95_us <= m.p99_us
    problem = profile.stability(windows, 25)
    assert problem is not None and "limit 25 %" in problem and "throughput" in problem
    assert profile.stability(windows, 1000) is None
    with pytest.raises(MeasurementError, match="no level 3"):
        profile.read_windows(path, 3)


def test_widening_doubles_the_window_of_either_mode():
    count = PerfAnalyzerOptions(measurement_mode="count_windows", measurement_request_count=16)
    assert count.widened().measurement_request_count == 32
    assert count.widened().window() == "32 requests"
    assert PerfAnalyzerOptions().widened().measurement_interval_ms == 10000
    assert "--measurement-interval=10000" in PerfAnalyzerOptions().widened().arguments()


BLOCK_AND_RUN = """
import sys
from importlib.abc import MetaPathFinder

class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in sys.argv[1].split(","):
            raise ModuleNotFoundError(name)
        return None

sys.meta_path.insert(0, Missing())
from loader.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("missing", "argv", "extra"),
    [
        ("pytriton", ["serve", "/nonexistent"], "[serve]"),
        ("matplotlib", ["tune", "--repository", "/nonexistent"], "[bench]"),
        ("pytriton", ["tune", "--repository", "/nonexistent"], "[serve]"),
    ],
)
def test_a_command_whose_extra_is_missing_names_the_extra(missing, argv, extra):
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_AND_RUN, missing, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"pip install 'model-triton-loader{extra}'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_shows_every_flags_default_and_documents_the_environment():
    from loader.cli import build_parser

    help_text = build_parser().format_help()
    assert "MODEL_LOADER_LOG_LEVEL" in help_text
    tune = subprocess.run(
        [sys.executable, "-m", "loader", "tune", "--help"], capture_output=True, text=True
    ).stdout
    assert "--serving-experiment" not in tune  # only flags and defaults tune has
    assert "default 1:16:5" in tune and "bench/mixed.json" in tune
