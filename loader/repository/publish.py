"""Staging directories and the atomic rename that publishes a repository.

Everything is written under ``ROOT/.staging/<key>.<owner>.<token>/`` (same filesystem as
``ROOT``, so the final rename is atomic) and then renamed to ``ROOT/<key>``. Triton is pointed
at ``ROOT/<key>`` only, so it never sees a half-written repository: ``ROOT/<key>`` is either
absent or complete. Every step works relative to directory descriptors (:mod:`loader.fs`): a
link or a file where the loader's own directory belongs (``ROOT/<name>@<revision>``,
``.staging``, ``.trash``) is a :class:`~loader.errors.NotOursError`, never followed.

A staging directory carries the loader's marker (:data:`STAGING_MARKER`, naming the key) from
the moment it is created; a published key is recognised by its manifest naming it. Nothing else
is ever removed (:func:`owned`).

Publishing, in order (:func:`publish`):

1. every file and directory of the staging directory gets mode 0644 / 0755 (whatever the
   umask) and is fsynced: the data is durable before any name points at it (:func:`seal`);
2. ``ROOT/<name>@<revision>`` is created if absent, and then ``ROOT`` is fsynced;
3. one rename of the staging directory to ``ROOT/<key>``: ``renameat2(RENAME_NOREPLACE)`` when
   the key is absent (a key that appeared meanwhile is a :class:`PublishError`; nothing is
   merged into it), ``renameat2(RENAME_EXCHANGE)`` when it replaces a published copy
   (``--force``, ``--follow-source``): the two trees swap in one step, so a complete copy is
   under the key at every moment; the old one, now in the staging directory's place, is
   removed after;
4. an fsync of ``ROOT/<name>@<revision>``, so the new name is durable.

**Where the file system lacks renameat2** (some NFS servers answer EINVAL): a new key is
published with ``rename(2)``, which still refuses a non-empty target; a replaced key is first
renamed into ``ROOT/.trash/`` and the new copy renamed into place right after. A loader killed
between those two renames leaves the key absent for a moment, and the previous copy in
``.trash``: the next loader of the key puts it back before anything else (:func:`recover`), so
a rerun while the source is unreachable still finds a complete copy.

``<owner>`` is ``<pid>-<host digest>`` of the loader that created a staging directory. The next
loader holding the key's lock removes what earlier loaders left (:func:`clear_leftovers`): a
staging directory whose owner ran on this host and is gone, or in which nothing changed for the
lock expiry (its owner lost the lock then, and stops before publishing), and the key's
``.trash`` entries (once the key is in place).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import time
from pathlib import Path

from loader import fs
from loader.errors import DirectoryRemovedError, NotOursError, PublishError
from loader.fs import NO_RENAMEAT2, Dir, host_digest, pid_alive
from loader.repository import manifest
from loader.repository.key import key_filename

log = logging.getLogger(__name__)

STAGING_DIR = ".staging"
TRASH_DIR = ".trash"
#: Default parent of download directories (``--work-dir``), and the file marking a download
#: directory the loader created (the only kind it ever removes; removed last of the tree).
WORK_DIR = ".work"
DOWNLOAD_MARKER = fs.MARKER_PREFIX + "download"
#: The file marking a staging directory (and so a repository it published) as the loader's:
#: its first line is the key.
STAGING_MARKER = manifest.STAGING_MARKER
FILE_MODE = fs.FILE_MODE
DIR_MODE = fs.DIR_MODE
#: What marks a staging directory, or a published copy, of a loader that kept no record of what
#: it made (:meth:`loader.fs.Dir.remove_tree`'s ``marks``): a directory without a record and
#: without either is someone else's, never removed.
TREE_MARKS = (STAGING_MARKER, manifest.MANIFEST)


def published_path(root: Path, key: str) -> Path:
    return Path(root).absolute() / key


def _split(key: str) -> tuple[str, str]:
    """``<name>@<revision>`` and the variant directory of a key."""
    parent, _, variant = key.partition("/")
    return parent, variant


#: What a staging directory is, for :func:`check_staging`: its device and inode.
Identity = tuple[int, int]


def identity(path: Path) -> Identity:
    """The device and inode of the staging directory at ``path`` (entered without following a
    link): one without the loader's record (:data:`loader.fs.MADE`) is not the one
    :func:`new_staging_dir` made (a :class:`~loader.errors.NotOursError`)."""
    path = Path(path).absolute()
    with Dir.open(path.parent) as parent, _entered(parent, path.name) as d:
        if d.made is None:
            raise parent.not_ours(path.name, "the staging directory this run made")
        found = d.stat()
    return found.st_dev, found.st_ino


def _entered(parent: Dir, name: str) -> Dir:
    """The run's staging directory ``parent/name``; gone from its name (removed, or renamed
    away, by someone else while the run worked) it is a
    :class:`~loader.errors.DirectoryRemovedError` (exit 75: running again starts anew), not a
    name the loader lost (a bug's ``ENOENT``)."""
    try:
        return parent.sub(name)
    except FileNotFoundError as exc:
        if isinstance(exc, DirectoryRemovedError):
            raise
        raise DirectoryRemovedError(parent.path / name, parent.path / name) from None


def _check_at(base: Dir, name: str, expected: Identity | None) -> None:
    if expected is None:
        return
    found = base.lstat(name)
    if found is None:  # removed (or moved away) by someone else while the run worked
        raise DirectoryRemovedError(base.path / name, base.path / name)
    ours = _same(found, expected)
    if ours and stat.S_ISDIR(found.st_mode):  # and it holds the record it was made with: a
        with _entered(base, name) as d:  # directory made after it was removed can have its inode
            ours = d.made is not None and _same(d.stat(), expected)
    if not ours:
        raise base.not_ours(
            name, "the staging directory this run made (something was renamed to its name "
            "while the run worked)",
        )  # fmt: skip


def _same(found: os.stat_result | None, expected: Identity) -> bool:
    """Whether ``found`` (an entry's stat; None: no entry) is the directory ``expected`` names."""
    return found is not None and (found.st_dev, found.st_ino) == tuple(expected)


def check_staging(staging: Path, expected: Identity) -> None:
    """That ``staging`` is still the very directory this run made (``expected``: its
    :func:`identity` then): a directory someone renamed to its name meanwhile is a
    :class:`~loader.errors.NotOursError`, never built into, sealed or published."""
    staging = Path(staging).absolute()
    with Dir.open(staging.parent) as base:
        _check_at(base, staging.name, expected)


def new_staging_dir(root: Path, key: str) -> Path:
    """A fresh, empty staging directory for ``key`` under ``root``, named after its owner and
    marked as the loader's."""
    name = f"{key_filename(key)}.{fs.owner()}.{secrets.token_hex(6)}"
    with Dir.open(root, create=True) as r, r.sub(STAGING_DIR, create=True) as base:
        if not base.make_marked(name, STAGING_MARKER, key):  # its new name, taken meanwhile
            raise base.not_ours(name, f"the loader's new staging directory for {key}")
        return base.path / name


def _key_directory(root: Path, key: str) -> tuple[Dir, str] | None:
    """``ROOT/<name>@<revision>`` of ``key``, opened from ``ROOT`` without following a link (a
    link or a file there is a :class:`NotOursError`), and the variant's name in it; None when
    ROOT or that directory is absent. The caller closes the directory."""
    parent_name, variant = _split(key)
    try:
        with Dir.open(root) as r:
            if r.lstat(parent_name) is None:
                return None
            return r.sub(parent_name, what="key directory"), variant
    except FileNotFoundError:
        return None


def open_published(root: Path, key: str) -> Dir | None:
    """The published directory of ``key``, opened from ``ROOT`` without following any link
    (a link or a file there is a :class:`NotOursError`); None when absent."""
    found = _key_directory(root, key)
    if found is None:
        return None
    parent, variant = found
    with parent:
        if parent.lstat(variant) is None:
            return None
        return parent.sub(variant, what="published repository")


def present(root: Path, key: str) -> bool:
    """Whether anything (a link too) is at ``ROOT/<key>``, looked up from ``ROOT`` one name at
    a time (a link or a file at ``ROOT/<name>@<revision>`` is a :class:`NotOursError`).
    Reads only."""
    try:
        found = _key_directory(root, key)
    except NotADirectoryError:
        return False
    if found is None:
        return False
    parent, variant = found
    with parent:
        return parent.lstat(variant) is not None


def discard_staging(staging: Path, key: str, expected: Identity | None = None) -> None:
    """Remove the staging directory ``staging`` of ``key`` (if it is still the loader's; with
    ``expected``, its :func:`identity`: only while it is that very directory. A published copy
    a failed put-back left at its name, or a directory someone renamed there, is kept)."""
    staging = Path(staging).absolute()
    with Dir.open(staging.parent) as base:
        judged = ours(base, staging.name, key)
        if judged is not None:
            base.remove_tree(staging.name, marks=TREE_MARKS, expected=expected or judged)


def owned(parent: Dir, name: str, key: str) -> bool:
    """Whether ``parent/name`` is a tree the loader made for ``key``: a real directory with the
    staging marker naming ``key``, or a manifest naming it (a published copy)."""
    return ours(parent, name, key) is not None


def ours(
    parent: Dir, name: str, key: str, *, marker: str = STAGING_MARKER, manifests: bool = True
) -> Identity | None:
    """The device and inode of ``parent/name`` when it is a tree the loader made for ``key``
    (``marker``'s first line naming ``key``, or with ``manifests`` a manifest naming it), judged
    on one descriptor of it; None otherwise. Removing it with ``expected`` set to this removes
    only the very directory judged: one someone renamed to its name since is kept whole."""
    if not parent.is_dir(name):
        return None
    try:
        with parent.sub(name) as d:
            found = d.stat()
            try:
                mark = d.read(marker, limit=4096)
            except (NotOursError, FileNotFoundError, IsADirectoryError, fs.TooLargeError):
                mark = None
            if mark is not None and mark.decode("utf-8", "replace").split("\n")[0] == key:
                return found.st_dev, found.st_ino
            data = manifest.read_manifest_in(d) if manifests else None
    except (NotOursError, FileNotFoundError, NotADirectoryError):
        return None
    return (found.st_dev, found.st_ino) if data is not None and data.get("key") == key else None


def _owner(name: str, prefix: str) -> tuple[int, str] | None:
    """(pid, host digest) from a staging name ``<prefix>.<pid>-<host>.<token>``."""
    owner = name[len(prefix) + 1 :].rsplit(".", 1)[0]
    pid, _, host = owner.partition("-")
    return (int(pid), host) if pid.isascii() and pid.isdigit() and host else None


def _last_change(d: Dir, name: str, depth: int = 0) -> float:
    """The newest modification time of ``d/name`` and everything under it (no link
    followed, nothing deeper than a walk goes: :data:`loader.fs.MAX_TREE_DEPTH`)."""
    found = d.lstat(name)
    if found is None:
        raise FileNotFoundError(errno.ENOENT, "gone", str(d.path / name))
    newest = found.st_mtime
    if stat.S_ISDIR(found.st_mode) and depth < fs.MAX_TREE_DEPTH:
        with d.sub(name) as sub:
            for entry in sub.names():
                try:
                    newest = max(newest, _last_change(sub, entry, depth + 1))
                except FileNotFoundError:
                    continue
    return newest


def last_change(path: Path) -> float:
    """The newest modification time of ``path`` and everything under it (no links followed)."""
    path = Path(path).absolute()
    with Dir.open(path.parent) as parent:
        return _last_change(parent, path.name)


def abandoned_in(parent: Dir, name: str, prefix: str, *, idle_s: float) -> bool:
    """Whether the staging directory ``parent/name``'s owner is gone: on this host and dead,
    or silent for ``idle_s`` seconds (nothing under it changed)."""
    owner = _owner(name, prefix)
    if owner is not None and owner[1] == host_digest():
        if owner[0] == os.getpid():
            return False
        if not pid_alive(owner[0]):
            return True
    try:
        return time.time() - _last_change(parent, name) >= idle_s
    except (FileNotFoundError, NotOursError):
        return False


def abandoned(path: Path, prefix: str, *, idle_s: float) -> bool:
    """:func:`abandoned_in` for a path."""
    path = Path(path).absolute()
    with Dir.open(path.parent) as parent:
        return abandoned_in(parent, path.name, prefix, idle_s=idle_s)


def _entries(r: Dir, directory: str, prefix: str) -> list[str]:
    """Names in ``ROOT/<directory>`` that start with ``<prefix>.`` (none if it is absent)."""
    if r.lstat(directory) is None:
        return []
    with r.sub(directory) as d:
        return [n for n in d.names() if n.startswith(prefix + ".")]


def staging_left(root: Path, key: str) -> bool:
    """Whether ``ROOT/.staging`` holds a directory named after ``key`` (reads only)."""
    try:
        with Dir.open(root) as r:
            return bool(_entries(r, STAGING_DIR, key_filename(key)))
    except (FileNotFoundError, NotADirectoryError, NotOursError):
        return False


def replaced_copy_waiting(root: Path, key: str) -> bool:
    """Whether ``key`` is absent and ``.trash`` holds an entry named after it (a replacement
    the fallback started and a kill stopped: :func:`recover` puts it back). Reads only."""
    root = Path(root).absolute()
    if present(root, key):
        return False
    prefix = key_filename(key) + "."
    try:
        with Dir.open(root) as r:
            if not r.is_dir(TRASH_DIR):
                return False
            with r.sub(TRASH_DIR) as trash:
                return any(n.startswith(prefix) for n in trash.names())
    except (FileNotFoundError, NotADirectoryError, NotOursError):
        return False


def recover(root: Path, key: str) -> Path | None:
    """Put a replaced copy back under an absent key: what a loader killed between the two
    renames of the fallback replacement leaves (see the module docstring). Call under the
    key's lock; returns the key's path when a copy was put back."""
    root = Path(root).absolute()
    parent_name, variant = _split(key)
    prefix = key_filename(key)
    with Dir.open(root, create=True) as r:
        if r.lstat(TRASH_DIR) is None:
            return None
        with r.sub(TRASH_DIR) as trash:
            candidates = [n for n in trash.names() if n.startswith(prefix + ".")]
            if not candidates:
                return None
            if r.is_dir(parent_name):
                with r.sub(parent_name) as parent:
                    if parent.lstat(variant) is not None:
                        return None
            made: list[tuple[int, int]] = []  # the key's directory, when made here
            try:
                put = _recover_from(r, trash, candidates, key, parent_name, variant, made)
            except BaseException:
                _unmake_key_directory(r, parent_name, made)
                raise
            if put is None:
                _unmake_key_directory(r, parent_name, made)
            return put


def _unmake_key_directory(r: Dir, parent_name: str, made: list[tuple[int, int]]) -> None:
    """Remove the key's directory :func:`recover` made for a put-back that did not happen,
    only while it is that very directory, still empty (an empty ``<name>@<rev>`` stayed)."""
    if made:
        with contextlib.suppress(OSError):
            r.rmdir_made(parent_name, made[0])


def _recover_from(
    r: Dir,
    trash: Dir,
    candidates: list[str],
    key: str,
    parent_name: str,
    variant: str,
    made: list[tuple[int, int]],
) -> Path | None:
    """:func:`recover`'s put-back of the first complete copy among ``candidates``; the key's
    directory, when made here, is appended to ``made``."""
    for name in candidates:
        if not trash.is_dir(name):  # a file or link of someone else's: no copy
            continue
        try:
            with trash.sub(name) as copy:
                judged = copy.stat()
                complete = not manifest.verify_in(copy, key=key, checksums=False)
        except NotOursError:  # a link in it, swapped for it: someone else's
            continue
        if not complete:
            continue
        # The key's directory is made only for a copy to put back (an empty one was
        # left when no copy in .trash was complete).
        if r.mkdir(parent_name, exist_ok=True, what="key directory"):
            found = r.lstat(parent_name)
            if found is not None:
                made.append((found.st_dev, found.st_ino))
        with r.sub(parent_name) as parent:
            if parent.lstat(variant) is not None:
                return None
            try:  # never over what was put at the key while the copy was checked
                trash.rename_back(name, parent, variant)
            except FileNotFoundError:
                continue  # removed by someone else since it was checked
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                log.warning("left the previous copy of %s at %s: %s appeared "
                            "meanwhile", key, trash.path / name,
                            parent.path / variant)  # fmt: skip
                return None
            if not _same(parent.lstat(variant), (judged.st_dev, judged.st_ino)):
                # Something renamed to the copy's name after it was checked (a
                # directory or link of the user's) went to the key: back, untouched.
                _put_back_unchecked(parent, variant, trash, name)
                continue
            parent.fsync()
            log.warning(
                "put the previous copy of %s back from %s (a loader was stopped "
                "while replacing it)",
                key,
                trash.path / name,
            )
            return parent.path / variant
    return None


def _put_back_unchecked(parent: Dir, variant: str, trash: Dir, name: str) -> None:
    """Move what :func:`recover` put at the key, which is not the copy it checked, back to
    its name in ``.trash``; a failure is a :class:`PublishError` saying where it is."""
    try:
        parent.rename_back(variant, trash, name)
    except OSError as exc:
        raise PublishError(
            f"{trash.path / name} was replaced after the loader checked it as the previous copy "
            f"of the key, and went to {parent.path / variant}; the rename putting it back "
            f"failed ({exc.strerror or exc}).",
            f"Move {parent.path / variant} back where it belongs, then run again.",
        ) from exc
    log.warning("kept %s: renamed there after the loader checked the copy it held",
                trash.path / name)  # fmt: skip


def clear_leftovers(root: Path, key: str, *, idle_s: float) -> list[Path]:
    """Remove what earlier loaders of ``key`` left: abandoned staging directories, the
    key's ``.trash`` entries and the temporary directories of staging directories never named
    (:meth:`loader.fs.Dir.unfinished_marked`), only those carrying the loader's marker
    (:func:`owned`). Call under the key's lock, after :func:`recover`."""
    root = Path(root).absolute()
    prefix = key_filename(key)
    removed: list[Path] = []
    with Dir.open(root, create=True) as r:
        for name in _entries(r, STAGING_DIR, prefix):
            with r.sub(STAGING_DIR) as base:
                path = base.path / name
                if not abandoned_in(base, name, prefix, idle_s=idle_s):
                    continue
                if _remove_ours(base, name, key, "leftover staging directory"):
                    removed.append(path)
        for name in _entries(r, TRASH_DIR, prefix) if key_is_ours_or_absent(root, key) else ():
            with r.sub(TRASH_DIR) as trash:
                if _remove_ours(trash, name, key, "the replaced copy"):
                    removed.append(trash.path / name)
        if r.is_dir(STAGING_DIR):  # a staging directory whose loader stopped before naming it
            with r.sub(STAGING_DIR) as base:
                for name in base.unfinished_marked(prefix + ".", STAGING_MARKER, key,
                                                   idle_s=idle_s):  # fmt: skip
                    judged = ours(base, name, key, manifests=False)
                    if judged is None:  # (renamed away meanwhile)
                        continue
                    log.info("removing unfinished staging directory %s", base.path / name)
                    base.remove_tree(name, marks=TREE_MARKS, expected=judged)
                    removed.append(base.path / name)
    return removed


def key_is_ours_or_absent(root: Path, key: str) -> bool:
    """Whether ``ROOT/<key>`` is absent or the loader's copy of ``key``: while a directory of
    someone else's is there (one renamed to a staging name that a replacement moved to the key,
    the rename putting it back failed), the previous copy in ``.trash`` is the key's only
    copy, kept."""
    found = _key_directory(root, key)
    if found is None:
        return True
    parent, variant = found
    with parent:
        return parent.lstat(variant) is None or owned(parent, variant, key)


def _remove_ours(d: Dir, name: str, key: str, what: str) -> bool:
    """Remove the tree ``name`` in ``d`` if it carries the loader's marker for ``key``."""
    path = d.path / name
    judged = ours(d, name, key)
    if judged is None:
        if d.is_dir(name):
            # A removal stopped after the marker, before the directory itself went, leaves
            # it empty: an empty directory holds nothing of anyone's (rmdir fails otherwise).
            with contextlib.suppress(OSError):
                d.rmdir(name)
                log.info("removed the empty %s %s", what, path)
                return True
        log.warning("leaving %s alone: the loader did not create it", path)
        return False
    log.info("removing %s %s", what, path)
    d.remove_tree(name, marks=TREE_MARKS, expected=judged)
    return True


def _seal(d: Dir, depth: int = 0) -> None:
    for name in d.names():
        found = d.lstat(name)
        if found is None:
            continue
        if stat.S_ISDIR(found.st_mode) and depth >= fs.MAX_TREE_DEPTH:
            raise NotOursError(
                d.path / name,
                f"a directory nested over {fs.MAX_TREE_DEPTH} levels deep",
                "a directory the loader wrote",
            )
        if stat.S_ISDIR(found.st_mode):
            with d.sub(name) as sub:
                _seal(sub, depth + 1)
            d.chmod(name, DIR_MODE)
        elif stat.S_ISREG(found.st_mode):
            d.chmod(name, FILE_MODE)
            d.fsync_file(name)  # a FIFO swapped in meanwhile is refused, never opened to block
        else:
            raise d.not_ours(name, "a file or directory the loader wrote")
    d.fsync()


def seal(tree: Path, expected: Identity | None = None) -> None:
    """Give every file 0644 and every directory 0755 (only where the mode differs) and fsync
    them, deepest first, so the data is durable before the rename makes it visible. A link
    or any other kind of entry in the tree is a :class:`NotOursError`: the loader writes none.
    With ``expected`` (a staging directory's :func:`identity`), the directory opened is
    checked to be that very one before any mode changes in it."""
    tree = Path(tree).absolute()
    with Dir.open(tree.parent) as parent, _entered(parent, tree.name) as d:
        if expected is not None and (d.made is None or not _same(d.stat(), expected)):
            raise parent.not_ours(tree.name, "the staging directory this run made (something "
                                  "was renamed to its name while the run worked)")  # fmt: skip
        _seal(d)
        d.set_mode(DIR_MODE)  # (by its descriptor: what is at its name now may be another's)


def publish(
    staging: Path,
    root: Path,
    key: str,
    *,
    replace: bool = False,
    expected: Identity | None = None,
) -> Path:
    """Rename ``staging`` (a directory of ``ROOT/.staging``) to ``ROOT/<key>`` (see the module
    docstring); with ``replace`` a published copy is exchanged for it. Returns the published
    path."""
    root = Path(root).absolute()
    staging = Path(staging).absolute()
    target = published_path(root, key)
    seal(staging, expected)
    try:
        _publish(staging, root, key, replace=replace, expected=expected)
    except DirectoryRemovedError as exc:
        # ``prune`` removes ``<name>@<revision>`` once its last key is gone: the one this
        # loader had just opened (the rename failed: the staging directory is where it was).
        if exc.directory != root / _split(key)[0]:
            raise
        log.info("%s was removed meanwhile (pruned); making it again", exc.directory)
        _publish(staging, root, key, replace=replace, expected=expected)
    except FileNotFoundError:
        if _staging_present(staging):
            raise
        # The staging directory removed (rm -rf) between the last look and the rename.
        raise DirectoryRemovedError(staging, staging) from None
    log.info("published %s", target)
    return target


def _staging_present(staging: Path) -> bool:
    """Whether anything is at the staging directory's name (a look on a failure's path)."""
    try:
        with Dir.open(staging.parent) as base:
            return base.lstat(staging.name) is not None
    except OSError:
        return False


def _publish(
    staging: Path, root: Path, key: str, *, replace: bool, expected: Identity | None
) -> None:
    target = published_path(root, key)
    parent_name, variant = _split(key)
    with Dir.open(root) as r:
        if r.mkdir(parent_name, exist_ok=True, what="key directory"):
            r.fsync()  # the new <name>@<revision> directory is durable before a key is in it
        with r.sub(STAGING_DIR) as base, r.sub(parent_name, what="key directory") as parent:
            _warn_unless_others_enter(r)
            _warn_unless_others_enter(parent)
            if staging.parent != base.path:
                raise ValueError(f"{staging} is not a directory of {base.path}")
            _check_at(base, staging.name, expected)
            found = parent.lstat(variant)
            if found is not None and not stat.S_ISDIR(found.st_mode):
                raise parent.not_ours(variant, "a published repository")
            if found is not None and not replace:
                raise PublishError(
                    f"{target} already exists.",
                    "Run again with --force to publish a fresh copy.",
                )
            if found is not None and not owned(parent, variant, key):
                raise parent.not_ours(variant, f"a repository the loader published for {key}")
            if found is not None:
                _exchange(r, base, staging.name, parent, variant, key, expected)
            else:
                _rename_new(base, staging.name, parent, variant, target)
                _moved_back_unless(base, staging.name, parent, variant, expected, "noreplace")
            parent.fsync()


def _warn_unless_others_enter(d: Dir) -> None:
    """Warn when others may not search and read ``d`` (a ROOT or ``<name>@<rev>`` the user made
    0700): a Triton running as another uid could not load what is published in it. Not an
    error: the chart runs both as one uid."""
    mode = stat.S_IMODE(d.stat().st_mode)
    if mode & 0o005 != 0o005:
        log.warning(
            "%s has mode %04o: a Triton running as another uid cannot enter it to load the "
            "model; chmod a+rx %s, or run Triton as the same uid as the loader",
            d.path, mode, d.path,
        )  # fmt: skip


def _appeared(target: Path, exc: OSError) -> PublishError:
    return PublishError(
        f"{target} appeared while this loader was publishing it; nothing was merged into it.",
        "Another loader published the same key; run again to verify it.",
    )


def _rename_new(base: Dir, name: str, parent: Dir, variant: str, target: Path) -> None:
    """Rename the staging directory to the absent key."""
    try:
        base.rename(name, parent, variant, how="noreplace")
        return
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise _appeared(target, exc) from exc
        if exc.errno not in NO_RENAMEAT2:
            raise
    if parent.lstat(variant) is not None:
        raise _appeared(target, OSError(errno.EEXIST, "exists"))
    try:
        base.rename(name, parent, variant, how="replace")  # rename(2) refuses a non-empty target
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise _appeared(target, exc) from exc
        raise


def _moved_back_unless(
    base: Dir, name: str, parent: Dir, variant: str, expected: Identity | None, how: str
) -> None:
    """After the rename of ``base/name`` to the key: unless what is at the key now is the
    staging directory this run made (``expected``), it was a directory someone renamed to the
    staging name in the instant before: it goes back (``how``: ``noreplace`` after a new key,
    ``exchange`` after a replacement, which brings the published copy back too), and nothing
    is published."""
    if expected is None:
        return
    if _same(parent.lstat(variant), expected):
        return
    try:
        if how == "exchange":
            base.rename(name, parent, variant, how="exchange")
        else:
            parent.rename_back(variant, base, name)
    except OSError as exc:
        raise _not_put_back(base, name, parent, variant, exc, how == "exchange") from exc
    raise base.not_ours(name, "the staging directory this run made (something was renamed to "
                        "its name while the run worked)")  # fmt: skip


def _not_put_back(
    base: Dir, name: str, parent: Dir, variant: str, exc: OSError, previous: str | bool
) -> PublishError:
    """What to tell when a directory renamed to the staging name went to the key and the rename
    putting it back failed: where it is now, and where the previous copy is (``previous``)."""
    there = (f"; the previous copy of the key is at {previous}" if isinstance(previous, str)
             else f"; the previous copy of the key is at {base.path / name}" if previous
             else "")  # fmt: skip
    return PublishError(
        f"A directory someone renamed to the staging name {base.path / name} while the run "
        f"worked went to {parent.path / variant}, and the rename putting it back failed "
        f"({exc.strerror or exc}){there}; the run stopped, and removed neither.",
        f"Move {parent.path / variant} back where it belongs"
        + (" and the previous copy back to the key" if there else "")
        + ", then run again.",
    )


def _exchange(
    r: Dir,
    base: Dir,
    name: str,
    parent: Dir,
    variant: str,
    key: str,
    expected: Identity | None = None,
) -> None:
    """Swap the staging directory with the published copy (one step), then remove the old
    copy; where the file system lacks ``RENAME_EXCHANGE``, the fallback through ``.trash``."""
    try:
        base.rename(name, parent, variant, how="exchange")
    except OSError as exc:
        if exc.errno == errno.ENOENT and parent.lstat(variant) is None:  # removed meanwhile
            _rename_new(base, name, parent, variant, parent.path / variant)
            _moved_back_unless(base, name, parent, variant, expected, "noreplace")
            return
        if exc.errno not in NO_RENAMEAT2:
            raise
        _replace_through_trash(r, base, name, parent, variant, key, expected)
        return
    previous = ours(base, name, key)
    if previous is None:
        # Someone else's directory was put at the key after it was looked at: the two go back
        # where they were (it untouched), and nothing is published over it.
        base.rename(name, parent, variant, how="exchange")
        raise parent.not_ours(variant, f"a repository the loader published for {key}")
    _moved_back_unless(base, name, parent, variant, expected, "exchange")
    parent.fsync()
    log.info("replaced the published copy of %s; removing the previous one", key)
    _remove_replaced(base, name, previous)  # the previous copy, in the staging directory's place


def _remove_replaced(d: Dir, name: str, previous: Identity) -> None:
    """Remove a replaced copy (``previous``: the very directory judged the key's) once the new
    one is in place; a failure only leaves it for the next loader of the key (or prune) to
    remove: the key is published."""
    try:
        d.remove_tree(name, marks=TREE_MARKS, expected=previous)
    except OSError as exc:
        log.warning(
            "could not remove the replaced copy %s (%s); the next loader of the key or "
            "`model-loader prune` removes it",
            d.path / name,
            exc,
        )


def _replace_through_trash(
    r: Dir, base: Dir, name: str, parent: Dir, variant: str, key: str, expected: Identity | None
) -> None:
    """Without ``RENAME_EXCHANGE``: the published copy is moved aside into ``.trash``, the
    staging directory renamed to the key, and the copy then removed. What the rename put at the
    key is checked to be the staging directory this run made (``expected``): a directory someone
    renamed to the staging name in the instant before goes back to that name, the previous copy
    back to the key, and nothing is published."""
    aside = f"{key_filename(key)}.{secrets.token_hex(6)}"
    with r.sub(TRASH_DIR, create=True) as trash:
        parent.rename(variant, trash, aside, how="replace")
        previous = ours(trash, aside, key)
        if previous is None:  # put at the key after it was looked at: back
            trash.rename(aside, parent, variant, how="replace")  # (no renameat2 here)
            raise parent.not_ours(variant, f"a repository the loader published for {key}")
        log.info("moved the previous %s aside to %s", key, trash.path / aside)
        try:
            base.rename(name, parent, variant, how="replace")
        except BaseException:
            trash.rename(aside, parent, variant, how="replace")  # put the previous copy back
            raise
        if expected is not None and not _same(parent.lstat(variant), expected):
            try:
                parent.rename_back(variant, base, name)
                trash.rename(aside, parent, variant, how="replace")
            except OSError as exc:
                if parent.lstat(variant) is None:  # the next loader of the key puts it back
                    raise
                raise _not_put_back(
                    base, name, parent, variant, exc, str(trash.path / aside)
                ) from exc
            raise base.not_ours(name, "the staging directory this run made (something was "
                                "renamed to its name while the run worked)")  # fmt: skip
        parent.fsync()
        _remove_replaced(trash, aside, previous)
