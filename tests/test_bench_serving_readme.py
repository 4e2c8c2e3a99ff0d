"""The serving experiment's README: written from its results files alone, every number theirs.

The committed ``bench/results/serving/README.md`` must be what the generator writes from the
committed ``results.csv``, ``summary.txt`` and ``tables.txt``: a README telling another run's
numbers fails here. The generator itself is checked on a small synthetic run written by
:func:`loader.bench.report.write_report`, as the experiment writes it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from loader.bench.report import CSV_FILE, README_FILE, SUMMARY_FILE, Report, write_report
from loader.bench.results import Measurement, Sweep, sweeps_from_csv, sweeps_to_csv
from loader.bench.serving_readme import (
    parse_summary,
    read_run,
    readme_from_directory,
    readme_text,
)
from loader.errors import MeasurementError

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "bench" / "results" / "serving"
OFF = {"instance_group": 1, "dynamic_batching": False}
ON = {**OFF, "dynamic_batching": True, "preferred_batch_size": [4, 8]}
NOTES = {
    "command": "scripts/bench --serving-experiment --output-dir out",
    "model": "demo CodeGen checkpoint (n_layer=2)",
    "requests": "test: bench/demo/test.json; mixed: bench/demo/mixed.json",
    "measurement": "measurement_mode=count_windows, stability_percentage=25.0",
    "machine": "x86_64, 7 CPUs, Python 3.11.7",
    "load average (1 min) at the start of each sweep": "i1-batching-off 0.4; now 0.6",
    "load average (1 min) of the whole run": "1-minute load average 0.3 before, 0.6 after",
    "duration": "123 s",
    "chart default (fewest instances within 5% of the best on every workload)": "i1-batching-on",
}


def level(c: int, throughput: float, *, stable: bool = True, counts=(None, None)) -> Measurement:
    return Measurement(
        c, throughput, 100_000 * c, stable=stable, note="" if stable else "did not settle",
        inference_count=counts[0], execution_count=counts[1],
    )  # fmt: skip


def synthetic() -> list[Sweep]:
    """Batching off and on, two request files, levels 1, 8 and 16; batching on is unstable at
    16 on ``test``, so the top level both measured stably there is 8."""
    return [
        Sweep("i1-batching-off", [level(1, 5), level(8, 10), level(16, 9, counts=(90, 90))],
              settings=OFF, workload="test"),
        Sweep("i1-batching-off", [level(1, 4), level(8, 8), level(16, 7.5, counts=(75, 75))],
              settings=OFF, workload="mixed"),
        Sweep("i1-batching-on",
              [level(1, 5), level(8, 30), level(16, 45, stable=False, counts=(120, 20))],
              settings=ON, workload="test"),
        Sweep("i1-batching-on", [level(1, 4), level(8, 20), level(16, 24, counts=(96, 16))],
              settings=ON, workload="mixed"),
    ]  # fmt: skip


def written(tmp_path: Path, sweeps: list[Sweep], **changes) -> str:
    fields = {
        "baseline": "i1-batching-off",
        "notes": NOTES,
        "status": "Complete: 12 measurements in 1 round(s).\nRecommendation: uncertain: one round",
        "readme": readme_from_directory,
        **changes,
    }
    report = Report(sweeps=sweeps, **fields)
    paths = write_report(report, tmp_path, plot=False)
    assert paths["readme"] == tmp_path / README_FILE
    return (tmp_path / README_FILE).read_text()


def flat(text: str) -> str:
    """The text with its line wrapping undone (phrases are checked, not where lines break)."""
    return " ".join(text.split())


def test_the_committed_serving_readme_is_what_its_results_files_say():
    """Regenerated from the committed results: a README with another run's numbers differs."""
    assert (COMMITTED / README_FILE).read_text() == readme_from_directory(COMMITTED), (
        "bench/results/serving/README.md is stale: regenerate it with "
        "`.venv/bin/python -c 'from loader.bench.serving_readme import readme_from_directory as "
        'r; import sys; sys.stdout.write(r("bench/results/serving"))\' > '
        "bench/results/serving/README.md` (or rerun make bench-serving)"
    )


