"""Where the time goes, stage by stage: wall and CPU seconds accumulated per named stage.

Off unless :func:`enable` was called (``MODEL_LOADER_PROFILE=FILE``, read by the command
line): then ``with stages.stage("write", nbytes):`` adds the block's wall time
(``time.perf_counter``), the CPU time of the thread that ran it (``time.thread_time``), its
page faults (``getrusage(RUSAGE_THREAD)``: the fault-in of memory-mapped source pages), the
time it was runnable but queued for a CPU (``/proc/thread-self/schedstat``: a busy machine),
one call and ``nbytes`` to the stage's totals, and the totals are written to ``FILE`` as JSON
when the process exits. Wall minus CPU is time the thread spent waiting (on the disk, a page
fault read in from storage, a lock, the GIL, the network) or queued for a CPU. Off,
:func:`stage` returns one shared object whose ``__enter__`` and ``__exit__`` do nothing, so the
call sites cost next to nothing; the stages are coarse (one per chunk of megabytes, never per
element).

Several threads may be in the same stage at once: a stage's wall seconds are then the sum over
the threads, which can exceed the process's wall time (two writers writing for one second
count two seconds of ``write``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import stat
import sys
import threading
import time
from pathlib import Path

from loader import fs
from loader.errors import LoaderError, shown


class _Off:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()
_lock = threading.Lock()
#: stage -> [wall seconds, CPU seconds, calls, bytes, page faults, seconds queued for a CPU]
_totals: dict[str, list[float]] = {}
_enabled = False
_started_wall = 0.0
_started_cpu = 0.0


def _faults() -> int:
    """Page faults of the calling thread so far (minor and major: a page of a mapped file
    found in the page cache, or read from storage)."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_minflt + usage.ru_majflt


def _runqueue_wait() -> float:
    """Seconds the calling thread spent runnable but waiting for a CPU (the scheduler's
    statistics; 0 where the kernel keeps none)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class _Timed:
    __slots__ = ("cpu", "faults", "name", "nbytes", "queued", "wall")

    def __init__(self, name: str, nbytes: int) -> None:
        self.name, self.nbytes = name, nbytes

    def __enter__(self) -> None:
        self.faults = _faults()
        self.queued = _runqueue_wait()
        self.wall = time.perf_counter()
        self.cpu = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        wall, cpu = time.perf_counter() - self.wall, time.thread_time() - self.cpu
        queued = _runqueue_wait() - self.queued
        add(self.name, wall, cpu, self.nbytes, _faults() - self.faults, queued)


def stage(name: str, nbytes: int = 0) -> _Off | _Timed:
    """A context manager timing its block as ``name`` (when enabled; nothing otherwise)."""
    return _Timed(name, nbytes) if _enabled else _OFF


def enabled() -> bool:
    return _enabled


def add(
    name: str, wall: float, cpu: float = 0.0, nbytes: int = 0, faults: int = 0, queued: float = 0.0
) -> None:
    """Add a measured interval to ``name``'s totals (when enabled)."""
    if not _enabled:
        return
    with _lock:
        row = _totals.setdefault(name, [0.0, 0.0, 0, 0, 0, 0.0])
        row[0] += wall
        row[1] += cpu
        row[2] += 1
        row[3] += nbytes
        row[4] += faults
        row[5] += queued


def snapshot() -> dict:
    """The totals so far, with the process's own wall and CPU seconds since :func:`enable`."""
    with _lock:
        rows = {
            name: {
                "wall_s": w,
                "cpu_s": c,
                "calls": int(n),
                "bytes": int(b),
                "faults": int(f),
                "queued_s": q,
            }
            for name, (w, c, n, b, f, q) in _totals.items()
        }
    return {
        "process": {
            "wall_s": time.perf_counter() - _started_wall,
            "cpu_s": time.process_time() - _started_cpu,
        },
        "stages": rows,
    }


def enable(path: Path | str | None = None) -> None:
    """Start accumulating; with ``path``, write :func:`snapshot` there (JSON) at exit.

    ``path`` is the user's (``MODEL_LOADER_PROFILE``): it must be a file name in an existing
    directory, where nothing but a regular file stands (that one is replaced), else a
    :class:`~loader.errors.LoaderError` before any work. At exit the totals are written to a
    new file beside it and renamed over it through :mod:`loader.fs` (a link, FIFO, device or
    directory that appeared there meanwhile stays); a failure then is one warning line, and
    the temporary file is removed."""
    global _enabled, _started_wall, _started_cpu
    target = None if path is None else _profile_target(path)
    _started_wall, _started_cpu = time.perf_counter(), time.process_time()
    _enabled = True
    if target is not None:
        atexit.register(_dump, target)


_PROFILE_FIX = (
    "Set MODEL_LOADER_PROFILE to the name of a file in an existing directory (a file there is "
    "replaced), or unset it."
)


def _profile_target(path: Path | str) -> Path:
    """The absolute path ``MODEL_LOADER_PROFILE`` names, checked (see :func:`enable`)."""
    try:
        target = Path(path).absolute()
        found = os.lstat(target) if os.path.lexists(target) else None
        parent = os.stat(target.parent)
    except (OSError, ValueError) as exc:
        raise LoaderError(
            f"MODEL_LOADER_PROFILE={shown(path)} names no file the profile can be written to "
            f"({exc}).",
            _PROFILE_FIX,
        ) from None
    if not target.name or not stat.S_ISDIR(parent.st_mode):
        raise LoaderError(
            f"MODEL_LOADER_PROFILE={shown(path)} names no file in a directory.", _PROFILE_FIX
        )
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise LoaderError(
            f"MODEL_LOADER_PROFILE={shown(path)} names {fs.kind_of(found.st_mode)}: the profile "
            "is written as a regular file, and the loader replaces nothing else.",
            _PROFILE_FIX,
        )
    return target


def _dump(target: Path) -> None:
    """Write :func:`snapshot` to ``target`` (see :func:`enable`)."""
    data = (json.dumps(snapshot(), indent=1) + "\n").encode()
    tmp = f".{target.name}.{os.getpid()}"
    try:
        with fs.Dir.open(target.parent) as where:
            where.write(tmp, data, sync=False)
            try:
                where.rename(tmp, where, target.name, how="replace")
            except BaseException:
                where.unlink(tmp, missing_ok=True)
                raise
    except (OSError, LoaderError) as exc:
        with contextlib.suppress(OSError):
            print(
                f"warning: the stage profile was not written to {shown(target)} "
                f"(MODEL_LOADER_PROFILE): {exc}",
                file=sys.stderr,
            )


def disable() -> None:
    """Stop accumulating and forget the totals (tests)."""
    global _enabled
    _enabled = False
    with _lock:
        _totals.clear()
