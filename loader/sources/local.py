"""Local checkpoints: ``file:///abs/path`` and plain paths.

A local directory is used in place: :func:`fetch_source` checks that it exists and is a
directory and returns it without copying (``dest`` is unused). With ``copy=True`` its files are
copied under ``dest`` (each to a temporary name, then renamed), skipping files already there
with the same size and content.

A symbolic link inside the source that leads out of it is refused (a
:class:`~loader.errors.SourceError` naming it): the loader never reads, copies or publishes a
file from outside the directory it was pointed at. Links within the source are followed, and
so are the links of a Hugging Face cache snapshot (``.../models--ORG--NAME/snapshots/<commit>``,
what ``hf download`` and ``snapshot_download`` write) into that cache entry's own ``blobs/``.

The source is the user's, and only read: it is taken by path, as the user named it (links
within it followed, above). What a copy writes below ``dest`` is the loader's: ``dest`` is
opened once and every file there is reached from it one name at a time, never through a link
(:class:`loader.fs.Dir`; its directories and temporary names: :mod:`loader.sources.transfer`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from loader import digest, fs
from loader.errors import (
    NotOursError,
    SourceError,
    SourceNotFoundError,
    SpecialFileError,
    TransientSourceError,
    shown,
)
from loader.fs import Dir
from loader.progress import byte_progress
from loader.sources import FetchOptions, FetchResult, SourceURI
from loader.sources.fingerprint import Fingerprint
from loader.sources.names import colliding
from loader.sources.transfer import (
    beside_other_fetches,
    clear_partials,
    ensure_disk_space,
    enter_parent,
    mark_dest,
    place,
    refuse_what_is_in_the_way,
    remove_own_partials,
    temporary_download,
)
from loader.waits import map_in_steps

log = logging.getLogger(__name__)

#: Bytes of a source file and its copy compared at a time.
_COMPARE_CHUNK = 8 * 2**20


#: Names of a Hugging Face cache entry's folder (``<kind>--<org>--<name>``).
_HF_CACHE_ENTRY = re.compile(r"^(models|datasets|spaces)--.+")


def link_boundaries(root: Path) -> list[Path]:
    """Where symbolic links under ``root`` may lead: ``root`` itself, and for a Hugging Face
    cache snapshot the ``blobs/`` folder of its own cache entry."""
    real_root = root.resolve()
    allowed = [real_root]
    snapshots = real_root.parent
    entry = snapshots.parent
    if snapshots.name == "snapshots" and _HF_CACHE_ENTRY.match(entry.name):
        allowed.append(entry / "blobs")
    return allowed


def list_files(root: Path) -> list[str]:
    """Regular files under ``root`` as sorted POSIX relative paths, hidden entries excluded.

    Raises :class:`SourceError` for a symbolic link that leads outside ``root`` (or, for a
    Hugging Face cache snapshot, outside its cache entry's ``blobs/``).
    """
    allowed = link_boundaries(root)
    files = []
    for path in _entries(root):
        rel = path.relative_to(root)
        if path.is_symlink():
            try:
                target = path.resolve(strict=True)
            except (OSError, RuntimeError) as exc:  # a loop, a dangling link
                raise SourceError(
                    f"{shown(path)} in the local source is a symbolic link that leads nowhere "
                    f"({type(exc).__name__}: a loop or a missing target).",
                    "Replace the link with the file itself, or remove it.",
                ) from None
            if not any(target.is_relative_to(place) for place in allowed):
                raise SourceError(
                    f"{shown(path)} in the local source is a symbolic link to {shown(target)}, "
                    "outside the "
                    "source directory; the loader does not follow links out of a source.",
                    "Replace the link with the file itself (cp --dereference), or point the "
                    "loader at a directory that holds the files.",
                )
        if path.is_file():
            files.append(rel.as_posix())
        elif not path.is_dir():
            raise SpecialFileError(path, "a FIFO, device or socket")
    return sorted(files)


def _entries(root: Path) -> Iterator[Path]:
    """Every entry under ``root`` not hidden and in no hidden directory, one directory at a
    time (no recursion), never entering a link. A directory nested deeper than
    :data:`loader.fs.MAX_NAME_LEVELS` below ``root`` is a :class:`SourceError`: no checkpoint is
    laid out that deep, and a chain of them would outgrow any walk."""
    todo = [(root, 0)]
    while todo:
        directory, depth = todo.pop()
        with os.scandir(directory) as entries:
            found = [Path(entry.path) for entry in entries if not entry.name.startswith(".")]
        for path in found:
            yield path
            if path.is_dir() and not path.is_symlink():
                if depth + 1 >= fs.MAX_NAME_LEVELS:
                    raise SourceError(
                        f"{shown(path)} in the local source is a directory nested "
                        f"{depth + 1} levels deep; the loader reads no checkpoint file nested "
                        f"more than {fs.MAX_NAME_LEVELS} levels deep.",
                        "Point the loader at the checkpoint's own directory, or move the "
                        "deeply nested directories out of it.",
                    )
                todo.append((path, depth + 1))


def _algorithm(recorded: Fingerprint | None) -> str:
    """The digest a fingerprint compared with ``recorded`` must use: the one it used (sha256
    for fingerprints of earlier loaders), else :data:`loader.digest.DEFAULT`."""
    if recorded is not None:
        for info in recorded.files.values():
            for name in digest.ALGORITHMS:
                if name in info:
                    return name
    return digest.DEFAULT


def fingerprint_source(
    uri: SourceURI, options: FetchOptions, *, recorded: Fingerprint | None = None
) -> Fingerprint:
    """Every file's size and digest (BLAKE3, or sha256 to compare with a fingerprint of an
    earlier loader: :func:`_algorithm`); a digest ``recorded`` for a file whose stat stamp
    (mtime, ctime, inode, size) is unchanged is reused instead of reading the file again."""
    algorithm = _algorithm(recorded)
    root = _checked_root(uri)
    files = list_files(root)
    stamps, sizes = {}, {}
    for rel in files:
        st = (root / rel).stat()
        stamps[rel] = [st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        sizes[rel] = st.st_size
    known: dict[str, str] = {}
    if recorded is not None:
        for rel in files:
            info = recorded.files.get(rel, {})
            if recorded.stamps.get(rel) == stamps[rel] and info.get("size") == sizes[rel]:
                known[rel] = str(info.get(algorithm))
    todo = [rel for rel in files if rel not in known]
    if todo:
        log.info("hashing %s file(s) of %s to fingerprint it", len(todo), root)
        with ThreadPoolExecutor(max_workers=options.workers or min(4, os.cpu_count() or 1)) as pool:
            digests = map_in_steps(pool, lambda rel: digest.of_file(root / rel, algorithm), todo)
            known.update(zip(todo, digests, strict=True))
    return Fingerprint(
        uri=uri.canonical,
        files={rel: {"size": sizes[rel], algorithm: known[rel]} for rel in files},
        stamps=stamps,
    )


def _checked_root(uri: SourceURI) -> Path:
    root = Path(uri.location)
    if not root.exists() and root.is_symlink():
        raise SourceNotFoundError(
            f"Local source {shown(root)} (from {uri.raw!r}) is a symbolic link that leads "
            "nowhere (a loop or a missing target).",
            "Point the loader at the checkpoint directory itself, or fix the link.",
        )
    if not root.exists():
        raise SourceNotFoundError(
            f"Local source {root} (from {uri.raw!r}) does not exist.",
            "Check the path; it must be a checkpoint directory readable by the loader.",
        )
    if not root.is_dir():
        raise SourceNotFoundError(
            f"Local source {root} (from {uri.raw!r}) is not a directory.",
            "Point the loader at the checkpoint directory (the one holding config.json), "
            "not at a single file.",
        )
    return root


def fetch_source(uri: SourceURI, dest: Path | None, options: FetchOptions) -> FetchResult:
    root = _checked_root(uri)
    files = list_files(root)
    total = sum((root / f).stat().st_size for f in files)
    if not options.copy:
        log.info("using local checkpoint %s in place (%s files)", root, len(files))
        return FetchResult(path=root, revision=None, files=files, bytes=total)
    if dest is None:
        raise SourceError(
            "Copying a local source needs a destination directory.",
            "Pass a destination (model-loader fetch URI DEST).",
        )
    return _copy(root, dest.absolute(), files, total, options)


def _copy(
    root: Path, dest: Path, files: list[str], total: int, options: FetchOptions
) -> FetchResult:
    if _is_source(dest, root):
        return FetchResult(path=root, revision=None, files=files, bytes=total)
    found = colliding(files)
    if found is not None:
        raise SourceError(
            f"{shown(root / found[0])} and {shown(root / found[1])} in the local source cannot "
            "both be copied: they differ only in case or in how their letters are written (or "
            "one would be a file where the other's directory goes), and some file systems keep "
            "one file for both; nothing was copied.",
            "Rename or remove one of them in the source, then copy it again.",
        )
    with Dir.open(dest, create=True) as d:
        clear_partials(dest)
        todo = [f for f in files if not _same(root / f, d, f)]
    needed = sum((root / f).stat().st_size for f in todo)
    if options.check_disk_space:
        ensure_disk_space(dest, needed, what=f"copying {root}")
    if todo:
        with Dir.open(dest) as d:
            mark_dest(d)  # before its first copy: what it creates is recorded
            refuse_what_is_in_the_way(d, todo)
    log.info("copying %s of %s files from %s to %s", len(todo), len(files), root, dest)
    with byte_progress(f"copy {root.name}", needed) as progress:
        for rel in todo:
            size = beside_other_fetches(dest, lambda rel=rel: _copy_one(root, dest, rel))
            progress.update(size)
    remove_own_partials(dest)
    return FetchResult(path=dest, revision=None, files=files, bytes=total, downloaded_bytes=needed)


def _copy_one(root: Path, dest: Path, rel: str) -> int:
    """Copy ``root/rel`` to ``dest/rel`` through a partial file, verified; its size."""
    before = fs.stamp(fs.stat_path(root / rel))
    with temporary_download(dest, rel) as tmp:
        with enter_parent(dest, tmp) as d:
            d.copy_in(tmp.name, root / rel)
            with fs.open_read(root / rel) as src, d.open_read(tmp.name) as copy:
                size = _equal(src, copy)
                changed = fs.stamp(os.fstat(src.fileno())) != before
        if size is None and changed:  # written to (or replaced) meanwhile: not the disks
            raise TransientSourceError(
                f"{shown(root / rel)} changed while it was copied (the copy was discarded).",
                "Run the loader again once nothing writes to the source.",
            )
        if size is None:
            raise SourceError(
                f"Copy of {root / rel} differs from its source.",
                "Check the disks (the copy was discarded) and run again.",
            )
        place(tmp, dest / rel, dest=dest)
    return size


def _is_source(dest: Path, root: Path) -> bool:
    """Whether DEST is the source directory itself (a copy onto itself has nothing to do):
    DEST looked up through descriptors (below a confined tree one name at a time, a link there
    a :class:`NotOursError`, never followed), the source followed as the user gave it."""
    level, missing = Dir.deepest(dest)
    with level:
        if missing:
            return False
        here = level.stat()
    there = fs.stat_path(root)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _same(src: Path, d: Dir, rel: str) -> bool:
    """Whether ``rel`` below DEST (open as ``d``: entered one name at a time, never through a
    link) is a regular file holding what the source file ``src`` holds."""
    *levels, name = rel.split("/")
    try:
        with d.enter(levels) as where:
            if where.regular_size(name) != src.stat().st_size:
                return False
            with fs.open_read(src) as fh, where.open_read(name) as copy:
                return _equal(fh, copy) is not None
    except (FileNotFoundError, NotADirectoryError, NotOursError):
        return False


def _equal(a: BinaryIO, b: BinaryIO) -> int | None:
    """The size of two open files holding the same bytes; None when they differ."""
    size = 0
    while True:
        chunk = a.read(_COMPARE_CHUNK)
        if chunk != b.read(len(chunk) or 1):
            return None
        if not chunk:
            return size
        size += len(chunk)
