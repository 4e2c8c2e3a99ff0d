"""The manifest's digests come from the writes, and a published key is re-verified quickly.

The converter hashes every weight file as it writes it (when asked: ``model-loader convert``
publishes no manifest and hashes nothing); the manifest reads only the small files again. A
rerun that finds its key published compares sizes and seals (inode, modification time) with the
disk and re-hashes only the files that changed; ``--verify full`` re-hashes them all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader import digest
from loader.checkpoint import read_hf_config, read_inventory
from loader.cli import main
from loader.convert import convert_checkpoint
from loader.convert.plan import plan_conversion
from loader.convert.sequential import convert_planned
from loader.parallel import Parallelism
from loader.repository import manifest
from tests.tiers import examples

#: The digests by another implementation than the loader's, to compare with.
REFERENCE = {
    "blake3": lambda data: blake3.blake3(data).hexdigest(),
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
}


@pytest.mark.parametrize("algorithm", sorted(digest.ALGORITHMS))
@pytest.mark.parametrize("dtype", [None, "fp16"])
def test_the_converters_digests_are_the_written_files_digests(
    tiny_checkpoint_with_tokenizer, tmp_path, dtype, algorithm
):
    # dtype None keeps fp32: replicated tensors are plain runs of source bytes (copied by the
    # kernel when nothing is hashed); fp16 casts them.
    src = tiny_checkpoint_with_tokenizer
    plan = plan_conversion(
        read_hf_config(src), read_inventory(src), parallelism=Parallelism(tp=2), dtype=dtype
    )
    result = convert_planned(plan, tmp_path, algorithm=algorithm)
    on_disk = {p.name: p for p in result.output_path.iterdir()}
    assert sorted(result.digests) == sorted(on_disk) == sorted(result.files)
    for name, (size, hexdigest) in result.digests.items():
        assert size == on_disk[name].stat().st_size, name
        assert hexdigest == REFERENCE[algorithm](on_disk[name].read_bytes()), name


@pytest.mark.parametrize("dtype", [None, "fp16"])
def test_model_loader_convert_computes_no_digest(
    tiny_checkpoint_with_tokenizer, tmp_path, dtype, monkeypatch
):
    def refuse(*_args, **_kwargs):
        raise AssertionError("convert hashed a file")

    monkeypatch.setattr(digest, "new", refuse)
    monkeypatch.setattr(digest, "of_bytes", refuse)
    result = convert_checkpoint(tiny_checkpoint_with_tokenizer, tmp_path, tp_size=2, dtype=dtype)
    assert {hexdigest for _size, hexdigest in result.digests.values()} == {None}
    assert sorted(result.digests) == sorted(p.name for p in result.output_path.iterdir())


@pytest.fixture
def hashed(monkeypatch) -> list[Path]:
    """Every file the manifest module reads to hash it, in order."""
    seen: list[Path] = []
    real = digest.of_file_in

    def counting(d, rel: str, *args, **kwargs) -> str:
        seen.append(d.path / rel)
        return real(d, rel, *args, **kwargs)

    monkeypatch.setattr(digest, "of_file_in", counting)
    return seen


def _run(source: Path, root: Path, *extra: str) -> str:
    argv = ["run", "--source", str(source), "--repository", str(root), "--model-name", "tiny",
            "--tp-size", "2", "--pp-size", "1", "--instance-count", "1", *extra]  # fmt: skip
    assert main(argv) == 0
    return str(next(root.glob("tiny@*/*")))


def _weights(path: Path) -> list[Path]:
    return sorted((path / "fastertransformer" / "1" / "2-gpu").glob("*.bin"))


def test_publishing_reads_no_weight_file_again_and_a_rerun_reads_none(
    tiny_checkpoint_with_tokenizer, tmp_path, hashed, capsys, caplog
):
    caplog.set_level(logging.INFO, logger="loader")
    published = Path(_run(tiny_checkpoint_with_tokenizer, tmp_path))
    assert len(_weights(published)) > 10
    assert not any(p.suffix == ".bin" or p.name == "config.ini" for p in hashed)
    assert hashed  # the small files (tokenizer copies, configs, models) were hashed
    assert manifest.verify(published) == []  # and the digests recorded are the files'
    hashed.clear()
    _run(tiny_checkpoint_with_tokenizer, tmp_path)
    assert "nothing to do" in caplog.text
    assert hashed == []
    _run(tiny_checkpoint_with_tokenizer, tmp_path, "--verify", "full")
    listed = {e["path"] for e in manifest.read_manifest(published)["files"]}
    assert {p.relative_to(published).as_posix() for p in hashed} == listed


def _overwrite_same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_quick_verification_finds_a_file_changed_in_place(
    tiny_checkpoint_with_tokenizer, tmp_path, hashed
):
    published = Path(_run(tiny_checkpoint_with_tokenizer, tmp_path))
    assert manifest.verify(published, quick=True) == []
    victim = _weights(published)[3]
    _overwrite_same_size(victim)
    hashed.clear()
    problems = manifest.verify(published, quick=True)
    assert problems == [
        f"{victim.relative_to(published).as_posix()} blake3 differs from the manifest"
    ]
    assert hashed == [victim]  # only the file whose seal changed was read


def test_a_changed_file_whose_modification_time_was_put_back_is_found_by_quick_too(
    tiny_checkpoint_with_tokenizer, tmp_path, hashed
):
    """Setting the mtime back cannot set the ctime back: the seal still differs."""
    published = Path(_run(tiny_checkpoint_with_tokenizer, tmp_path))
    victim = _weights(published)[0]
    before = victim.stat()
    _overwrite_same_size(victim)
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert victim.stat().st_mtime_ns == before.st_mtime_ns
    hashed.clear()
    assert manifest.verify(published, quick=True) == [
        f"{victim.relative_to(published).as_posix()} blake3 differs from the manifest"
    ]
    assert hashed == [victim]


def test_a_rerun_republishes_a_key_whose_file_changed(
    tiny_checkpoint_with_tokenizer, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="loader")
    published = Path(_run(tiny_checkpoint_with_tokenizer, tmp_path))
    victim = _weights(published)[1]
    expected = victim.read_bytes()
    _overwrite_same_size(victim)
    assert _run(tiny_checkpoint_with_tokenizer, tmp_path) == str(published)
    assert "blake3 differs from the manifest); publishing it again" in caplog.text
    assert victim.read_bytes() == expected
    assert manifest.verify(published) == []


def test_a_manifest_without_seals_is_verified_in_full(tiny_checkpoint_with_tokenizer, tmp_path):
    published = Path(_run(tiny_checkpoint_with_tokenizer, tmp_path))
    data = manifest.read_manifest(published)
    for entry in data["files"]:
        del entry["seal"]
    (published / manifest.MANIFEST).chmod(0o644)
    manifest.write_manifest(published, data)
    _overwrite_same_size(_weights(published)[2])
    assert manifest.verify(published, quick=True) != []


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_a_size_the_manifest_records_differently_is_found_even_when_the_seal_matches(
    tiny_checkpoint_with_tokenizer, tmp_path, quick
):
    """The size check comes before the seal: a manifest whose size disagrees with the file is
    damage, whatever the seal says."""
    published = Path(_run(tiny_checkpoint_with_tokenizer, tmp_path))
    data = manifest.read_manifest(published)
    entry = next(e for e in data["files"] if e["path"].endswith(".bin"))
    entry["size"] += 1
    (published / manifest.MANIFEST).chmod(0o644)
    manifest.write_manifest(published, data)
    assert manifest.verify(published, quick=quick) == [
        f"{entry['path']} has {entry['size'] - 1} bytes, manifest says {entry['size']}"
    ]


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**70) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=5,
)


@pytest.fixture(scope="module")
def published_once(tiny_checkpoint_with_tokenizer, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("manifest-fuzz")
    return Path(_run(tiny_checkpoint_with_tokenizer, root))


@settings(max_examples=examples(60), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    field=st.sampled_from(["files", "directories", "key", "format", "entry", "entry-field"]),
    value=_json,
    quick=st.booleans(),
)
def test_a_malformed_manifest_is_damage_never_a_traceback(published_once, field, value, quick):
    original = manifest.read_manifest(published_once)
    data = json.loads(json.dumps(original))
    if field == "entry":
        data["files"][0] = value
    elif field == "entry-field":
        digest = manifest.DIGESTS[manifest.FORMAT_VERSION]
        data["files"][0][("path", "size", digest, "seal")[abs(hash(str(value))) % 4]] = value
    else:
        data[field] = value
    path = published_once / manifest.MANIFEST
    path.chmod(0o644)
    path.write_text(json.dumps(data))
    try:
        problems = manifest.verify(published_once, key=original["key"], quick=quick)
        changed = data != original and not (field == "entry-field" and _seal_only(data, original))
        if changed:
            assert problems, (field, value)
    finally:
        path.write_text(json.dumps(original))


def _seal_only(data: dict, original: dict) -> bool:
    """Whether only the first entry's seal differs (a changed seal means re-hash, not damage)."""
    a, b = dict(data["files"][0]), dict(original["files"][0])
    a.pop("seal", None)
    b.pop("seal", None)
    return a == b and data["files"][1:] == original["files"][1:]
