"""The settings a user may change (loader.limits): one default and one bound each, worded in
the library's terms by the library and in the flag's terms by the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from loader.cli import build_parser, main
from loader.limits import LOCK_EXPIRY_S, PRUNE_KEEP, RETRY_DEADLINE_S, WORKERS, SettingError
from loader.parallel import Parallelism
from loader.repository.key import ServingSettings
from loader.run import RunRequest
from loader.sources import fetch


def _request(**settings: object) -> RunRequest:
    return RunRequest(
        source="/nowhere",
        repository=Path("/nowhere"),
        model_name="tiny",
        parallelism=Parallelism(),
        settings=ServingSettings(),
        **settings,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("setting", "value", "words"),
    [
        ("lock_expiry_s", 0.5, "The publish lock expiry must be at least 1 s, got 0.5 s"),
        ("lock_timeout_s", -1.0, "The publish lock timeout must be at least 0 s, got -1 s"),
        ("retry_deadline_s", 0.0, "The retry deadline must be more than 0 s, got 0 s"),
        ("prune_keep", 0, "The number of keys kept per model name must be at least 1, got 0"),
        ("workers", 0, "The number of workers must be at least 1, got 0"),
    ],
)
def test_a_request_outside_a_bound_names_the_setting_not_a_flag(setting, value, words):
    with pytest.raises(SettingError) as info:
        _request(**{setting: value})
    assert info.value.message.startswith(words)
    assert "--" not in str(info.value)


def test_the_bounds_themselves_are_accepted():
    request = _request(lock_expiry_s=1.0, lock_timeout_s=0.0, prune_keep=1, workers=1)
    assert request.lock_expiry_s == LOCK_EXPIRY_S.least


def test_every_entry_point_checks_the_same_bound():
    with pytest.raises(SettingError) as info:
        fetch("/nowhere", retry_deadline_s=-1)
    assert info.value.limit is RETRY_DEADLINE_S
    with pytest.raises(SettingError) as info:
        fetch("/nowhere", workers=0)
    assert info.value.limit is WORKERS


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["prune", "--repository", "/nowhere", "--keep", "0"], "--keep must be at least 1, got 0"),
        (
            ["fetch", "gs://b/p", "/tmp/x", "--retry-deadline", "0"],
            "--retry-deadline must be more than 0 s, got 0 s",
        ),
        # 0 was taken as "not set" (the default slice) and -1 named in bytes, not the flag
        (["fetch", "gs://b/p", "/tmp/x", "--slice-mib", "0"], "--slice-mib must be at least 1 MiB"),
        # 0 was taken as "not set"; -5 reached ThreadPoolExecutor in the gs:// backend (a ValueError)
        (["fetch", "gs://b/p", "/tmp/x", "--workers", "0"], "--workers must be at least 1, got 0"),
        (
            ["fetch", "--copy", "/nowhere", "/tmp/x", "--workers", "-5"],
            "--workers must be at least 1",
        ),
    ],
)
def test_the_command_line_names_its_flag(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {words}" in err and "hint: Set " in err


def test_the_command_line_defaults_and_help_come_from_the_limits():
    parser = build_parser()
    prune = parser.parse_args(["prune", "--repository", "/r"])
    assert prune.keep == PRUNE_KEEP.default
    run = parser.parse_args(
        ["run", "--source", "s", "--repository", "/r", "--model-name", "m", "--tp-size", "1",
         "--pp-size", "1", "--instance-count", "1"]
    )  # fmt: skip
    assert (run.lock_expiry_s, run.retry_deadline) == (LOCK_EXPIRY_S.default, 300.0)
    assert run.prune_keep is None  # run prunes only when asked
    subparsers = next(a for a in parser._actions if a.dest == "command")
    help_text = subparsers.choices["run"].format_help()
    assert "(default: 120 s)" in help_text and "(default: 300 s)" in help_text


@pytest.mark.parametrize("value", ["0", "-5", "0.5", "nan", "inf", "1e400"])
def test_prune_checks_its_lock_expiry_like_run(tmp_path, capsys, value):
    """A lock expiry below 1 s would take over the lock of a loader that merely paused (and
    NaN or infinity of one that is gone never or always): refused before anything is read."""
    assert main(["prune", "--repository", str(tmp_path), "--lock-expiry-s", value]) == 2
    err = capsys.readouterr().err
    assert "error: --lock-expiry-s must be " in err and "hint: Set the publish lock expiry" in err


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("setting", ["lock_expiry_s", "lock_timeout_s", "retry_deadline_s"])
def test_a_setting_must_be_a_finite_number(setting, value):
    """An infinite retry deadline or lock timeout would retry or wait forever."""
    with pytest.raises(SettingError) as info:
        _request(**{setting: value})
    assert "must be a finite number" in info.value.message, info.value.message


@pytest.mark.parametrize("value", ["nan", "inf", "1e308", "0", "-1"])
@pytest.mark.parametrize("command", ["plan", "run"])
def test_the_gpu_memory_is_a_checked_setting(tmp_path, capsys, command, value):
    """plan died with a traceback on NaN or a number whose bytes overflow (int(inf)); run took
    infinity as fitting anything."""
    if command == "plan":
        argv = ["plan", "--model", "codegen-350m", "--gpus-per-node", "8"]
    else:
        argv = ["run", "--source", str(tmp_path), "--repository", str(tmp_path / "r"),
                "--model-name", "m", "--tp-size", "1", "--pp-size", "1", "--instance-count", "1"]  # fmt: skip
    assert main([*argv, "--gpu-memory-gib", value]) == 2
    err = capsys.readouterr().err
    assert "error: --gpu-memory-gib must be " in err and "hint: Set the memory of one GPU" in err


def test_the_gpu_memory_bound_is_the_charts():
    import json

    from loader.limits import GPU_MEMORY_GIB

    schema = json.loads(Path("charts/model-triton/values.schema.json").read_text())
    (bound,) = {
        p["maximum"]
        for p in _properties(schema)
        if isinstance(p, dict) and p.get("description") == "Memory of one GPU in GiB."
    }
    assert GPU_MEMORY_GIB.most == bound


def _properties(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _properties(value)
    elif isinstance(node, list):
        for value in node:
            yield from _properties(value)


@pytest.mark.parametrize("setting", ["lock_expiry_s", "lock_timeout_s", "retry_deadline_s"])
def test_a_wait_longer_than_a_week_is_a_typo(setting):
    """1e308 s passed as finite and retried a source that fails forever, in effect."""
    with pytest.raises(SettingError) as info:
        _request(**{setting: 1e308})
    assert "must be at most 604800 s, got 1e+308 s" in info.value.message, info.value.message
    _request(**{setting: 7 * 24 * 3600.0})  # a week itself is accepted


@pytest.mark.parametrize("value", ["0", "-1"])
def test_convert_checks_its_workers_like_run(tmp_path, capsys, value):
    """convert took -1 workers (and ran with the default)."""
    argv = ["convert", "--tp-size", "1", "--workers", value, str(tmp_path), str(tmp_path / "o")]
    assert main(argv) == 2
    assert f"error: --workers must be at least 1, got {value}." in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag",
    ["--gpus-per-node", "--gpus-per-replica", "--replicas-per-node", "--max-batch-size",
     "--max-sequence-length"],
)  # fmt: skip
@pytest.mark.parametrize("value", ["0", "-1"])
def test_plan_refuses_a_count_below_one(capsys, flag, value):
    """plan printed rows of negative working memory (and 'fits') for them."""
    argv = ["plan", "--model", "codegen-350m", "--gpus-per-node", "8", flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} must be at least 1, got {value}." in err and "hint:" in err, err


def test_the_deployment_count_bounds_are_the_charts():
    """run, plan and tune refuse what the chart would refuse at install (run published
    --instance-count 17, a key no release could serve)."""
    import json

    from loader.limits import GPUS_PER_NODE_MOST, INSTANCE_COUNT_MOST, PARALLEL_SIZE_MOST

    props = json.loads(Path("charts/model-triton/values.schema.json").read_text())["properties"]
    assert props["triton"]["properties"]["instanceCount"]["maximum"] == INSTANCE_COUNT_MOST
    assert props["cluster"]["properties"]["gpusPerNode"]["maximum"] == GPUS_PER_NODE_MOST
    for key in ("tensorParallelSize", "pipelineParallelSize"):
        assert props["model"]["properties"][key]["maximum"] == PARALLEL_SIZE_MOST


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--instance-count", "17", "The instance count must be at most 16"),
        ("--tp-size", "64", "The tensor-parallel size must be at most 32"),
        ("--pp-size", "33", "The pipeline-parallel size must be at most 32"),
    ],
)
def test_run_refuses_a_count_past_the_charts_bound(tmp_path, capsys, flag, value, words):
    argv = ["run", "--source", str(tmp_path), "--repository", str(tmp_path / "r"),
            "--model-name", "m", "--tp-size", "1", "--pp-size", "1", "--instance-count", "1"]  # fmt: skip
    argv[argv.index(flag) + 1] = value
    assert main(argv) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_plan_refuses_a_node_past_the_charts_bound(capsys):
    assert main(["plan", "--model", "codegen-350m", "--gpus-per-node", "65"]) == 2
    assert (
        "--gpus-per-node must be at most 64 (the chart's bound), got 65." in capsys.readouterr().err
    )
    assert main(["plan", "--model", "codegen-350m", "--gpus-per-node", "64"]) == 0
