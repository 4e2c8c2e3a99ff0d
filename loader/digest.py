"""The digest a repository's manifest records for each of its files: BLAKE3.

What the digest must prove: that a file of a published repository still holds the bytes the
loader wrote, against bit rot, a truncated copy, and a file edited or replaced on purpose (a
modified weight file, planted code). A 32-bit CRC catches accidents but an edit chosen to keep
it passes, so the digest is a cryptographic hash. Measured on the 2-core development machine
(AVX2 and SHA-NI, one thread, bytes already in memory): sha256 about 1.5 GB per CPU second,
BLAKE3 (the ``blake3`` package) about 3.4, CRC32C about 12. BLAKE3 is the 256-bit hash at more
than twice sha256's speed, and it releases the GIL while it hashes, so the writer threads that
hash what they write run on every core.

Manifests written before (format 1) hold sha256 digests and are still verified: each format
names its algorithm (:data:`ALGORITHMS`), and :func:`new` makes a hasher for either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

import blake3

from loader import fs
from loader.fs import Dir

#: The algorithm new manifests and conversions use.
DEFAULT = "blake3"
#: Every algorithm a manifest may name, and how to start a hash of it.
ALGORITHMS: dict[str, Callable[[], Hasher]] = {
    "blake3": blake3.blake3,
    "sha256": hashlib.sha256,
}
#: Bytes read at a time when hashing a file.
CHUNK_BYTES = 8 * 2**20


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new(algorithm: str = DEFAULT) -> Hasher:
    """A fresh hash of ``algorithm`` (one of :data:`ALGORITHMS`)."""
    return ALGORITHMS[algorithm]()


def of_bytes(data: bytes, algorithm: str = DEFAULT) -> str:
    hasher = new(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def of_file(
    path: Path,
    algorithm: str = DEFAULT,
    *,
    progress: Callable[[int], object] | None = None,
) -> str:
    """The hex digest of the file at ``path``, read in :data:`CHUNK_BYTES` pieces into one
    buffer; ``progress(n)`` hears of every piece. Opened through :mod:`loader.fs`, as given (a
    source's file, read as the user named it: :func:`of_file_in` reads the loader's own)."""
    with fs.open_read(path) as fh:
        return _of_stream(fh, algorithm, progress)


def of_file_in(
    d: Dir,
    rel: str,
    algorithm: str = DEFAULT,
    *,
    progress: Callable[[int], object] | None = None,
) -> str:
    """The hex digest of the regular file ``rel`` (``a/b/c``: names, each checked) below the
    directory open as ``d`` (a repository the loader wrote), entered one name at a time and
    opened without following any link (anything but a regular file is a
    :class:`~loader.errors.NotOursError`)."""
    *levels, name = rel.split("/")
    with d.enter(levels) as where, where.open_read(name) as fh:
        return _of_stream(fh, algorithm, progress)


def _of_stream(fh: BinaryIO, algorithm: str, progress: Callable[[int], object] | None) -> str:
    hasher = new(algorithm)
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    while n := fh.readinto(buf):
        hasher.update(view[:n])
        if progress is not None:
            progress(n)
    return hasher.hexdigest()
