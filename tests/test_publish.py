"""Manifest, .ready and the atomic publish of a staging directory."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest

from loader import fs
from loader.errors import PublishError
from loader.repository import manifest, publish
from loader.repository.key import key_filename

KEY = "m@r/tp1-pp1-i1-0123abcd"


def _stage(root: Path) -> Path:
    """A staging directory filled as the loader fills one: through :class:`loader.fs.Dir`, so
    its record names every file (what is not recorded there would be someone else's)."""
    staging = publish.new_staging_dir(root, KEY)
    with fs.Dir.open(staging) as d:
        d.makedirs(("m", "1")).close()
        with d.sub("m") as m:
            m.write("config.pbtxt", b'name: "m"\n')
        with d.makedirs(("fastertransformer", "1", "1-gpu")) as weights:
            weights.write("model.wte.bin", b"\x01" * 1000)
    meta = {"key": KEY, "source": "/x"}
    manifest.write_manifest(staging, manifest.build_manifest(staging, meta))
    manifest.write_ready(staging, KEY)
    return staging


def test_manifest_lists_every_file_with_size_and_blake3(tmp_path: Path):
    staging = _stage(tmp_path)
    data = json.loads((staging / manifest.MANIFEST).read_text())
    files = {f["path"]: f for f in data["files"]}
    assert set(files) == {"m/config.pbtxt", "fastertransformer/1/1-gpu/model.wte.bin"}
    wte = files["fastertransformer/1/1-gpu/model.wte.bin"]
    assert data["format"] == 2
    assert wte["size"] == 1000
    assert wte["blake3"] == blake3.blake3(b"\x01" * 1000).hexdigest()
    assert "sha256" not in wte
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
            "blake3 differs",
        ),
        (lambda d: (d / manifest.MANIFEST).write_text("{"), "manifest.json is missing"),
    ],
)
def test_verify_reports_each_kind_of_damage(tmp_path: Path, damage, expected):
    staging = _stage(tmp_path)
    damage(staging)
    problems = manifest.verify(staging, key=KEY)
    assert any(expected in p for p in problems), problems


def _as_format_1(staging: Path) -> None:
    """Rewrite the manifest as loaders before format 2 wrote it: sha256 digests."""
    data = manifest.read_manifest(staging)
    data["format"] = 1
    for entry in data["files"]:
        del entry["blake3"]
        entry["sha256"] = hashlib.sha256((staging / entry["path"]).read_bytes()).hexdigest()
    manifest.write_manifest(staging, data)


def test_a_manifest_of_format_1_is_still_verified_with_its_sha256(tmp_path: Path):
    staging = _stage(tmp_path)
    _as_format_1(staging)
    assert manifest.verify(staging, key=KEY) == []
    assert manifest.verify(staging, key=KEY, quick=True) == []
    wte = staging / "fastertransformer/1/1-gpu/model.wte.bin"
    wte.write_bytes(b"\x02" * 1000)
    expected = ["fastertransformer/1/1-gpu/model.wte.bin sha256 differs from the manifest"]
    assert manifest.verify(staging, key=KEY) == expected
    assert manifest.verify(staging, key=KEY, quick=True) == expected  # its seal changed


@pytest.mark.parametrize("fmt", [0, 3, "2", None, True, [2], {"v": 2}])
def test_a_manifest_of_a_format_this_loader_does_not_read_is_not_complete(
    tmp_path: Path, fmt: object
):
    staging = _stage(tmp_path)
    data = manifest.read_manifest(staging)
    data["format"] = fmt
    manifest.write_manifest(staging, data)
    problems = manifest.verify(staging, key=KEY)
    assert problems == [
        f"manifest.json has format {fmt!r}, which this loader does not read (it reads 1, 2)"
    ]


