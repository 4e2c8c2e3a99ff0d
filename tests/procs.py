"""Reading other processes from ``/proc`` in tests, where any of them may exit between the
listing and the read: a process or thread gone meanwhile is skipped, never an error."""

from __future__ import annotations

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
