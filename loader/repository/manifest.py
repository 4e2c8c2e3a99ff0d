"""``manifest.json`` (every file and directory of a repository: path, size, digest, seal) and
the ``.ready`` marker.

A published repository is complete when ``.ready`` names its key and the repository holds
exactly what the manifest lists: every listed file present as a regular file with its size
and digest, every listed directory a real directory, and nothing else: no other file, no
symbolic link, no other directory (a ``__pycache__`` planted beside a ``model.py`` is found;
Python would run its bytecode). The loader's own bookkeeping files at the top
(:data:`BOOKKEEPING`) are the only exception. ``.ready`` is written last, after the manifest,
and both are fsynced, so a reader that sees ``.ready`` sees a complete repository.

The manifest's ``format`` names the digest its entries hold (:data:`DIGESTS`): format 2, written
now, BLAKE3 (:mod:`loader.digest` says why); format 1, written by earlier loaders, sha256, still
verified as such; any other format is damage (the key is published again). The digests of the
weights are computed while the converter writes them (``known`` in :func:`build_manifest`); only
the small files written besides them are read again. Each entry
also records the file's *seal* as written: inode, modification time and change time (ctime,
which a user cannot set back). A quick :func:`verify` compares sizes and seals with the disk
and re-hashes only the files whose seal changed (a write, a ``touch``, a ``chmod`` each move
the ctime), so a rerun that finds its key published reads no weights when nothing changed; a
full :func:`verify` re-hashes every file. What only a full verification finds: bytes that
changed on the disk without any write through the file system (bit rot, a disk written
behind the kernel's back).

A manifest that cannot be read, or whose entries are not what this module writes, is damage
like a missing file: :func:`verify` reports it (the key is published again), never raises.
Everything is read relative to directory descriptors (:mod:`loader.fs`): a link is never
followed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loader import digest, fs
from loader.errors import NotOursError, ReplacedOutputError
from loader.formats import jsondoc
from loader.fs import Dir
from loader.progress import byte_progress
from loader.waits import map_in_steps

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
READY = ".ready"
#: The file marking a staging directory, and so the repository it became, as the loader's
#: (its first line is the key; :mod:`loader.repository.publish`); removed last of the tree.
STAGING_MARKER = fs.MARKER_PREFIX + "staging"
#: The loader's files at the top of a repository that the manifest does not list.
BOOKKEEPING = frozenset({MANIFEST, READY, STAGING_MARKER, fs.MADE})
#: Manifest field holding the source fingerprint (:mod:`loader.sources.fingerprint`).
SOURCE_FINGERPRINT = "source_fingerprint"
#: The format new manifests are written in.
FORMAT_VERSION = 2
#: Manifest format -> the digest algorithm (:data:`loader.digest.ALGORITHMS`) its entries hold,
#: each under the algorithm's name.
DIGESTS = {1: "sha256", 2: digest.DEFAULT}
#: The largest manifest read (one of a large sharded model is well under a megabyte).
MAX_MANIFEST_BYTES = 64 * 2**20
_HEX256 = re.compile(r"[0-9a-f]{64}")


class _Tree:
    """What a directory holds, walked without following links: regular files (relative
    path -> stat), directories, and anything else (relative path -> what it is)."""

    def __init__(self, d: Dir) -> None:
        self.files: dict[str, os.stat_result] = {}
        self.dirs: list[str] = []
        self.others: dict[str, str] = {}
        self._walk(d, "", 0)

    def _walk(self, d: Dir, prefix: str, depth: int) -> None:
        for name in d.names():
            rel = prefix + name
            if not prefix and name in BOOKKEEPING:
                continue
            found = d.lstat(name)
            if found is None:
                continue
            if stat.S_ISDIR(found.st_mode) and depth >= fs.MAX_TREE_DEPTH:
                self.others[rel] = f"directory nested over {fs.MAX_TREE_DEPTH} levels deep"
            elif stat.S_ISDIR(found.st_mode):
                self.dirs.append(rel)
                with d.sub(name) as sub:
                    self._walk(sub, rel + "/", depth + 1)
            elif stat.S_ISREG(found.st_mode):
                self.files[rel] = found
            else:
                self.others[rel] = fs.kind_of(found.st_mode)


def _hash_all(
    d: Dir, files: dict[str, os.stat_result], what: str, workers: int | None, algorithm: str
) -> dict[str, str]:
    """The ``algorithm`` digest of each file ``files`` names (relative to ``d``, with its
    size as listed), entered from ``d`` one name at a time, never through a link."""
    rels = list(files)
    total = sum(files[rel].st_size for rel in rels)
    with (
        byte_progress(what, total) as progress,
        ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool,
    ):
        digests = map_in_steps(
            pool, lambda rel: digest.of_file_in(d, rel, algorithm, progress=progress.update), rels
        )
        return dict(zip(rels, digests, strict=True))


def _lstat_in(d: Dir, rel: str) -> os.stat_result | None:
    """The ``lstat`` of ``rel`` (``a/b/c``) below ``d``, entered one name at a time, never
    through a link (None: nothing there, or no directory on the way)."""
    *levels, name = rel.split("/")
    try:
        with d.enter(levels) as where:
            return where.lstat(name)
    except (FileNotFoundError, NotADirectoryError, NotOursError):
        return None


def file_seal(stat_result: os.stat_result) -> list[int]:
    """What a quick verification compares with the disk: inode, modification time and change
    time (ns)."""
    return [stat_result.st_ino, stat_result.st_mtime_ns, stat_result.st_ctime_ns]


def _sealed(recorded: object, found: os.stat_result) -> bool:
    """Whether ``found`` still has the seal ``recorded`` (an older manifest's seal has no
    ctime: its inode and modification time are compared)."""
    seal = file_seal(found)
    if not isinstance(recorded, list) or len(recorded) not in (2, 3):
        return False
    return recorded == seal[: len(recorded)]


def build_manifest(
    root: Path,
    meta: dict,
    *,
    workers: int | None = None,
    known: dict[str, tuple[int, str | None]] | None = None,
    written: Mapping[str, fs.Stamp] | None = None,
) -> dict:
    """List every file and directory under ``root`` (files with size, digest
    (:data:`loader.digest.DEFAULT`) and seal), in the current format; ``meta`` (key, source,
    settings...) is stored alongside. Call once the tree is final (modes set): the seals are
    taken now.

    ``known`` maps relative paths to the (size, digest) computed while they were written: those
    files are not read again (a size that differs from the disk's is an error). Every other
    file, and one known without its digest (None), is hashed. A link or special file in the
    tree is an error: the loader writes none. ``written`` maps relative paths to the
    :data:`~loader.fs.Stamp` of the file each known digest is of, after its last write: a
    file there that is not it (written over, or renamed over it, since) is refused
    (:class:`~loader.errors.ReplacedOutputError`), never sealed under a digest it does not
    hold.
    """
    root = Path(root).absolute()
    with Dir.open(root) as d:
        return _build_in(d, meta, workers=workers, known=known, written=written)


def _build_in(
    d: Dir,
    meta: dict,
    *,
    workers: int | None,
    known: dict[str, tuple[int, str | None]] | None,
    written: Mapping[str, fs.Stamp] | None = None,
) -> dict:
    root = d.path
    tree = _Tree(d)
    if tree.others:
        rel, what = next(iter(tree.others.items()))
        raise OSError(errno.ELOOP, f"{what} in a repository being built", str(root / rel))
    stats = tree.files
    rels = sorted(stats)
    known = dict(known or {})
    for rel, stamp in (written or {}).items():
        if rel in stats and fs.stamp(stats[rel]) != stamp:
            raise ReplacedOutputError(root / rel)
    for rel, (size, _digest) in known.items():
        if rel in stats and stats[rel].st_size != size:
            raise OSError(
                errno.EIO, f"holds {stats[rel].st_size} bytes, {size} were written", str(root / rel)
            )
    algorithm = DIGESTS[FORMAT_VERSION]
    digests = {
        rel: hexdigest
        for rel, (_size, hexdigest) in known.items()
        if rel in stats and hexdigest is not None
    }
    todo = {rel: stats[rel] for rel in rels if rel not in digests}
    digests.update(_hash_all(d, todo, "hashing repository", workers, algorithm))
    for rel in set(todo) & set(written or {}):  # and the file hashed, unwritten meanwhile
        found = _lstat_in(d, rel)
        if found is None or fs.stamp(found) != (written or {})[rel]:
            raise ReplacedOutputError(root / rel)
    files = [
        {
            "path": rel,
            "size": stats[rel].st_size,
            algorithm: digests[rel],
            "seal": file_seal(stats[rel]),
        }
        for rel in rels
    ]
    return {
        "format": FORMAT_VERSION,
        **meta,
        "files": files,
        "directories": sorted(tree.dirs),
        "total_bytes": sum(f["size"] for f in files),
    }


def write_manifest(root: Path, manifest: dict) -> Path:
    """Write ``root/manifest.json`` (fsynced): one name in ``root``, opened once."""
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    with Dir.open(root) as d:
        d.write(MANIFEST, data, exclusive=False, sync=True)
        return d.path / MANIFEST


def write_ready(root: Path, key: str) -> Path:
    """Write ``.ready`` (last) and fsync the directory so both markers are durable."""
    with Dir.open(root) as d:
        d.write(READY, f"{key}\n".encode(), exclusive=False, sync=True)
        d.fsync()
        return d.path / READY


def _parse(data: bytes | None) -> dict | None:
    if data is None:
        return None
    try:
        parsed = jsondoc.loads(data)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) and isinstance(parsed.get("files"), list) else None


def read_manifest_in(d: Dir) -> dict | None:
    """The manifest of the repository open as ``d``; None when absent or not a JSON object
    with a file list."""
    try:
        return _parse(d.read(MANIFEST, limit=MAX_MANIFEST_BYTES))
    except (fs.TooLargeError, IsADirectoryError):
        return None


def read_manifest(root: Path) -> dict | None:
    """The manifest of the repository at ``root`` (see :func:`read_manifest_in`)."""
    try:
        with Dir.open(root) as d:
            return read_manifest_in(d)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _relative(path: object) -> bool:
    """A relative POSIX path of plain names (no ``..``, no empty part)."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\0" in path:
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def _listed(manifest: dict, algorithm: str) -> tuple[dict[str, dict], set[str] | None] | str:
    """The manifest's file entries by path (each with its ``algorithm`` digest) and its
    directories (None: an older manifest that lists none), or what is malformed in it."""
    files: dict[str, dict] = {}
    for entry in manifest["files"]:
        if not isinstance(entry, dict) or not _relative(entry.get("path")):
            return f"an entry is not a file of the repository: {str(entry)[:80]}"
        size, hexdigest = entry.get("size"), entry.get(algorithm)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"{entry['path']} has no valid size"
        if not isinstance(hexdigest, str) or not _HEX256.fullmatch(hexdigest):
            return f"{entry['path']} has no valid {algorithm}"
        if entry["path"] in files:
            return f"{entry['path']} is listed twice"
        files[entry["path"]] = entry
    directories = manifest.get("directories")
    if directories is None:
        return files, None
    if not isinstance(directories, list) or not all(_relative(d) for d in directories):
        return "its directory list is not a list of paths"
    return files, set(directories)


def verify_in(
    d: Dir,
    *,
    key: str | None = None,
    checksums: bool = True,
    workers: int | None = None,
    quick: bool = False,
    seals: bool = False,
) -> list[str]:
    """:func:`verify` of the repository open as ``d``; with ``seals`` and without
    ``checksums`` a file whose seal differs from the one recorded is a problem (written since:
    what it holds is not known), where sizes alone are compared otherwise."""
    problems = []
    try:
        ready = d.read(READY, limit=4096) if d.kind(READY) == "a file" else None
    except fs.TooLargeError:
        ready = b""
        problems.append(f"{READY} is larger than any the loader writes")
    if ready is None:
        problems.append(f"{READY} is missing")
    elif key is not None and ready.decode("utf-8", "replace").strip() != key:
        problems.append(f"{READY} names another key")
    data = read_manifest_in(d)
    if data is None:
        return [*problems, f"{MANIFEST} is missing or unreadable"]
    if key is not None and data.get("key") != key:
        problems.append(f"{MANIFEST} names key {str(data.get('key'))[:80]!r}, expected {key!r}")
    fmt = data.get("format")
    algorithm = DIGESTS.get(fmt) if type(fmt) is int else None
    if algorithm is None:
        return [
            *problems,
            f"{MANIFEST} has format {repr(fmt)[:80]}, which this loader does not read "
            f"(it reads {', '.join(map(str, DIGESTS))})",
        ]
    listing = _listed(data, algorithm)
    if isinstance(listing, str):
        return [*problems, f"{MANIFEST} is malformed: {listing}"]
    listed, directories = listing
    tree = _Tree(d)
    present = set(tree.files)
    problems += [f"missing file {rel}" for rel in sorted(set(listed) - present)]
    problems += [f"unexpected file {rel}" for rel in sorted(present - set(listed))]
    problems += [f"unexpected {what} {rel}" for rel, what in sorted(tree.others.items())]
    expected_dirs = directories
    if expected_dirs is None:  # an older manifest: the directories of its files
        expected_dirs = {
            rel.rsplit("/", i)[0] for rel in listed for i in range(1, rel.count("/") + 1)
        }
        problems += [
            f"unexpected directory {rel}"
            for rel in sorted(set(tree.dirs) - expected_dirs)
            if any(f.startswith(rel + "/") for f in present | set(tree.others))
        ]
    else:
        problems += [f"missing directory {rel}" for rel in sorted(expected_dirs - set(tree.dirs))]
        problems += [
            f"unexpected directory {rel}" for rel in sorted(set(tree.dirs) - expected_dirs)
        ]
    to_hash = []
    for rel in sorted(set(listed) & present):
        found = tree.files[rel]
        seal = listed[rel].get("seal")
        if found.st_size != listed[rel]["size"]:
            problems.append(f"{rel} has {found.st_size} bytes, manifest says {listed[rel]['size']}")
        elif not checksums and seals and seal is not None and not _sealed(seal, found):
            # Not hashed, but written (or replaced) since the manifest took its seal: what it
            # holds now is not known to be what was published.
            problems.append(f"{rel} was changed since it was written (its seal differs)")
        elif not quick or not _sealed(seal, found):
            to_hash.append(rel)
    if checksums and not problems and quick and not to_hash:
        log.info(
            "verified %s: %s files of the sizes and seals recorded, none to re-hash",
            d.path,
            len(listed),
        )
    if checksums and not problems:
        todo = {rel: tree.files[rel] for rel in to_hash}
        digests = _hash_all(d, todo, "verifying repository", workers, algorithm)
        problems += [
            f"{rel} {algorithm} differs from the manifest"
            for rel in to_hash
            if digests[rel] != listed[rel][algorithm]
        ]
    return problems


def verify(
    root: Path,
    *,
    key: str | None = None,
    checksums: bool = True,
    workers: int | None = None,
    quick: bool = False,
) -> list[str]:
    """Problems that make ``root`` not a complete published repository (empty list: complete).

    Checks ``.ready`` (naming ``key``), the manifest (well formed, naming ``key``), that the
    repository holds exactly what it lists (see the module docstring), every listed file's
    size, and with ``checksums`` every file's digest (the algorithm of the manifest's format,
    :data:`DIGESTS`): with ``quick`` only the files whose seal (:func:`file_seal`) differs from
    the one recorded, or that record none, are read; the others are taken to hold what was
    written.
    """
    root = Path(root).absolute()
    try:
        d = Dir.open(root)
    except (FileNotFoundError, NotADirectoryError):
        return [f"{root} does not exist"]
    with d:
        return verify_in(d, key=key, checksums=checksums, workers=workers, quick=quick)
