"""End to end: the real perf_analyzer against the real local Triton serving a tiny model.

The repository is published by ``model-loader run --backend python`` from a tiny random GPT-J
checkpoint; the requests are the production ``bench/test.json``. Measurement windows are short
(3 windows of 3 requests per level, any spread accepted): these tests check that the pipeline
works and its outputs are well formed, not how fast anything is.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loader.bench.cli import main as bench_main
from loader.bench.endpoint import Endpoint
from loader.bench.perf_analyzer import PerfAnalyzerOptions
from loader.bench.report import CSV_FILE, PLOT_FILE, SUMMARY_FILE, TABLES_FILE
from loader.bench.results import TABLE_HEADER, parse_table, sweeps_from_csv
from loader.bench.sweep import sweep
from loader.errors import ModelNotFoundError
from loader.serving import TritonServer
from loader.tune import tune, values_snippet

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^Concurrency: (\d+), throughput: ([0-9.e+-]+) infer/sec, latency (\d+) usec$")
SHORT = PerfAnalyzerOptions(
    input_data=ROOT / "bench" / "test.json",
    measurement_mode="count_windows",
    measurement_request_count=3,
    stability_percentage=1000,
    max_trials=3,
)
SHORT_FLAGS = (
    "--measurement-mode=count_windows",
    "--measurement-request-count=3",
    "--stability-percentage=1000",
    "--max-trials=3",
)


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
def test_bench_cli_prints_the_seed_table_and_writes_csv_and_plot(server, tmp_path, capsys):
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
def test_a_model_the_server_does_not_have_is_a_model_not_found_error(server):
    with pytest.raises(ModelNotFoundError, match="nosuch"):
        sweep(Endpoint(server.http_url, "http"), "nosuch", [1], options=SHORT)


@pytest.mark.slow
def test_tune_measures_batching_off_and_on_and_prints_values(
    published_tiny_python_repository, tmp_path
):
    started = []
    result = tune(
        published_tiny_python_repository,
        work_dir=tmp_path / "tune",
        instance_counts=[1],
        concurrencies=[4],
        options=SHORT,
        preferred_batch_sizes=[4],
        on_start=started.append,
    )
    assert [t.label for t in started] == ["i1-batching-off", "i1-batching-on"]
    assert [s.label for s in result.sweeps] == ["i1-batching-off", "i1-batching-on"]
    assert all(s.measurements[0].throughput > 0 for s in result.sweeps)
    assert result.winner is not None
    best = max(result.sweeps, key=lambda s: s.measurements[0].throughput)
    assert result.winner.sweep is best or (
        best.measurements[0].throughput * 0.95 <= result.winner.measurement.throughput
    )
    snippet = values_snippet(
        result.winning_variant,
        result.winner.measurement,
        label=result.winner.sweep.label,
        max_p95_ms=None,
    )
    assert "instanceCount: 1" in snippet
    assert (tmp_path / "tune" / "logs" / "tritonserver-i1-batching-on.log").is_file()


@pytest.mark.slow
def test_compare_prints_one_table_per_endpoint_and_the_best(server, tmp_path, capsys):
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
