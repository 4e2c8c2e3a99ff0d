"""End to end: the real perf_analyzer against the real local Triton serving a tiny model.

The repository is published by ``model-loader run --backend python`` from a tiny random GPT-J
checkpoint; the requests are the production ``bench/test.json`` with start and end ids inside the
tiny vocabulary (``tests/data/tiny/test.json``). Measurement windows are short
(3 windows of 3 requests per level, any spread accepted): these tests check that the pipeline
works and its outputs are well formed, not how fast anything is.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loader.bench.perf_analyzer import PerfAnalyzerOptions
from loader.bench.report import CSV_FILE, PLOT_FILE, SUMMARY_FILE, TABLES_FILE
from loader.bench.results import TABLE_HEADER, parse_table, sweeps_from_csv
from loader.bench.sweep import sweep
from loader.cli import main as loader_main
from loader.cli.bench import main as bench_main
from loader.endpoint import Endpoint
from loader.errors import ModelNotFoundError
from loader.serving import TritonServer, restricted_protocols
from tests.tinymodels import TINY_REQUEST_FILE

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^Concurrency: (\d+), throughput: ([0-9.e+-]+) infer/sec, latency (\d+) usec$")
SHORT = PerfAnalyzerOptions(
    input_data=TINY_REQUEST_FILE,
    measurement_mode="count_windows",
    measurement_request_count=3,
    stability_percentage=1000,
)
SHORT_FLAGS = (
    "--measurement-mode=count_windows",
    "--measurement-request-count=3",
    "--stability-percentage=1000",
)
#: The users' request for the tiny model (the CLI's default is the production bench/test.json).
TINY_INPUT = ("--input-data", str(TINY_REQUEST_FILE))


@pytest.fixture(scope="module")
def admin_header(server: TritonServer) -> tuple[str, ...]:
    """perf_analyzer's -H with the chart's admin header: over gRPC it reads the model's metadata,
    configuration and statistics, which the chart restricts (it sends -H over gRPC too)."""
    [(name, token)] = set(restricted_protocols(server.pod_args).values())
    return ("-H", f"{name}:{token}")


@pytest.fixture(scope="module")
def server(published_tiny_python_repository):
    with TritonServer(published_tiny_python_repository) as running:
        yield running


@pytest.mark.slow
def test_sweep_measures_positive_throughput_and_ordered_latencies(server):
    seen = []
    result = sweep(
        Endpoint(server.http_url, "http"),
        "codegen",
        [2],
        options=SHORT,
        label="tiny",
        on_measurement=seen.append,
    )
    assert [m.concurrency for m in result.sorted()] == [2]
    assert seen == result.measurements
    for m in result.measurements:
        assert m.throughput > 0
        assert 0 < m.p50_us <= m.p90_us <= m.p95_us <= m.p99_us
        assert m.server_compute_infer_us is not None and m.server_compute_infer_us > 0
    assert result.unstable == []


@pytest.mark.slow
def test_bench_cli_prints_the_seed_table_and_writes_csv_and_plot(
    server, admin_header, tmp_path, capsys
):
    out = tmp_path / "out"
    code = bench_main(
        [
            "--url",
            f"grpc://{server.grpc_url}",
            "--model",
            "codegen",
            "--concurrency-range",
            "1:2",
            "--output-dir",
            str(out),
            *SHORT_FLAGS,
            *TINY_INPUT,
            "--",
            *admin_header,
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.out.splitlines()
    assert TABLE_HEADER in lines
    table = [line for line in lines if line.startswith("Concurrency:")]
    assert [int(LINE.match(line)[1]) for line in table] == [1, 2]  # every line well formed
    assert all(float(LINE.match(line)[2]) > 0 for line in table)
    assert lines.index(TABLE_HEADER) == lines.index(table[0]) - 1

    (result,) = sweeps_from_csv((out / CSV_FILE).read_text())
    assert [m.concurrency for m in result.measurements] == [1, 2]
    assert all(m.throughput > 0 and m.p95_us > 0 for m in result.measurements)
    assert parse_table("\n".join(table)) == [
        type(m)(m.concurrency, m.throughput, m.p95_us) for m in result.measurements
    ]
    assert (out / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
    assert "Best configuration" in (out / SUMMARY_FILE).read_text()
    assert parse_table((out / TABLES_FILE).read_text()) == parse_table("\n".join(table))


@pytest.mark.slow
def test_a_level_that_never_settles_is_widened_then_reported_unstable(server, caplog):
    import dataclasses

    never = dataclasses.replace(SHORT, stability_percentage=0.001, widenings=1)
    with caplog.at_level("INFO", logger="loader.bench"):
        result = sweep(Endpoint(server.http_url, "http"), "codegen", [2], options=never)
    [m] = result.measurements
    assert not m.stable and result.unstable == [m]
    assert m.throughput > 0 and m.p95_us > 0
    assert m.note.startswith("the 3 windows' throughput") and "(limit 0.001 %)" in m.note
    assert "with windows of 6 requests" in caplog.text  # widened once before giving up


@pytest.mark.slow
def test_a_model_the_server_does_not_have_is_a_model_not_found_error(server):
    with pytest.raises(ModelNotFoundError, match="nosuch"):
        sweep(Endpoint(server.http_url, "http"), "nosuch", [1], options=SHORT)


@pytest.mark.slow
def test_tune_measures_batching_off_and_on_and_prints_the_values_snippet(
    published_tiny_python_repository, tmp_path, capsys
):
    import json

    import yaml

    # Two workloads, like the defaults (the tiny model's 64 positions need shorter prompts
    # than bench/mixed.json): the production request and prompts of three lengths.
    entry = json.loads(TINY_REQUEST_FILE.read_text())["data"][0]
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"data": [
        {**entry, "prompt": {"content": [p], "shape": [1]}}
        for p in ("def f(", "import os\nimport sys\ndef main(", "x = 1\ny = 2\nz = x +")
    ]}))  # fmt: skip
    code = loader_main(
        [
            "tune",
            "--repository",
            str(published_tiny_python_repository),
            "--instance-counts",
            "1",
            "--preferred-batch-size",
            "4",
            "--concurrency-range",
            "4",
            "--work-dir",
            str(tmp_path / "tune"),
            "--input-data",
            str(TINY_REQUEST_FILE),
            str(mix),
            "--rounds",
            "2",
            *SHORT_FLAGS,
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = captured.out
    headings = [line for line in out.splitlines() if line.startswith("Benchmark ")]
    assert headings == [
        f"Benchmark {n}: i1-batching-{b} ({w}) (round {r} of 2)"
        for n, (r, b, w) in enumerate(
            [(r, b, w) for r in (1, 2) for b in ("off", "on") for w in ("test", "mix")], start=1
        )
    ]
    table = [LINE.match(line) for line in out.splitlines() if line.startswith("Concurrency:")]
    assert [int(m[1]) for m in table] == [4] * 8
    assert all(float(m[2]) > 0 for m in table)
    summary = (tmp_path / "tune" / "results" / SUMMARY_FILE).read_text()
    assert summary.startswith("Complete.\nRecommendation: ")
    if "Recommendation: uncertain" in out:
        # the two rounds chose differently on this busy machine: said plainly, nothing to paste
        assert "the rounds chose differently" in out and "No values to paste" in out
        assert "# Measured by" not in out
        return
    assert "Recommendation: certain: each of the 2 rounds chose" in out
    snippet = yaml.safe_load(out[out.index("# Measured by `model-loader tune`") :])
    assert snippet["triton"]["instanceCount"] == 1
    batching = snippet["triton"]["dynamicBatching"]
    assert batching in (
        {"enabled": False},
        {"enabled": True, "preferredBatchSize": [4], "maxQueueDelayMicroseconds": 100},
    )
    results = tmp_path / "tune" / "results"
    sweeps = sweeps_from_csv((results / CSV_FILE).read_text())
    assert [(s.label, s.workload) for s in sweeps] == [
        ("i1-batching-off", "test"),
        ("i1-batching-off", "mix"),
        ("i1-batching-on", "test"),
        ("i1-batching-on", "mix"),
    ]
    assert (tmp_path / "tune" / "logs" / "tritonserver-i1-batching-on.log").is_file()
    # Triton's own counts of the generating model around each level: without dynamic batching
    # every request is an execution of its own; with it, never more executions than requests.
    for s in sweeps:
        [level] = s.measurements
        assert level.inference_count is not None and level.inference_count >= 3 * 3, s.name
        if s.label == "i1-batching-off":
            assert level.execution_count == level.inference_count, s.name
        else:
            assert 1 <= level.execution_count <= level.inference_count, s.name
    # The winner's worst ratio to the best over both workloads is within 5 % of the other's.
    suffix = "on" if batching["enabled"] else "off"

    def score(variant: str) -> float:
        ratios = []
        for workload in ("test", "mix"):
            top = max(s.measurements[0].throughput for s in sweeps if s.workload == workload)
            own = next(s for s in sweeps if s.label == variant and s.workload == workload)
            ratios.append(own.measurements[0].throughput / top)
        return min(ratios)

    other = "off" if suffix == "on" else "on"
    assert score(f"i1-batching-{suffix}") >= 0.95 * score(f"i1-batching-{other}")


@pytest.mark.slow
def test_compare_prints_one_table_per_endpoint_and_the_best(server, admin_header, tmp_path, capsys):
    code = bench_main(
        [
            "--compare",
            f"over-http=http://{server.http_url}",
            f"over-grpc=grpc://{server.grpc_url}",
            "--model",
            "codegen",
            "--concurrency-range",
            "2",
            "--baseline",
            "over-http",
            "--output-dir",
            str(tmp_path),
            *SHORT_FLAGS,
            *TINY_INPUT,
            "--",
            *admin_header,
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = captured.out
    assert out.index("Benchmark 1: over-http") < out.index("Benchmark 2: over-grpc")
    assert len([line for line in out.splitlines() if LINE.match(line)]) == 2
    assert re.search(r"^Best configuration \(no latency budget\): over-(http|grpc)$", out, re.M)
    labels = [s.label for s in sweeps_from_csv((tmp_path / CSV_FILE).read_text())]
    assert labels == ["over-http", "over-grpc"]


@pytest.mark.slow
def test_a_capped_run_stops_starting_levels_and_says_what_it_left(server, tmp_path, capsys):
    argv = [
        "--compare", f"a=http://{server.http_url}", f"b=http://{server.http_url}",
        "--model", "codegen", "--concurrency-range", "1:3:1", "--rounds", "2",
        "--max-minutes", "0.001", "--output-dir", str(tmp_path), *SHORT_FLAGS, *TINY_INPUT,
    ]  # fmt: skip
    assert bench_main(argv) == 0, capsys.readouterr().err
    summary = (tmp_path / SUMMARY_FILE).read_text()
    assert summary.startswith("CUT SHORT by the time cap: ")
    measured = sum(len(s.measurements) for s in sweeps_from_csv((tmp_path / CSV_FILE).read_text()))
    assert summary.startswith(f"CUT SHORT by the time cap: {measured} of 12 measurements")
    assert measured < 12
    # a second run into the same folder is refused unless asked
    assert bench_main(argv) == 2
    assert "already holds results of an earlier run" in capsys.readouterr().err
    assert bench_main([*argv, "--overwrite"]) == 0


@pytest.mark.slow
def test_an_interrupted_run_leaves_the_results_it_measured(server, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "bench"), "--url", f"http://{server.http_url}", "--model",
         "codegen", "--concurrency-range", "1:40:1", "--output-dir", str(out), *SHORT_FLAGS, *TINY_INPUT],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / CSV_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / CSV_FILE).exists(), "no partial result was written"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err  # SIGTERM: stopped cleanly
    summary = (out / SUMMARY_FILE).read_text()
    assert summary.startswith("INTERRUPTED: ") and "the run was interrupted" in summary
    [result] = sweeps_from_csv((out / CSV_FILE).read_text())
    assert 1 <= len(result.measurements) < 40
    assert (out / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
