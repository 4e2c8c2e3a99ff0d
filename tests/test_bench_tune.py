"""The tuner's decision: stable results only, every workload, ties to fewer instances."""

from __future__ import annotations

import pytest
import yaml

from loader.bench.report import Winner
from loader.bench.results import Measurement, Sweep
from loader.bench.tune import Choice, TuneResult, pick_winner, plan_variants, values_snippet
from loader.bench.variants import Variant


def test_plan_variants_covers_instances_times_batching():
    planned = plan_variants([2, 1], preferred_batch_sizes=[4, 8], max_queue_delay_us=50)
    assert [v.label for v in planned] == [
        "i1-batching-off",
        "i1-batching-on",
        "i2-batching-off",
        "i2-batching-on",
    ]
    assert planned[1].preferred_batch_sizes == (4, 8) and planned[0].preferred_batch_sizes == ()


VARIANTS = {v.label: v for v in plan_variants([1, 2], preferred_batch_sizes=[4])}


def test_near_ties_go_to_fewer_instances_and_the_budget_is_respected():
    sweeps = [
        Sweep("i1-batching-off", [Measurement(8, 10.0, 800_000)]),
        Sweep("i1-batching-on", [Measurement(8, 40.0, 200_000)]),
        Sweep("i2-batching-off", [Measurement(8, 20.0, 400_000)]),
        Sweep("i2-batching-on", [Measurement(8, 41.0, 190_000), Measurement(16, 60.0, 900_000)]),
    ]
    assert pick_winner(sweeps, VARIANTS).variant.label == "i2-batching-on"  # 60 at c16
    within = pick_winner(sweeps, VARIANTS, max_p95_ms=500)
    assert within.variant.label == "i1-batching-on"  # 40 vs 41: a tie, fewer instances win
    strict = pick_winner(sweeps, VARIANTS, max_p95_ms=500, tolerance=0.0)
    assert strict.variant.label == "i2-batching-on"
    assert pick_winner(sweeps, VARIANTS, max_p95_ms=100) is None


def test_unstable_levels_never_decide_and_are_listed():
    shaky = Measurement(16, 99.0, 100_000, stable=False, note="Failed to obtain stable ...")
    sweeps = [
        Sweep("i1-batching-off", [Measurement(8, 10.0, 800_000)]),
        Sweep("i1-batching-on", [Measurement(8, 40.0, 200_000), shaky]),
    ]
    choice = pick_winner(sweeps, VARIANTS)
    assert choice.variant.label == "i1-batching-on"
    assert choice.best[""].measurement.concurrency == 8  # not the faster unstable level
    result = TuneResult(sweeps=sweeps, variants=VARIANTS, choice=choice, max_p95_ms=None)
    assert result.unstable == [(sweeps[1], shaky)]
    only_unstable = [Sweep("i1-batching-on", [shaky])]
    assert pick_winner(only_unstable, VARIANTS) is None


def test_the_winner_is_never_far_from_the_best_on_any_workload():
    # i2-batching-on is best on the production request, but batching does nothing on the mix
    # (different prompt lengths) where i2-batching-off is as good: the score is the worst ratio.
    sweeps = [
        Sweep("i1-batching-on", [Measurement(8, 50.0, 1)], workload="test"),
        Sweep("i1-batching-on", [Measurement(8, 10.0, 1)], workload="mixed"),
        Sweep("i2-batching-on", [Measurement(8, 60.0, 1)], workload="test"),
        Sweep("i2-batching-on", [Measurement(8, 12.0, 1)], workload="mixed"),
        Sweep("i2-batching-off", [Measurement(8, 30.0, 1)], workload="test"),
        Sweep("i2-batching-off", [Measurement(8, 20.0, 1)], workload="mixed"),
    ]
    choice = pick_winner(sweeps, VARIANTS)
    # scores: i1-on min(50/60, 10/20) = 0.5; i2-on min(1, 0.6) = 0.6; i2-off min(0.5, 1) = 0.5
    assert choice.variant.label == "i2-batching-on"
    assert abs(choice.score - 0.6) < 1e-9
    assert set(choice.best) == {"test", "mixed"}


def test_values_snippet_is_the_chart_values_for_the_winner():
    variant = Variant(2, True, preferred_batch_sizes=(4, 8), max_queue_delay_us=100)
    sweep = Sweep(variant.label, [Measurement(16, 55.5, 250_000)], workload="mixed")
    choice = Choice(variant, 1.0, {"mixed": Winner(sweep, sweep.measurements[0])})
    text = values_snippet(choice, max_p95_ms=300)
    assert yaml.safe_load(text) == {
        "triton": {
            "instanceCount": 2,
            "dynamicBatching": {
                "enabled": True,
                "preferredBatchSize": [4, 8],
                "maxQueueDelayMicroseconds": 100,
            },
        }
    }
    assert "p95 <= 300 ms" in text and "55.5 infer/sec with mixed" in text
    off_sweep = Sweep("x", [Measurement(1, 5, 1)])
    off = Choice(Variant(1, False), 1.0, {"": Winner(off_sweep, off_sweep.measurements[0])})
    assert yaml.safe_load(values_snippet(off, max_p95_ms=None)) == {
        "triton": {"instanceCount": 1, "dynamicBatching": {"enabled": False}}
    }


