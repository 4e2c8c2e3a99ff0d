"""Helpers every source backend shares: temporary names, atomic placement, checksums and the
free-disk-space check (retrying is :mod:`loader.sources.failures`).

A download is written to ``DEST/.partial/<relative path>.<owner>...`` and renamed to
``DEST/<relative path>`` only after it was verified, so a complete-looking file under ``DEST``
is always a verified one and a killed download leaves only files under ``.partial/``.

Partial names carry their owner (:func:`loader.fs.owner`: pid and host), so two loaders never
write the same partial file: not even a loader that stalled, lost its publish lock and still
has downloads landing while its successor fetches the same key. What a gone owner of this host
left is taken over (a rerun resumes it: :func:`adopt`) or removed (:func:`clear_partials`);
what a live owner or another host's writes is left alone, and so is what names no owner
(the loader did not write it). Each fetch removes only its own partial files at the end
(:func:`remove_own_partials`).

CRC32C: Cloud Storage records each object's CRC32C; a download computes the CRC32C of every
byte-range slice from the bytes as they arrive, and :func:`crc32c_combine` joins the slices'
values (in any order of arrival) into the object's, so no file is read back to verify it.

Nothing is written through a symbolic link inside DEST: :func:`safe_path` refuses a path whose
directories under DEST include a link (or a file), so a DEST holding a link to elsewhere cannot
make a download land outside it.
"""

from __future__ import annotations

import base64
import errno
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TypeVar

from loader import fs
from loader.errors import (
    DirectoryRemovedError,
    InsufficientDiskSpaceError,
    InTheWayError,
    SourceError,
    shown,
)
from loader.fs import Dir
from loader.progress import human_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Directory under DEST that holds downloads in progress.
PARTIAL_DIR = ".partial"
#: Bytes kept free beyond what a download needs (file-system metadata, logs).
DISK_MARGIN = 64 * 1024 * 1024
_CHUNK = 8 * 1024 * 1024
#: What removing a directory a walk emptied may meet when another process works beside it: a
#: file put into it (not empty), or the directory removed already.
_EMPTIED_MEANWHILE = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT)


#: A download's answer that delivers fewer than :data:`STALL_BYTES` in :data:`STALL_S` seconds
#: has stalled: a server or proxy trickling a byte now and then, each within the read timeout
#: (which is per read), would hold the download for days. It is dropped and retried as a cut
#: connection (:class:`Stalled`), within the retry deadline.
STALL_S = 60.0
STALL_BYTES = 64 * 1024


class Stalled(ConnectionError):
    """An answer slowed below :data:`STALL_BYTES` per :data:`STALL_S` seconds: a transient
    failure, retried (the connection errors' class)."""


