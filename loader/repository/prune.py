"""``model-loader prune``: remove what loaders left behind and published keys nobody needs.

What it removes, under ``ROOT`` only, and only things the loader itself creates:

* leftovers: staging directories of killed or stalled loaders (``.staging/``, the same rule as
  :func:`loader.repository.publish.clear_leftovers`), replaced copies (``.trash/``), download
  directories carrying the loader's marker (``.work/<key>/``), moved-away stale lock files;
* published keys (``ROOT/<name>@<revision>/<parallelism>-<variant>``, recognised by a manifest
  naming that very key) beyond the ``keep`` newest of each model name (by the manifest's
  ``created_at``). A key goes by one ``rename`` into ``.trash/`` first, so Triton never sees a
  half-deleted repository at a key path, then it is deleted.

What it never removes, and how it knows:

* anything of a key whose publish lock is live: held by a running process on this host, or
  rewritten (heartbeat) within ``lock_expiry_s`` by its file's modification time;
* a key named in ``in_use``: prune cannot see pods; the Helm chart passes the key its
  Deployment serves (``--in-use``), and ``keep`` (default 2) keeps the previous key too, which
  old pods serve until a rollout finishes. Keys deployed elsewhere from the same volume must be
  passed with ``--in-use`` as well;
* anything it does not recognise (no manifest, another manifest key, other files).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from loader.errors import RepositoryError
from loader.limits import LOCK_EXPIRY_S, PRUNE_KEEP
from loader.repository import manifest
from loader.repository.key import key_filename
from loader.repository.lock import LOCKS_DIR
from loader.repository.publish import (
    DOWNLOAD_MARKER,
    STAGING_DIR,
    TRASH_DIR,
    WORK_DIR,
    abandoned,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Removal:
    path: Path
    reason: str
    bytes: int


@dataclass
class PruneReport:
    removed: list[Removal] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    dry_run: bool = False

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.removed)


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


def lock_live(root: Path, keyfile: str, *, expiry_s: float) -> bool:
    """Whether the publish lock of the key named ``keyfile`` may be held right now."""
    path = Path(root) / LOCKS_DIR / f"{keyfile}.lock"
    try:
        content = path.read_bytes()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return False
    try:
        record = json.loads(content)
    except ValueError:
        record = {}
    local = isinstance(record, dict) and record.get("host") == socket.gethostname()
    if local and isinstance(record.get("pid"), int):
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return time.time() - mtime < expiry_s


def _staging_keyfile(name: str) -> str | None:
    """``<keyfile>`` of a staging name ``<keyfile>.<pid>-<host>.<token>``."""
    parts = name.rsplit(".", 2)
    if len(parts) != 3 or "-" not in parts[1]:
        return None
    return parts[0]


def _published(root: Path) -> list[tuple[str, Path, dict]]:
    """(key, path, manifest) of every repository under ``root`` whose manifest names its key."""
    found = []
    for parent in sorted(root.glob("*@*")):
        if parent.is_symlink() or not parent.is_dir() or parent.name.startswith("."):
            continue
        for path in sorted(parent.iterdir()):
            if path.is_symlink() or not path.is_dir():
                continue
            key = f"{parent.name}/{path.name}"
            data = manifest.read_manifest(path)
            if data is not None and data.get("key") == key:
                found.append((key, path, data))
    return found


def _discard(path: Path, root: Path) -> None:
    """Remove ``path``: a published key is first renamed into ``.trash`` (one atomic step)."""
    if path.parent.parent == root and not path.parent.name.startswith("."):
        trash = root / TRASH_DIR
        trash.mkdir(exist_ok=True)
        aside = trash / f"{key_filename(str(path.relative_to(root)))}.{secrets.token_hex(6)}"
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # the <name>@<revision> directory, if now empty
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune(
    root: Path,
    *,
    keep: int = PRUNE_KEEP.default,
    in_use: tuple[str, ...] = (),
    lock_expiry_s: float = LOCK_EXPIRY_S.default,
    dry_run: bool = False,
) -> PruneReport:
    """Remove leftovers and published keys beyond the ``keep`` newest per model name (see the
    module docstring); with ``dry_run`` only report what would go."""
    root = Path(root).absolute()
    PRUNE_KEEP.check(keep)
    if not root.is_dir():
        raise RepositoryError(
            f"The repository root {root} does not exist.",
            "Point --repository at the model repository volume (e.g. /models).",
        )
    report = PruneReport(dry_run=dry_run)

    def live(keyfile: str) -> bool:
        return lock_live(root, keyfile, expiry_s=lock_expiry_s)

    candidates: list[tuple[Path, str]] = []
    for path in sorted((root / STAGING_DIR).glob("*")):
        keyfile = _staging_keyfile(path.name)
        if keyfile is None or live(keyfile):
            continue
        if abandoned(path, keyfile, idle_s=lock_expiry_s):
            candidates.append((path, "staging directory of a loader that is gone"))
    for path in sorted((root / TRASH_DIR).glob("*")):
        keyfile = path.name.rsplit(".", 1)[0]
        if not live(keyfile):
            candidates.append((path, "replaced copy left by an interrupted publish"))
    for path in sorted((root / WORK_DIR).glob("*")):
        if (path / DOWNLOAD_MARKER).is_file() and not live(path.name):
            candidates.append((path, "download directory of an unfinished run"))
    candidates += [
        (path, "moved-away stale lock file")
        for path in sorted((root / LOCKS_DIR).glob("*.lock.stale-*"))
    ]

    wanted = set(in_use)
    by_model: dict[str, list[tuple[str, Path, dict]]] = defaultdict(list)
    for key, path, data in _published(root):
        by_model[str(data.get("model_name") or key.split("@", 1)[0])].append((key, path, data))
    for entries in by_model.values():
        entries.sort(key=lambda e: (str(e[2].get("created_at") or ""), e[1].stat().st_mtime))
        entries.reverse()  # newest first
        for index, (key, path, _) in enumerate(entries):
            if index < keep:
                report.kept.append((key, f"one of the {keep} newest of its model"))
            elif key in wanted:
                report.kept.append((key, "in use (--in-use)"))
            elif live(key_filename(key)):
                report.kept.append((key, "its publish lock is live"))
            else:
                candidates.append((path, f"published key beyond the {keep} newest of its model"))

    for path, reason in candidates:
        removal = Removal(path, reason, _size(path) if path.is_dir() else 0)
        if not dry_run:
            _discard(path, root)
        report.removed.append(removal)
        log.info("%s %s (%s)", "would remove" if dry_run else "removed", path, reason)
    return report


__all__ = ["PruneReport", "Removal", "lock_live", "prune"]
