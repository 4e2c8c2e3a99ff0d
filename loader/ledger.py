"""What this process maps and leaves behind while it works, written where the process that
supervises it (:mod:`loader.cli.supervise`) reads it after this one died of a signal.

A process killed by a signal runs no ``finally``: a source file truncated under its memory map
(``SIGBUS``), the kernel's OOM killer (``SIGKILL``). Its supervisor then needs to know which
files were mapped, and at what size, to name the one that shrank, and what this process had
made that only it would have removed: its publish locks (the key's leftovers go with them,
through the same recovery the next loader of the key runs) and the temporary directory of a
conversion.

The ledger is an anonymous shared memory block made by the supervisor before it forks
(:func:`open_shared`): the child appends one JSON line per event, the parent reads them once
the child is gone (:func:`entries`). Without a supervisor (the command run in-process, by a
test or a script) every ``note_*`` call does nothing.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

#: Bytes of the shared block: thousands of entries (a path is at most 4 KiB).
SIZE = 2**20
_HEADER = struct.Struct("<QQ")  # bytes used after the header, entries dropped for lack of room

_block: mmap.mmap | None = None
_lock = threading.Lock()


def open_shared() -> mmap.mmap:
    """A fresh shared block, which this process (and a child forked after) records into."""
    global _block
    _block = mmap.mmap(-1, SIZE)  # anonymous and MAP_SHARED: the fork's child writes to it
    _HEADER.pack_into(_block, 0, 0, 0)
    return _block


def stop() -> None:
    """Record nothing more in this process (the supervisor, once it forked)."""
    global _block
    _block = None


def active() -> bool:
    """Whether this process records (a supervisor reads what it records)."""
    return _block is not None


def _note(kind: str, **fields: object) -> None:
    block = _block
    if block is None:
        return
    line = json.dumps({"kind": kind, **fields}).encode() + b"\n"
    with _lock:
        used, dropped = _HEADER.unpack_from(block, 0)
        start = _HEADER.size + used
        if start + len(line) > SIZE:
            _HEADER.pack_into(block, 0, used, dropped + 1)
            return
        block[start : start + len(line)] = line  # the entry first, then the length that shows it
        _HEADER.pack_into(block, 0, used + len(line), dropped)


def note_mapped(path: Path | str, fd: int) -> None:
    """``path`` (open as ``fd``) is about to be memory-mapped at its present size."""
    if _block is None:
        return
    st = os.fstat(fd)
    _note("mapped", path=os.fspath(path), size=st.st_size, dev=st.st_dev, ino=st.st_ino)


def note_temporary(path: Path | str) -> None:
    """This process made the directory ``path``, which it alone removes when it stops."""
    if _block is None:
        return
    st = os.lstat(path)
    _note("temporary", path=os.fspath(path), dev=st.st_dev, ino=st.st_ino)


def note_lock(root: Path | str, key: str, expiry_s: float) -> None:
    """This process holds the publish lock of ``key`` under ``root``."""
    _note("lock", root=os.fspath(root), key=key, expiry_s=expiry_s)


@dataclass(frozen=True)
class Entries:
    """What a dead child recorded."""

    mapped: list[dict]
    temporary: list[dict]
    locks: list[dict]
    dropped: int


def entries(block: mmap.mmap) -> Entries:
    """The entries recorded in ``block``, by kind (a line that does not parse is skipped)."""
    used, dropped = _HEADER.unpack_from(block, 0)
    found: dict[str, list[dict]] = {"mapped": [], "temporary": [], "lock": []}
    for line in block[_HEADER.size : _HEADER.size + used].splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("kind") in found:
            found[entry["kind"]].append(entry)
    return Entries(found["mapped"], found["temporary"], found["lock"], dropped)
