"""Staging directories and the atomic rename that publishes a repository.

Everything is written under ``ROOT/.staging/<key>.<owner>.<token>/`` (same filesystem as
``ROOT``, so the final ``rename(2)`` is atomic) and then renamed to ``ROOT/<key>``. Triton is
pointed at ``ROOT/<key>`` only, so it never sees a half-written repository: ``ROOT/<key>`` is
either absent or complete.

Publishing, in order (:func:`publish`):

1. every file and directory of the staging directory gets mode 0644 / 0755 (whatever the
   umask) and is fsynced: the data is durable before any name points at it;
2. one ``rename`` of the staging directory to ``ROOT/<key>``, which must be absent:
   ``renameat2(RENAME_NOREPLACE)`` where the file system supports it, else ``rename(2)``, which
   refuses a non-empty target. A target that appeared meanwhile is a :class:`PublishError`;
   nothing is merged into it;
3. an fsync of ``ROOT/<key>``'s parent directory, so the new name is durable.

Replacing a published copy (``--force``, or a source followed with ``--follow-source``) first
moves the old one to ``ROOT/.trash/`` and deletes it after the new one is in place.

``<owner>`` is ``<pid>-<host digest>`` of the loader that created a staging directory. The next
loader holding the key's lock removes what earlier loaders left (:func:`clear_leftovers`): a
staging directory whose owner ran on this host and is gone, or in which nothing changed for
the lock expiry (its owner lost the lock then, and stops before publishing), and the key's
``.trash`` entries.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

from loader.errors import PublishError
from loader.repository.key import key_filename
from loader.repository.lock import pid_alive
from loader.repository.manifest import fsync_dir

log = logging.getLogger(__name__)

STAGING_DIR = ".staging"
TRASH_DIR = ".trash"
#: Default parent of download directories (``--work-dir``), and the file marking a download
#: directory the loader created (the only kind it ever removes).
WORK_DIR = ".work"
DOWNLOAD_MARKER = ".model-loader-download"
FILE_MODE = 0o644
DIR_MODE = 0o755


def published_path(root: Path, key: str) -> Path:
    return Path(root).absolute() / key


def host_digest(host: str | None = None) -> str:
    """8 hex digits naming a host in staging names (host names can be long)."""
    host = host if host is not None else socket.gethostname()
    return hashlib.sha256(host.encode("utf-8")).hexdigest()[:8]


def new_staging_dir(root: Path, key: str) -> Path:
    """A fresh, empty staging directory for ``key`` under ``root``, named after its owner."""
    base = Path(root).absolute() / STAGING_DIR
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{key_filename(key)}.{os.getpid()}-{host_digest()}.{secrets.token_hex(6)}"
    path.mkdir()
    return path


def _owner(name: str, prefix: str) -> tuple[int, str] | None:
    """(pid, host digest) from a staging name ``<prefix>.<pid>-<host>.<token>``."""
    owner = name[len(prefix) + 1 :].rsplit(".", 1)[0]
    pid, _, host = owner.partition("-")
    return (int(pid), host) if pid.isdigit() and host else None


def last_change(path: Path) -> float:
    """The newest modification time of ``path`` and everything under it (no links followed)."""
    newest = path.lstat().st_mtime
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def abandoned(path: Path, prefix: str, *, idle_s: float) -> bool:
    """Whether a staging directory's owner is gone: on this host and dead, or silent for
    ``idle_s`` seconds (nothing under it changed)."""
    owner = _owner(path.name, prefix)
    if owner is not None and owner[1] == host_digest():
        if owner[0] == os.getpid():
            return False
        if not pid_alive(owner[0]):
            return True
    try:
        return time.time() - last_change(path) >= idle_s
    except FileNotFoundError:
        return False


def clear_leftovers(root: Path, key: str, *, idle_s: float, keep: Path | None = None) -> list[Path]:
    """Remove what earlier loaders of ``key`` left: abandoned staging directories and the
    key's ``.trash`` entries. Call under the key's lock."""
    root = Path(root).absolute()
    prefix = key_filename(key)
    removed = []
    for path in sorted((root / STAGING_DIR).glob(f"{prefix}.*")):
        if path == keep or not abandoned(path, prefix, idle_s=idle_s):
            continue
        log.info("removing leftover staging directory %s", path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for path in sorted((root / TRASH_DIR).glob(f"{prefix}.*")):
        log.info("removing the replaced copy %s", path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def seal(tree: Path) -> None:
    """Give every file 0644 and every directory 0755 and fsync them, deepest first, so the
    data is durable before the rename makes it visible."""
    for dirpath, _dirs, filenames in os.walk(tree, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            os.chmod(path, FILE_MODE)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.chmod(dirpath, DIR_MODE)
        fsync_dir(Path(dirpath))


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _rename_noreplace(src: Path, dst: Path) -> None:
    """``rename(src, dst)`` that fails with EEXIST when ``dst`` exists, even as an empty
    directory (``renameat2``); where the kernel or file system lacks it, ``rename(2)``, which
    still refuses a non-empty ``dst``."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        result = renameat2(
            _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE
        )
        if result == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(dst))
    if dst.exists():
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def atomic_rename(src: Path, dst: Path) -> None:
    """Rename ``src`` to the absent ``dst`` in one step, then fsync ``dst``'s parent so the
    new name is durable."""
    _rename_noreplace(src, dst)
    fsync_dir(dst.parent)


def _move_aside(target: Path, root: Path) -> Path:
    trash = Path(root).absolute() / TRASH_DIR
    trash.mkdir(parents=True, exist_ok=True)
    aside = trash / f"{key_filename(str(target.relative_to(root)))}.{secrets.token_hex(6)}"
    os.rename(target, aside)
    return aside


def publish(staging: Path, root: Path, key: str, *, replace: bool = False) -> Path:
    """Rename ``staging`` to ``ROOT/<key>`` (see the module docstring); with ``replace`` an
    existing one is moved aside first (and deleted afterwards). Returns the published path."""
    root = Path(root).absolute()
    target = published_path(root, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not replace:
        raise PublishError(
            f"{target} already exists.",
            "Run again with --force to publish a fresh copy.",
        )
    seal(staging)
    aside = None
    if replace and target.exists():
        aside = _move_aside(target, root)
        log.info("moved the previous %s aside to %s", target, aside)
    try:
        atomic_rename(staging, target)
    except OSError as exc:
        if aside is not None and not target.exists():
            os.rename(aside, target)  # put the previous copy back
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise PublishError(
                f"{target} appeared while this loader was publishing it; nothing was merged "
                "into it.",
                "Another loader published the same key; run again to verify it.",
            ) from exc
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    log.info("published %s", target)
    return target
