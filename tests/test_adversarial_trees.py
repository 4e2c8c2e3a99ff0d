"""Someone else's entries planted in the loader's own directories under ROOT (``.locks/``, ...):
each stays exactly as it was, and what the loader says about it is a typed error."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from loader.cli import main
from loader.errors import NotOursError
from loader.repository.key import key_filename
from loader.repository.lock import LOCKS_DIR, PublishLock, lock_path
from loader.repository.prune import lock_live, prune

KEY = "m@r/tp1-pp1-i1-abcdef01"


def _old(path: Path, age_s: float = 10_000) -> None:
    then = time.time() - age_s
    os.utime(path, (then, then), follow_symlinks=False)


# --- .locks/ ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "notes.lock.stale-1",
        f"{key_filename(KEY)}.lock.stale-0123456789abcdef",
        ".lock.stale-",
    ],
)
def test_prune_keeps_a_users_file_named_like_a_moved_away_lock(tmp_path, name):
    """Only a lock file a take-over moved aside (a lock record, at the name a take-over gives
    it) is the loader's; a user's file of a similar name, with other content, stays."""
    (tmp_path / LOCKS_DIR).mkdir()
    planted = tmp_path / LOCKS_DIR / name
    planted.write_text("a user's notes\n")
    report = prune(tmp_path, keep=1)
    assert planted.read_text() == "a user's notes\n"
    assert planted not in [r.path for r in report.removed]


def test_prune_still_removes_a_lock_a_take_over_moved_away(tmp_path):
    (tmp_path / LOCKS_DIR).mkdir()
    moved = tmp_path / LOCKS_DIR / f"{key_filename(KEY)}.lock.stale-0123456789abcdef"
    moved.write_text(json.dumps({"key": KEY, "pid": 1, "host": "gone", "token": "x"}))
    report = prune(tmp_path, keep=1)
    assert not moved.exists()
    assert [r.path for r in report.removed] == [moved]


@pytest.mark.parametrize("content", [b"a user's notes at the lock's name\n", b"#!/bin/sh\n"])
def test_a_users_file_at_a_locks_name_is_never_taken_over(tmp_path, content):
    """A file at the lock's path that holds no lock record is no lock of a loader (however
    long it has not changed): the run is refused naming it, and the file stays."""
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    _old(path)
    lock = PublishLock(tmp_path, KEY, expiry_s=0.2, timeout_s=2, poll_s=0.05)
    with pytest.raises(NotOursError) as info:
        lock.acquire()
    assert str(path) in info.value.message
    assert path.read_bytes() == content
    assert sorted(os.listdir(path.parent)) == [path.name]
    # prune leaves the key alone: what holds its lock's name is not a lock it may judge
    assert lock_live(tmp_path, key_filename(KEY), expiry_s=0.2)


@pytest.mark.parametrize(
    "content",
    [b"", b"\x00" * 64, b'{"key": "m@r/tp1-pp1-i1-abcdef01", "pid": 1, "host": "gone"}', b'{"ke'],
)
def test_what_a_stopped_loader_may_leave_at_its_locks_name_is_still_taken_over(tmp_path, content):
    """Nothing written yet, zeros (a crash before the write reached the disk), a record cut
    short: a lock a loader left, taken over once it has not changed for the expiry."""
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with PublishLock(tmp_path, KEY, expiry_s=0.2, timeout_s=5, poll_s=0.05) as lock:
        assert lock.held()
    assert sorted(os.listdir(path.parent)) == []


def test_a_run_refuses_a_users_file_at_its_locks_name(tiny_checkpoint_with_tokenizer, tmp_path):
    root = tmp_path / "root"
    argv = ["run", "--source", str(tiny_checkpoint_with_tokenizer), "--repository", str(root),
            "--model-name", "tiny", "--tp-size", "1", "--pp-size", "1", "--instance-count", "1",
            "--backend", "python", "--lock-expiry-s", "1"]  # fmt: skip
    assert main(argv) == 0
    assert not list((root / LOCKS_DIR).iterdir())  # released
    (published,) = root.glob("tiny@*/*")
    path = lock_path(root, f"{published.parent.name}/{published.name}")
    path.write_text("a user's notes\n")
    _old(path)
    assert main([*argv, "--force"]) == 2
    assert path.read_text() == "a user's notes\n"
    assert main(["prune", "--repository", str(root), "--keep", "1"]) == 0
    assert path.read_text() == "a user's notes\n"
