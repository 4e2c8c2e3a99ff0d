"""`model-loader prune`: leftovers and old keys go; live, in-use and foreign things stay."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loader.cli import main
from loader.repository import manifest
from loader.repository.key import key_filename
from loader.repository.lock import PublishLock
from loader.repository.publish import (
    DOWNLOAD_MARKER,
    STAGING_DIR,
    STAGING_MARKER,
    TRASH_DIR,
    WORK_DIR,
    host_digest,
)
from tests.tiers import FAST_TIER


def _publish(source: Path, root: Path, name: str, revision: str, created: str) -> Path:
    argv = [
        "run", "--source", str(source), "--repository", str(root), "--model-name", name,
        "--revision", revision, "--tp-size", "1", "--pp-size", "1", "--instance-count", "1",
        "--backend", "python",
    ]  # fmt: skip
    assert main(argv) == 0
    (path,) = (root / f"{name}@{revision}").iterdir()
    data = json.loads((path / manifest.MANIFEST).read_text())
    data["created_at"] = created
    (path / manifest.MANIFEST).write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def published(tiny_checkpoint_with_tokenizer, tmp_path_factory) -> SimpleNamespace:
    """tiny@r1..r4 (r4 newest) and other@r1, published once for the module: each test prunes
    a copy of its own (:func:`tree`)."""
    root = tmp_path_factory.mktemp("published") / "models"
    src = tiny_checkpoint_with_tokenizer
    keys = {
        rev: _publish(src, root, "tiny", rev, f"2026-01-0{i}T00:00:00Z")
        for i, rev in enumerate(["r1", "r2", "r3", "r4"], start=1)
    }
    other = _publish(src, root, "other", "r1", "2025-01-01T00:00:00Z")
    return SimpleNamespace(root=root, keys=keys, other=other)


@pytest.fixture
def tree(published, tmp_path) -> SimpleNamespace:
    """tiny@r1..r4 (r4 newest), other@r1 (a copy of :func:`published`), and every kind of
    leftover."""
    root = tmp_path / "models"
    shutil.copytree(published.root, root, symlinks=True)
    t = SimpleNamespace(root=root)
    t.keys = {rev: root / path.relative_to(published.root) for rev, path in published.keys.items()}
    t.other = root / published.other.relative_to(published.root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    key = str(t.keys["r4"].relative_to(root))
    keyfile = key_filename(key)
    staging = root / STAGING_DIR
    t.dead_staging = staging / f"{keyfile}.{dead.pid}-{host_digest()}.0123456789ab"
    t.live_staging = staging / f"{keyfile}.{os.getpid()}-{host_digest()}.ba9876543210"
    # Named like the loader's, without its marker: never removed.
    t.unmarked_staging = staging / f"{keyfile}.{dead.pid}-{host_digest()}.aaaaaaaaaaaa"
    for path in (t.dead_staging, t.live_staging, t.unmarked_staging):
        (path / "fastertransformer").mkdir(parents=True)
        (path / "fastertransformer" / "weights.bin").write_bytes(b"\0" * 4096)
        if path != t.unmarked_staging:
            (path / STAGING_MARKER).write_text(f"{key}\n")
    t.trash = root / TRASH_DIR / f"{keyfile}.0123456789ab"
    (t.trash / "m").mkdir(parents=True)
    (t.trash / manifest.MANIFEST).write_text(json.dumps({"key": key, "files": []}))
    t.download = root / WORK_DIR / keyfile
    (t.download / "source").mkdir(parents=True)
    (t.download / DOWNLOAD_MARKER).write_text(f"{key}\n")
    t.foreign = root / WORK_DIR / "someone-elses"
    t.foreign.mkdir()
    (root / "notes.txt").write_text("not the loader's")
    (root / "x@y").mkdir()  # not a published key: no manifest
    return t


def _prune(capsys, root: Path, *extra: str) -> tuple[int, list[str]]:
    code = main(["prune", "--repository", str(root), *extra])
    return code, capsys.readouterr().out.splitlines()


def test_dry_run_lists_what_would_go_and_removes_nothing(tree, capsys):
    before = sorted(p.relative_to(tree.root) for p in tree.root.rglob("*"))
    code, out = _prune(capsys, tree.root, "--keep", "1", "--dry-run")
    assert code == 0
    assert any(line.startswith(f"would remove {tree.keys['r1']}") for line in out)
    assert out[-1].startswith("would remove 6 item(s)")
    assert sorted(p.relative_to(tree.root) for p in tree.root.rglob("*")) == before


def test_prune_removes_leftovers_and_keys_beyond_the_newest_n_per_model(tree, capsys):
    code, out = _prune(capsys, tree.root, "--keep", "2")
    assert code == 0
    assert not tree.keys["r1"].exists() and not tree.keys["r2"].exists()
    for kept in (tree.keys["r3"], tree.keys["r4"], tree.other):
        assert manifest.verify(kept) == []
    assert not tree.dead_staging.exists() and not tree.trash.exists()
    assert not tree.download.exists()
    assert tree.live_staging.exists()  # its owner (this process) is alive
    assert tree.unmarked_staging.exists()  # not the loader's
    assert (
        tree.foreign.exists()
        and (tree.root / "notes.txt").exists()
        and (tree.root / "x@y").exists()
    )
    assert out[-1].startswith("removed 5 item(s)")
    assert not (tree.root / "tiny@r1").exists()  # the emptied <name>@<revision> directory too


def test_keys_in_use_or_with_a_live_lock_are_never_removed(tree, capsys):
    r1 = str(tree.keys["r1"].relative_to(tree.root))
    r2 = str(tree.keys["r2"].relative_to(tree.root))
    with PublishLock(tree.root, r2, expiry_s=60):
        code, out = _prune(capsys, tree.root, "--keep", "1", "--in-use", r1)
    assert code == 0
    assert manifest.verify(tree.keys["r1"]) == [] and manifest.verify(tree.keys["r2"]) == []
    assert not tree.keys["r3"].exists()
    assert f"kept {r1} (in use (--in-use))" in out
    assert f"kept {r2} (its publish lock is live)" in out


def test_keep_below_one_is_refused(tree, capsys):
    assert main(["prune", "--repository", str(tree.root), "--keep", "0"]) == 2
    assert "--keep must be at least 1" in capsys.readouterr().err


def test_run_with_prune_keep_prunes_after_publishing_and_keeps_its_own_key(
    tree, tiny_checkpoint_with_tokenizer, capsys
):
    argv = [
        "run", "--source", str(tiny_checkpoint_with_tokenizer), "--repository", str(tree.root),
        "--model-name", "tiny", "--revision", "r0", "--tp-size", "1", "--pp-size", "1",
        "--instance-count", "1", "--backend", "python", "--prune-keep", "1",
    ]  # fmt: skip
    assert main(argv) == 0
    published = Path(capsys.readouterr().out.splitlines()[-1])
    # r0, published now, is the newest; with --keep 1 the older tiny keys go.
    assert manifest.verify(published) == []
    assert not tree.keys["r1"].exists() and not tree.keys["r4"].exists()
    assert manifest.verify(tree.other) == []  # newest of its own model
    assert not tree.dead_staging.exists()


def test_in_use_takes_what_users_paste_and_refuses_what_names_no_key(tree, capsys):
    r1 = tree.keys["r1"]
    key = str(r1.relative_to(tree.root))
    for spelling in (key, f"{key}/", str(r1), f"{r1}/"):
        code, out = _prune(capsys, tree.root, "--keep", "1", "--dry-run", "--in-use", spelling)
        assert code == 0, spelling
        assert f"kept {key} (in use (--in-use))" in out, spelling
    for wrong in ("tiny@r1", f"{key}-typo", "/elsewhere/tiny@r1/x", "tiny@nope/tp1-pp1-i1-x", ""):
        code = main(["prune", "--repository", str(tree.root), "--in-use", wrong])
        err = capsys.readouterr().err
        assert code == 2, wrong
        assert "names no key published" in err or "outside the repository root" in err, err
        assert "hint:" in err
    assert r1.exists()


def test_a_key_whose_lock_was_taken_over_from_a_stalled_prune_is_kept(tree, capsys, monkeypatch):
    """Prune removes an old key holding its publish lock; stalled past the lock's expiry
    (stopped, swapped out, a hung volume), its lock is taken over by a loader of that key,
    which may publish it again or hand it to its user as published. Prune went on and removed
    the key all the same. Now it checks that it still holds the lock before each removal: the
    key is kept, and said so."""
    from loader.repository import prune as pruning
    from loader.repository.lock import LOCKS_DIR

    r1 = str(tree.keys["r1"].relative_to(tree.root))
    recover = pruning.recover

    def taken_over(root: Path, key: str) -> None:
        if key == r1:  # what the successor does: the stale file moved away, its own made
            lock = root / LOCKS_DIR / f"{key_filename(key)}.lock"
            lock.rename(lock.with_name(f"{lock.name}.stale-0123456789abcdef"))
            lock.write_text(json.dumps({"pid": 1, "host": "another-node", "token": "t"}))
        recover(root, key)

    monkeypatch.setattr(pruning, "recover", taken_over)
    code, out = _prune(capsys, tree.root, "--keep", "3")
    assert code == 0
    assert manifest.verify(tree.keys["r1"]) == []
    assert f"kept {r1} (its publish lock was taken over meanwhile)" in out


def test_a_key_published_again_while_prune_works_is_kept(
    tree, tiny_checkpoint_with_tokenizer, capsys
):
    """Prune decides which keys are old, then removes them one at a time under each key's lock,
    deciding again: r1 republished (--force) between the two is not removed. Generated: the
    republish happens at each file-system call prune makes before it reaches r1."""
    from loader import fs
    from tests.faults import Recorder, site_here

    recorder = Recorder()
    with fs.inject(recorder):
        _prune(capsys, tree.root, "--keep", "3", "--dry-run")
    argv = [
        "run", "--source", str(tiny_checkpoint_with_tokenizer), "--repository", str(tree.root),
        "--model-name", "tiny", "--revision", "r1", "--tp-size", "1", "--pp-size", "1",
        "--instance-count", "1", "--backend", "python", "--force", "--lock-timeout-s", "0",
    ]  # fmt: skip
    template = tree.root.with_name("template")
    shutil.copytree(tree.root, template, symlinks=True)
    checked = 0
    for site in list(recorder.sites)[: 6 if FAST_TIER else 14]:  # the fast tier: the first 6
        shutil.rmtree(tree.root)
        shutil.copytree(template, tree.root, symlinks=True)
        done: list[int] = []

        def republish(op: str, path: str, site=site, done=done) -> None:
            if done or site_here(op) != site:
                return
            done.append(1)
            with fs.inject(lambda *_: None):  # the publish itself is not watched
                done.append(main(argv))

        with fs.inject(republish):
            code = main(["prune", "--repository", str(tree.root), "--keep", "3"])
        capsys.readouterr()
        assert code == 0
        if done and done[1] == 0:  # r1 was published again meanwhile: it must still be there
            checked += 1
            assert manifest.verify(tree.keys["r1"]) == [], site
    assert checked > 3


def test_a_run_publishing_while_prune_removes_the_key_directory_it_is_about_to_fill(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """Prune removes ``<name>@<revision>`` once its last key is gone; a run of another key of
    it that opened that directory just before (to rename its staging directory into it) finds
    it removed: it makes it again and publishes, instead of failing (an ``ENOENT`` rename)."""
    from loader import fs

    root = tmp_path / "root"
    argv = ["run", "--source", str(tiny_checkpoint_with_tokenizer), "--repository", str(root),
            "--model-name", "tiny", "--revision", "r1", "--tp-size", "1", "--pp-size", "1",
            "--instance-count", "1", "--backend", "python"]  # fmt: skip
    removed = []

    def prune_meanwhile(op: str, path: str) -> None:
        if op.startswith("rename") and f" -> {root / 'tiny@r1'}/" in path and not removed:
            (root / "tiny@r1").rmdir()  # what prune's removal of the last key does last
            removed.append(path)

    with fs.inject(prune_meanwhile):
        code = main(argv)
    out, err = capsys.readouterr()
    assert removed
    assert code == 0, err
    published = Path(out.splitlines()[-1])
    assert published.parent == root / "tiny@r1"
    assert manifest.verify(published) == []


def test_unfinished_marked_directories_of_gone_loaders_are_removed_and_others_kept(
    tmp_path, capsys
):
    """A loader killed between making its staging or download directory under its temporary
    name and renaming it leaves that name: prune removes it when it carries the marker for
    its key and its owner is gone; a live owner's, and one without the marker holding a
    user's file, stay. One killed before its marker was written (empty) goes too."""
    root = tmp_path / "models"
    key = "tiny@r1/tp1-pp1-i1-0123abcd"
    keyfile = key_filename(key)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone, live = f"{dead.pid}-{host_digest()}", f"{os.getpid()}-{host_digest()}"
    staging_name = f"{keyfile}.{gone}.0123456789ab"
    planted = {
        root / STAGING_DIR / f".{staging_name}.{gone}.0a1b2c3d.tmp": (STAGING_MARKER, True),
        root / WORK_DIR / f".{keyfile}.{gone}.0a1b2c3d.tmp": (DOWNLOAD_MARKER, True),
        root / STAGING_DIR / f".{staging_name}.{live}.0a1b2c3d.tmp": (STAGING_MARKER, False),
        root / STAGING_DIR / f".{staging_name}.{gone}.99999999.tmp": (None, False),
        root / STAGING_DIR / f".{staging_name}.{gone}.0e0e0e0e.tmp": ("", True),
    }
    for path, (marker, _) in planted.items():
        path.mkdir(parents=True)
        if marker:
            (path / marker).write_text(f"{key}\n")
        elif marker is None:
            (path / "notes.txt").write_text("mine\n")
    code, out = _prune(capsys, root)
    assert code == 0
    for path, (_, removed) in planted.items():
        assert path.exists() != removed, path
    assert out[-1].startswith("removed 2 item(s)")