def test_the_serving_experiment_keeps_the_stability_test_on_and_needs_rounds_to_agree():
    from loader.bench import experiment

    defaults = experiment.MEASUREMENT_DEFAULTS
    assert defaults.stability_percentage is not None and defaults.stability_percentage <= 25
    assert defaults.widenings >= 1  # an unstable level is measured again before it is reported
    assert experiment.BASELINE == "i1-batching-off"
    assert experiment.ROUNDS >= 2  # a choice is certain only when rounds agree
    assert 0 < experiment.MAX_MINUTES <= 15  # the README's promise


def test_a_choice_is_certain_only_when_every_round_made_it_and_nothing_was_cut_short():
    from loader.bench.tune import verdict

    variant = plan_variants([1], preferred_batch_sizes=[4])[1]
    choice = Choice(variant=variant, score=1.0, best={})
    label = variant.label
    assert verdict(choice, [label, label, label], complete=True) == (
        f"certain: each of the 3 rounds chose {label}"
    )
    assert verdict(choice, [label], complete=True).startswith("uncertain: one round only")
    mixed = verdict(choice, [label, "i1-batching-off"], complete=True)
    assert mixed.startswith("uncertain: the rounds chose differently")
    assert "i1-batching-off" in mixed
    assert verdict(choice, [label, label], complete=False).startswith("uncertain: the time cap")
    assert verdict(None, [], complete=True).startswith("uncertain: no configuration")
    result = TuneResult([], {label: variant}, choice, None, (label, None), True)
    assert not result.certain  # a round with nothing stable does not agree


def test_the_experiments_chart_default_is_what_the_chart_ships():
    from pathlib import Path

    from loader.bench import experiment

    values = yaml.safe_load(
        (Path(__file__).parents[1] / "charts" / "model-triton" / "values.yaml").read_text()
    )
    triton = values["triton"]
    batching = "on" if triton["dynamicBatching"]["enabled"] else "off"
    assert f"i{triton['instanceCount']}-batching-{batching}" == experiment.CHART_DEFAULT
    assert list(triton["dynamicBatching"]["preferredBatchSize"]) == list(
        experiment.PREFERRED_BATCH_SIZES
    )


# --- what tune refuses before it starts anything ----------------------------------------------


def _streaming_repository(root):
    """A repository whose one model is decoupled, as ``run --streaming`` publishes its front."""
    model = root / "codegen"
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'name: "codegen"\nbackend: "python"\nmax_batch_size: 8\n'
        "model_transaction_policy { decoupled: true }\n"
    )
    return root


def test_tune_refuses_a_streaming_repository_before_copying_or_serving_it(tmp_path, capsys):
    """perf_analyzer's HTTP client cannot send a decoupled model anything: tune started its
    servers, then failed quoting perf_analyzer's first log line ("Successfully read data")."""
    from loader.cli import main

    repository = _streaming_repository(tmp_path / "repo")
    work = tmp_path / "work"
    code = main(["tune", "--repository", str(repository), "--work-dir", str(work)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "streams its responses" in err and "without --streaming" in err, err
    assert not work.exists()  # refused before any variant was made


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-instances", "100000"], "--max-instances must be from 1 to 16"),  # it hung
        (["--instance-counts", "1", "17"], "instance counts must be from 1 to 16"),
        (["--concurrency-range", "1:999999999:1"], "asks for 999999999 levels"),  # OOM-killed
        (["--concurrency-range", "1:2048"], "Keep END at most 1024"),
        (["--work-dir", "{fifo}"], "is a FIFO, not a directory"),  # was a traceback
        (["--output-dir", "{dangling}/results"], "is a dangling symbolic link"),
    ],
)
def test_tune_refuses_options_past_their_bounds_at_once(tmp_path, capsys, argv, needle):
    import os

    from loader.cli import main

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    argv = [a.format(fifo=tmp_path / "fifo", dangling=tmp_path / "dangling") for a in argv]
    repository = _streaming_repository(tmp_path / "repo")
    try:
        code = main(["tune", "--repository", str(repository), *argv])
    except SystemExit as exc:  # argparse's own refusal of the value (exit 2, its message)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "nowhere").exists()
