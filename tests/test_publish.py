"""Manifest, .ready and the atomic publish of a staging directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from loader.errors import PublishError
from loader.repository import manifest, publish

KEY = "m@r/tp1-pp1-i1-0123abcd"


def _stage(root: Path) -> Path:
    staging = publish.new_staging_dir(root, KEY)
    (staging / "m" / "1").mkdir(parents=True)
    (staging / "m" / "config.pbtxt").write_text('name: "m"\n')
    (staging / "fastertransformer" / "1" / "1-gpu").mkdir(parents=True)
    (staging / "fastertransformer" / "1" / "1-gpu" / "model.wte.bin").write_bytes(b"\x01" * 1000)
    meta = {"key": KEY, "source": "/x"}
    manifest.write_manifest(staging, manifest.build_manifest(staging, meta))
    manifest.write_ready(staging, KEY)
    return staging


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path: Path):
    staging = _stage(tmp_path)
    data = json.loads((staging / manifest.MANIFEST).read_text())
    files = {f["path"]: f for f in data["files"]}
    assert set(files) == {"m/config.pbtxt", "fastertransformer/1/1-gpu/model.wte.bin"}
    wte = files["fastertransformer/1/1-gpu/model.wte.bin"]
    assert wte["size"] == 1000
    assert wte["sha256"] == hashlib.sha256(b"\x01" * 1000).hexdigest()
    assert data["key"] == KEY and data["total_bytes"] == 1000 + len('name: "m"\n')
    assert (staging / manifest.READY).read_text().strip() == KEY
    assert manifest.verify(staging, key=KEY) == []


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: (d / manifest.READY).unlink(), ".ready is missing"),
        (lambda d: (d / "m" / "config.pbtxt").unlink(), "missing file m/config.pbtxt"),
        (lambda d: (d / "m" / "extra.txt").write_text("x"), "unexpected file m/extra.txt"),
        (
            lambda d: (d / "fastertransformer/1/1-gpu/model.wte.bin").write_bytes(b"\x01" * 999),
            "has 999 bytes",
        ),
        (
            lambda d: (d / "fastertransformer/1/1-gpu/model.wte.bin").write_bytes(b"\x02" * 1000),
            "sha256 differs",
        ),
        (lambda d: (d / manifest.MANIFEST).write_text("{"), "manifest.json is missing"),
    ],
)
def test_verify_reports_each_kind_of_damage(tmp_path: Path, damage, expected):
    staging = _stage(tmp_path)
    damage(staging)
    problems = manifest.verify(staging, key=KEY)
    assert any(expected in p for p in problems), problems


def test_verify_ignores_bytecode_caches_a_server_writes_beside_model_py(tmp_path: Path):
    staging = _stage(tmp_path)
    cache = staging / "m" / "1" / "__pycache__"
    cache.mkdir()
    (cache / "model.cpython-311.pyc").write_bytes(b"\x00")
    assert manifest.verify(staging, key=KEY) == []
    (staging / "m" / "1" / "model.pyc").write_bytes(b"\x00")
    assert manifest.verify(staging, key=KEY) == ["unexpected file m/1/model.pyc"]


def test_verify_by_size_only_does_not_read_contents(tmp_path: Path):
    staging = _stage(tmp_path)
    (staging / "fastertransformer/1/1-gpu/model.wte.bin").write_bytes(b"\x02" * 1000)
    assert manifest.verify(staging, key=KEY, checksums=False) == []
    assert manifest.verify(staging, key="other/key") != []


def test_publish_renames_staging_into_place_and_refuses_to_replace_without_force(tmp_path: Path):
    first = _stage(tmp_path)
    target = publish.publish(first, tmp_path, KEY)
    assert target == tmp_path / KEY
    assert not first.exists()
    assert manifest.verify(target, key=KEY) == []
    second = _stage(tmp_path)
    with pytest.raises(PublishError) as info:
        publish.publish(second, tmp_path, KEY)
    assert "--force" in info.value.remediation
    assert second.exists()


def test_publish_with_replace_swaps_in_the_new_copy_and_removes_the_old(tmp_path: Path):
    publish.publish(_stage(tmp_path), tmp_path, KEY)
    old_inode = (tmp_path / KEY / "m" / "config.pbtxt").stat().st_ino
    target = publish.publish(_stage(tmp_path), tmp_path, KEY, replace=True)
    assert (target / "m" / "config.pbtxt").stat().st_ino != old_inode
    assert manifest.verify(target, key=KEY) == []
    assert list((tmp_path / publish.TRASH_DIR).iterdir()) == []


def test_leftover_staging_directories_of_the_key_are_cleared(tmp_path: Path):
    a, b = _stage(tmp_path), _stage(tmp_path)
    other = publish.new_staging_dir(tmp_path, "other@r/tp1-pp1-i1-0123abcd")
    removed = publish.clear_staging(tmp_path, KEY, keep=b)
    assert removed == [a]
    assert b.exists() and other.exists() and not a.exists()