def test_every_ratio_in_the_committed_readme_is_one_of_its_results():
    """Independently of the generator: each ``**N.NNx**`` is the ratio of two throughputs the
    README quotes on the same line, and those throughputs are rows of results.csv."""
    text = (COMMITTED / README_FILE).read_text()
    csv_values = {
        m.throughput for s in sweeps_from_csv((COMMITTED / CSV_FILE).read_text())
        for m in s.measurements
    }  # fmt: skip
    ratios = 0
    for item in re.split(r"\n(?=- |\n)", text):
        for ratio in re.findall(r"\*\*([0-9.]+)x\*\*", item):
            a, b = (float(x) for x in re.findall(r"([0-9.]+)\s(?:infer/s|against)", item)[:2])
            assert {a, b} <= csv_values, item
            assert float(ratio) == pytest.approx(a / b, abs=0.005), item
            ratios += 1
    assert ratios >= 4


def test_the_readme_gives_the_batching_gain_best_against_best_and_at_the_top_shared_level(
    tmp_path,
):
    text = flat(written(tmp_path, synthetic()))
    test_part = text[text.index("`i1-batching-off` with `bench/demo/test.json` (test):") :]
    test_part = test_part[: test_part.index("`i1-batching-on` against")]
    # best stable against best stable: 30 at 8 (16 is unstable) against 10 at 8
    assert "i1-batching-on 30 infer/s at concurrency 8" in test_part
    assert "against i1-batching-off 10 infer/s at concurrency 8" in test_part
    assert "**3.00x**" in test_part
    # at the same level: 8 is the highest both measured stably, and 16 is named as not compared
    assert "at concurrency 8, the highest level both measured stably: 30 against 10" in test_part
    assert "concurrency 16 (i1-batching-on unstable)" in test_part
    mixed = text[text.index("with `bench/demo/mixed.json` (mixed):") :]
    assert "i1-batching-on 24 infer/s at concurrency 16" in mixed
    assert "against i1-batching-off 8 infer/s at concurrency 8" in mixed
    assert "**3.00x**" in mixed  # 24 / 8
    assert "at concurrency 16, the highest level both measured stably: 24 against 7.5" in mixed
    assert "**3.20x**" in mixed


def test_the_readme_gives_tritons_average_batch_at_the_top_concurrency(tmp_path):
    text = written(tmp_path, synthetic())
    rows = [line for line in text.splitlines() if line.startswith("| i1-")]
    assert rows == [
        "| i1-batching-off | `bench/demo/test.json` (test) | 90 | 90 | 1.00 |",
        "| i1-batching-off | `bench/demo/mixed.json` (mixed) | 75 | 75 | 1.00 |",
        "| i1-batching-on | `bench/demo/test.json` (test) | 120 | 20 | 6.00 |",
        "| i1-batching-on | `bench/demo/mixed.json` (mixed) | 96 | 16 | 6.00 |",
    ]
    assert "perf_analyzer run of concurrency 16" in flat(text)
    assert "--concurrency-range=16:16" in text
    assert "variants/i1-batching-on" in text


def test_the_readme_names_the_run_its_machine_load_and_unstable_levels(tmp_path):
    wrapped = written(tmp_path, synthetic())
    assert all(len(line) <= 100 for line in wrapped.splitlines() if not line.startswith("|"))
    text = flat(wrapped)
    assert "- command: `scripts/bench --serving-experiment --output-dir out`" in text
    assert "- machine: x86_64, 7 CPUs, Python 3.11.7" in text
    assert "- duration: 123 s" in text
    assert "1-minute load average 0.3 before, 0.6 after" in text
    assert "i1-batching-off 0.4; now 0.6" in text
    assert "Status: Complete: 12 measurements in 1 round(s). Recommendation: uncertain" in text
    assert "at concurrency 1, 8, 16" in text
    assert "12 levels in all, 1 of them unstable" in text
    assert "- i1-batching-on (test) at concurrency 16 " in text
    assert "`tune`'s choice from this run: i1-batching-on." in text
    assert (
        "- `i1-batching-on`: instance_group 1, dynamic_batching on, preferred_batch_size 4, 8"
        in (text)
    )


