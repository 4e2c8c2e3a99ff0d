"""A publish lock a loader of another node or pod left when it was killed (its pid means
nothing here): a take that never waits (``prune``, the clean-up of a run that finds its key
published) judges it by how long ago its file was written. One silent for the expiry is taken
over and what its key left is removed; one written within the expiry is live and kept."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from loader.cli import main
from loader.errors import LockTimeoutError
from loader.repository import publish
from loader.repository.lock import PublishLock, lock_path
from loader.repository.prune import prune, try_lock
from tests.runs import forged_key, run_argv

KEY = "m@r1/v"


def _foreign_lock(root: Path, key: str, *, age_s: float) -> Path:
    """The lock file of ``key`` as a loader of another host left it, last written ``age_s``
    seconds ago."""
    path = lock_path(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "pid": 12345, "host": "loader-7f9c-xk2p", "pid_space": "b:1",
              "token": "0123456789abcdef", "beats": 3, "heartbeat_at": 0}  # fmt: skip
    path.write_text(json.dumps(record))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


@pytest.mark.parametrize(("age_s", "taken"), [(7200, True), (5, False)])
def test_try_lock_takes_a_foreign_lock_silent_for_the_expiry_and_only_that(
    tmp_path: Path, age_s: float, taken: bool
):
    path = _foreign_lock(tmp_path, KEY, age_s=age_s)
    lock = try_lock(tmp_path, KEY, 60)
    assert (lock is not None) == taken
    if lock is not None:
        assert json.loads(path.read_text())["pid"] == os.getpid()
        lock.release()
    assert path.exists() != taken


def test_prune_removes_an_old_key_whose_foreign_lock_is_long_silent(tmp_path: Path):
    root = tmp_path / "models"
    forged_key(root, "m@r2/v", "2026-01-02T00:00:00Z")
    old = forged_key(root, KEY, "2026-01-01T00:00:00Z")
    lock = _foreign_lock(root, KEY, age_s=7200)
    report = prune(root, keep=1, lock_expiry_s=60)
    assert [r.path for r in report.removed] == [old]
    assert not old.exists() and not lock.exists()


def test_a_run_finding_its_key_published_removes_what_a_killed_loader_of_another_pod_left(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, caplog
):
    root = tmp_path / "models"
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root)) == 0
    key = str(Path(capsys.readouterr().out.splitlines()[-1]).relative_to(root))
    staging = publish.new_staging_dir(root, key)
    staging = staging.rename(staging.with_name(staging.name.replace(publish.host_digest(),
                                                                    "0a1b2c3d")))  # fmt: skip
    for path in (staging, *staging.iterdir()):
        os.utime(path, (1_000_000_000, 1_000_000_000))
    lock = _foreign_lock(root, key, age_s=7200)
    with caplog.at_level("INFO", logger="loader"):
        assert main(run_argv(tiny_checkpoint_with_tokenizer, root, "--lock-expiry-s", "60")) == 0
    assert "already published" in caplog.text
    assert not staging.exists() and not lock.exists()


def _foreign_holder(root: Path, key: str, *, age_s: float, expiry_s: object) -> Path:
    """A lock of ``key`` whose holder (on another host) says it was given ``expiry_s``."""
    path = _foreign_lock(root, key, age_s=age_s)
    record = json.loads(path.read_text())
    record["expiry_s"] = expiry_s
    path.write_text(json.dumps(record))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_waiter_with_a_shorter_expiry_than_the_holders_waits_out_the_holders(tmp_path: Path):
    """The holder beats every quarter of its own expiry (here 15 s of 60): a waiter given 1 s
    never takes its lock between two beats."""
    path = _foreign_holder(tmp_path, KEY, age_s=0, expiry_s=60.0)
    before = path.read_bytes()
    with pytest.raises(LockTimeoutError):
        PublishLock(tmp_path, KEY, expiry_s=1, timeout_s=3, poll_s=0.1).acquire()
    assert path.read_bytes() == before


def test_prune_with_a_shorter_expiry_than_the_holders_keeps_its_key(tmp_path: Path):
    root = tmp_path / "models"
    forged_key(root, "m@r2/v", "2026-01-02T00:00:00Z")
    old = forged_key(root, KEY, "2026-01-01T00:00:00Z")
    lock = _foreign_holder(root, KEY, age_s=30, expiry_s=600.0)
    report = prune(root, keep=1, lock_expiry_s=1)
    assert not report.removed and (KEY, "its publish lock is live") in report.kept
    assert old.is_dir() and lock.exists()


@pytest.mark.parametrize("bogus", [1e300, -5, 0, "600", True, 10**400, None])
def test_an_expiry_in_a_lock_record_no_loader_could_be_given_is_ignored(
    tmp_path: Path, bogus: object
):
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    record = {"pid": 12345, "host": "loader-7f9c-xk2p", "pid_space": "b:1"}
    path.write_text(json.dumps(record)[:-1] + f', "expiry_s": {json.dumps(bogus)}}}')
    then = time.time() - 7200
    os.utime(path, (then, then))
    lock = try_lock(tmp_path, KEY, 60)
    assert lock is not None
    lock.release()