def test_verify_reports_bytecode_caches_beside_model_py_python_would_run_them(tmp_path: Path):
    staging = _stage(tmp_path)
    cache = staging / "m" / "1" / "__pycache__"
    cache.mkdir()
    (cache / "model.cpython-311.pyc").write_bytes(b"\x00")
    assert manifest.verify(staging, key=KEY) == [
        "unexpected file m/1/__pycache__/model.cpython-311.pyc",
        "unexpected directory m/1/__pycache__",
    ]


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
    # One exchange: nothing went through .trash, and the old copy left the staging area.
    assert not (tmp_path / publish.TRASH_DIR).exists()
    assert list((tmp_path / publish.STAGING_DIR).iterdir()) == []


def _age(path: Path, seconds: float) -> None:
    """Make everything under ``path`` look untouched for ``seconds``."""
    then = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (then, then), follow_symlinks=False)


def test_leftovers_of_gone_or_silent_loaders_are_cleared_and_live_ones_kept(tmp_path: Path):
    ours = _stage(tmp_path)  # this process: alive
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = _stage(tmp_path)  # renamed below to belong to a dead pid on this host
    killed = killed.rename(killed.with_name(
        killed.name.replace(f".{os.getpid()}-", f".{dead.pid}-")))  # fmt: skip
    silent = _stage(tmp_path)  # another host's loader that stopped writing long ago
    silent = silent.rename(silent.with_name(
        silent.name.replace(publish.host_digest(), "0other00")))  # fmt: skip
    _age(silent, 600)
    busy = _stage(tmp_path)  # another host's loader still writing
    busy = busy.rename(busy.with_name(busy.name.replace(publish.host_digest(), "0other00")))
    other = publish.new_staging_dir(tmp_path, "other@r/tp1-pp1-i1-0123abcd")
    _age(other, 600)
    trash = tmp_path / publish.TRASH_DIR
    replaced = trash / f"{key_filename(KEY)}.0123456789ab"  # a replaced copy: its manifest
    (replaced / "m").mkdir(parents=True)
    (replaced / manifest.MANIFEST).write_text(json.dumps({"key": KEY, "files": []}))
    unmarked = trash / f"{key_filename(KEY)}.ba9876543210"  # named like one, not the loader's
    (unmarked / "m").mkdir(parents=True)
    (trash / "other@r__tp1-pp1-i1-0123abcd.0123456789ab").mkdir()

    removed = publish.clear_leftovers(tmp_path, KEY, idle_s=120)

    assert sorted(removed) == sorted([killed, silent, replaced])
    assert ours.exists() and busy.exists() and other.exists() and unmarked.exists()
    assert sorted(p.name for p in trash.iterdir()) == sorted(
        [unmarked.name, "other@r__tp1-pp1-i1-0123abcd.0123456789ab"]
    )


