"""Reading other processes from ``/proc`` in tests, where any of them may exit between the
listing and the read: a process or thread gone meanwhile is skipped, never an error."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def command_lines() -> Iterator[tuple[int, list[bytes]]]:
    """Every process's pid and argv (NUL-separated ``cmdline``), those still there when read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile (ENOENT, ESRCH)
            continue
        yield int(entry.name), argv


def children(pid: int) -> list[int]:
    """The children of ``pid``, from each of its threads still there; [] once it is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    found = []
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` is a process still running: not gone, and not a zombie (dead, its exit
    status not yet collected: a child its parent killed and gave up waiting for is reaped by
    PID 1, or never where PID 1 does not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def signal_masks(pid: int) -> dict[int, int]:
    """The signal mask (``SigBlk``) of each thread of ``pid`` still there when read, by thread
    id; {} once the process is gone."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    masks = {}
    for tid in tids:
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        line = next(x for x in status.splitlines() if x.startswith("SigBlk"))
        masks[tid] = int(line.split()[1], 16)
    return masks
