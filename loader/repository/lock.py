"""The publish lock: one loader works on a model key, the others wait.

A lock is the file ``ROOT/.locks/<key as one file name>.lock``, created with ``O_CREAT |
O_EXCL`` (atomic on local filesystems and NFSv3+), holding JSON with the holder's pid, host,
a random token and a heartbeat counter/time. While held, a heartbeat thread rewrites the file
through the holder's own open descriptor every ``heartbeat_s`` seconds.

A waiter polls. It takes over a lock that is *stale*:

* the holder runs on this host, in this pid space (same boot, same pid namespace:
  :func:`local_pid`), and its pid no longer exists (a killed loader, at once), or
* the lock's content has not changed for ``expiry_s`` seconds of the waiter's own clock (a
  holder on another node that died; comparing against the waiter's clock avoids trusting
  clocks of other machines). A take that never waits (``timeout_s`` 0: ``prune``, the clean-up
  of a run that finds its key published) cannot watch the content for that long: it judges by
  the lock file's modification time instead (``judge_by_age``), as ``prune`` judges a lock
  live; else a lock a loader of another node or pod left when it was killed would stop every
  clean-up of its key for good.

Each judges by the longer of its own expiry and the holder's, which the lock record names
(``expiry_s``): a holder beats every quarter of its own expiry, so a waiter or ``prune`` given
a shorter ``--lock-expiry-s`` than the holder's would otherwise take over a live lock between
two beats.

Take-over renames the stale file to a unique name (atomic: only one waiter wins), checks that
what it moved is the stale lock it judged, and then competes for ``O_EXCL`` creation like any
other waiter. A holder whose file was taken over notices (its descriptor no longer names the
lock path) and :meth:`PublishLock.check_held` raises, so it never publishes without the lock.
Publishing is safe even then: the final rename never replaces a complete repository.

The lock file is reached through a descriptor of ``ROOT/.locks`` (:mod:`loader.fs`): a link at
``.locks`` or at the lock's path is a :class:`~loader.errors.NotOursError` (exit 2, naming it),
never read or written through; so is a file there that holds no lock record (:func:`lock_like`:
someone else's, never judged stale, moved or removed). A lock file whose first write fails is
removed before the error goes up, so no empty lock is left for the next loader to wait on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path

from loader import ledger
from loader.errors import (
    LockLostError,
    LockTimeoutError,
    NameTakenError,
    NotOursError,
    PublishError,
)
from loader.formats import jsondoc
from loader.fs import Dir, TooLargeError, fsync_fd, pid_alive, pid_space, rewrite_fd
from loader.limits import LOCK_EXPIRY_S, LOCK_TIMEOUT_S
from loader.repository.key import key_filename

log = logging.getLogger(__name__)

__all__ = [
    "LOCKS_DIR",
    "PublishLock",
    "expiry_of",
    "local_pid",
    "lock_left",
    "lock_like",
    "lock_path",
    "pid_alive",
]

LOCKS_DIR = ".locks"


def lock_path(root: Path, key: str) -> Path:
    return Path(root) / LOCKS_DIR / f"{key_filename(key)}.lock"


def lock_left(root: Path, key: str) -> bool:
    """Whether ``ROOT/.locks`` holds an entry at ``key``'s lock name (reads only): a holder's,
    live or dead, or whatever stands there."""
    try:
        with Dir.open(root) as r:
            if not r.is_dir(LOCKS_DIR):
                return False
            with r.sub(LOCKS_DIR) as locks:
                return locks.lstat(f"{key_filename(key)}.lock") is not None
    except (FileNotFoundError, NotADirectoryError, NotOursError):
        return False


class PublishLock:
    """Exclusive lock on one model key under ``root``; use as a context manager."""

    def __init__(
        self,
        root: Path,
        key: str,
        *,
        expiry_s: float = LOCK_EXPIRY_S.default,
        heartbeat_s: float | None = None,
        timeout_s: float = LOCK_TIMEOUT_S.default,
        poll_s: float = 1.0,
        judge_by_age: bool = False,
    ) -> None:
        heartbeat_s = heartbeat_s if heartbeat_s is not None else max(expiry_s / 4, 0.05)
        if not expiry_s > 0 or not heartbeat_s < expiry_s:
            raise PublishError(
                f"A publish lock expiry of {expiry_s} s is not longer than its heartbeat "
                f"({heartbeat_s:g} s): waiting loaders would take over a live holder's lock.",
                "Use an expiry longer than the heartbeat and than any stall of a loader.",
            )
        LOCK_TIMEOUT_S.check(timeout_s)
        self.root = Path(root).absolute()
        self.path = lock_path(self.root, key)
        self.key = key
        self.expiry_s = expiry_s
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        #: Count the content as unchanged since the lock file's modification time (its age on
        #: this host's clock), not only since this waiter first read it.
        self.judge_by_age = judge_by_age
        self.token = secrets.token_hex(8)
        self.host = socket.gethostname()
        self._fd: int | None = None
        self._dir: Dir | None = None
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost = False
        self.waited_s = 0.0

    # -- content --------------------------------------------------------------------------

    def _content(self) -> bytes:
        record = {
            "key": self.key,  # first: how a loader's record is told (RECORD_START)
            "pid": os.getpid(),
            "host": self.host,
            "pid_space": pid_space(),
            "token": self.token,
            "beats": self._beats,
            "heartbeat_at": time.time(),
            "expiry_s": self.expiry_s,
        }
        return json.dumps(record).encode()

    def _write(self) -> None:
        assert self._fd is not None
        rewrite_fd(self._fd, self._content(), self.path)
        fsync_fd(self._fd, self.path)

    # -- acquire / release ----------------------------------------------------------------

    def acquire(self) -> PublishLock:
        with Dir.open(self.root, create=True) as root:
            self._dir = root.sub(LOCKS_DIR, create=True, what="lock directory")
        try:
            return self._acquire()
        except BaseException:
            # Created, then failed (no thread for the heartbeat: memory ran out; Ctrl-C): a
            # lock left here would hold every other host's loader of the key until it expires.
            self.release()
            raise

    def _acquire(self) -> PublishLock:
        assert self._dir is not None
        start = time.monotonic()
        seen: bytes | None = None
        seen_since = start
        announced = False
        while True:
            if self._create():
                self.waited_s = time.monotonic() - start
                ledger.note_lock(self.root, self.key, self.expiry_s)  # for a supervisor
                self._start_heartbeat()
                log.info("holding publish lock %s", self.path)
                return self
            now = time.monotonic()
            content = self._read()
            if content is not None and not lock_like(content):
                if self._newer_record(content):
                    raise PublishError(
                        f"The publish lock {self.path} holds a record of this key with fields "
                        f"this loader does not know: a newer loader's lock ({_describe(content)}"
                        "), which may be live; this loader cannot judge it and leaves it alone.",
                        "Upgrade this loader to the version of the loaders sharing this "
                        "repository, or wait for that loader to finish (or its lock to expire, "
                        "as a newer loader judges it), then run again; never move a lock file "
                        "away while its loader may run.",
                    )
                raise NotOursError(
                    self.path, "a file holding no loader's lock record", "a publish lock file"
                )
            if content != seen:
                seen, seen_since = content, now - self._age()
            if content is not None and self._is_stale(content, unchanged_s=now - seen_since):
                self._take_over(content)
                continue
            if not announced:
                log.info(
                    "another loader holds %s (%s)%s",
                    self.path,
                    _describe(content),
                    "; waiting" if self.timeout_s > 0 else "",
                )
                announced = True
            if now - start > self.timeout_s:
                raise LockTimeoutError(
                    f"Waited {self.timeout_s:.0f} s for the publish lock {self.path} held by "
                    f"{_describe(content)}."
                )
            time.sleep(self.poll_s)

    def _newer_record(self, content: bytes) -> bool:
        """Whether ``content`` is a record of this key a newer loader wrote: a whole object
        beginning as a record does, naming this key and a record's pid, host and token, with
        fields besides a record's (this loader's records name no others)."""
        record = _parse(content)
        return (
            content.startswith(RECORD_START)
            and record is not None
            and record.get("key") == self.key
            and {"pid", "host", "token"} <= set(record)
            and not set(record) <= RECORD_FIELDS
        )

    def _create(self) -> bool:
        """Create the lock file (``O_EXCL``) and write our record; False if it exists. A write
        that fails removes the file again: no empty lock is left behind."""
        assert self._dir is not None
        try:
            fd = self._dir.open_file(self.path.name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        except FileExistsError:
            return False
        self._fd = fd
        try:
            self._write()
        except BaseException:
            self._fd = None
            with contextlib.suppress(OSError):  # only the very file made (not by name)
                made = os.fstat(fd)
                self._dir.unlink_judged(
                    self.path.name,
                    (made.st_dev, made.st_ino),
                    f"{self.path.name}.stale-{secrets.token_hex(8)}",
                )
            os.close(fd)
            raise
        return True

    def _read(self) -> bytes | None:
        assert self._dir is not None
        try:
            return self._dir.read(self.path.name, limit=64 * 1024)
        except TooLargeError:
            raise NotOursError(
                self.path, "a file larger than any lock record", "a publish lock file"
            ) from None

    def _age(self) -> float:
        """With ``judge_by_age``, how long ago the lock file was last written (0 otherwise, or
        when it is gone)."""
        if not self.judge_by_age:
            return 0.0
        assert self._dir is not None
        found = self._dir.lstat(self.path.name)
        return 0.0 if found is None else max(0.0, time.time() - found.st_mtime)

    def _is_stale(self, content: bytes, *, unchanged_s: float) -> bool:
        record = _parse(content)
        local = record and local_pid(record) is not None
        if local and not pid_alive(record["pid"]):
            log.warning(
                "publish lock %s belongs to pid %s, which is gone", self.path, record["pid"]
            )
            return True
        if unchanged_s >= expiry_of(record, self.expiry_s):
            log.warning(
                "publish lock %s has had no heartbeat for %.0f s; taking it over",
                self.path,
                unchanged_s,
            )
            return True
        return False

    def _take_over(self, stale: bytes) -> None:
        assert self._dir is not None
        locks, name = self._dir, self.path.name
        moved = f"{name}.stale-{self.token}"
        try:  # replacing nothing: whatever stands at the fresh name is someone else's
            locks.rename_back(name, locks, moved)
        except FileNotFoundError:
            return  # someone else removed it first
        except FileExistsError:
            raise NameTakenError(locks.path / moved, locks._found(moved)) from None
        try:
            found = locks.read_judged(moved, limit=64 * 1024)
        except (NotOursError, TooLargeError):
            found = (b"not a lock", (-1, -1))  # (put back below, never removed)
        if found is None:
            return  # someone else removed what we moved
        content, judged = found
        if not lock_like(content):
            # Not a lock file (a link, a FIFO, a directory, a user's file put at the lock's
            # path after we judged it): never removed; back where it was, and refused.
            try:
                locks.rename_back(moved, locks, name)
            except OSError:  # a new lock is there meanwhile: left beside it, and named
                raise locks.not_ours(moved, "a publish lock file") from None
            raise locks.not_ours(name, "a publish lock file")
        try:
            if content != stale:
                # We moved a lock that changed since we judged it: put it back unless a new
                # one exists already (its holder then notices the loss and stops).
                # (FileNotFoundError: prune removed what we moved meanwhile, a moved-away
                # lock file to it: nothing is left to put back, and its holder stops)
                with contextlib.suppress(FileExistsError, FileNotFoundError):
                    locks.link(moved, name)
        finally:  # only the very file read (a user's renamed to that name since stays)
            locks.unlink_judged(moved, judged, f"{name}.stale-{secrets.token_hex(8)}")

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        thread = threading.Thread(target=self._beat, name="publish-lock-heartbeat", daemon=True)
        thread.start()
        self._thread = thread  # only a started thread is joined

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self.held():
                    self._lost = True
                    log.error("publish lock %s was taken over by another loader", self.path)
                    return
                self._beats += 1
                self._write()
            except OSError as exc:  # keep beating; a transient NFS error must not kill us
                log.warning("could not refresh publish lock %s: %s", self.path, exc)

    def held(self) -> bool:
        """Whether our descriptor still names the lock file at its path (an ``OSError`` when
        that cannot be told)."""
        if self._fd is None or self._dir is None:
            return False
        ours, current = os.fstat(self._fd), self._dir.lstat(self.path.name)
        if current is None:
            return False
        return (ours.st_dev, ours.st_ino) == (current.st_dev, current.st_ino)

    def check_held(self) -> None:
        """Raise :class:`LockLostError` if the lock was lost (taken over as stale)."""
        if self._lost or not self.held():
            raise LockLostError(
                f"The publish lock {self.path} was taken over by another loader (this one was "
                "presumed dead); nothing was published by this run."
            )

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and close it. A lock file that cannot be
        removed is left with a warning: it names this process, so once it exits the next loader
        on this host takes it over at once (on another host: after the expiry)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if self._fd is not None and self.held():
                self._remove_own()
        except OSError as exc:
            log.warning("could not remove the publish lock %s (%s); the next loader takes it "
                        "over", self.path, exc)  # fmt: skip
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._dir is not None:
                self._dir.close()
                self._dir = None
        log.debug("released publish lock %s", self.path)

    def _remove_own(self) -> None:
        """Remove the lock file while it is this holder's: moved aside first (one rename), and
        removed only if what moved is the file this holder's descriptor names. A waiter that
        took the lock over in the instant after :meth:`held` looked (this holder stalled past
        the expiry) has its new lock file there: that one goes back, never removed."""
        assert self._dir is not None and self._fd is not None
        ours = os.fstat(self._fd)
        moved = f"{self.path.name}.stale-{secrets.token_hex(8)}"  # (prune removes one a kill left)
        try:
            self._dir.unlink_judged(self.path.name, (ours.st_dev, ours.st_ino), moved)
        except OSError as exc:
            # A volume that refuses the rename (EIO, EPERM of an odd file system) would leave
            # the lock naming this process: the next run of this process (a long-lived caller)
            # waited out the whole --lock-timeout. Removed by name while it is still ours, as
            # before the move aside (only a take-over within this instant is not told apart).
            log.debug("moving the publish lock %s aside failed (%s)", self.path, exc)
            if self.held():
                self._dir.unlink(self.path.name, missing_ok=True)

    def __enter__(self) -> PublishLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def local_pid(record: object) -> int | None:
    """The pid a lock record names when it means a process this one can see: same host name
    and same pid space (:func:`loader.fs.pid_space`: boot and pid namespace; a record written
    without one, by an older loader, is judged by its host name). None otherwise: a pid of
    another container or boot may be alive though absent here, so only the expiry tells."""
    if not isinstance(record, dict) or record.get("host") != socket.gethostname():
        return None
    pid, space = record.get("pid"), record.get("pid_space", pid_space())
    if not isinstance(pid, int) or isinstance(pid, bool) or space != pid_space():
        return None
    return pid


def expiry_of(record: object, expiry_s: float) -> float:
    """How long a lock of ``record`` may go without a heartbeat before a loader whose own
    expiry is ``expiry_s`` judges it stale: the longer of the two (the holder beats every
    quarter of its own). A value in a record that is no expiry a loader could have been given
    (:data:`loader.limits.LOCK_EXPIRY_S`) is ignored."""
    theirs = record.get("expiry_s") if isinstance(record, dict) else None
    if type(theirs) not in (int, float):
        return expiry_s
    try:
        theirs = float(theirs)
    except OverflowError:  # an integer no float holds
        return expiry_s
    return max(expiry_s, theirs) if LOCK_EXPIRY_S.ok(theirs) else expiry_s


def lock_like(content: bytes) -> bool:
    """Whether ``content`` may be what a loader left in its lock file: the JSON object it
    writes (perhaps with the tail of a longer earlier record, a rewrite stopped between its
    write and its truncation), nothing yet (stopped between the create and the first write),
    or zeros (a crash before the write reached the disk). Every record a loader writes begins
    with its key (:data:`RECORD_START`): a record cut short, or followed by such a tail, is no
    whole JSON object and begins with that (or is a beginning of it); a whole JSON object is
    one only if it names fields of a record alone (:data:`RECORD_FIELDS`), in any order.
    Anything else at a lock's name (any other JSON object among it, one whose first field is
    ``key`` too: a user's settings, notes) is someone else's file: never judged stale, moved
    or removed.

    A record is one line of ASCII (``json.dumps``): content that is no whole object is a
    record's only if it is one line of ASCII (zeros after it: a crash), every field it names
    is a record's, and what follows a whole first object (an earlier record's tail) ends as
    a record does. A user's JSON lines, an object followed by notes, or text in another
    encoding, each beginning as a record does, are someone else's."""
    if not content.strip(b"\0"):
        return True
    record = _parse(content)
    if record is not None:  # a whole object: a record names only a record's fields
        return bool(record) and set(record) <= RECORD_FIELDS
    if not (content.startswith(RECORD_START) or RECORD_START.startswith(content)):
        return False
    text = content.rstrip(b"\0")
    if not text.isascii() or b"\n" in text:
        return False
    try:
        first, end = json.JSONDecoder().raw_decode(text.decode())
    except ValueError:  # cut short: the fields it names so far
        return {f.decode() for f in _FIELD.findall(text)} <= RECORD_FIELDS
    # An older record's tail: a piece of a field, then whole fields (from the first ', "'),
    # and its end.
    tail = text[end:]
    cut = tail.find(b', "')
    fields = set(first) | {f.decode() for f in _FIELD.findall(tail[cut:] if cut >= 0 else b"")}
    return fields <= RECORD_FIELDS and (not tail or (tail.endswith(b"}") and b"{" not in tail))


#: How every lock record begins (:meth:`PublishLock._content`: ``json.dumps`` of a dict whose
#: first entry is the key, as since the first lock record).
RECORD_START = b'{"key": '
#: The fields a lock record has (:meth:`PublishLock._content`).
RECORD_FIELDS = frozenset(
    {"key", "pid", "host", "pid_space", "token", "beats", "heartbeat_at", "expiry_s"}
)


#: A field's name in a record's JSON text (``"name":``; a record's values hold no quote).
_FIELD = re.compile(rb'"([^"\\]*)"\s*:')


def _parse(content: bytes | None) -> dict | None:
    if not content:
        return None
    try:
        record = jsondoc.loads(content)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _describe(content: bytes | None) -> str:
    record = _parse(content)
    if not record:
        return "an unknown loader"
    return f"pid {record.get('pid')} on {record.get('host')}"
