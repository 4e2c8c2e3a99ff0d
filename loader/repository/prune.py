"""``model-loader prune``: remove what loaders left behind and published keys nobody needs.

What it removes, under ``ROOT`` only, and only trees carrying the loader's own marker
(:func:`loader.repository.publish.owned`: the staging marker or a manifest naming the key; a
download directory's marker names its key too):

* leftovers: staging directories of killed or stalled loaders (``.staging/``, the same rule as
  :func:`loader.repository.publish.clear_leftovers`), replaced copies (``.trash/``, once their
  key is in place again: a copy whose key is absent is put back instead,
  :func:`loader.repository.publish.recover`), download directories (``.work/<key>/``),
  the temporary directories of staging and download directories a killed loader never named
  (:meth:`loader.fs.Dir.unfinished_marked`), moved-away stale lock files;
* published keys (``ROOT/<name>@<revision>/<parallelism>-<variant>``, recognised by a manifest
  naming that very key) beyond the ``keep`` newest of each model name (by the manifest's
  ``created_at``). A key goes by one rename into ``.trash/`` first, so Triton never sees a
  half-deleted repository at a key path, then it is deleted.

**Decide, then remove under the key's lock.** Prune first looks at everything, then removes one
key's things at a time holding that key's publish lock (taken without waiting: a key whose lock
is held by a live loader is kept), and decides again for that key under the lock: a key
published or republished since prune looked (another inode or creation time) is kept, a staging
directory whose owner came back is kept. So a loader publishing meanwhile never loses its key.

What it never removes, and how it knows:

* anything of a key whose publish lock is live: held by a running process on this host, or
  rewritten (heartbeat) within ``lock_expiry_s`` by its file's modification time;
* a key named in ``in_use``: prune cannot see pods; the Helm chart passes the key its
  Deployment serves, and ``keep`` (default 2) keeps the previous key too, which old pods serve
  until a rollout finishes. Keys deployed elsewhere from the same volume must be passed with
  ``in_use`` as well. A value may be the key or the path ``run`` printed (trailing slash or
  not); one that names no published key is refused (:func:`in_use_key`);
* anything it does not recognise (no marker, another key's marker, links, other files).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loader import fs
from loader.errors import (
    LockLostError,
    LockTimeoutError,
    NameTakenError,
    NotOursError,
    RepositoryError,
    some_names,
)
from loader.formats import jsondoc
from loader.fs import Dir
from loader.limits import LOCK_EXPIRY_S, PRUNE_KEEP
from loader.repository import manifest
from loader.repository.key import key_filename
from loader.repository.lock import (
    LOCKS_DIR,
    PublishLock,
    expiry_of,
    local_pid,
    lock_like,
    pid_alive,
)
from loader.repository.publish import (
    DOWNLOAD_MARKER,
    STAGING_DIR,
    STAGING_MARKER,
    TRASH_DIR,
    TREE_MARKS,
    WORK_DIR,
    abandoned_in,
    key_is_ours_or_absent,
    ours,
    owned,
    recover,
)

log = logging.getLogger(__name__)

#: ``<name>@<revision>/<variant>``: the shape of a model key (the parts' own rules are
#: :mod:`loader.repository.key`'s).
_KEY = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9._-]*@[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
)


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


def _size(d: Dir, name: str, depth: int = 0) -> int:
    """Bytes of the files under ``d/name`` (no link followed, none deeper than a walk goes:
    :data:`loader.fs.MAX_TREE_DEPTH`)."""
    found = d.lstat(name)
    if found is None:
        return 0
    if not stat.S_ISDIR(found.st_mode):
        return found.st_size if stat.S_ISREG(found.st_mode) else 0
    if depth >= fs.MAX_TREE_DEPTH:
        return 0
    with d.sub(name) as sub:
        return sum(_size(sub, entry, depth + 1) for entry in sub.names())


def lock_live(root: Path, keyfile: str, *, expiry_s: float) -> bool:
    """Whether the publish lock of the key named ``keyfile`` may be held right now."""
    with Dir.open(root) as r:
        if not r.is_dir(LOCKS_DIR):
            return False
        with r.sub(LOCKS_DIR) as locks:
            found = locks.lstat(f"{keyfile}.lock")
            if found is None:
                return False
            try:
                content = locks.read(f"{keyfile}.lock", limit=64 * 1024) or b""
            except NotOursError:
                return True  # a link there: leave the key alone
            except fs.TooLargeError:
                return True  # larger than any lock record: someone else's, left alone
    if not lock_like(content):
        return True  # someone else's file at the lock's name: leave the key alone
    try:
        record = jsondoc.loads(content)
    except ValueError:
        record = {}
    pid = local_pid(record)
    if pid is not None:
        return pid_alive(pid)
    return time.time() - found.st_mtime < expiry_of(record, expiry_s)


def _staging_keyfile(name: str) -> str | None:
    """``<keyfile>`` of a staging name ``<keyfile>.<pid>-<host>.<token>``."""
    parts = name.rsplit(".", 2)
    if len(parts) != 3 or "-" not in parts[1]:
        return None
    return parts[0]


def _marker_key(d: Dir, name: str, marker: str) -> str | None:
    """The key the marker file in the directory ``d/name`` names (None: no marker)."""
    if not d.is_dir(name):
        return None
    try:
        with d.sub(name) as sub:
            content = sub.read(marker, limit=4096)
    except (NotOursError, OSError):
        return None
    if content is None:
        return None
    key = content.decode("utf-8", "replace").split("\n")[0]
    return key if _KEY.fullmatch(key) else None


def _tree_key(d: Dir, name: str) -> str | None:
    """The key a tree of the loader was made for: its staging marker's, else its manifest's."""
    key = _marker_key(d, name, STAGING_MARKER)
    if key is not None:
        return key
    try:
        with d.sub(name) as sub:
            data = manifest.read_manifest_in(sub)
    except (NotOursError, OSError):
        return None
    key = data.get("key") if data else None
    return key if isinstance(key, str) and _KEY.fullmatch(key) else None


def in_use_key(root: Path, value: str) -> str:
    """The key ``value`` names: a key (``name@rev/variant``) or the path of one under ``root``
    (as ``run`` prints it), with or without a trailing slash. A value that names no key
    published under ``root`` is a :class:`RepositoryError`."""
    root = Path(root).absolute()
    text = value.strip().rstrip("/")
    rel = text
    if text.startswith("/"):
        path = Path(text)
        for base, candidate in ((root, path), (Path(os.path.realpath(root)),
                                               Path(os.path.realpath(path)))):  # fmt: skip
            try:
                rel = candidate.relative_to(base).as_posix()
                break
            except ValueError:
                continue
        else:
            raise RepositoryError(
                f"--in-use {value!r} is a path outside the repository root {root}.",
                "Pass a key (NAME@REVISION/tpT-ppP-iI-VARIANT) or the path `model-loader run` "
                f"printed, under {root}.",
            )
    published = sorted(k for k, _, _ in _published(root))
    if _KEY.fullmatch(rel) and rel in published:
        return rel
    model = rel.split("@", 1)[0]
    same_model = [k for k in published if k.split("@", 1)[0] == model]
    raise RepositoryError(
        f"--in-use {value!r} names no key published under {root}.",
        "Pass a published key (NAME@REVISION/tpT-ppP-iI-VARIANT, or the path `model-loader run` "
        "printed)"
        + (f"; published for {model}: {some_names(same_model)}" if same_model else "")
        + ".",
    )


def _published(root: Path) -> list[tuple[str, os.stat_result, dict]]:
    """(key, stat of its directory, manifest) of every repository under ``root`` whose
    manifest names its key; links and files are skipped."""
    found = []
    with Dir.open(root) as r:
        for parent in r.names():
            if parent.startswith(".") or "@" not in parent or not r.is_dir(parent):
                continue
            try:
                p = r.sub(parent)
            except FileNotFoundError:  # removed by someone else since the look
                continue
            with p:
                for name in p.names():
                    entry = p.lstat(name)
                    if entry is None or not stat.S_ISDIR(entry.st_mode):
                        continue
                    key = f"{parent}/{name}"
                    try:
                        with p.sub(name) as d:
                            data = manifest.read_manifest_in(d)
                    except NotOursError:  # a link, FIFO or directory at its manifest's name
                        continue  # no key prune recognises: kept, never read through
                    except FileNotFoundError:  # removed by someone else since the look
                        continue
                    if data is not None and data.get("key") == key:
                        found.append((key, entry, data))
    return found


@dataclass
class _Candidate:
    """Something to remove, the key it belongs to, and how to check again under the key's
    lock that it still should go."""

    key: str
    path: Path
    reason: str
    #: Under the key's lock: whether it still goes (None: yes), else why it stays.
    recheck: Callable[[], str | None]
    #: Removes it; returns why it stayed after all (None: removed).
    remove: Callable[[], str | None]


def try_lock(root: Path, key: str, expiry_s: float) -> PublishLock | None:
    """The key's publish lock if no loader holds it now (never waits: a lock whose file was not
    written for ``expiry_s`` is stale); None otherwise."""
    lock = PublishLock(root, key, expiry_s=expiry_s, timeout_s=0, poll_s=0.01, judge_by_age=True)
    try:
        return lock.acquire()
    except LockTimeoutError:
        return None


def prune(
    root: Path,
    *,
    keep: int = PRUNE_KEEP.default,
    in_use: tuple[str, ...] = (),
    lock_expiry_s: float = LOCK_EXPIRY_S.default,
    dry_run: bool = False,
) -> PruneReport:
    """Remove leftovers and published keys beyond the ``keep`` newest per model name (see the
    module docstring); with ``dry_run`` only report what would go. Below ``root`` no link is
    followed (:func:`loader.fs.confined`)."""
    with fs.confined(root):
        return _prune(root, keep, in_use, lock_expiry_s, dry_run)


def _prune(
    root: Path, keep: int, in_use: tuple[str, ...], lock_expiry_s: float, dry_run: bool
) -> PruneReport:
    root = Path(root).absolute()
    PRUNE_KEEP.check(keep)
    LOCK_EXPIRY_S.check(lock_expiry_s)
    if not root.is_dir():
        raise RepositoryError(
            f"The repository root {root} {fs.not_a_directory(root)}.",
            "Point --repository at the model repository volume (e.g. /models).",
        )
    wanted = {in_use_key(root, value) for value in in_use}
    report = PruneReport(dry_run=dry_run)
    candidates = _leftovers(root, lock_expiry_s) + _old_keys(root, keep, wanted, report)

    def live(key: str) -> bool:
        return lock_live(root, key_filename(key), expiry_s=lock_expiry_s)

    by_key: dict[str, list[_Candidate]] = defaultdict(list)
    for candidate in candidates:
        by_key[candidate.key].append(candidate)
    for key, items in by_key.items():
        if dry_run:
            if live(key):
                report.kept.append((key, "its publish lock is live"))
                continue
            for c in items:
                report.removed.append(Removal(c.path, c.reason, _path_size(c.path)))
                log.info("would remove %s (%s)", c.path, c.reason)
            continue
        lock = try_lock(root, key, lock_expiry_s) if not live(key) else None
        if lock is None:
            report.kept.append((key, "its publish lock is live"))
            continue
        try:
            recover(root, key)
            for c in items:
                if not _still_held(lock):
                    report.kept.append((key, "its publish lock was taken over meanwhile"))
                    break
                why = _gone_meanwhile(c.recheck)
                if why is not None:
                    report.kept.append((key, why))
                    continue
                size = _path_size(c.path)
                why = _gone_meanwhile(c.remove)
                if why is not None:
                    report.kept.append((key, why))
                    continue
                report.removed.append(Removal(c.path, c.reason, size))
                log.info("removed %s (%s)", c.path, c.reason)
        finally:
            lock.release()
    report.removed += _stale_lock_files(root, dry_run)
    return report


def _gone_meanwhile(step: Callable[[], str | None]) -> str | None:
    """``step()`` (a candidate's recheck or removal); a name it works on that someone else
    removed since prune looked (``ENOENT``) only means the candidate is gone meanwhile."""
    try:
        return step()
    except FileNotFoundError:
        return "gone meanwhile"


def _path_size(path: Path) -> int:
    try:
        with Dir.open(path.parent) as d:
            return _size(d, path.name)
    except (FileNotFoundError, NotADirectoryError):
        return 0


def _still_held(lock: PublishLock) -> bool:
    """Whether prune still holds ``lock``: a prune stalled past the expiry (stopped, swapped
    out, a hung volume) had its lock taken over by a loader of the key, which may have
    published it again, or handed it to its user as published, meanwhile; nothing more of
    the key is removed then."""
    try:
        lock.check_held()
    except (LockLostError, OSError):
        return False
    return True


def _leftovers(root: Path, lock_expiry_s: float) -> list[_Candidate]:
    """Abandoned staging directories, replaced copies and download directories, each with
    the key it belongs to."""
    found: list[_Candidate] = []
    with Dir.open(root) as r:
        if r.is_dir(STAGING_DIR):
            with r.sub(STAGING_DIR) as base:
                for name in base.names():
                    keyfile = _staging_keyfile(name)
                    key = _tree_key(base, name)
                    if keyfile is None or key is None or key_filename(key) != keyfile:
                        continue
                    if abandoned_in(base, name, keyfile, idle_s=lock_expiry_s):
                        found.append(_in(root, STAGING_DIR, name, key,
                                         "staging directory of a loader that is gone",
                                         abandoned_too=(keyfile, lock_expiry_s)))  # fmt: skip
        if r.is_dir(TRASH_DIR):
            with r.sub(TRASH_DIR) as trash:
                for name in trash.names():
                    key = _tree_key(trash, name)
                    if key is None or not name.startswith(key_filename(key) + "."):
                        continue
                    found.append(_in(root, TRASH_DIR, name, key,
                                     "replaced copy left by an interrupted publish"))  # fmt: skip
        if r.is_dir(WORK_DIR):
            with r.sub(WORK_DIR) as work:
                for name in work.names():
                    key = _marker_key(work, name, DOWNLOAD_MARKER)
                    if key is None or key_filename(key) != name:
                        continue
                    found.append(_in(root, WORK_DIR, name, key,
                                     "download directory of an unfinished run",
                                     marker=DOWNLOAD_MARKER))  # fmt: skip
        for directory, marker in ((STAGING_DIR, STAGING_MARKER), (WORK_DIR, DOWNLOAD_MARKER)):
            if r.is_dir(directory):
                with r.sub(directory) as d:
                    found += _unfinished(root, d, directory, marker, lock_expiry_s)
    return found


def _unfinished(
    root: Path, d: Dir, directory: str, marker: str, lock_expiry_s: float
) -> list[_Candidate]:
    """The temporary directories of staging or download directories never named (their
    loader was killed before the rename: :meth:`loader.fs.Dir.unfinished_marked`)."""
    found = []
    for name in d.names():
        if not name.endswith(".tmp"):
            continue
        key = _marker_key(d, name, marker)
        if key is None:
            continue
        prefix = key_filename(key) + "."

        def gone(name: str = name, key: str = key, prefix: str = prefix) -> str | None:
            with Dir.open(root) as r:
                if not r.is_dir(directory):
                    return "gone meanwhile"
                with r.sub(directory) as sub:
                    unfinished = sub.unfinished_marked(prefix, marker, key, idle_s=lock_expiry_s)
            return None if name in unfinished else f"{directory}/{name} is in use or not ours"

        if gone() is None:
            found.append(_Candidate(key, root / directory / name,
                                    "directory a loader stopped before naming it", gone,
                                    _remover(root, directory, name, key, marker)))  # fmt: skip
    return found


def _remover(
    root: Path, directory: str, name: str, key: str, marker: str | None
) -> Callable[[], str | None]:
    """Removes ``ROOT/<directory>/<name>`` while it is a tree of ``key``'s (``marker``'s, or
    with None the staging marker's or a manifest's), judged and removed as one directory: one
    renamed to its name since is kept."""

    def remove() -> str | None:
        with Dir.open(root) as r, r.sub(directory) as d:
            judged = (ours(d, name, key) if marker is None
                      else ours(d, name, key, marker=marker, manifests=False))  # fmt: skip
            if judged is None:
                return f"{directory}/{name} is not the loader's"
            d.remove_tree(name, marks=(marker,) if marker else TREE_MARKS, expected=judged)
        return None

    return remove


def _in(
    root: Path,
    directory: str,
    name: str,
    key: str,
    reason: str,
    *,
    marker: str | None = None,
    abandoned_too: tuple[str, float] | None = None,
) -> _Candidate:
    """A leftover ``ROOT/<directory>/<name>`` of ``key``: still the loader's (and abandoned)
    under the lock, it goes."""

    def recheck() -> str | None:
        with Dir.open(root) as r:
            if not r.is_dir(directory):
                return "gone meanwhile"
            with r.sub(directory) as d:
                if d.lstat(name) is None:
                    return "gone meanwhile"
                ours = _marker_key(d, name, marker) == key if marker else owned(d, name, key)
                if not ours:
                    return f"{directory}/{name} is not the loader's"
                if directory == TRASH_DIR and not key_is_ours_or_absent(root, key):
                    return f"{key} holds a directory not the loader's: {name} is its only copy"
                if abandoned_too and not abandoned_in(d, name, abandoned_too[0],
                                                      idle_s=abandoned_too[1]):  # fmt: skip
                    return f"{directory}/{name} is in use again"
        return None

    return _Candidate(
        key, root / directory / name, reason, recheck, _remover(root, directory, name, key, marker)
    )


def _old_keys(root: Path, keep: int, wanted: set[str], report: PruneReport) -> list[_Candidate]:
    """Published keys beyond the ``keep`` newest of their model and not in ``wanted``."""
    by_model: dict[str, list[tuple[str, os.stat_result, dict]]] = defaultdict(list)
    for key, entry, data in _published(root):
        by_model[str(data.get("model_name") or key.split("@", 1)[0])].append((key, entry, data))
    found = []
    for entries in by_model.values():
        entries.sort(key=lambda e: (str(e[2].get("created_at") or ""), e[1].st_mtime))
        entries.reverse()  # newest first
        for index, (key, entry, data) in enumerate(entries):
            if index < keep:
                report.kept.append((key, f"one of the {keep} newest of its model"))
            elif key in wanted:
                report.kept.append((key, "in use (--in-use)"))
            else:
                found.append(_old_key(root, key, entry, data, keep))
    return found


def _old_key(root: Path, key: str, seen: os.stat_result, data: dict, keep: int) -> _Candidate:
    parent_name, variant = key.split("/", 1)

    def recheck() -> str | None:
        with Dir.open(root) as r:
            if not r.is_dir(parent_name):
                return "gone meanwhile"
            with r.sub(parent_name) as p:
                now = p.lstat(variant)
                if now is None:
                    return "gone meanwhile"
                try:
                    with p.sub(variant) as d:
                        fresh = manifest.read_manifest_in(d)
                except NotOursError:  # something else put at its manifest's name meanwhile
                    fresh = None
        if (
            (now.st_ino, now.st_dev) != (seen.st_ino, seen.st_dev)
            or fresh is None
            or (fresh.get("created_at") != data.get("created_at") or fresh.get("key") != key)
        ):
            return "published again since prune looked"
        return None

    def remove() -> str | None:
        with Dir.open(root) as r, r.sub(TRASH_DIR, create=True) as trash:
            aside = f"{key_filename(key)}.{secrets.token_hex(6)}"
            with r.sub(parent_name) as p:  # (removed since the look above: gone meanwhile)
                p.rename(variant, trash, aside, how="replace")
                p.fsync()
                moved = trash.lstat(aside)
                if moved is None:
                    return "gone meanwhile"
                if (moved.st_ino, moved.st_dev) != (seen.st_ino, seen.st_dev):
                    # Another directory was put at the key's name after the look above (a
                    # rename of the user's): it goes back, untouched.
                    try:
                        trash.rename_back(aside, p, variant)
                    except OSError as exc:
                        raise RepositoryError(
                            f"A directory renamed to {p.path / variant} while prune removed "
                            f"that key was moved to {trash.path / aside}, and the rename "
                            f"putting it back failed ({exc.strerror or exc}): it is there, "
                            "untouched.",
                            f"Move {trash.path / aside} back where it belongs.",
                        ) from exc
                    return f"{key} was replaced by another directory meanwhile"
            trash.remove_tree(aside, marks=TREE_MARKS, expected=(seen.st_dev, seen.st_ino))
            with contextlib.suppress(OSError):  # removed, or published into, meanwhile
                with r.sub(parent_name) as p:
                    empty = not p.names()
                if empty:
                    r.rmdir(parent_name)  # the <name>@<revision> directory, now empty
        return None

    return _Candidate(
        key, root / key, f"published key beyond the {keep} newest of its model", recheck, remove
    )


#: The name a take-over gives the lock file it moves aside (``PublishLock._take_over``):
#: ``<key as one file name>.lock.stale-<its token>``.
_MOVED_LOCK = re.compile(r".+\.lock\.stale-[0-9a-f]{16}")


def _stale_lock_files(root: Path, dry_run: bool) -> list[Removal]:
    """Lock files a take-over moved away and did not remove (a killed waiter)."""
    removed = []
    with Dir.open(root) as r:
        if not r.is_dir(LOCKS_DIR):
            return []
        with r.sub(LOCKS_DIR) as locks:
            for name in locks.names():
                if not _MOVED_LOCK.fullmatch(name) or locks.kind(name) != "a file":
                    continue
                try:
                    found = locks.read_judged(name, limit=64 * 1024)
                except NotOursError:  # swapped for something else since: not ours
                    continue
                except fs.TooLargeError:
                    continue  # larger than any lock record: someone else's
                if found is None or not lock_like(found[0]):
                    continue  # someone else's file of a similar name
                # Removed only while it is the very file read: a user's file renamed to its
                # name after the read stays (moved aside to a name prune removes only once
                # it holds a lock record, and put back when it is not the file read).
                aside = f"{name.rsplit('.stale-', 1)[0]}.stale-{secrets.token_hex(8)}"
                try:
                    if not dry_run and not locks.unlink_judged(name, found[1], aside):
                        continue
                except NameTakenError as exc:  # something at the fresh name: never replaced
                    log.warning(
                        "kept the moved-away stale lock file %s: the name %s it is moved to "
                        "before its removal holds %s the loader did not put there; move %s "
                        "away (it stays as it is), then prune again to remove the stale lock",
                        locks.path / name, exc.filename, exc.found, exc.filename,
                    )  # fmt: skip
                    continue
                removed.append(Removal(locks.path / name, "moved-away stale lock file", 0))
                log.info("%s %s", "would remove" if dry_run else "removed", locks.path / name)
    return removed


__all__ = ["PruneReport", "Removal", "in_use_key", "lock_live", "prune"]
