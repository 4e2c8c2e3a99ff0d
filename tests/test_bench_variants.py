"""Variants of a published repository: instance count and dynamic batching as `run` writes them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from loader.bench.variants import (
    Variant,
    describe,
    ensemble_name,
    make_variant,
    model_dirs,
    read_configs,
)
from loader.errors import RepositoryError
from loader.parallel import Parallelism
from loader.repository.config import RepositorySpec, build_all
from loader.repository.key import ServingSettings


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts
    }


def test_variant_configs_match_what_run_writes_for_those_settings(
    published_tiny_python_repository, tmp_path
):
    source = published_tiny_python_repository
    before = tree_digest(source)
    variant = Variant(2, True, preferred_batch_sizes=(4, 8), max_queue_delay_us=250)
    out = make_variant(source, tmp_path / "v", variant)

    original, changed = read_configs(source), read_configs(out)
    assert set(changed) == set(original) == set(model_dirs(source))
    ft = original["fastertransformer"]
    params = {k: v.string_value for k, v in ft.parameters.items()}
    expected = build_all(
        RepositorySpec(
            name="codegen",
            parallelism=Parallelism(tp=1, pp=1, instance_count=2),
            settings=ServingSettings(
                backend="python",
                dynamic_batching=True,
                preferred_batch_sizes=(4, 8),
                max_queue_delay_us=250,
            ),
            data_type=params["data_type"],
            end_id=0,
        )
    )
    for name, config in changed.items():
        assert config.instance_group == expected[name].instance_group, name
        assert config.dynamic_batching == expected[name].dynamic_batching, name
        assert list(config.batch_input) == list(expected[name].batch_input), name
        ragged = [(i.name, i.allow_ragged_batch) for i in config.input]
        assert ragged == [(i.name, i.allow_ragged_batch) for i in expected[name].input], name
        # Everything else is the published config, untouched.
        reference = type(config)()
        reference.CopyFrom(original[name])
        for message in (config, reference):
            message.ClearField("instance_group")
            message.ClearField("dynamic_batching")
            message.ClearField("batch_input")
            for tensor in message.input:
                tensor.allow_ragged_batch = False
        assert config == reference, name
    assert "model_checkpoint_path" not in changed["fastertransformer"].parameters
    assert describe(read_configs(out)) == {
        "instance_group": 2,
        "dynamic_batching": True,
        "preferred_batch_size": [4, 8],
        "max_queue_delay_microseconds": 250,
        "max_batch_size": 8,
    }
    assert tree_digest(source) == before  # the published repository is never modified


def test_variant_links_large_files_and_copies_small_ones(
    published_tiny_python_repository, tmp_path
):
    source = published_tiny_python_repository
    out = make_variant(source, tmp_path / "v", Variant(1, False), link_threshold_bytes=4096)
    weights = sorted((out / "fastertransformer" / "1").glob("*-gpu/*.bin"))
    assert weights
    large = [w for w in weights if w.stat().st_size >= 4096]
    small = [w for w in weights if w.stat().st_size < 4096]
    assert large and small
    for path in large:
        assert path.is_symlink()
        assert Path(os.readlink(path)) == (source / path.relative_to(out)).resolve()
    assert not any(p.is_symlink() for p in small)
    assert not (out / "fastertransformer" / "config.pbtxt").is_symlink()
    assert not list(tmp_path.glob(".v.*"))  # the staging directory was renamed into place


def test_remaking_a_variant_replaces_it(published_tiny_python_repository, tmp_path):
    source = published_tiny_python_repository
    make_variant(source, tmp_path / "v", Variant(2, True, preferred_batch_sizes=(8,)))
    make_variant(source, tmp_path / "v", Variant(1, False))
    assert describe(read_configs(tmp_path / "v"))["instance_group"] == 1
    assert not describe(read_configs(tmp_path / "v"))["dynamic_batching"]


def test_ensemble_name_is_the_model_clients_call(published_tiny_python_repository):
    assert ensemble_name(read_configs(published_tiny_python_repository)) == "codegen"


def test_a_directory_without_models_is_a_repository_error(tmp_path):
    with pytest.raises(RepositoryError, match="holds no model"):
        make_variant(tmp_path, tmp_path / "v", Variant(1, False))
    with pytest.raises(RepositoryError, match="does not exist"):
        model_dirs(tmp_path / "missing")
