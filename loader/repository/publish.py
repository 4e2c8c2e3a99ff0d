"""Staging directories and the atomic rename that publishes a repository.

Everything is written under ``ROOT/.staging/<key>.<token>/`` (same filesystem as ``ROOT``, so the
final ``rename(2)`` is atomic) and then renamed to ``ROOT/<key>``. Triton is pointed at
``ROOT/<key>`` only, so it never sees a half-written repository: ``ROOT/<key>`` is either absent
or complete. ``rename`` refuses to replace a non-empty directory, so two loaders can never
clobber each other's complete repository; replacing one (``--force``) first moves the old one
to ``ROOT/.trash/`` and deletes it after the new one is in place.

Leftover staging directories of killed loaders are removed by the next loader that holds the
key's lock (:func:`clear_staging`).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from pathlib import Path

from loader.errors import PublishError
from loader.repository.key import key_filename
from loader.repository.manifest import fsync_dir

log = logging.getLogger(__name__)

STAGING_DIR = ".staging"
TRASH_DIR = ".trash"


def published_path(root: Path, key: str) -> Path:
    return Path(root).absolute() / key


def new_staging_dir(root: Path, key: str) -> Path:
    """A fresh, empty staging directory for ``key`` under ``root``."""
    base = Path(root).absolute() / STAGING_DIR
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{key_filename(key)}.{secrets.token_hex(6)}"
    path.mkdir()
    return path


def clear_staging(root: Path, key: str, *, keep: Path | None = None) -> list[Path]:
    """Remove staging directories of ``key`` left by earlier (killed) loaders; call under the
    key's lock."""
    base = Path(root).absolute() / STAGING_DIR
    removed = []
    for path in sorted(base.glob(f"{key_filename(key)}.*")):
        if keep is not None and path == keep:
            continue
        log.info("removing leftover staging directory %s", path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def atomic_rename(src: Path, dst: Path) -> None:
    """``rename(2)`` ``src`` to ``dst`` (which must not exist or be an empty dir), then fsync the
    destination's parent so the new name is durable."""
    os.rename(src, dst)
    fsync_dir(dst.parent)


def _move_aside(target: Path, root: Path) -> Path:
    trash = Path(root).absolute() / TRASH_DIR
    trash.mkdir(parents=True, exist_ok=True)
    aside = trash / f"{key_filename(str(target.relative_to(root)))}.{secrets.token_hex(6)}"
    os.rename(target, aside)
    return aside


def publish(staging: Path, root: Path, key: str, *, replace: bool = False) -> Path:
    """Rename ``staging`` to ``ROOT/<key>``; with ``replace`` an existing one is moved aside
    first (and deleted afterwards). Returns the published path."""
    root = Path(root).absolute()
    target = published_path(root, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    aside = None
    if target.exists():
        if not replace:
            raise PublishError(
                f"{target} already exists.",
                "Run again with --force to publish a fresh copy.",
            )
        aside = _move_aside(target, root)
        log.info("moved the previous %s aside to %s", target, aside)
    try:
        atomic_rename(staging, target)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise PublishError(
                f"{target} appeared while this loader was publishing it.",
                "Another loader published the same key; run again to verify it.",
            ) from exc
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    log.info("published %s", target)
    return target
