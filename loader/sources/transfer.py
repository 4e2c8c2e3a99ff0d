"""Helpers every source backend shares: temporary names, atomic placement, checksums and the
free-disk-space check (retrying is :mod:`loader.sources.failures`).

A download is written to ``DEST/.partial/<relative path>.<random>`` and renamed to
``DEST/<relative path>`` only after it was verified, so a complete-looking file under ``DEST``
is always a verified one and a killed download leaves only files under ``.partial/`` (removed
by the next run).

Nothing is written through a symbolic link inside DEST: :func:`safe_path` refuses a path whose
directories under DEST include a link (or a file), so a DEST holding a link to elsewhere cannot
make a download land outside it.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loader.errors import InsufficientDiskSpaceError, SourceError
from loader.progress import human_bytes

log = logging.getLogger(__name__)

#: Directory under DEST that holds downloads in progress.
PARTIAL_DIR = ".partial"
#: Bytes kept free beyond what a download needs (file-system metadata, logs).
DISK_MARGIN = 64 * 1024 * 1024
_CHUNK = 8 * 1024 * 1024


def safe_path(dest: Path, relpath: str) -> Path:
    """``dest / relpath`` with its directories created, each a real directory (no symbolic link,
    no file in the way): a :class:`SourceError` otherwise."""
    path = Path(dest)
    parts = Path(relpath).parts
    for part in parts[:-1]:
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            what = "a symbolic link" if path.is_symlink() else "a file"
            raise SourceError(
                f"{path} is {what}, so {relpath} cannot be written under {dest}: the loader "
                "writes only into real directories under the destination.",
                f"Remove {path} or choose another destination directory.",
            )
        if not path.exists():
            try:
                path.mkdir()
            except FileExistsError:
                pass
            except NotADirectoryError as exc:
                raise SourceError(f"Cannot create {path}: {exc.strerror}.") from exc
    return path / parts[-1] if parts else path


def partial_path(dest: Path, relpath: str) -> Path:
    """A unique temporary path for ``relpath`` under ``dest``'s partial directory."""
    return safe_path(dest, f"{PARTIAL_DIR}/{relpath}.{secrets.token_hex(4)}")


def clear_partials(dest: Path) -> None:
    """Remove what killed runs left under ``dest``'s partial directory (a link there is
    removed, never followed)."""
    partial = dest / PARTIAL_DIR
    if partial.is_symlink() or partial.is_file():
        partial.unlink()
    elif partial.exists():
        log.info("removing unfinished downloads of an earlier run under %s", partial)
        shutil.rmtree(partial)


def place(tmp: Path, final: Path, *, dest: Path | None = None) -> None:
    """Move a verified temporary file to its final name atomically (same file system); with
    ``dest``, ``final``'s directories under it must be real directories (:func:`safe_path`)."""
    if dest is not None:
        safe_path(dest, final.relative_to(dest).as_posix())
    else:
        final.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)


@contextmanager
def temporary_download(dest: Path, relpath: str) -> Iterator[Path]:
    """Yield a temporary path for ``relpath``; it is removed if the block raises."""
    tmp = partial_path(dest, relpath)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_crc32c(path: Path) -> str:
    """The CRC32C of a file as Cloud Storage writes it: base64 of the big-endian 32-bit value."""
    import google_crc32c

    checksum = google_crc32c.Checksum()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            checksum.update(chunk)
    return base64.b64encode(checksum.digest()).decode("ascii")


def file_md5(path: Path) -> str:
    """The MD5 of a file as Cloud Storage writes it: base64 of the 16-byte digest."""
    import hashlib

    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return base64.b64encode(digest.digest()).decode("ascii")


def ensure_disk_space(dest: Path, needed: int, *, what: str) -> None:
    """Raise :class:`InsufficientDiskSpaceError` unless ``needed`` bytes fit under ``dest``."""
    probe = dest
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed + DISK_MARGIN > free:
        raise InsufficientDiskSpaceError(
            f"Not enough free disk space under {dest} for {what}: need {human_bytes(needed)} "
            f"(+{human_bytes(DISK_MARGIN)} margin), {human_bytes(free)} free.",
        )
    log.debug("disk space for %s: need %s, %s free", what, human_bytes(needed), human_bytes(free))
