"""The model key: exact canonical strings (the Helm chart reproduces them with sha256sum)."""

from __future__ import annotations

import pytest

from loader.errors import LoaderError, RepositoryError
from loader.parallel import Parallelism
from loader.repository.key import (
    ServingSettings,
    check_model_name,
    key_filename,
    model_key,
    resolve_revision,
)

# Expected hashes computed with coreutils: printf %s "<canonical>" | sha256sum | cut -c1-8
DEFAULT_CANONICAL = (
    "backend=fastertransformer;dtype=auto;max_batch_size=8;dynamic_batching=1;"
    "preferred_batch_size=;max_queue_delay_us=100;streaming=0"
)


def test_default_settings_give_the_documented_canonical_string_and_variant():
    settings = ServingSettings()
    assert settings.canonical() == DEFAULT_CANONICAL
    assert settings.variant() == "fe99d5a8"


def test_every_setting_appears_in_the_canonical_string_in_contract_order():
    settings = ServingSettings(
        backend="fastertransformer",
        dtype="fp16",
        max_batch_size=16,
        dynamic_batching=True,
        preferred_batch_sizes=(4, 8),
        max_queue_delay_us=250,
        streaming=True,
    )
    assert settings.canonical() == (
        "backend=fastertransformer;dtype=fp16;max_batch_size=16;dynamic_batching=1;"
        "preferred_batch_size=4,8;max_queue_delay_us=250;streaming=1"
    )
    assert settings.variant() == "c292e4de"


def test_batching_fields_are_empty_when_dynamic_batching_is_off():
    settings = ServingSettings(
        backend="python",
        dtype="fp32",
        max_batch_size=1,
        dynamic_batching=False,
        preferred_batch_sizes=(1,),
        max_queue_delay_us=500,
    )
    assert settings.canonical() == (
        "backend=python;dtype=fp32;max_batch_size=1;dynamic_batching=0;"
        "preferred_batch_size=;max_queue_delay_us=;streaming=0"
    )
    assert settings.variant() == "7915488f"
    assert settings.preferred_batch_sizes == ()


def test_key_uses_explicit_revision_first():
    key = model_key(
        "codegen-16b-multi",
        "hf://Salesforce/codegen-16B-multi@abc123",
        Parallelism(2, 1, 2),
        ServingSettings(),
        revision="v1.0",
    )
    assert key == "codegen-16b-multi@v1.0/tp2-pp1-i2-fe99d5a8"


def test_key_takes_the_revision_written_in_an_hf_uri():
    key = model_key("m", "hf://org/name@0123abcd", Parallelism(1, 2, 1), ServingSettings())
    assert key == "m@0123abcd/tp1-pp2-i1-fe99d5a8"


def test_key_without_any_revision_hashes_the_canonical_source_uri():
    # printf %s "file:///data/ckpt" | sha256sum | cut -c1-10
    assert resolve_revision("file:///data/ckpt") == "src-955ba170c4"
    key = model_key("m", "file:///data/ckpt", Parallelism(4, 1, 3), ServingSettings())
    assert key == "m@src-955ba170c4/tp4-pp1-i3-fe99d5a8"
    # printf %s "gs://bucket/ckpt" | sha256sum | cut -c1-10
    assert resolve_revision("gs://bucket/ckpt/") == resolve_revision("gs://bucket/ckpt")
    assert resolve_revision("gs://bucket/ckpt") == "src-6747afc875"
    assert resolve_revision("gs://bucket/other") != resolve_revision("gs://bucket/ckpt")


def test_every_spelling_of_a_local_path_gives_one_key(tmp_path, monkeypatch):
    ckpt = tmp_path / "demo-work" / "checkpoint"
    ckpt.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    spellings = [
        "demo-work/checkpoint",
        "./demo-work/checkpoint/",
        str(ckpt),
        f"{tmp_path}//demo-work/../demo-work/checkpoint",
        f"file://{ckpt}",
        f"file://{ckpt}/",
        f"file://localhost{ckpt}",
    ]
    keys = {model_key("m", s, Parallelism(), ServingSettings()) for s in spellings}
    assert len(keys) == 1, keys
    assert keys != {model_key("m", str(tmp_path / "demo-work"), Parallelism(), ServingSettings())}


def test_key_is_a_two_level_path_and_its_filename_form_is_one_component():
    key = model_key("m", "/x", Parallelism(), ServingSettings())
    assert key.count("/") == 1
    assert "/" not in key_filename(key)
    assert key_filename(key).startswith("m@src-")


@pytest.mark.parametrize(
    "name", ["", "a/b", "-x", "has space", "preprocessing", "x@y", "codegen\n", "a" * 65, "a" * 300]
)
def test_unusable_model_names_are_refused_with_a_hint(name):
    with pytest.raises(RepositoryError) as info:
        check_model_name(name)
    assert info.value.remediation


@pytest.mark.parametrize("revision", ["refs/pr/1", "v1\n", "v1\nx", "r" * 65, "r" * 300])
def test_revision_that_cannot_be_a_directory_name_is_refused(revision):
    with pytest.raises(RepositoryError, match="Revision") as info:
        resolve_revision("hf://org/name", revision)
    assert "--revision" in info.value.remediation


def test_longest_name_and_revision_still_fit_every_file_name_the_key_makes():
    from loader.limits import INSTANCE_COUNT_MOST, PARALLEL_SIZE_MOST
    from loader.repository.key import MAX_PART_BYTES

    key = model_key(
        "n" * MAX_PART_BYTES,
        "/x",
        Parallelism(PARALLEL_SIZE_MOST, PARALLEL_SIZE_MOST, INSTANCE_COUNT_MOST),
        ServingSettings(),
        revision="r" * MAX_PART_BYTES,
    )
    # the longest derived name: the staging directory (key, owner, random token)
    assert len(key_filename(key)) + len(".4194304-0123abcd.0123456789ab") <= 255


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backend": "onnx"},
        {"dtype": "bf8"},
        {"max_batch_size": 0},
        {"preferred_batch_sizes": (16,)},
        {"max_queue_delay_us": -1},
    ],
)
def test_invalid_settings_are_typed_errors(kwargs):
    with pytest.raises(LoaderError):
        ServingSettings(**kwargs)
