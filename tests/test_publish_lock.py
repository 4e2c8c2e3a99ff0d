"""The publish lock: one holder at a time across processes; stale locks expire."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loader.errors import LockTimeoutError, PublishError
from loader.repository.lock import PublishLock, lock_path

KEY = "m@r/tp1-pp1-i1-abcdef01"

#: A child process that takes the lock, records when it held it, and releases it.
_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from loader.repository.lock import PublishLock
    root, key, log, hold = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
    with PublishLock(root, key, expiry_s=5, heartbeat_s=0.1, poll_s=0.05) as lock:
        start = time.time()
        time.sleep(hold)
        with open(log, "a") as f:
            f.write(f"{start} {time.time()}\\n")
    """
)


def _holder(root: Path, log: Path, hold: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _HOLDER, str(root), KEY, str(log), str(hold)])


def test_two_concurrent_processes_hold_the_lock_one_after_the_other(tmp_path: Path):
    log = tmp_path / "held.log"
    procs = [_holder(tmp_path, log, 0.6) for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    spans = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(spans) == 2
    (_, end_first), (start_second, _) = spans
    assert start_second >= end_first  # never both at once
    assert not lock_path(tmp_path, KEY).exists()


def test_a_waiter_takes_over_at_once_when_the_holder_pid_on_this_host_is_gone(tmp_path: Path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    record = {"pid": dead.pid, "host": os.uname().nodename, "token": "x", "beats": 3}
    path.write_text(json.dumps(record))
    started = time.monotonic()
    with PublishLock(tmp_path, KEY, expiry_s=30, poll_s=0.05) as lock:
        assert lock.held()
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert time.monotonic() - started < 5


def test_a_take_over_whose_fresh_name_is_taken_is_refused_and_moves_nothing(tmp_path: Path):
    """A take-over moves the stale lock to ``<lock>.stale-<its token>`` first, replacing
    nothing there: a file already at that name (a user's) is refused, the lock's path named
    taken (2, not the bare EEXIST of the rename), and both files stay as they were."""
    from loader.errors import NameTakenError

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    stale = json.dumps({"pid": dead.pid, "host": os.uname().nodename, "token": "x", "beats": 3})
    path.write_text(stale)
    lock = PublishLock(tmp_path, KEY, expiry_s=30, timeout_s=0, poll_s=0.05)
    theirs = path.with_name(f"{path.name}.stale-{lock.token}")
    theirs.write_text("a user's notes\n")
    with pytest.raises(NameTakenError, match=theirs.name):
        lock.acquire()
    assert path.read_text() == stale and theirs.read_text() == "a user's notes\n"


def _zombie() -> subprocess.Popen:
    """A child that has exited and not been reaped yet: what a loader killed with its process
    group (SIGKILL) is for a moment, until its reaper waits for it, or for good under a PID 1
    that never reaps."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return proc
        time.sleep(0.01)
    raise AssertionError("the child did not exit")


def test_a_holder_that_exited_but_was_not_reaped_yet_is_gone(tmp_path: Path, caplog):
    """A lock whose holder is a zombie (killed, not reaped yet: a resume started within
    milliseconds of a group SIGKILL) is a dead holder's: taken over at once, by a waiter and by
    ``try_lock`` (which never waits: it does not say it waits), never waited for until the
    expiry."""
    from loader.fs import owner_gone, pid_alive
    from loader.repository.prune import try_lock

    zombie = _zombie()
    try:
        assert not pid_alive(zombie.pid)
        assert pid_alive(os.getpid())
        assert owner_gone(f"{zombie.pid}-{__import__('loader.fs').fs.host_digest()}")
        path = lock_path(tmp_path, KEY)
        path.parent.mkdir(parents=True)
        record = {"pid": zombie.pid, "host": os.uname().nodename, "token": "x", "beats": 3}
        path.write_text(json.dumps(record))
        caplog.set_level("INFO")
        lock = try_lock(tmp_path, KEY, 30)
        assert lock is not None and lock.held()
        lock.release()
        assert "waiting" not in caplog.text
        path.write_text(json.dumps(record))
        started = time.monotonic()
        with PublishLock(tmp_path, KEY, expiry_s=30, poll_s=5) as held:
            assert held.held()
        assert time.monotonic() - started < 4  # not one poll
    finally:
        zombie.wait()


def test_try_lock_does_not_say_it_waits_for_a_live_holder(tmp_path: Path, caplog):
    from loader.repository.prune import try_lock

    caplog.set_level("INFO")
    with PublishLock(tmp_path, KEY, expiry_s=30):
        assert try_lock(tmp_path, KEY, 30) is None
    assert "waiting" not in caplog.text
    assert "holds" in caplog.text


def test_a_lock_of_another_host_expires_when_its_heartbeat_stops(tmp_path: Path):
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": 1, "host": "other-node", "token": "y", "beats": 7}))
    started = time.monotonic()
    with PublishLock(tmp_path, KEY, expiry_s=0.5, poll_s=0.05):
        waited = time.monotonic() - started
    assert 0.5 <= waited < 5


def test_a_lock_with_a_live_heartbeat_is_not_taken_over(tmp_path: Path):
    # The waiter waits longer than the expiry, so a holder without heartbeats would be taken
    # over; the expiry is 50 heartbeats, so only a heartbeat thread starved for 2.5 s (not a
    # busy 2-core machine's 0.4 s) would be judged dead.
    holder = PublishLock(tmp_path, KEY, expiry_s=2.5, heartbeat_s=0.05).acquire()
    try:
        waiter = PublishLock(tmp_path, KEY, expiry_s=2.5, timeout_s=3.5, poll_s=0.05)
        with pytest.raises(LockTimeoutError) as info:
            waiter.acquire()
        assert "pid" in info.value.message
        assert holder.held()
        holder.check_held()
    finally:
        holder.release()
    assert not lock_path(tmp_path, KEY).exists()


def test_a_holder_whose_lock_was_taken_over_knows_it_and_refuses_to_publish(tmp_path: Path):
    holder = PublishLock(tmp_path, KEY, expiry_s=60, heartbeat_s=0.05).acquire()
    try:
        path = lock_path(tmp_path, KEY)
        os.rename(path, tmp_path / "moved")  # what a waiter does with a lock it judged stale
        path.write_text(json.dumps({"pid": 1, "host": "other-node", "token": "z"}))
        assert not holder.held()
        with pytest.raises(PublishError, match="taken over"):
            holder.check_held()
    finally:
        holder.release()
    # Releasing a lost lock leaves the new holder's file alone.
    assert json.loads(lock_path(tmp_path, KEY).read_text())["token"] == "z"


def test_heartbeat_rewrites_the_lock_file(tmp_path: Path):
    with PublishLock(tmp_path, KEY, expiry_s=60, heartbeat_s=0.05):
        first = json.loads(lock_path(tmp_path, KEY).read_text())["beats"]
        time.sleep(0.4)
        later = json.loads(lock_path(tmp_path, KEY).read_text())["beats"]
    assert later > first


@pytest.mark.parametrize("raised", [RuntimeError("can't start new thread"), KeyboardInterrupt()])
def test_a_lock_created_but_not_acquired_is_removed(tmp_path: Path, monkeypatch, raised):
    """The lock file was created, then its heartbeat thread could not start (memory ran out:
    ``ulimit -v``) or Ctrl-C came: the error went up with the lock file left, naming this
    process, and every loader of the key on another host waited for it to expire."""
    import threading

    started = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == "publish-lock-heartbeat":
            raise raised
        started(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(type(raised)):
        PublishLock(tmp_path, KEY).acquire()
    assert not lock_path(tmp_path, KEY).exists()
    monkeypatch.setattr(threading.Thread, "start", started)
    with PublishLock(tmp_path, KEY, timeout_s=0):
        pass


def test_a_users_file_renamed_to_a_lock_whose_first_write_failed_at_any_step_stays(tmp_path):
    """The lock file's first write fails (the volume is full): the file is removed, but only
    while it is the very file this loader created (it was unlinked by name, so a user's file
    renamed to the lock's path in between was removed); the error is the full volume's."""
    import errno

    from loader import fs
    from tests.at_step import AtStep

    def full(op: str, where: str) -> None:
        if op == "write" and where.endswith(".lock"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)

    def acquire(root: Path) -> None:
        with pytest.raises(OSError, match="No space"):
            PublishLock(root, KEY, timeout_s=0).acquire()

    calls: list[str] = []

    def counted(op: str, where: str) -> None:
        calls.append(f"{op} {where}")
        full(op, where)

    with fs.inject(counted):
        acquire(tmp_path / "count")
    failed = next(i for i, call in enumerate(calls, 1) if call.startswith("write "))
    for step in range(failed + 1, len(calls) + 1):
        root = tmp_path / f"at-{step}"
        theirs = tmp_path / f"theirs-{step}"
        theirs.write_text("a user's notes\n")
        path = lock_path(root, KEY)
        hook = AtStep(step, lambda op, where: where, lambda _, o=theirs, p=path: os.rename(o, p))

        def both(op: str, where: str, hook: AtStep = hook) -> None:
            hook(op, where)
            full(op, where)

        with fs.inject(both):
            acquire(root)
        assert hook.done and path.read_text() == "a user's notes\n", (step, calls[step - 1])
        assert os.listdir(path.parent) == [path.name]


def test_a_release_never_removes_the_lock_a_waiter_took_over_in_the_instant_before(tmp_path: Path):
    """The holder stalled past the expiry just as it released: a waiter moved its lock aside as
    stale and created its own; the release that then resumes removes nothing of the new
    holder's: it holds the lock (its file at the lock's path) until it releases it."""
    from loader import fs

    holder = PublishLock(tmp_path, KEY, expiry_s=60, heartbeat_s=0.05).acquire()
    path = lock_path(tmp_path, KEY)
    taken: list[PublishLock] = []

    def take_over(op: str, where: str) -> None:
        if taken or not where.startswith(str(path)) or not op.startswith(("unlink", "rename")):
            return
        taken.append(None)  # type: ignore[arg-type]  (re-entered below: once)
        os.rename(path, tmp_path / "moved")  # what a waiter does with a lock it judged stale
        os.unlink(tmp_path / "moved")
        taken[0] = PublishLock(tmp_path, KEY, expiry_s=60, timeout_s=0).acquire()

    with fs.inject(take_over):
        holder.release()
    (waiter,) = taken
    try:
        assert path.is_file() and waiter.held()
        assert json.loads(path.read_text())["token"] == waiter.token
        waiter.check_held()
    finally:
        waiter.release()
    assert not path.exists()


def test_a_release_whose_move_aside_fails_still_removes_its_own_lock(tmp_path: Path):
    """The volume refuses the rename that moves the lock aside (EIO): the lock, still this
    holder's, is removed by name instead of being left naming this process, which a next run
    of the same process (a long-lived caller) waited out for its whole --lock-timeout."""
    import errno

    from loader import fs

    holder = PublishLock(tmp_path, KEY, heartbeat_s=0.05).acquire()
    path = lock_path(tmp_path, KEY)

    def refuse(op: str, where: str) -> None:
        if op.startswith("rename") and where.startswith(str(path)):
            raise OSError(errno.EIO, os.strerror(errno.EIO), where)

    with fs.inject(refuse):
        holder.release()
    assert not path.exists() and not list(path.parent.glob("*.stale-*"))
    with PublishLock(tmp_path, KEY, timeout_s=0):  # taken at once
        pass


def test_a_release_whose_move_aside_fails_keeps_a_lock_taken_over_meanwhile(tmp_path: Path):
    """The rename that moves the lock aside fails (EIO) just as a waiter, which judged this
    stalled holder's lock stale, takes it over: the removal by name that follows leaves the
    waiter's lock file, which no longer names this holder."""
    import errno

    from loader import fs

    holder = PublishLock(tmp_path, KEY, expiry_s=60, heartbeat_s=0.05).acquire()
    path = lock_path(tmp_path, KEY)
    taken: list[PublishLock] = []

    def take_over_and_refuse(op: str, where: str) -> None:
        if taken or not op.startswith("rename") or not where.startswith(str(path)):
            return
        taken.append(None)  # type: ignore[arg-type]  (re-entered below: once)
        os.rename(path, tmp_path / "moved")  # what a waiter does with a lock it judged stale
        os.unlink(tmp_path / "moved")
        taken[0] = PublishLock(tmp_path, KEY, expiry_s=60, timeout_s=0).acquire()
        raise OSError(errno.EIO, os.strerror(errno.EIO), where)

    with fs.inject(take_over_and_refuse):
        holder.release()
    (waiter,) = taken
    try:
        assert path.is_file() and waiter.held()
        assert json.loads(path.read_text())["token"] == waiter.token
    finally:
        waiter.release()
    assert not path.exists()


def test_a_take_over_whose_moved_lock_prune_removed_meanwhile_goes_on(tmp_path: Path):
    """A waiter moved a lock it judged stale aside, found it changed since (a late beat of its
    holder) and puts it back; prune removed it meanwhile as a moved-away lock: nothing is left
    to put back, and the waiter goes on to take the lock, not a traceback (exit 1)."""
    from loader import fs

    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": KEY, "pid": 1, "host": "gone", "token": "x"}))
    steps: list[str] = []

    def race(op: str, where: str) -> None:
        if op.startswith("rename") and where.startswith(f"{path} -> ") and not steps:
            steps.append("rename")
            path.write_text(json.dumps({"key": KEY, "pid": 1, "host": "gone", "beats": 1}))
        elif op == "link" and steps == ["rename"]:
            steps.append(op)
            os.unlink(where.split(" -> ")[0])

    with (
        fs.inject(race),
        PublishLock(tmp_path, KEY, expiry_s=0.2, timeout_s=5, poll_s=0.05) as lock,
    ):
        assert lock.held()
    assert steps == ["rename", "link"]
    assert os.listdir(path.parent) == []