def test_a_changed_result_changes_the_readme(tmp_path):
    """Mutants of results.csv: another throughput, another stable flag."""
    first = flat(written(tmp_path, synthetic()))
    csv_path = tmp_path / CSV_FILE
    sweeps = sweeps_from_csv(csv_path.read_text())
    sweeps[2].measurements[1] = dataclasses.replace(sweeps[2].measurements[1], throughput=33.0)
    csv_path.write_text(sweeps_to_csv(sweeps))
    second = flat(readme_from_directory(tmp_path))
    assert second != first and "**3.30x**" in second and "**3.00x**" in second  # mixed kept
    sweeps[0].measurements[1] = dataclasses.replace(sweeps[0].measurements[1], stable=False)
    csv_path.write_text(sweeps_to_csv(sweeps))
    third = flat(readme_from_directory(tmp_path))
    assert "at concurrency 1, the highest level both measured stably: 5 against 5" in third
    assert "concurrency 8 (i1-batching-off unstable)" in third


def test_a_run_that_did_not_count_batches_says_so_and_gives_no_number(tmp_path):
    sweeps = [
        dataclasses.replace(
            s,
            measurements=[
                dataclasses.replace(m, inference_count=None, execution_count=None)
                for m in s.measurements
            ],
        )
        for s in synthetic()
    ]
    notes = {k: v for k, v in NOTES.items() if k != "command"}
    text = flat(written(tmp_path, sweeps, notes=notes))
    assert "This run did not count Triton's batches" in text
    assert "| configuration |" not in text
    assert "- command: not recorded in this run's `summary.txt`" in text


def test_one_request_file_and_no_stable_level_are_said_plainly(tmp_path):
    sweeps = [
        Sweep("i1-batching-off", [level(4, 3, stable=False)], settings=OFF),
        Sweep("i1-batching-on", [level(4, 6, counts=(40, 10))], settings=ON),
    ]
    notes = {**NOTES, "requests": "test: bench/demo/test.json"}
    text = flat(written(tmp_path, sweeps, notes=notes))
    assert "with `bench/demo/test.json`:" in text
    assert "none (i1-batching-off measured no level stably)" in text
    assert "no level that both measured stably" in text
    assert "| i1-batching-on | `bench/demo/test.json` | 40 | 10 | 4.00 |" in text


def test_summary_notes_are_the_key_value_lines_after_the_summary_proper():
    text = (
        "Complete: 4 measurements in 1 round(s).\nRecommendation: uncertain: one round only\n\n"
        "Best configuration with test (no latency budget): i1-batching-on\n"
        "  at concurrency 4: 6 infer/sec, p95 latency 400.0 ms\n"
        "Unstable levels (reported, never chosen): 1 of 4\n"
        "  i1-batching-off (test) at concurrency 4: did not settle\n\n"
        "command: scripts/bench --serving-experiment\nduration: 9 s\n"
        "values:\n# Measured by x: y\ntriton:\n"
    )
    status, notes = parse_summary(text)
    assert status.startswith("Complete: 4 measurements") and "Recommendation" in status
    assert notes == {"command": "scripts/bench --serving-experiment", "duration": "9 s"}
    assert parse_summary((COMMITTED / SUMMARY_FILE).read_text())[1]["duration"]


def test_a_directory_without_results_is_a_measurement_error(tmp_path):
    (tmp_path / CSV_FILE).write_text(sweeps_to_csv(synthetic()))
    with pytest.raises(MeasurementError, match=r"summary\.txt"):
        read_run(tmp_path)
    assert readme_text(read_run(COMMITTED)) == readme_from_directory(COMMITTED)


def test_a_run_without_unstable_levels_says_every_one_was_stable(tmp_path):
    sweeps = [
        Sweep("i1-batching-off", [level(4, 3, counts=(30, 30))], settings=OFF),
        Sweep("i1-batching-on", [level(4, 6, counts=(40, 10))], settings=ON),
    ]
    text = flat(written(tmp_path, sweeps, notes={**NOTES, "requests": "test: bench/t.json"}))
    assert "2 levels in all, every one stable." in text
    assert "did not settle" not in text
    assert "**2.00x**" in text