def test_a_staging_directory_emptied_by_a_killed_removal_is_removed(tmp_path: Path):
    """A removal killed after the marker went, before the directory itself did, leaves an
    empty staging directory of a dead loader: the next loader removes it (an empty directory
    holds nothing of anyone's); one holding something stays."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    emptied, kept = _stage(tmp_path), _stage(tmp_path)
    for path in (emptied, kept):
        for p in sorted(path.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
    (kept / "notes.txt").write_text("mine\n")
    emptied = emptied.rename(emptied.with_name(
        emptied.name.replace(f".{os.getpid()}-", f".{dead.pid}-")))  # fmt: skip
    kept = kept.rename(kept.with_name(kept.name.replace(f".{os.getpid()}-", f".{dead.pid}-")))

    assert publish.clear_leftovers(tmp_path, KEY, idle_s=120) == [emptied]
    assert not emptied.exists() and (kept / "notes.txt").read_text() == "mine\n"


def test_publish_is_one_rename_the_published_directory_is_the_staged_one(tmp_path: Path):
    staging = _stage(tmp_path)
    inodes = {p.relative_to(staging): p.stat().st_ino for p in [staging, *staging.rglob("*")]}
    target = publish.publish(staging, tmp_path, KEY)
    # A rename keeps every inode; a copy followed by a delete would not.
    assert {p.relative_to(target): p.stat().st_ino for p in [target, *target.rglob("*")]} == inodes


@pytest.mark.parametrize("contents", [["theirs.txt"], []])
def test_a_target_appearing_while_publishing_is_a_typed_error_and_nothing_is_merged(
    tmp_path: Path, contents
):
    staging = _stage(tmp_path)
    target = tmp_path / KEY

    def someone_publishes_first(op: str, path: str) -> None:
        if op.startswith("rename") and path.endswith(f"-> {target}") and not target.exists():
            target.mkdir(parents=True)
            for name in contents:
                (target / name).write_text("another loader's file")

    with fs.inject(someone_publishes_first), pytest.raises(PublishError, match="appeared") as info:
        publish.publish(staging, tmp_path, KEY)
    assert "run again" in info.value.remediation
    assert sorted(p.name for p in target.iterdir()) == contents  # untouched, nothing merged
    assert manifest.verify(staging, key=KEY) == []  # our copy is intact for the caller


def test_data_then_rename_then_directory_are_synced_in_that_order(tmp_path: Path):
    staging = _stage(tmp_path)
    files = {p for p in staging.rglob("*") if p.is_file()}
    events: list[tuple[str, str]] = []
    with fs.inject(lambda op, path: events.append((op, path))):
        target = publish.publish(staging, tmp_path, KEY)

    renames = [i for i, (op, _) in enumerate(events) if op.startswith("rename")]
    assert len(renames) == 1 and events[renames[0]][1] == f"{staging} -> {target}"
    before, after = events[: renames[0]], events[renames[0] + 1 :]
    synced_before = {Path(path) for op, path in before if op == "fsync"}
    assert files <= synced_before  # every file's data
    assert staging in synced_before  # and the staged directory itself
    assert ("fsync", str(target.parent)) in after  # the new name is made durable after the rename


def test_published_files_are_0644_and_directories_0755_whatever_the_umask(tmp_path: Path):
    old = os.umask(0o077)
    try:
        staging = _stage(tmp_path)
        with fs.Dir.open(staging) as d, d.sub("m") as m:
            m.write("private.txt", b"x")  # 0600 under this umask
        assert stat.S_IMODE((staging / "m" / "private.txt").stat().st_mode) == 0o600
        manifest.write_manifest(staging, manifest.build_manifest(staging, {"key": KEY}))
        target = publish.publish(staging, tmp_path, KEY)
    finally:
        os.umask(old)
    for path in [target, *target.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755], ids=oct)
@pytest.mark.parametrize("which", ["ROOT", "<name>@<rev>"])
def test_a_directory_others_cannot_enter_is_published_into_with_a_warning(
    tmp_path: Path, caplog, which, mode
):
    """A ROOT or ``<name>@<rev>`` the user made 0700 was published into without a word, though
    a Triton running as another uid cannot enter it: a warning names it, its mode and what to
    do (not an error: the chart runs both as one uid)."""
    root = tmp_path / "root"
    root.mkdir()
    staging = _stage(root)
    denied = root if which == "ROOT" else root / KEY.split("/")[0]
    denied.mkdir(exist_ok=True)
    denied.chmod(mode)
    with caplog.at_level("WARNING", logger="loader"):
        publish.publish(staging, root, KEY)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if mode == 0o755:
        assert warned == []
    else:
        [message] = warned
        assert str(denied) in message and f"{mode:04o}" in message, message
        assert "chmod a+rx" in message and "same uid" in message
    assert manifest.verify(root / KEY, key=KEY) == []


def test_a_new_name_at_revision_directory_is_made_durable_before_a_key_moves_into_it(
    tmp_path: Path,
):
    staging = _stage(tmp_path)
    events: list[tuple[str, str]] = []
    with fs.inject(lambda op, path: events.append((op, path))):
        target = publish.publish(staging, tmp_path, KEY)
    parent = str(target.parent)
    made = events.index(("mkdir", parent))
    synced = events.index(("fsync", str(tmp_path)), made)
    moved = next(i for i, (op, _) in enumerate(events) if op.startswith("rename"))
    assert made < synced < moved
