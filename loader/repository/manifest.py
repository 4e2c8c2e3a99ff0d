"""``manifest.json`` (every file of a repository: path, size, sha256) and the ``.ready`` marker.

A published repository is complete when ``.ready`` exists and every file the manifest lists is
present with its size and sha256, and no other file is. ``.ready`` is written last, after the
manifest, and both are fsynced, so a reader that sees ``.ready`` sees a complete repository.

The sha256 of the weights are computed while the converter writes them (``known`` in
:func:`build_manifest`); only the small files written besides them are read again. Each entry
also records the file's *seal*, its inode and modification time as written: a quick
:func:`verify` compares sizes and seals with the disk and re-hashes only the files whose seal
changed (a write to a file changes its modification time), so a rerun that finds its key
published reads no weights when nothing changed; a full :func:`verify` re-hashes every file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loader.progress import byte_progress

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
READY = ".ready"
#: Manifest field holding the source fingerprint (:mod:`loader.sources.fingerprint`).
SOURCE_FINGERPRINT = "source_fingerprint"
FORMAT_VERSION = 1
_CHUNK = 8 * 2**20


#: Directories the Python interpreter may create beside a model.py when a server imports it
#: from a writable repository: caches, not content, so neither listed nor reported.
IGNORED_DIRS = frozenset({"__pycache__"})


def _files(root: Path) -> list[str]:
    """Every regular file under ``root`` as a sorted POSIX relative path (manifest, marker and
    bytecode caches excluded)."""
    found = []
    for path in root.rglob("*"):
        if IGNORED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        if path.is_file() and not path.is_symlink():
            rel = path.relative_to(root).as_posix()
            if rel not in (MANIFEST, READY):
                found.append(rel)
    return sorted(found)


def _sha256(path: Path, progress) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            progress.update(len(chunk))
    return digest.hexdigest()


def _hash_all(root: Path, rels: Iterable[str], what: str, workers: int | None) -> dict[str, str]:
    rels = list(rels)
    total = sum((root / rel).stat().st_size for rel in rels)
    with (
        byte_progress(what, total) as progress,
        ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool,
    ):
        digests = pool.map(lambda rel: _sha256(root / rel, progress), rels)
        return dict(zip(rels, digests, strict=True))


def file_seal(stat: os.stat_result) -> list[int]:
    """What a quick verification compares with the disk: inode and modification time (ns)."""
    return [stat.st_ino, stat.st_mtime_ns]


def build_manifest(
    root: Path,
    meta: dict,
    *,
    workers: int | None = None,
    known: dict[str, tuple[int, str]] | None = None,
) -> dict:
    """List every file under ``root`` with its size, sha256 and seal; ``meta`` (key, source,
    settings...) is stored alongside.

    ``known`` maps relative paths to the (size, sha256) computed while they were written: those
    files are not read again (a size that differs from the disk's is an error). Every other
    file is hashed.
    """
    root = Path(root)
    rels = _files(root)
    known = dict(known or {})
    stats = {rel: (root / rel).stat() for rel in rels}
    for rel, (size, _digest) in known.items():
        if rel in stats and stats[rel].st_size != size:
            raise OSError(
                errno.EIO, f"{root / rel} holds {stats[rel].st_size} bytes, {size} were written"
            )
    digests = {rel: digest for rel, (_size, digest) in known.items() if rel in stats}
    digests.update(_hash_all(root, [r for r in rels if r not in digests], "hashing repository",
                             workers))  # fmt: skip
    files = [
        {
            "path": rel,
            "size": stats[rel].st_size,
            "sha256": digests[rel],
            "seal": file_seal(stats[rel]),
        }
        for rel in rels
    ]
    return {
        "format": FORMAT_VERSION,
        **meta,
        "files": files,
        "total_bytes": sum(f["size"] for f in files),
    }


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(root: Path, manifest: dict) -> Path:
    path = Path(root) / MANIFEST
    _write_synced(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return path


def write_ready(root: Path, key: str) -> Path:
    """Write ``.ready`` (last) and fsync the directory so both markers are durable."""
    path = Path(root) / READY
    _write_synced(path, f"{key}\n".encode())
    fsync_dir(Path(root))
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(root: Path) -> dict | None:
    try:
        data = json.loads((Path(root) / MANIFEST).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), list) else None


def verify(
    root: Path,
    *,
    key: str | None = None,
    checksums: bool = True,
    workers: int | None = None,
    quick: bool = False,
) -> list[str]:
    """Problems that make ``root`` not a complete published repository (empty list: complete).

    Checks ``.ready``, the manifest (and that it names ``key``), every listed file's presence
    and size, no unlisted files, and with ``checksums`` every file's sha256: with ``quick``
    only the files whose seal (:func:`file_seal`) differs from the one recorded, or that
    record none, are read; the others are taken to hold what was written.
    """
    root = Path(root)
    if not root.is_dir():
        return [f"{root} does not exist"]
    problems = []
    if not (root / READY).is_file():
        problems.append(f"{READY} is missing")
    manifest = read_manifest(root)
    if manifest is None:
        return [*problems, f"{MANIFEST} is missing or unreadable"]
    if key is not None and manifest.get("key") != key:
        problems.append(f"{MANIFEST} names key {manifest.get('key')!r}, expected {key!r}")
    listed = {entry["path"]: entry for entry in manifest["files"]}
    present = set(_files(root))
    problems += [f"missing file {rel}" for rel in sorted(set(listed) - present)]
    problems += [f"unexpected file {rel}" for rel in sorted(present - set(listed))]
    sized = []
    for rel in sorted(set(listed) & present):
        stat = (root / rel).stat()
        if stat.st_size != listed[rel]["size"]:
            problems.append(f"{rel} has {stat.st_size} bytes, manifest says {listed[rel]['size']}")
        elif not quick or listed[rel].get("seal") != file_seal(stat):
            sized.append(rel)
    if checksums and not problems and quick and not sized:
        log.info(
            "verified %s: %s files of the sizes and seals recorded, none to re-hash",
            root,
            len(listed),
        )
    if checksums and not problems:
        digests = _hash_all(root, sized, "verifying repository", workers)
        problems += [
            f"{rel} sha256 differs from the manifest"
            for rel in sized
            if digests[rel] != listed[rel]["sha256"]
        ]
    return problems
