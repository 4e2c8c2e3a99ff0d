"""The supervisor of the commands that memory-map source files (``convert``, ``run``): a
process that dies of a signal still ends with an error line, an exit code that says what
happened, and nothing of its own left behind.

Reading a memory-mapped file past an end that moved (the file truncated or rewritten in place
by another process while the loader reads it) is a bus error: the kernel sends ``SIGBUS``, which
no Python code can recover from (the faulting read is inside C code), and the process dies at
once with exit status 135, no error line, its publish lock and staging directory left. So the
process started as ``model-loader`` (or ``python -m loader``) forks before anything else (one
thread, nothing open but the standard streams), and:

* the **child** runs the command, exactly as an unsupervised process would: the same output,
  the same unwinding on SIGTERM and Ctrl-C, the same exit code. It records in a shared memory
  block (:mod:`loader.ledger`) each file it maps with its size at that moment, each publish
  lock it takes and the temporary directory of a conversion;
* the **parent** passes SIGTERM, SIGINT, SIGHUP, SIGQUIT and every other signal that would
  end it (SIGUSR1, SIGALRM, the real-time signals, ...: :data:`FORWARDED`) sent to it on
  to the child
  (those a terminal sends reach the child directly: both are in its foreground process group)
  and waits. A child that exits is answered with its exit code, unchanged. A child that dies of a
  signal the parent forwarded: the parent removes what the child left (below) and dies of that
  signal too (the status is what it was without a supervisor). A child that dies of any other
  signal: the parent removes what only the child
  would have removed, through the loader's own ownership-checked recovery (a lock held by a
  process that is gone is taken over, the key's abandoned staging directories removed, exactly
  what the next loader of the key does; the conversion's temporary directory, if it is still
  the very directory the child made), and prints an ``error:`` and a ``hint:`` line:

  - ``SIGBUS``: :class:`~loader.errors.SourceShrankError` naming the mapped files that are
    shorter now (:class:`~loader.errors.MappedReadError` when none is: an I/O error), exit 75:
    a rerun reads the source again, and a file left cut short is then refused by its header
    check (exit 2, named);
  - any other signal: :class:`~loader.errors.KilledError` naming it, exit 128 + its number
    (``SIGKILL``, 137: most often the OOM killer; the hint says so).

The child asks the kernel to kill it (SIGKILL) should the parent die first
(``PR_SET_PDEATHSIG``): ``kill -9`` of the loader stops its work at once, as it did before there
was a supervisor, and the next loader of the key removes what it left.

:func:`loader.cli.main` supervises only when it reads the process's own command line (no
``argv``: the console script and ``python -m loader``); ``main(argv)`` called in a process, as
tests and scripts do, runs the command in that process, unsupervised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from loader import ledger
from loader.errors import KilledError, LoaderError, MappedReadError, SourceShrankError, shown

#: The command modules whose processes map source files (:data:`loader.cli.COMMANDS`).
SUPERVISED = ("loader.cli.convert", "loader.cli.run")
#: The signals other than the stops whose default action ends a process (``signal(7)``), which
#: the loader gives no meaning: SIGUSR1 and SIGUSR2, SIGALRM (``timeout -s ALRM``), the timers'
#: and resource limits' signals, those of a fault sent with ``kill``, the real-time ones.
#: Sent to the supervisor, each killed it at once, the child then taken by
#: ``PR_SET_PDEATHSIG``, its publish lock and staging directory left to the next run.
_ENDING = ("SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGXCPU", "SIGIO", "SIGPWR",
           "SIGSYS", "SIGSTKFLT", "SIGTRAP", "SIGABRT", "SIGILL", "SIGFPE", "SIGSEGV", "SIGBUS")  # fmt: skip
#: Signals the parent passes on to the child: the stops (the child unwinds), and every other
#: signal that would end the parent (:data:`_ENDING`), which kills the child as it would an
#: unsupervised loader; the parent removes what the child left, then dies of it too.
FORWARDED = (
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
    *(getattr(signal, name) for name in _ENDING if hasattr(signal, name)),
    *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
)  # fmt: skip
_PR_SET_PDEATHSIG = 1
#: ``si_code`` of a signal the kernel sent (``include/uapi/asm-generic/siginfo.h``).
_SI_KERNEL = 0x80


def supervise() -> int | LoaderError | None:
    """Fork; in the child (or where forking is not possible): None, run the command here. In
    the parent, once the child is gone: its exit code, or the error that says how it died."""
    if not hasattr(os, "fork") or not hasattr(signal, "sigwaitinfo"):
        return None  # not Linux (macOS has no sigwaitinfo): unsupervised
    if threading.active_count() != 1:
        return None  # never fork with threads: a lock another thread held stays held
    block = ledger.open_shared()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: started closed (loader.cli refuses a closed stdout)
            with contextlib.suppress(OSError, ValueError):  # its reader gone: the child says
                stream.flush()
    parent = os.getpid()
    # Blocked from now on in the parent, which takes them with sigwaitinfo (a PID 1 of a
    # container gets them too: a blocked signal is never discarded).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, (*FORWARDED, signal.SIGCHLD))
    try:
        pid = os.fork()
    except OSError:
        ledger.stop()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return None  # no process to spare: run unsupervised, as before
    if pid == 0:
        _child(parent, mask)
        return None
    ledger.stop()
    status, received = _wait(pid)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    sig = os.WTERMSIG(status)
    if sig in received:  # the signal this process got: end as it would have ended unsupervised
        report_removed(clean_up(ledger.entries(block), pid))
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (sig,))  # dies here, unless it is PID 1
        return 128 + sig
    return died(sig, ledger.entries(block), pid, stopping=min(received, default=None))


def _wait(pid: int) -> tuple[int, set[int]]:
    """Wait for the child ``pid`` to end, passing on each signal of :data:`FORWARDED` sent to
    this process alone; its wait status and the signals this process received. A signal the
    kernel sent (``SI_KERNEL``: a terminal's Ctrl-C, Ctrl-\\ or hang-up, sent to the whole
    foreground process group) reached the child too: it is not sent twice."""
    received: set[int] = set()
    while True:
        info = signal.sigwaitinfo((*FORWARDED, signal.SIGCHLD))
        if info.si_signo == signal.SIGCHLD:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return status, received
            continue  # the child stopped or went on
        received.add(info.si_signo)
        if info.si_code != _SI_KERNEL:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, info.si_signo)


def _child(parent: int, mask: set[signal.Signals]) -> None:
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if os.getppid() != parent:  # the parent died before the request above: as it asks
        os.kill(os.getpid(), signal.SIGKILL)


def died(
    sig: int, recorded: ledger.Entries, pid: int, *, stopping: int | None = None
) -> LoaderError:
    """The error of a child ``pid`` killed by ``sig``, once what it left is removed
    (``stopping``: a signal this process passed on to it before)."""
    report_removed(clean_up(recorded, pid))
    if sig == signal.SIGBUS:
        return bus_error(recorded)
    return KilledError(sig, stopping=stopping)


def say(*lines: str) -> None:
    """Write ``lines`` to standard error, as far as it can be written: its reader gone (``2>&1 |
    head``), its terminal hung up or closed never changes the exit code the lines go with (the
    write's error, raised out of the command line's funnel, was exit 1)."""
    stream = sys.stderr
    if stream is None:  # closed (print would write to standard output)
        return
    with contextlib.suppress(OSError, ValueError):
        for line in lines:
            print(line, file=stream)
        stream.flush()


def report_removed(paths: list[Path]) -> None:
    say(*(f"removed {shown(path)} (left by the killed loader)" for path in paths))


def bus_error(recorded: ledger.Entries) -> MappedReadError:
    """SIGBUS: the mapped files that are shorter now than when they were mapped."""
    shrank: list[tuple[str, int, int]] = []
    seen: set[tuple[str, int, int]] = set()
    for entry in recorded.mapped:
        path, size = entry["path"], entry["size"]
        if (path, entry["dev"], entry["ino"]) in seen:
            continue
        seen.add((path, entry["dev"], entry["ino"]))
        try:
            now = os.stat(path)
        except OSError:
            continue  # gone: its pages were not cut (a deleted file stays readable while mapped)
        if (now.st_dev, now.st_ino) == (entry["dev"], entry["ino"]) and now.st_size < size:
            shrank.append((path, size, now.st_size))
    if shrank:
        return SourceShrankError(shrank, killed=True)
    named = sorted({shown(entry["path"]) for entry in recorded.mapped})
    if not named and not recorded.dropped:
        return MappedReadError(
            "The loader was killed by SIGBUS (a bus error) before it mapped any source file: "
            "a library's own mapped file failed to read, or another process sent the signal.",
            "Run the loader again; if it keeps failing, check the storage it reads and writes "
            "(the kernel log, the volume's events).",
        )
    more = " (and more not recorded)" if recorded.dropped else ""
    return MappedReadError(
        "The loader was killed by SIGBUS (a bus error) reading a memory-mapped file, and none "
        f"of the files it mapped is shorter now: {', '.join(named)}{more}. The storage failed "
        "to deliver a page (an I/O error), or a file was cut short and written again meanwhile."
    )


def clean_up(recorded: ledger.Entries, pid: int) -> list[Path]:
    """Remove what the dead child ``pid`` left that it alone would have removed; what was
    removed. A failure leaves it to the next run (logged)."""
    removed: list[Path] = []
    for entry in recorded.temporary:
        with _quietly("the temporary directory %s", entry["path"]):
            if _remove_temporary(entry, pid):
                removed.append(Path(entry["path"]))
    for entry in recorded.locks:
        with _quietly("what the loader of %s left", entry["key"]):
            removed += _clear_key(Path(entry["root"]), entry["key"], float(entry["expiry_s"]))
    return removed


@contextlib.contextmanager
def _quietly(what: str, name: object) -> Iterator[None]:
    try:
        yield
    except (OSError, LoaderError) as exc:
        say(f"could not remove {what % shown(name)} ({exc}); the next run does")


def _remove_temporary(entry: dict, pid: int) -> bool:
    """Remove a conversion's ``.<name>.partial-<pid>-<token>`` directory if it is still the
    very directory the child made (same device and inode, never through a link)."""
    from loader.fs import Dir

    path = Path(entry["path"])
    if not re.fullmatch(rf"\..+\.partial-{pid}-[0-9a-f]+", path.name):
        return False
    with Dir.open(path.parent) as parent:
        st = parent.lstat(path.name)
        if st is None or not stat.S_ISDIR(st.st_mode):
            return False
        if (st.st_dev, st.st_ino) != (entry["dev"], entry["ino"]):
            return False
        parent.remove_tree(path.name)
    return True


def _clear_key(root: Path, key: str, expiry_s: float) -> list[Path]:
    """What the next loader of ``key`` does first: take over the lock of the dead holder (a
    live one keeps it, and clears up itself), put back a replaced copy, remove abandoned staging
    directories, release."""
    from loader import fs
    from loader.repository import publish
    from loader.repository.lock import lock_path
    from loader.repository.prune import try_lock

    quiet = logging.getLogger("loader")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the take-over's warnings: this process says it in one line
    try:
        with fs.confined(root):
            held = lock_path(root, key)
            left = False  # whether a lock is there: ROOT's lock directory entered, never followed
            with contextlib.suppress(FileNotFoundError), fs.Dir.open(held.parent) as locks:
                left = locks.lstat(held.name) is not None
            lock = try_lock(root, key, expiry_s)
            if lock is None:
                return []
            try:
                publish.recover(root, key)
                removed = publish.clear_leftovers(root, key, idle_s=expiry_s)
            finally:
                lock.release()
            return [*removed, *([held] if left else [])]
    finally:
        quiet.setLevel(level)