class Pace:
    """Raises :class:`Stalled` from :meth:`arrived` once a span of :data:`STALL_S` seconds
    delivered fewer than :data:`STALL_BYTES` (each span starts where the last one ended)."""

    __slots__ = ("got", "since", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self.since, self.got = time.monotonic(), 0

    def arrived(self, n: int) -> None:
        self.got += n
        elapsed = time.monotonic() - self.since
        if elapsed < STALL_S:
            return
        if self.got < STALL_BYTES:
            raise Stalled(
                f"{self.what} slowed to {self.got} bytes in {elapsed:.0f} s (less than "
                f"{STALL_BYTES} bytes in {STALL_S:.0f} s)"
            )
        self.since, self.got = time.monotonic(), 0


#: The marker of a DEST the loader keeps a record in (:func:`mark_dest`).
FETCH_MARKER = fs.MARKER_PREFIX + "fetch"


def mark_dest(d: Dir) -> None:
    """Make DEST (open as ``d``) the top of a tree where the loader records every file and
    directory it creates (:meth:`loader.fs.Dir.mark_in_place`), before it writes anything
    there: a file of DEST's that no fetch wrote (a user's own ``config.json``) is never
    replaced, even when the source's file of that name differs. A run's download directory is
    such a tree already. Called once the fetch knows it will write (after its checks: a fetch
    refused before that leaves DEST as it was)."""
    d.mark_in_place(FETCH_MARKER, "model-loader fetch")


def refuse_what_is_in_the_way(top: Dir, rels: Iterable[str]) -> None:
    """Before a fetch writes anything but its record: every name it will put a file at
    (``rels``, below DEST open as ``top``, marked: :func:`mark_dest`) is free or holds a file
    a fetch wrote. What else stands there (a user's file whose bytes differ from the
    source's, a link, a directory, a file where a directory belongs) would stop the fetch only
    once that file was downloaded, or copied: an :class:`InTheWayError` naming them all, now."""
    found = [what for rel in rels if (what := _in_the_way(top, rel)) is not None]
    if found:
        raise InTheWayError(found, top.path)


def _in_the_way(top: Dir, rel: str) -> str | None:
    """What stands where a fetch would put ``rel`` below ``top`` (or one of its
    directories), named for a message; None when nothing does."""
    *levels, name = _names(rel)
    d = top.enter(())
    try:
        for level in levels:
            found = d.lstat(level)
            if found is None:
                return None
            if not stat.S_ISDIR(found.st_mode):
                return f"{shown(d.path / level)} ({fs.kind_of(found.st_mode)})"
            d = d.walk_in((level,))
        if d.replaceable(name):
            return None
        return f"{shown(d.path / name)} ({d.kind(name)})"
    finally:
        d.close()


#: How many times a step that creates a partial file is tried when another fetch into the same
#: DEST removed the partial directory it had entered (that fetch found it empty: this one had
#: not created its file there yet).
PARTIAL_TRIES = 3


def beside_other_fetches(dest: Path, step: Callable[[], T]) -> T:
    """``step()`` (which creates a partial file under ``dest``'s partial directory), tried
    again when a directory under ``.partial`` it had entered was removed meanwhile: another
    fetch into the same DEST removes what it found empty there when it is done, which is no
    failure of this one. A directory removed elsewhere is the error it is."""
    partials = Path(dest) / PARTIAL_DIR
    for attempt in range(1, PARTIAL_TRIES + 1):
        try:
            return step()
        except DirectoryRemovedError as exc:
            if attempt == PARTIAL_TRIES or not (
                exc.directory == partials or partials in exc.directory.parents
            ):
                raise
            log.info("%s was removed by another fetch meanwhile: trying again", exc.directory)
    raise AssertionError("unreachable")


def safe_path(dest: Path, relpath: str) -> Path:
    """``dest / relpath`` with its directories created, each a real directory (no symbolic link,
    no file in the way): a :class:`SourceError` otherwise."""
    parts = _names(relpath)
    with _enter(dest, relpath, parts[:-1]):
        pass
    return Path(dest).joinpath(*parts)


def enter_parent(dest: Path, path: Path) -> Dir:
    """The directory holding ``path`` (a path below ``dest``), open: entered one name at a
    time from ``dest`` as :func:`safe_path` makes it (a link or a file on the way is a
    :class:`SourceError`)."""
    rel = Path(path).relative_to(dest)
    return _enter(dest, rel, _names(rel)[:-1])


def _names(relpath: str | Path) -> tuple[str, ...]:
    """The names of a path relative to DEST (one name each: no ``..``, no ``/``)."""
    parts = Path(relpath).parts
    for part in parts:
        if not fs.is_name(part):
            raise SourceError(f"{shown(relpath)} is not a path below the destination.")
    return parts


def _enter(dest: Path, relpath: str | Path, parts: tuple[str, ...]) -> Dir:
    """The directory ``parts`` below ``dest``, open: entered one name at a time from ``dest``
    (the user's path, followed as given; below it never through a link), each level created
    if absent; a link or a file on the way is a :class:`SourceError` naming it."""
    d = Dir.open(dest)
    try:
        for part in parts:
            found = d.lstat(part)
            if found is not None and not stat.S_ISDIR(found.st_mode):
                _not_a_directory(dest, relpath, d.path / part, found.st_mode)
            if found is None:
                try:
                    d.mkdir(part)
                except FileExistsError:
                    pass
                except NotADirectoryError as exc:
                    raise SourceError(f"Cannot create {d.path / part}: {exc.strerror}.") from exc
            following = d.sub(part)
            d.close()
            d = following
    except BaseException:
        d.close()
        raise
    return d


def _not_a_directory(dest: Path, relpath: str | Path, path: Path, mode: int) -> None:
    what = fs.kind_of(mode)
    raise SourceError(
        f"{shown(path)} is {what}, so {shown(relpath)} cannot be written under "
        f"{shown(dest)}: the loader writes only into real directories under the "
        "destination.",
        f"Remove {shown(path)} or choose another destination directory.",
    )


def partial_path(dest: Path, relpath: str) -> Path:
    """A unique temporary path for ``relpath`` under ``dest``'s partial directory, named after
    this process."""
    return safe_path(dest, f"{PARTIAL_DIR}/{relpath}.{fs.owner()}.{secrets.token_hex(4)}")


def own_partial(dest: Path, relpath: str) -> Path:
    """``DEST/.partial/<relpath>.<owner>``: this process's partial file (or directory) for
    ``relpath``, its directories created."""
    return safe_path(dest, f"{PARTIAL_DIR}/{relpath}.{fs.owner()}")


def adopt(ours: Path, *, companions: tuple[str, ...] = ()) -> bool:
    """Take over the partial download a gone owner of this host left for the same name as
    ``ours`` (``<name>.<their owner>`` beside it), with its ``companions`` (suffixes of
    files that go with it, such as a journal): a rerun resumes it. A live owner's, or another
    host's, is left alone. True if something was taken over."""
    with Dir.open(ours.parent) as d:
        return adopt_in(d, ours.name, companions=companions)


def adopt_in(d: Dir, ours: str, *, companions: tuple[str, ...] = ()) -> bool:
    """:func:`adopt` relative to the open directory ``d``: ``ours`` is this process's name
    there (``<name>.<owner>``)."""
    if d.lstat(ours) is not None:
        return False
    stem = ours[: -len(fs.owner())]
    for name in d.names():
        tag = name[len(stem) :]
        if not name.startswith(stem) or fs.owner_in(tag) != tag or not fs.owner_gone(tag):
            continue
        if any(
            d.lstat(n) is not None and not d.owns(n)
            for n in (name, *(name + x for x in companions))
        ):
            # A link, a FIFO, or what the record of DEST does not name (a user's, an earlier
            # loader's that kept no record): no partial download of a fetch's; it stays as it is.
            continue
        d.rename(name, d, ours, how="replace")
        for suffix in companions:
            if d.lstat(name + suffix) is not None:
                d.rename(name + suffix, d, ours + suffix, how="replace")
        log.info("resuming the partial download %s of a stopped run", d.path / name)
        return True
    return False


def _partials(d: Dir, keep: object, foreign: list[str] | None = None, depth: int = 0) -> bool:
    """Remove the entries under ``d`` that ``keep(owner tag or None)`` refuses, then the empty
    directories; whether ``d`` is empty now. ``foreign`` collects the entries kept that name
    no owner (relative to the directory first called). A directory deeper than a walk goes
    (:data:`loader.fs.MAX_TREE_DEPTH`) is kept as it is, never entered."""
    empty = True
    for name in d.names():
        tag = fs.owner_in(name)
        if tag is None and d.is_dir(name) and depth >= fs.MAX_TREE_DEPTH:
            if foreign is not None:
                foreign.append(name)
            empty = False
        elif tag is None and d.is_dir(name):
            inner: list[str] | None = None if foreign is None else []
            with d.sub(name) as sub:
                if _partials(sub, keep, inner, depth + 1) and _rmdir_emptied(d, name):
                    continue
            if foreign is not None and inner is not None:
                foreign.extend(f"{name}/{n}" for n in inner)
            empty = False
        elif keep(tag):  # type: ignore[operator]
            if tag is None and foreign is not None:
                foreign.append(name)
            empty = False
        elif d.remove_tree(name):  # a link or FIFO at a gone owner's name: someone else's, kept
            empty = False
    return empty


def _rmdir_emptied(d: Dir, name: str) -> bool:
    """Remove the directory ``name`` of ``d`` that a walk just emptied; whether it is gone.
    Another fetch into the same DEST may put its partial file there meanwhile, or remove the
    directory first: neither is a failure (what it put there stays, with the directory)."""
    try:
        d.rmdir(name)
    except OSError as exc:
        if isinstance(exc, DirectoryRemovedError) or exc.errno not in _EMPTIED_MEANWHILE:
            raise
        return exc.errno == errno.ENOENT
    return d.lstat(name) is None


def clear_partials(dest: Path) -> None:
    """Remove what stopped runs of this loader left under ``dest``'s partial directory: the
    entries of gone owners of this host. Everything else stays: a live owner's, another
    host's, and whatever names no owner (this loader did not write it: a warning names how
    many). A ``.partial`` that is not a directory (a file, a link) is left as it is; the first
    download into it then fails with a message saying to remove it."""
    try:
        d = Dir.open(dest)
    except FileNotFoundError:
        return
    with d:
        if not d.is_dir(PARTIAL_DIR):
            return
        foreign: list[str] = []

        def keep(tag: str | None) -> bool:
            return tag is None or not fs.owner_gone(tag)

        with d.sub(PARTIAL_DIR) as sub:
            empty = _partials(sub, keep, foreign)
        if empty:
            _rmdir_emptied(d, PARTIAL_DIR)
        elif foreign:
            log.warning(
                "%s holds %d entr%s this loader did not write (%s), left in place: remove "
                "what is not needed",
                d.path / PARTIAL_DIR, len(foreign), "y" if len(foreign) == 1 else "ies",
                ", ".join(shown(n) for n in foreign[:3]) + (", ..." if len(foreign) > 3 else ""),
            )  # fmt: skip


def remove_own_partials(dest: Path) -> None:
    """Remove this process's partial files under ``dest`` (and ``.partial`` once empty);
    what other owners write there stays."""
    try:
        d = Dir.open(dest)
    except FileNotFoundError:
        return
    with d:
        remove_own_partials_in(d)


def remove_own_partials_in(d: Dir) -> None:
    """:func:`remove_own_partials` of the open destination directory ``d``."""
    if not d.is_dir(PARTIAL_DIR):
        return
    ours = fs.owner()
    with d.sub(PARTIAL_DIR) as sub:
        empty = _partials(sub, lambda tag: tag != ours)
    if empty:
        _rmdir_emptied(d, PARTIAL_DIR)


def place(tmp: Path, final: Path, *, dest: Path | None = None, durable: bool = True) -> None:
    """Move a verified temporary file to its final name atomically (same file system); with
    ``dest``, ``final``'s directories under it must be real directories (:func:`safe_path`).

    ``durable``: fsync the file first, so that a file under its final name survives a power
    loss. A file its reader deletes soon after (:attr:`ArrivalHooks.transient
    <loader.sources.ArrivalHooks>`) is not fsynced: if it is deleted before the kernel writes it
    back, it never costs a disk write; after a crash the next run finds it damaged (its checksum)
    or missing, and downloads it again.
    """
    if dest is None:
        source = Dir.open(tmp.parent)
    else:
        source = _enter(dest, tmp.relative_to(dest), _names(tmp.relative_to(dest))[:-1])
    try:
        if dest is None:
            target = Dir.open(final.parent, create=True)
        else:
            target = _enter(dest, final.relative_to(dest), _names(final.relative_to(dest))[:-1])
    except BaseException:
        source.close()
        raise
    with source, target:
        if durable:
            source.fsync_file(tmp.name)
        source.rename(tmp.name, target, final.name, how="replace")


@contextmanager
def temporary_download(dest: Path, relpath: str) -> Iterator[Path]:
    """Yield a temporary path for ``relpath``; it is removed if the block raises."""
    tmp = partial_path(dest, relpath)
    try:
        yield tmp
    except BaseException:
        rel = tmp.relative_to(dest)
        with _enter(dest, rel, _names(rel)[:-1]) as d:
            d.unlink(tmp.name, missing_ok=True)
        raise


def crc32c_text(value: int) -> str:
    """A CRC32C as Cloud Storage writes it: base64 of the big-endian 32-bit value."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc32c_of(fh: BinaryIO, start: int = 0, length: int | None = None) -> int:
    """The CRC32C of ``length`` bytes of the open file ``fh`` from ``start`` (to its end when
    None)."""
    import google_crc32c

    crc = 0
    fh.seek(start)
    left = length
    while left is None or left > 0:
        chunk = fh.read(_CHUNK if left is None else min(_CHUNK, left))
        if not chunk:
            break
        crc = google_crc32c.extend(crc, chunk)
        left = None if left is None else left - len(chunk)
    return crc


#: The CRC-32C (Castagnoli) polynomial without its x^32 term, bit-reversed: CRC32C keeps its
#: remainders with x^0 in the highest bit, and so do the helpers below.
_CRC32C_POLY = 0x82F63B78
_X0 = 1 << 31  # the polynomial 1 in that order


def _times(a: int, b: int) -> int:
    """a x b modulo the CRC-32C polynomial (both bit-reversed remainders)."""
    product = 0
    for bit in range(31, -1, -1):  # a's terms x^0 .. x^31
        if a >> bit & 1:
            product ^= b
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1  # b x x
    return product


#: x^(2^k) modulo the polynomial, k = 0 .. 63.
_X_TO_2_TO_THE: list[int] = [_X0 >> 1]
for _ in range(63):
    _X_TO_2_TO_THE.append(_times(_X_TO_2_TO_THE[-1], _X_TO_2_TO_THE[-1]))


def crc32c_combine(first: int, second: int, second_length: int) -> int:
    """The CRC32C of the bytes ``A + B`` from ``first`` = CRC32C(A), ``second`` = CRC32C(B) and
    ``second_length`` = len(B): A's remainder shifted past B's bits (times x^(8 len(B))),
    plus B's. The initial and final inversions of CRC32C cancel out of the sum."""
    if second_length < 0 or second_length >= 1 << 60:
        raise ValueError(f"a length of {second_length} bytes is out of range")
    shift, k, n = _X0, 3, second_length  # x^(8n) from the bits of n: x^(2^(k+3)) per bit k
    while n:
        if n & 1:
            shift = _times(_X_TO_2_TO_THE[k], shift)
        n >>= 1
        k += 1
    return _times(shift, first) ^ second


def md5_of(fh: BinaryIO) -> str:
    """The MD5 of the open file ``fh`` (read from its current offset) as Cloud Storage writes
    it: base64 of the 16-byte digest."""
    import hashlib

    digest = hashlib.md5(usedforsecurity=False)
    while chunk := fh.read(_CHUNK):
        digest.update(chunk)
    return base64.b64encode(digest.digest()).decode("ascii")


def ensure_disk_space(dest: Path, needed: int, *, what: str, directory: Dir | None = None) -> None:
    """Raise :class:`InsufficientDiskSpaceError` unless ``needed`` bytes fit under ``dest``
    (``directory``: ``dest`` open already; else the deepest level of ``dest`` there, looked up
    through descriptors, :meth:`~loader.fs.Dir.deepest`): asked through its descriptor."""
    if directory is not None:
        found = os.fstatvfs(directory.fd)
    else:
        level, _ = Dir.deepest(dest)
        with level:
            found = os.fstatvfs(level.fd)
    free = found.f_bavail * found.f_frsize
    if needed + DISK_MARGIN > free:
        raise InsufficientDiskSpaceError(
            f"Not enough free disk space under {dest} for {what}: need {human_bytes(needed)} "
            f"(+{human_bytes(DISK_MARGIN)} margin), {human_bytes(free)} free.",
        )
    log.debug("disk space for %s: need %s, %s free", what, human_bytes(needed), human_bytes(free))
