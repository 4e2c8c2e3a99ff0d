"""The perf_analyzer parsers, the seed's table format, the CSV and the plot, on recorded output.

tests/data/perf_analyzer/ holds real perf_analyzer 2.41.0 output (stdout and ``-f`` CSV) recorded
against the CPU Triton, plus the table of Benchmark 6 of our production merge request.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg

from loader.bench.report import (
    Report,
    best_configuration,
    peak_ratio,
    summary_text,
    tables_text,
    write_plot,
    write_report,
)
from loader.bench.results import (
    RESULT_COLUMNS,
    TABLE_HEADER,
    Measurement,
    Sweep,
    format_line,
    format_table,
    median_sweeps,
    parse_csv,
    parse_table,
    sweeps_from_csv,
    sweeps_to_csv,
)
from loader.errors import MeasurementError
from loader.repository.tensors import ENSEMBLE_INPUTS

DATA = Path(__file__).parent / "data" / "perf_analyzer"
ROOT = Path(__file__).resolve().parents[1]


def read(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def recorded_sweep(name: str, label: str) -> Sweep:
    return Sweep(label, parse_csv(read(f"{name}.csv")))


def test_seed_table_lines_round_trip_exactly():
    text = read("seed_benchmark6_table.txt")
    measurements = parse_table(text)
    assert [m.concurrency for m in measurements] == list(range(1, 92, 10))
    assert measurements[-1].throughput == pytest.approx(73.5408)
    assert measurements[-1].p95_us == 1271415
    assert [format_line(m) for m in measurements] == text.splitlines()


def test_format_line_prints_throughput_like_perf_analyzer():
    line = format_line(Measurement(concurrency=11, throughput=10.998312, p95_us=1029421))
    assert line == "Concurrency: 11, throughput: 10.9983 infer/sec, latency 1029421 usec"
    assert format_line(Measurement(1, 2.4440, 409490)).endswith(
        "throughput: 2.444 infer/sec, latency 409490 usec"
    )


@pytest.mark.parametrize(
    "name", ["http_c1-4", "grpc_c1-7", "grpc_i2_batching_c1-16", "http_unstable_after_c1"]
)
def test_csv_and_stdout_table_agree(name):
    from_csv = parse_csv(read(f"{name}.csv"))
    from_stdout = parse_table(read(f"{name}_stdout.txt"))
    assert [m.concurrency for m in from_csv] == [m.concurrency for m in from_stdout]
    for a, b in zip(from_csv, from_stdout, strict=True):
        assert a.throughput == pytest.approx(b.throughput)
        assert a.p95_us == b.p95_us
        assert a.p50_us <= a.p90_us <= a.p95_us <= a.p99_us


def test_csv_rows_are_sorted_by_concurrency_not_throughput():
    raw = list(csv.DictReader(io.StringIO(read("grpc_c1-7.csv"))))
    assert [int(r["Concurrency"]) for r in raw] != sorted(int(r["Concurrency"]) for r in raw)
    assert [m.concurrency for m in parse_csv(read("grpc_c1-7.csv"))] == [1, 3, 5, 7]


def test_csv_without_p95_column_is_a_measurement_error():
    text = "Concurrency,Inferences/Second,p50 latency\n1,10.0,100\n"
    with pytest.raises(MeasurementError, match="p95 latency"):
        parse_csv(text)


def test_format_table_has_the_seed_header_and_one_line_per_level():
    sweep = recorded_sweep("grpc_i2_batching_c1-16", "i2")
    lines = format_table(sweep).splitlines()
    assert lines[0] == TABLE_HEADER
    assert lines[1:] == read("grpc_i2_batching_c1-16_stdout.txt").splitlines()[-4:]


WORDS = (
    "Failed to obtain stable measurement within 4 measurement windows for concurrency 6. "
    "Please try to increase the --measurement-request-count."
)


def test_tables_text_lists_settings_and_unstable_levels():
    sweep = recorded_sweep("http_unstable_after_c1", "i2-batching-on")
    sweep.settings = {"instance_group": 2, "dynamic_batching": True, "preferred_batch_size": [4, 8]}
    sweep.measurements.append(Measurement(6, 80.5, 30000, stable=False, note=WORDS))
    text = tables_text([sweep])
    assert text.startswith("Benchmark 1: i2-batching-on\n")
    assert "• instance_group = 2\n• dynamic_batching = on\n• preferred_batch_size = 4, 8\n" in text
    assert "Concurrency: 1, throughput: 70.4918 infer/sec, latency 14642 usec\n" in text
    assert "Concurrency: 6, throughput: 80.5 infer/sec, latency 30000 usec (unstable)\n" in text
    assert f"(unstable at concurrency 6: {WORDS})" in text
    # the unstable level is in the table, read back as unstable, and never the best
    assert [m.stable for m in parse_table(text)] == [True, False]
    assert sweep.best().concurrency == 1


def test_unstable_levels_survive_the_csv_and_are_named_in_the_summary(tmp_path):
    sweep = recorded_sweep("http_c1-4", "naive")
    sweep.measurements.append(Measurement(8, 99.0, 5000, stable=False, note=WORDS))
    [back] = sweeps_from_csv(sweeps_to_csv([sweep]))
    assert back.unstable == [Measurement(8, 99.0, 5000, stable=False, note=WORDS)]
    summary = summary_text([sweep])
    assert "Best configuration (no latency budget): naive" in summary
    assert "at concurrency 8: 99" not in summary
    assert f"naive at concurrency 8: {WORDS}" in summary


def test_results_csv_round_trips_every_configuration():
    sweeps = [recorded_sweep("http_c1-4", "naive"), recorded_sweep("grpc_i2_batching_c1-16", "b")]
    text = sweeps_to_csv(sweeps)
    rows = list(csv.reader(io.StringIO(text)))
    assert tuple(rows[0]) == RESULT_COLUMNS
    assert len(rows) == 1 + 4 + 4
    back = sweeps_from_csv(text)
    assert [s.label for s in back] == ["naive", "b"]
    assert back[1].measurements == sweeps[1].sorted()


def test_triton_batch_counts_round_trip_and_give_the_average_batch():
    level = Measurement(16, 40.0, 500_000, inference_count=199, execution_count=33)
    [back] = sweeps_from_csv(sweeps_to_csv([Sweep("b", [level], workload="mixed")]))
    assert back.measurements == [level]
    assert back.measurements[0].average_batch == pytest.approx(199 / 33)
    assert Measurement(1, 1.0, 1).average_batch is None
    assert Measurement(1, 1.0, 1, inference_count=0, execution_count=0).average_batch is None


def test_a_results_csv_of_an_earlier_version_reads_its_missing_columns_as_not_measured():
    """results.csv files written before a column was added are still read (the committed ones)."""
    older = [c for c in RESULT_COLUMNS if c not in ("cpu_ms_per_request", "inference_count")]
    text = (
        ",".join(older)
        + "\n"
        + ",".join(
            {"configuration": "a", "workload": "test", "concurrency": "4", "stable": "yes"}.get(
                c, "1" if c in ("throughput_infer_per_sec", "p95_latency_us") else ""
            )
            for c in older
        )
        + "\n"
    )
    [back] = sweeps_from_csv(text)
    assert back.measurements == [Measurement(4, 1.0, 1)]


@pytest.mark.parametrize(
    "header",
    [
        ",".join((*RESULT_COLUMNS, "surprise")),  # a column we never wrote
        ",".join(c for c in RESULT_COLUMNS if c != "p95_latency_us"),  # a required one missing
        ",".join((*RESULT_COLUMNS, "note")),  # a column twice
    ],
)
def test_a_csv_that_is_not_a_results_csv_is_refused(header):
    with pytest.raises(MeasurementError, match="not a bench results CSV"):
        sweeps_from_csv(header + "\n")


def test_best_configuration_respects_the_latency_budget():
    naive = recorded_sweep("http_c1-4", "naive")
    batching = recorded_sweep("grpc_i2_batching_c1-16", "batching")
    best = best_configuration([naive, batching])
    assert (best.sweep.label, best.measurement.concurrency) == ("batching", 16)
    within_20ms = best_configuration([naive, batching], max_p95_ms=20)
    assert (within_20ms.sweep.label, within_20ms.measurement.concurrency) == ("naive", 1)
    assert best_configuration([naive, batching], max_p95_ms=5) is None


def test_summary_reports_the_gain_over_the_baseline_between_best_stable_levels():
    naive = Sweep(
        "i1-batching-off",
        [
            Measurement(1, 10.0, 1000),
            Measurement(8, 8.0, 8000),
            Measurement(16, 2.0, 9000, stable=False, note="unstable"),  # never the reference
        ],
    )
    batching = Sweep("i1-batching-on", [Measurement(1, 10.0, 1000), Measurement(8, 40.0, 2000)])
    top, base, value = peak_ratio(batching, naive)
    assert (top.concurrency, base.concurrency, value) == (8, 1, pytest.approx(4.0))
    text = summary_text([naive, batching], baseline="i1-batching-off")
    assert "Best configuration (no latency budget): i1-batching-on" in text
    assert (
        "4.00x the best stable throughput of i1-batching-off (10 infer/sec at concurrency 1)"
        in text
    )


def test_plot_is_a_png_with_one_line_per_configuration(tmp_path):
    naive = recorded_sweep("http_c1-4", "naive")
    batching = recorded_sweep("grpc_i2_batching_c1-16", "batching")
    one = write_plot([naive], tmp_path / "one.png")
    two = write_plot([naive, batching], tmp_path / "two.png", max_p95_ms=30)
    assert two.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels_one, pixels_two = mpimg.imread(one), mpimg.imread(two)
    assert pixels_two.shape[0] > 400 and pixels_two.shape[1] > 600
    # The second configuration adds a line in matplotlib's second colour (C1, orange).
    orange = np.array([1.0, 0.498, 0.055])

    def orange_pixels(pixels):
        return int((np.abs(pixels[..., :3] - orange).sum(axis=-1) < 0.05).sum())

    assert orange_pixels(pixels_one) == 0
    assert orange_pixels(pixels_two) > 200
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_write_report_writes_tables_csv_plot_and_summary(tmp_path):
    sweeps = [recorded_sweep("http_c1-4", "naive"), recorded_sweep("grpc_c1-7", "grpc")]
    paths = write_report(Report(sweeps, baseline="naive"), tmp_path / "out", max_p95_ms=40)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.name for p in paths.values()
    )
    assert "Benchmark 2: grpc" in paths["tables"].read_text()
    assert sweeps_from_csv(paths["csv"].read_text())[0].measurements == sweeps[0].sorted()
    assert "p95 latency <= 40 ms" in paths["summary"].read_text()


def test_bench_test_json_is_the_production_request_for_the_ensemble():
    data = json.loads((ROOT / "bench" / "test.json").read_text())
    (request,) = data["data"]
    assert set(request) == {t.name for t in ENSEMBLE_INPUTS}
    assert request["prompt"] == {"content": ["<python>def is_even(na: int) ->"], "shape": [1]}
    assert request["request_output_len"] == {"content": [32], "shape": [1]}
    assert request["random_seed"] == [1594506369]


def test_median_of_rounds_keeps_each_levels_median_round_whole():
    def sweep(*levels, shaky=(16, 70.0, 3000)):
        measurements = [Measurement(c, t, p) for c, t, p in levels]
        if shaky:
            measurements.append(Measurement(*shaky, stable=False, note="unstable"))
        return Sweep("i1", measurements)

    rounds = [
        [sweep((1, 10.0, 100), (8, 30.0, 900))],
        [sweep((1, 12.0, 90), (8, 5.0, 5000), shaky=(16, 50.0, 2000))],  # disturbed at c8
        [sweep((1, 11.0, 95), (8, 31.0, 880), (16, 40.0, 1200), shaky=None)],
    ]
    (merged,) = median_sweeps(rounds)
    assert merged.measurements == [
        Measurement(1, 11.0, 95, rounds=3, throughput_low=10.0, throughput_high=12.0),
        Measurement(8, 30.0, 900, rounds=3, throughput_low=5.0, throughput_high=31.0),
        Measurement(16, 40.0, 1200, rounds=1, throughput_low=40.0, throughput_high=40.0),
    ]
    assert merged.unstable == []  # measured stably in one round: that round counts
    (two,) = median_sweeps(rounds[:2])
    assert (two.at(8).throughput, two.at(8).p95_us) == (5.0, 5000)  # the lower median
    assert [(m.concurrency, m.note) for m in two.unstable] == [(16, "unstable")]
    # rounds that disagree by more than the stability percentage make a level unstable
    (strict,) = median_sweeps(rounds, agreement_percentage=25)
    assert [m.concurrency for m in strict.unstable] == [8]
    assert "its 3 rounds disagree: 5 to 31 infer/sec" in strict.at(8).note
    assert strict.at(1).stable  # 10 to 12 around 11: within 25 %


def test_report_files_are_readable_by_everyone(tmp_path):
    paths = write_report(Report([recorded_sweep("http_c1-4", "naive")]), tmp_path)
    for path in paths.values():
        assert path.stat().st_mode & 0o044 == 0o044, path


def test_a_winner_by_a_small_gap_in_one_round_is_called_uncertain():
    """Two identical repositories, one round, 5% apart at one level: the summary names the
    better one and says the choice is uncertain, without a baseline named too."""
    a = Sweep("a", [Measurement(10, 10.5, 1000)])
    b = Sweep("b", [Measurement(10, 10.0, 1000)])
    text = summary_text([a, b], by_round=[[a, b]])
    assert "Best configuration (no latency budget): a" in text
    assert "1.05x the best stable throughput of b" in text
    assert "uncertain: 1 round(s) with stable levels of both" in text
    # Rounds that disagree are uncertain too; rounds that agree say so.
    a2, b2 = Sweep("a", [Measurement(10, 9.0, 1000)]), Sweep("b", [Measurement(10, 10.0, 1000)])
    assert "uncertain: the rounds disagree" in summary_text([a, b], by_round=[[a, b], [a2, b2]])
    a3 = Sweep("a", [Measurement(10, 11.0, 1000)])
    agreed = summary_text([a, b], by_round=[[a, b], [a3, b]])
    assert "higher in every round" in agreed and "uncertain" not in agreed


def test_the_plot_says_what_was_requested_and_the_tokens_per_second(tmp_path):
    """One title, each panel naming its requests' shape, and a second axis of generated tokens
    per second where every request asks for the same number."""
    from loader.bench.settings import RequestShape, request_shape

    root = Path(__file__).resolve().parents[1]
    shape = request_shape(root / "bench" / "test.json")
    assert shape == RequestShape(1, (31, 31), (32, 32))
    assert shape.text == "1 request: prompt 31 characters, 32 output tokens"
    mixed = request_shape(root / "bench" / "mixed.json")
    assert mixed.requests == 12 and mixed.prompt_chars[0] < mixed.prompt_chars[1]
    assert request_shape(tmp_path / "missing.json") is None
    sweeps = [recorded_sweep("http_c1-4", "naive")]
    plain = mpimg.imread(write_plot(sweeps, tmp_path / "plain.png"))
    shaped = mpimg.imread(write_plot(sweeps, tmp_path / "shaped.png", shapes={"": shape}))
    assert plain.shape == shaped.shape and not np.array_equal(plain, shaped)
    # The right-hand axis (tokens/s) draws dark tick labels where the plain plot has none.
    right = slice(int(plain.shape[1] * 0.9), plain.shape[1])
    dark = lambda pixels: int((pixels[:, right, :3].sum(axis=-1) < 1.0).sum())  # noqa: E731
    assert dark(shaped) > dark(plain) + 50


def test_a_p95_from_few_requests_is_marked_as_their_maximum(tmp_path):
    """Nearest rank: below 20 samples the 95th percentile is the slowest one. The tables say
    so and the plot draws such a point hollow (and says why); 32 samples are a p95."""
    from loader.bench.stream import MIN_P95_SAMPLES, Sample, StreamLevel, StreamSweep
    from loader.bench.stream import format_line as stream_line
    from loader.bench.stream import write_plot as stream_plot

    def level(concurrency: int, n: int) -> StreamLevel:
        samples = [Sample(0.1 + i / 1000, 0.01, 0.5, 16) for i in range(n)]
        return StreamLevel.of(concurrency, samples, wall_s=2.0)

    few, enough = level(1, 8), level(2, 32)
    assert MIN_P95_SAMPLES == 20 and few.ttft_p95_us == round(0.107 * 1e6)  # the maximum
    assert "TTFT mean" in stream_line(few) and "(max of 8: too few for a p95)" in stream_line(few)
    assert "too few" not in stream_line(enough)
    # The same numbers, once from 8 requests and once said to be from 32: only the marking
    # (hollow points, the note under the title) tells the two plots apart.
    counted = dataclasses.replace(few, requests=32, tpot_requests=32)
    marked = mpimg.imread(stream_plot([StreamSweep("a", [few, enough])], tmp_path / "few.png"))
    plain = mpimg.imread(stream_plot([StreamSweep("a", [counted, enough])], tmp_path / "n.png"))
    assert marked.shape == plain.shape and not np.array_equal(marked, plain)
