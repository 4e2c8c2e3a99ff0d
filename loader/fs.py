"""Every file-system operation the loader makes on what it writes, in one module: relative to
directory descriptors under the repository root, and through one seam for fault injection.

**What is the loader's.** The trees the loader keeps under ``ROOT`` (published keys,
``.staging``, ``.trash``, ``.locks``, ``.work``) are reached from a descriptor of ``ROOT``, one
name at a time (:class:`Dir`):

* a directory is entered with ``openat(O_DIRECTORY | O_NOFOLLOW)``: a symbolic link there, or a
  file where a directory belongs, is a :class:`~loader.errors.NotOursError` (exit 2, saying what
  was found), never followed;
* a file is opened with ``O_NOFOLLOW``, and created with ``O_EXCL`` where the loader creates it;
* a tree is removed (:meth:`Dir.remove_tree`) only by callers that found the loader's own marker
  in it (:meth:`Dir.marked`: a regular file naming the key; a published key's manifest counts),
  relative to descriptors: a link inside is never followed, and stays;
* a marked tree holds its record (:data:`MADE`): every regular file and directory the loader
  creates in it is recorded by its names below the tree and its inode, right after the create,
  and before a rename brings it there. A create is recorded as pending just before it (where
  nothing stands at the name): a loader stopped between its create and its record (a kill)
  leaves an empty file or directory at a pending name, which the next one takes as its own
  while it is still empty (it is all a create leaves). Only what the record names is removed,
  replaced, moved, written or sealed there: anything else in the tree is someone else's and
  stays exactly as it is. A :class:`Dir` entered from a marked tree's top knows the tree
  (``Dir.made``; below a :func:`confined` tree every one is: a path is entered from the
  anchor). Inode numbers, not device numbers, are recorded: an NFS volume mounted again
  (another pod, a reboot) gets another device number, its files keep their inodes. What the
  loader removes from a tree it records as gone first, with its change time (an entry made at
  that name afterwards, which may get the freed inode number, is someone else's; the entry
  itself, when the removal was stopped before it happened, still has that change time and is
  the loader's). Not told apart: an entry someone else makes where they removed the loader's
  file, with that file's inode number again; an empty file or directory (nothing else) someone
  makes at a name whose create a loader killed in that instant left pending, before the next
  loader takes the name;
* in a marked tree a file judged the loader's is removed or replaced only while it is the very
  file judged, never by its name alone (someone may rename their own file to that name between
  the look and the act): it is moved to a fresh recorded name first (:meth:`Dir._unlink_same`)
  or swapped out in one exchange (:meth:`Dir._replace_judged`), and what moved is removed only
  if it is that file; anything else goes back (the tree's last mark goes by name after a last
  look: moved aside, a stop there would leave a tree no loader knows);
* a published key is replaced in one step, ``renameat2(RENAME_EXCHANGE)`` (:meth:`Dir.rename`),
  and created with ``RENAME_NOREPLACE``; where the file system lacks ``renameat2`` (some NFS
  servers answer EINVAL), :data:`NO_RENAMEAT2` says so and the caller falls back (see
  :mod:`loader.repository.publish`).

Paths the user names (``--repository``, ``--work-dir``, a local source) are followed as given:
they are the user's choice. Below them, nothing is. Every operation that writes, creates,
renames or removes is a method of :class:`Dir` taking one name without separators; a path
below a tree the loader writes is reached from its anchor with :meth:`Dir.open` (one name at a
time) or :meth:`Dir.walk_in` / :meth:`Dir.makedirs` of checked names. The module's functions
that take a path only read, and only sources (:func:`read_file`, :func:`open_read`,
:func:`stat_path`, :func:`regular_size`: a checkpoint, a tokenizer, a token or request file);
below a :func:`confined` tree they too walk from the anchor, never through a link.

**The seam.** Every call that reaches the operating system goes through :func:`_seam` first,
with the operation's name and its path. :func:`inject` installs a hook there that may raise an
``OSError``: the fault-injection tests count the calls a clean run makes, then fail each one in
turn with each errno of :data:`loader.errors.ERRNO_CLASSES` (``tests/test_fault_injection.py``).
Without a hook the seam costs one global read.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from loader.errors import (
    DirectoryRemovedError,
    NameContendedError,
    NameTakenError,
    NotOursError,
    OutputPathError,
    ReplacedDownloadError,
    SpecialFileError,
    shown,
)

log = logging.getLogger(__name__)

# --- owners: who made a temporary name --------------------------------------------------------


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read(200).strip()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def pid_space() -> str:
    """Where a pid means one process: this boot of the kernel (its boot id) and this pid
    namespace (its inode). Two loaders with the same host name in two containers (another pid
    namespace), or before and after a reboot, have different pid spaces: neither judges the
    other's pid (a pid of another space may be alive though absent here)."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = ""
    return f"{_read_small('/proc/sys/kernel/random/boot_id')}:{namespace}"


def host_digest(host: str | None = None) -> str:
    """8 hex digits naming this host and its pid space (:func:`pid_space`) in temporary names
    (host names can be long); with ``host``, that host name alone."""
    if host is None:
        host = f"{socket.gethostname()}\n{pid_space()}"
    return hashlib.sha256(host.encode("utf-8")).hexdigest()[:8]


def owner() -> str:
    """``<pid>-<host digest>``: this process, in the names of what it writes for a while
    (staging directories, partial downloads), so two loaders never write the same file."""
    return f"{os.getpid()}-{host_digest()}"


_OWNER = re.compile(r"(\d+)-([0-9a-f]{8})")


def owner_in(name: str) -> str | None:
    """The owner tag a name carries as one of its dot-separated parts, if any."""
    found = [part for part in name.split(".") if _OWNER.fullmatch(part)]
    return found[-1] if found else None


#: The largest pid Linux gives (``PID_MAX_LIMIT`` of a 64-bit kernel).
PID_MAX = 2**22


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one we may not signal counts) and has not
    exited: a zombie (killed or ended, not reaped yet: a loader killed with its process group,
    until its reaper waits for it, or for good under a PID 1 that never reaps) writes nothing
    any more, and its pid is not reused while it is one. A number no process can have (below
    1, above :data:`PID_MAX`: read from a lock record or a name someone else wrote) is no live
    process, never handed to ``kill`` (0 and -1 name process groups there; a number too large
    for a ``pid_t`` is an ``OverflowError``)."""
    if not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _exited(pid)


def _exited(pid: int) -> bool:
    """Whether every thread of the process ``pid`` is a zombie (``/proc/<pid>/task/*/stat``'s
    state ``Z`` or ``X``): the process has ended. A group leader that ended while its other
    threads run is a zombie alone: the process is alive. False when it cannot be told."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/stat", "rb") as fh:
                state = fh.read(4096).rsplit(b")", 1)[1].split()[0]
            if state not in (b"Z", b"X"):
                return False
    except (OSError, IndexError):
        return False
    return bool(tasks)


def owner_gone(tag: str) -> bool:
    """Whether the owner ``tag`` names ran on this host and is gone: only then may another
    process take over what it was writing (a live one, or one of another host, may still
    write there)."""
    match = _OWNER.fullmatch(tag)
    if match is None or match[2] != host_digest():
        return False
    pid = int(match[1])
    return pid != os.getpid() and not pid_alive(pid)


#: What a file's bytes were checked as: (device, inode, size, modification time in ns). A file
#: opened later with the same stamp is the one checked, unwritten since (a file renamed over
#: its name has another inode; one written in place another size or mtime).
Stamp = tuple[int, int, int, int]


def stamp(st: os.stat_result) -> Stamp:
    """The :data:`Stamp` of ``st`` (an ``fstat`` of the descriptor read, or an ``lstat``)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


#: A hook of the seam: ``hook(operation, path)``; raising an ``OSError`` fails the call.
Hook = Callable[[str, str], None]
_hook: Hook | None = None


def _seam(op: str, path: object) -> None:
    hook = _hook
    if hook is not None:
        hook(op, os.fsdecode(path) if isinstance(path, str | bytes | os.PathLike) else str(path))


@contextlib.contextmanager
def inject(hook: Hook) -> Iterator[None]:
    """Call ``hook(operation, path)`` before every file-system call of the loader while the
    block runs (all threads); for tests."""
    global _hook
    previous, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = previous


# --- confined trees: below the paths the user named, descriptors only -------------------------

_confined: dict[Path, int] = {}
_followed: dict[Path, int] = {}
_zones_lock = threading.Lock()


@contextlib.contextmanager
def _zone(table: dict[Path, int], paths: tuple[Path | str | None, ...]) -> Iterator[None]:
    added = [Path(p).absolute() for p in paths if p is not None]
    with _zones_lock:
        for p in added:
            table[p] = table.get(p, 0) + 1
    try:
        yield
    finally:
        with _zones_lock:
            for p in added:
                table[p] -= 1
                if not table[p]:
                    del table[p]


def confined(*paths: Path | str | None) -> contextlib.AbstractContextManager[None]:
    """While the block runs (all threads), every path operation of this module on a path below
    one of ``paths`` (the repository root, the work directory, an output directory: paths the
    user named) is made relative to descriptors: ``paths`` itself is followed as given, every
    name below it is entered one at a time without following a link (a link, or a file where a
    directory belongs, is a :class:`NotOursError`), and a ``..`` is refused. A path below ROOT
    reaches the operating system only this way."""
    return _zone(_confined, paths)


def confined_within(path: Path | str | None) -> contextlib.AbstractContextManager[None]:
    """:func:`confined` of ``path`` unless it is in a confined tree already (then that tree's
    walk, from its own anchor, stays in force: a link at any level below the anchor, ``path``'s
    own levels included, is refused). What a library call writes below a directory it was
    given (:func:`loader.sources.fetch`'s ``dest``) is confined whoever calls it."""
    if path is None or _below(path) is not None:
        return contextlib.nullcontext()
    return confined(path)


def followed(*paths: Path | str | None) -> contextlib.AbstractContextManager[None]:
    """Paths the user named to be read as given even inside a :func:`confined` tree (a local
    source kept under the repository root may use links): read-only operations below them
    follow links."""
    return _zone(_followed, paths)


#: Directories the loader made and works in by path (a run's staging directory while it
#: converts and builds): for each path, the device and inode of the very directory made there
#: and a descriptor of it (to tell it removed from it replaced).
_pinned: dict[Path, tuple[int, int, int]] = {}


@contextlib.contextmanager
def pinned(path: Path | str, identity: tuple[int, int]) -> Iterator[None]:
    """While the block runs (all threads), ``path`` is entered (:meth:`Dir.open`, and
    :meth:`Dir.sub` from its parent) only while it is the directory ``identity`` (its device
    and inode) names, the one the loader made there: a directory someone renamed to its name
    since is a :class:`NotOursError` (one whose original was removed: a
    :class:`~loader.errors.DirectoryRemovedError`), never written into, sealed or read as the
    loader's. ``path`` must be that directory when the block starts."""
    path = Path(path).absolute()
    wanted = (int(identity[0]), int(identity[1]))
    try:
        d = Dir.open(path)
    except FileNotFoundError as exc:  # removed (or moved away) since it was made
        if isinstance(exc, DirectoryRemovedError):
            raise
        raise DirectoryRemovedError(path, path) from None
    with d:
        found = d.stat()
        if (found.st_dev, found.st_ino) != wanted:
            raise _not_pinned(path)
        fd = os.dup(d.fd)
    with _zones_lock:
        previous = _pinned.get(path)
        _pinned[path] = (*wanted, fd)
    try:
        yield
    finally:
        with _zones_lock:
            if previous is None:
                _pinned.pop(path, None)
            else:
                _pinned[path] = previous
        os.close(fd)


def _not_pinned(path: Path) -> NotOursError:
    return NotOursError(
        path, "another directory (renamed to its name while the loader worked)",
        "the directory the loader made there",
    )  # fmt: skip


def _pinned_gone(exc: OSError, path: Path) -> OSError:
    """``exc`` of entering ``path``; an ``ENOENT`` where ``path`` is pinned (:func:`pinned`)
    and the very directory made there was removed (nothing stands at its name now) is a
    :class:`~loader.errors.DirectoryRemovedError`, as when another directory stands there."""
    if exc.errno != errno.ENOENT or not _pinned:
        return exc
    with _zones_lock:
        wanted = _pinned.get(path)
    try:
        removed = wanted is not None and os.fstat(wanted[2]).st_nlink == 0
    except OSError:
        removed = False
    return DirectoryRemovedError(path, path) if removed else exc


def _check_pinned(fd: int, path: Path) -> None:
    """That the directory open as ``fd`` is the one pinned at ``path``, if any (:func:`pinned`);
    else ``fd`` is closed and the error raised."""
    if not _pinned:
        return
    with _zones_lock:
        wanted = _pinned.get(path)
    if wanted is None:
        return
    found = os.fstat(fd)
    if (found.st_dev, found.st_ino) == wanted[:2]:
        return
    os.close(fd)
    try:
        removed = os.fstat(wanted[2]).st_nlink == 0
    except OSError:
        removed = False
    if removed:
        raise DirectoryRemovedError(path, path)
    raise _not_pinned(path)


def _longest(table: dict[Path, int], parts: tuple[str, ...]) -> Path | None:
    best: Path | None = None
    for anchor in table:
        n = len(anchor.parts)
        if parts[:n] == anchor.parts and (best is None or n > len(best.parts)):
            best = anchor
    return best


def _below(path: Path | str, *, reading: bool = False) -> tuple[Path, tuple[str, ...]] | None:
    """The confined tree ``path`` is in and the names below it (None: a path the user named,
    followed as given). A ``..`` below a confined tree is a :class:`NotOursError`."""
    path = Path(path).absolute()
    with _zones_lock:
        anchor = _longest(_confined, path.parts)
        trusted = _longest(_followed, path.parts) if reading else None
    if anchor is None or (trusted is not None and len(trusted.parts) >= len(anchor.parts)):
        return None
    rest = path.parts[len(anchor.parts) :]
    for part in rest:
        if part in ("..", ".") or "\0" in part:
            raise NotOursError(path, f"a path with {part!r} in it", f"a name below {anchor}")
    return anchor, rest


def _locate(path: Path | str) -> tuple[Dir, str] | None:
    """The open parent directory of a confined ``path`` that is read (entered one name at a
    time, never through a link) and its last name; None for a path followed as given, or the
    confined tree itself. The caller closes the directory."""
    found = _below(path, reading=True)
    if found is None or not found[1]:
        return None
    anchor, rest = found
    return Dir._open_given(anchor).walk_in(rest[:-1]), rest[-1]


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
#: errno values of a ``renameat2`` the file system or kernel does not support.
NO_RENAMEAT2 = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})

_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: What the loader reads of its own small files (markers, locks, journals) at most.
SMALL_FILE_BYTES = 16 * 2**20
#: What :meth:`Dir.copy_in` reads and writes at a time.
_COPY_CHUNK = 8 * 2**20


class TooLargeError(OSError):
    """A file read whole is larger than the ``limit`` its reader gives (``errno`` is
    ``EFBIG``): what the loader writes of its own (a marker, lock, journal, manifest) is never
    that large, so one that is was put there by someone else, or has grown past what tells
    anything. Callers catch this type, never the errno."""

    def __init__(self, path: object, limit: int) -> None:
        super().__init__(errno.EFBIG, f"larger than {limit} bytes", str(path))
        self.limit = limit


def is_name(name: str) -> bool:
    """Whether ``name`` is one name, safe to take relative to a directory: not empty, no ``/``,
    no NUL, not ``.`` or ``..`` (what a journal or manifest records is checked with this on
    read)."""
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


#: The most bytes one name takes on the file systems the loader writes to (Linux ``NAME_MAX``).
NAME_MAX = 255


def is_file_name(name: str) -> bool:
    """:func:`is_name`, and a name a file here can have: at most :data:`NAME_MAX` bytes as the
    file system is given it (``os.fsencode``), and given at all (a lone surrogate, which a JSON
    document may spell, is no name). A name read back from what the loader wrote (a record's
    marker, a journal's outputs, the staging directory it names) is checked with this: any
    other was never one the loader wrote, and is skipped, never looked up."""
    if not is_name(name):
        return False
    try:
        return len(os.fsencode(name)) <= NAME_MAX
    except UnicodeError:
        return False


#: The mode of every directory the loader creates: Triton runs as another uid and must enter
#: ROOT, ``<name>@<revision>`` and a key whatever the loader's umask.
DIR_MODE = 0o755
#: The mode of every file Triton (another uid) reads: a repository's, a conversion's output.
FILE_MODE = 0o644
#: How the files marking a tree as the loader's are named (the staging and download markers):
#: :meth:`Dir.remove_tree` removes them last.
MARKER_PREFIX = ".model-loader-"


def _give_mode(path: str | Path, mode: int, *, dir_fd: int | None = None) -> os.stat_result:
    """Give the directory the loader has just created at ``path`` exactly ``mode`` (a umask
    such as 077 takes bits away at ``mkdir``): through a descriptor opened without following
    a link, so a link swapped in meanwhile is never followed. Returns what it is (``fstat``)."""
    fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        found = os.fstat(fd)
        if stat.S_IMODE(found.st_mode) != mode:
            os.fchmod(fd, mode)
        return found
    finally:
        os.close(fd)


def _component(name: str) -> str:
    if not is_name(name):
        raise ValueError(f"not a single path component: {name!r}")
    return name


def _special(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file"


def kind_of(mode: int) -> str:
    """What an entry of ``mode`` (an ``lstat``'s) is, for messages: ``a symbolic link``, ``a
    directory``, ``a file``, ``a FIFO``, ``a socket``, ``a device`` or ``a special file``."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a file"
    return _special(mode)


# --- what the loader made: the record of a marked tree -------------------------------------

#: The record of a tree the loader marks (:meth:`Dir.make_marked`), at its top: each regular
#: file and directory the loader created in the tree, by its name below the tree and its inode
#: number. Only what matches a record (:meth:`Dir.remove_tree`, :meth:`Dir.unlink`) is removed,
#: replaced or written again; everything else in the tree is someone else's.
MADE = ".model-loader-made"

#: How deep a walk of a tree goes (:meth:`Dir.remove_tree`, a repository's verification, the
#: checks of leftovers): the loader nests its directories a few levels (a repository's deepest
#: is 5 below its key), so a directory deeper than this below a tree's top is someone else's,
#: kept and never entered (a chain of them deeper than a recursive walk can follow is no crash).
MAX_TREE_DEPTH = 64

#: The most levels a name read from a source has (a checkpoint's file ``a/b/c`` has 3): what a
#: remote listing names is downloaded below a few directories of the loader's own (the download
#: directory, its partial directory), so the walks that remove it reach all of it.
MAX_NAME_LEVELS = 32


#: The temporary name of a record :meth:`Dir.mark_in_place` writes whole before it links it
#: into place: ``<MADE>.<owner>.<8 hex digits>.tmp``.
_MARKING_TMP = re.compile(re.escape(MADE) + r"\.(\d+-[0-9a-f]{8})\.[0-9a-f]{8}\.tmp")
#: The fresh name a file judged the loader's is moved to before it is removed
#: (:meth:`Dir._unlink_same`): ``.model-loader-gone.<owner>.<12 hex digits>``.
_GONE = re.compile(re.escape(MARKER_PREFIX) + r"gone\.(\d+-[0-9a-f]{8})\.[0-9a-f]{12}")


def _marker_name(name: str) -> bool:
    """Whether ``name`` is one a marker of the loader's has (:data:`MARKER_PREFIX`, not the
    record's own): a record's first line naming any other file (rewritten) names no marker."""
    return name.startswith(MARKER_PREFIX) and name != MADE


def made_header(marker: str) -> bytes:
    """The first line of a tree's record (:data:`MADE`): the name of the tree's marker, which
    the loader drops when it keeps something in the tree."""
    return json.dumps({"marker": _component(marker)}).encode() + b"\n"


def made_line(
    rel: tuple[str, ...] | list[str], found: os.stat_result, *, gone: bool = False
) -> bytes:
    """The line of a tree's record naming the entry ``rel`` (names below the tree) that
    ``found`` (its ``fstat``) describes; with ``gone``, the lines saying the loader is about
    to remove it (its inode may then be given to someone else's entry at the same name): the
    second names its change time too, so that the entry a removal stopped before it happened
    left (that inode with that very change time) is still told to be the loader's."""
    name = "/".join(map(_component, rel))
    if not gone:
        kind = "d" if stat.S_ISDIR(found.st_mode) else "f"
        return json.dumps([found.st_ino, kind, name]).encode() + b"\n"
    return (
        json.dumps([found.st_ino, "-", name]).encode()
        + b"\n"
        + json.dumps([found.st_ino, "-", name, found.st_ctime_ns]).encode()
        + b"\n"
    )


def pending_line(rel: tuple[str, ...] | list[str], kind: str | None) -> bytes:
    """The line of a tree's record saying the loader is about to create a file (``kind``
    ``f``) or directory (``d``) at ``rel``, where nothing stands (inode 0: not known yet);
    with ``kind`` None, that the create failed. An empty entry of that kind found at ``rel``
    with no inode recorded there since is the one a loader stopped between its create and
    its record made (see :meth:`Dir._made_by_loader`)."""
    return json.dumps([0, kind or "-", "/".join(map(_component, rel))]).encode() + b"\n"


#: For each name below a tree: ``(inode, "f" | "d")`` of what the loader made there;
#: ``(0, "f" | "d")`` while a create there is pending; ``(inode, "-<ctime ns>")`` of what it
#: was about to remove there.
Records = dict[tuple[str, ...], set[tuple[int, str]]]


def parse_made(data: bytes) -> tuple[str | None, Records]:
    """The marker and the records of a tree's record (:data:`MADE`). A line that is not one
    the loader writes (garbled, a name that is not one component, a number that is not an
    inode) is skipped: it only ever makes the loader keep more."""
    marker: str | None = None
    records: Records = {}
    for i, line in enumerate(data.split(b"\n")):
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):  # (a line nested too deeply: garbled too)
            continue
        if i == 0 and isinstance(item, dict):
            name = item.get("marker")
            if isinstance(name, str) and is_file_name(name) and _marker_name(name):
                marker = name
            continue
        _apply_line(records, item)
    return marker, records


def _half_made_record(data: bytes, marker: str) -> bool:
    """Whether ``data`` may be the record of a new tree :meth:`Dir.make_marked` left before
    its marker was whole (or a removal of that tree left): nothing, a beginning of its header
    naming ``marker``, or that header and lines naming only the record itself and ``marker``
    (by any inode: a tree copied file by file keeps none, :func:`_copied`), the last perhaps
    cut short (a crash). A copy of another tree's record (naming other entries) is someone
    else's."""
    header = made_header(marker)
    if not data.startswith(header):
        return header.startswith(data)
    shapes = [
        shape % json.dumps(name).encode()
        for name in (MADE, marker)
        for shape in (b'[0, "f", %s]', b'[0, "-", %s]', b'[0, "-", %s, 0]')
    ]
    # (inode numbers and change times as 0)
    *lines, last = re.sub(rb"\d+", b"0", data[len(header) :]).split(b"\n")
    return all(line in shapes for line in lines) and any(s.startswith(last) for s in shapes)


def _apply_line(records: Records, item: object) -> None:
    """Apply one line of a record (parsed JSON) to ``records``; one that is not a line the
    loader writes is skipped."""
    if not (isinstance(item, list) and len(item) in (3, 4)):
        return
    ino, kind, rel = item[:3]
    changed = item[3] if len(item) == 4 else None
    if (
        type(ino) is not int
        or ino < 0
        or kind not in ("f", "d", "-")
        or not isinstance(rel, str)
        or not all(is_file_name(part) for part in rel.split("/"))
        or (changed is not None and (kind != "-" or type(changed) is not int or ino == 0))
    ):
        return
    _apply(records, tuple(rel.split("/")), ino, kind, changed)


def _apply(
    records: Records, rel: tuple[str, ...], ino: int, kind: str, changed: int | None = None
) -> None:
    entries = records.setdefault(rel, set())
    if kind == "-":
        entries.difference_update({(ino, "f"), (ino, "d")})
        if changed is not None:
            entries.add((ino, f"-{changed}"))
    else:
        if ino:
            entries.discard((0, kind))  # the pending create, done
        entries.add((ino, kind))


class _Made:
    """The open record of one marked tree: its top directory's descriptor (a rename of the
    tree keeps it valid), the records read so far, and this process's appends."""

    __slots__ = ("_records", "_size", "copied", "dev", "fd", "lock", "marker", "path")

    def __init__(self, fd: int, path: Path, *, copied: bool = False) -> None:
        self.fd = fd
        self.path = path
        #: The tree was copied file by file (:func:`_copied`): its record's inode numbers are
        #: the original's, so what it names is told by name alone.
        self.copied = copied
        self.dev = os.fstat(fd).st_dev
        self.lock = threading.Lock()
        self._records: Records | None = None
        self._size = -1
        self.marker: str | None = None

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def record(self, rel: tuple[str, ...], found: os.stat_result, *, gone: bool = False) -> None:
        """Record that the loader made ``rel`` (``found``: its ``fstat``, taken on the
        descriptor of what this process just created); with ``gone``, that it is about to
        remove it (a removal stopped between the two keeps an entry that is still the
        loader's: the same inode with the same change time)."""
        data = made_line(rel, found, gone=gone)
        if gone and self.copied:  # the name goes: the original's inodes at it with it
            for ino, kind in sorted(self.records().get(tuple(rel), ())):
                if ino and ino != found.st_ino and kind in ("f", "d"):
                    data += json.dumps([ino, "-", "/".join(rel)]).encode() + b"\n"
        self._append(data)

    def pending(self, rel: tuple[str, ...], kind: str | None) -> None:
        """Record that the loader is about to create a file (``kind`` ``f``) or directory
        (``d``) at ``rel``; with None, that the create failed (:func:`pending_line`)."""
        self._append(pending_line(rel, kind))

    def _open(self, flags: int) -> int:
        """The record, open with ``flags`` (never through a link, never blocking on a FIFO):
        anything but a regular file there (put in its place) is a :class:`NotOursError`
        naming it where the tree is now, as every failure here does."""
        where = self.path / MADE
        _seam("open", where)
        try:
            fd = os.open(MADE, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ENOENT and self._removed():
                # the tree itself was removed by another process while the loader worked in it
                raise DirectoryRemovedError(self.path, where) from None
            if exc.errno == errno.ENOENT:  # removed by someone else: the tree is not known
                raise NotOursError(where, "no file", "the loader's record of a tree") from None
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise _named(exc, where) from None
            fd = -1
        mode = os.fstat(fd).st_mode if fd >= 0 else 0
        if not stat.S_ISREG(mode):
            if fd >= 0:
                os.close(fd)
            try:
                found = kind_of(os.stat(MADE, dir_fd=self.fd, follow_symlinks=False).st_mode)
            except OSError:
                found = "something else"
            raise NotOursError(where, found, "the loader's record of a tree")
        return fd

    def _removed(self) -> bool:
        """Whether the tree's top was removed since it was opened (no name links to it)."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return False

    def _append(self, data: bytes) -> None:
        where = self.path / MADE
        with self.lock:
            fd = self._open(os.O_WRONLY | os.O_APPEND)
            try:
                write_fd(fd, data, where)
            finally:
                os.close(fd)
            if self._records is not None:
                for line in data.splitlines():
                    _apply_line(self._records, json.loads(line))
                self._size += len(data)

    def records(self) -> Records:
        """What the tree's record holds (read again when another process appended to it)."""
        with self.lock:
            _seam("stat", self.path / MADE)
            try:
                found = os.stat(MADE, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                found = None
            except OSError as exc:
                raise _named(exc, self.path / MADE) from None
            if (
                found is None
                or not stat.S_ISREG(found.st_mode)
                # grown past any record the loader writes (someone else's doing): a read of it
                # would be refused, and nothing in it is known to be the loader's
                or found.st_size > SMALL_FILE_BYTES
            ):
                self._records, self._size = {}, -1
                return {}
            if self._records is None or found.st_size != self._size:
                try:
                    fd = self._open(os.O_RDONLY)
                except NotOursError:  # swapped since: nothing is known to be the loader's
                    self._records, self._size = {}, -1
                    return {}
                try:
                    os.set_blocking(fd, True)
                    data = read_fd(fd, self.path / MADE, limit=SMALL_FILE_BYTES)
                except TooLargeError:
                    self._records, self._size = {}, -1  # grown since the look: as above
                    return {}
                finally:
                    os.close(fd)
                self.marker, self._records = parse_made(data)
                self._size = len(data)
            return self._records

    def made(self, rel: tuple[str, ...], found: os.stat_result | None) -> bool:
        """Whether the entry ``found`` (an ``lstat``) at ``rel`` is one the loader made: a
        regular file or directory on the tree's device whose inode is recorded at that name
        (or was, with that very change time, when a removal of it was stopped before it
        happened)."""
        kind = self._kind(found)
        if kind is None or found is None:
            return False
        entries = self.records().get(tuple(rel), ())
        if (found.st_ino, kind) in entries or (found.st_ino, f"-{found.st_ctime_ns}") in entries:
            return True
        # A copied tree: a name the loader made (and has not removed) is its own there, any
        # other name someone else's, as in the original.
        return self.copied and any(ino and made == kind for ino, made in entries)

    def pending_at(self, rel: tuple[str, ...], found: os.stat_result | None) -> bool:
        """Whether a create of an entry of ``found``'s kind at ``rel`` is pending in the record
        (:func:`pending_line`): recorded as about to happen, with no inode recorded since."""
        kind = self._kind(found)
        return kind is not None and (0, kind) in self.records().get(tuple(rel), ())

    def _kind(self, found: os.stat_result | None) -> str | None:
        if found is None or found.st_dev != self.dev:
            return None
        if stat.S_ISREG(found.st_mode):
            return "f"
        return "d" if stat.S_ISDIR(found.st_mode) else None


_made_trees: dict[tuple[int, int], _Made] = {}
_made_lock = threading.Lock()


def _made_at(fd: int, path: Path) -> _Made | None:
    """The record of the tree whose top is the open directory ``fd``; None when it is no
    marked tree's top: a tree's top holds its record (:data:`MADE`, a regular file whose first
    line names the tree's marker) and that marker (a regular file). A file of that name that
    is not such a record (a user's) makes no tree, and is never written."""
    if not _regular_at(fd, path, MADE):  # (a record gone since it was read: none now)
        return None
    top = os.fstat(fd)
    with _made_lock:
        known = _made_trees.get((top.st_dev, top.st_ino))
        if known is not None and os.fstat(known.fd).st_nlink > 0:
            return known  # (a removed tree's inode given to a new one: its own record)
    _seam("read", path / MADE)
    try:
        made_fd = os.open(MADE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                          dir_fd=fd)  # fmt: skip
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # swapped for a link or FIFO: no record
            return None
        raise _named(exc, path / MADE) from None
    try:
        with _naming(path / MADE):
            if not stat.S_ISREG(os.fstat(made_fd).st_mode):
                return None
            start = os.pread(made_fd, 4096, 0)
            copied = _copied(made_fd, start)
    finally:
        os.close(made_fd)
    marker, _ = parse_made(start.split(b"\n", 1)[0])
    if marker is None:
        return None
    return _register_made(fd, path, copied=copied) if _regular_at(fd, path, marker) else None


def _regular_at(fd: int, path: Path, name: str) -> bool:
    """Whether a regular file stands at ``name`` in the open directory ``fd`` (``path``), no
    link followed."""
    _seam("stat", path / name)
    try:
        found = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise _named(exc, path / name) from None
    return stat.S_ISREG(found.st_mode)


def _copied(made_fd: int, start: bytes | None = None) -> bool:
    """Whether the record open as ``made_fd`` (``start``: its first 4096 bytes, when already
    read) is a copy: its second line, the record's own
    entry, names another inode than its own. A tree copied file by file (``cp -r``, ``rsync``
    to another volume; a snapshot or another mount keeps inodes) keeps its names but none of
    its inode numbers: its record names nothing in it by inode, and what it names is told by
    name alone (:attr:`_Made.copied`): the loader's files and directories at the names it made,
    someone else's, copied along, at any other name (neither everything someone else's, kept
    for good, nor everything the loader's, removed whole)."""
    lines = (os.pread(made_fd, 4096, 0) if start is None else start).split(b"\n", 2)
    if len(lines) < 3:
        return False
    _, own = parse_made(b"\n" + lines[1])
    inodes = own.get((MADE,), set())
    return bool(inodes) and (os.fstat(made_fd).st_ino, "f") not in inodes


def _register_made(fd: int, path: Path, *, copied: bool = False) -> _Made:
    """The record of the tree whose top is the open directory ``fd``, kept for this process
    (a descriptor of its own: a rename of the tree keeps it valid)."""
    top = os.fstat(fd)
    with _made_lock:
        made = _Made(os.dup(fd), path, copied=copied)
        _made_trees[(top.st_dev, top.st_ino)] = made
        return made


def _trees_moved(src: Path, dst: Path, *, exchange: bool) -> None:
    """Marked trees at or below ``src`` are now at ``dst`` (and, with ``exchange``, those at
    ``dst`` at ``src``): what their records' failures name follows them (a tree is made under
    a temporary name, then renamed)."""
    moves = ((src, dst), (dst, src)) if exchange else ((src, dst),)
    with _made_lock:
        for made in set(_made_trees.values()):
            for before, after in moves:
                if made.path == before or before in made.path.parents:
                    made.path = after / made.path.relative_to(before)
                    break


def _forget_made(made: _Made) -> None:
    with _made_lock:
        for key, known in list(_made_trees.items()):
            if known is made:
                del _made_trees[key]


class Dir:
    """An open directory: its descriptor and, for messages, its path. Use as a context manager
    (the descriptor is closed at the end)."""

    __slots__ = ("fd", "made", "path")

    def __init__(
        self, fd: int, path: Path, made: tuple[_Made, tuple[str, ...]] | None = None
    ) -> None:
        self.fd = fd
        self.path = path
        #: The record of the marked tree this directory is in, and its names below the tree's
        #: top (None: in no marked tree).
        self.made = made

    def _in_made(self, name: str) -> tuple[_Made, tuple[str, ...]] | None:
        """The record of the marked tree ``name`` would be in, and its names below the top."""
        if self.made is None:
            return None
        return self.made[0], (*self.made[1], name)

    def _made_by_loader(self, name: str, found: os.stat_result | None) -> bool:
        """Whether ``name`` (``found``: its ``lstat``) is the loader's to remove, replace or
        write again: outside a marked tree any regular file or directory is (only what a
        caller found in a tree carrying the loader's marker is handed here); inside one, only
        what the tree's record names."""
        inside = self._in_made(name)
        if inside is None:
            return found is not None and (
                stat.S_ISREG(found.st_mode) or stat.S_ISDIR(found.st_mode)
            )
        made, rel = inside
        if made.made(rel, found):
            return True
        if found is None or not made.pending_at(rel, found) or not self._empty(name, found):
            return False
        # What a loader stopped between its create and its record left: the empty file or
        # directory a create pending at this name made. Recorded now, as the record of that
        # create would have.
        made.record(rel, found)
        return True

    def _empty(self, name: str, found: os.stat_result) -> bool:
        """Whether ``name`` (``found``: its ``lstat``) is an empty regular file with no other
        link, or an empty directory: all a create leaves before anything is written into it."""
        if stat.S_ISREG(found.st_mode):
            return found.st_size == 0 and found.st_nlink == 1
        _seam("list", self.path / name)
        try:
            fd = os.open(_component(name), _DIR_FLAGS, dir_fd=self.fd)
        except OSError:
            return False
        try:
            return os.fstat(fd).st_ino == found.st_ino and not os.listdir(fd)
        finally:
            os.close(fd)

    def _pending(self, name: str, kind: str) -> bool:
        """In a marked tree, record that a file (``kind`` ``f``) or directory (``d``) is about
        to be created at ``name``, where nothing stands; True when it was recorded (the caller
        then records the create, or that it failed: :meth:`_not_made`)."""
        inside = self._in_made(name)
        if inside is None or self.lstat(name) is not None:
            return False
        inside[0].pending(inside[1], kind)
        return True

    def _not_made(self, name: str) -> None:
        """Record that the create :meth:`_pending` announced at ``name`` failed (a failure to
        say so only keeps more: an entry found there must be empty to be taken)."""
        inside = self._in_made(name)
        if inside is not None:
            with contextlib.suppress(OSError):
                inside[0].pending(inside[1], None)

    def _record(self, name: str, found: os.stat_result, *, gone: bool = False) -> None:
        """Record ``name`` (``found``: its ``fstat`` on the descriptor of what this process just
        created) in the record of the marked tree this directory is in, if any; with ``gone``,
        that the loader is about to remove it."""
        inside = self._in_made(name)
        if inside is not None:
            inside[0].record(inside[1], found, gone=gone)

    # -- entering --------------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path | str, *, create: bool = False) -> Dir:
        """The directory ``path``; with ``create`` it and its parents are created. A directory
        the user named (``--repository``, ``--work-dir``) is followed as given; one below a
        :func:`confined` tree is entered from it one name at a time, never through a link."""
        found = _below(path)
        if found is not None and found[1]:
            anchor, rest = found
            return cls._open_given(anchor, create=create).walk_in(rest, create=create)
        return cls._open_given(path, create=create)

    @classmethod
    def _open_given(cls, path: Path | str, *, create: bool = False) -> Dir:
        path = Path(path).absolute()
        if create:
            _seam("mkdir", path)
            missing = []
            for level in (path, *path.parents):
                if os.path.lexists(level):
                    break
                missing.append(level)
            try:
                path.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):  # a level is no directory
                cls._deepest_given(path)[0].close()  # raises, naming it and what it is
                raise
            try:  # Triton (another uid) reads them, whatever the umask
                for made in reversed(missing):
                    _give_mode(made, DIR_MODE)
            except PermissionError:
                # A umask that leaves the owner no access (0777) made them unopenable: each is
                # empty and this call's, removed (innermost first) rather than left unusable.
                for made in missing:
                    with contextlib.suppress(OSError):
                        os.rmdir(made)
                raise
        _seam("open", path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            cls._deepest_given(path)[0].close()  # raises, naming the level and what it is
            raise
        except FileNotFoundError as exc:
            raise _pinned_gone(exc, path) from None
        _check_pinned(fd, path)
        return cls._with_made(fd, path, None)

    @classmethod
    def _with_made(cls, fd: int, path: Path, made: tuple[_Made, tuple[str, ...]] | None) -> Dir:
        """The open directory ``fd``: in the marked tree ``made`` (entered from a directory in
        it), or the top of one when it holds a record (:data:`MADE`)."""
        if made is None:
            try:
                top = _made_at(fd, path)
            except BaseException:
                os.close(fd)
                raise
            made = None if top is None else (top, ())
        return cls(fd, path, made)

    @classmethod
    def deepest(cls, path: Path | str) -> tuple[Dir, tuple[str, ...]]:
        """The deepest level of ``path`` that exists, open, and the names below it that do not
        (what ``Dir.open(path, create=True)`` would create); only looks. Below a
        :func:`confined` tree it is entered from the anchor one name at a time (a link, or a
        file where a directory belongs, is a :class:`NotOursError`, never followed); a path
        the user named is followed as given, and a level of it that is there but no directory
        (a file, a FIFO, a dangling link) is a ``NotADirectoryError`` naming it, its
        ``strerror`` saying what it is (``a FIFO``)."""
        found = _below(path)
        anchor, rest = (Path(path).absolute(), ()) if found is None else found
        current, missing = cls._deepest_given(anchor)
        if missing:
            return current, missing + rest
        try:
            for i, name in enumerate(rest):
                if current.lstat(name) is None:
                    return current, rest[i:]
                current = current.walk_in((name,))
        except BaseException:
            current.close()
            raise
        return current, ()

    @classmethod
    def _deepest_given(cls, path: Path) -> tuple[Dir, tuple[str, ...]]:
        missing: list[str] = []
        for level in (path, *path.parents):
            _seam("stat", level)
            try:
                found = os.stat(level)
            except (FileNotFoundError, NotADirectoryError):
                if os.path.islink(level):
                    raise NotADirectoryError(
                        errno.ENOTDIR, "a dangling symbolic link", str(level)
                    ) from None
                if level.name == "..":  # below a level that does not exist: names nothing yet
                    raise OutputPathError(
                        f"{shown(path)} has '..' below {shown(level.parent)}, which does not "
                        "exist: it names no directory the loader could create.",
                        "Pass the path without '..' (or create the levels before it first).",
                    ) from None
                missing.append(level.name)
                continue
            if not stat.S_ISDIR(found.st_mode):  # strerror: what it is
                what = kind_of(found.st_mode)
                if os.path.islink(level):
                    what = f"a symbolic link to {what}"
                raise NotADirectoryError(errno.ENOTDIR, what, str(level))
            return cls._open_given(level), tuple(reversed(missing))
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))  # no "/"

    def sub(self, name: str, *, create: bool = False, what: str = "directory") -> Dir:
        """The directory ``name`` in this one, never through a link; with ``create`` made if
        absent. A link or a file there is a :class:`NotOursError` (``what`` names it)."""
        if create:
            self.mkdir(name, exist_ok=True, what=what)
        _seam("open", self.path / name)
        try:
            fd = os.open(_component(name), _DIR_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise self.not_ours(name, f"the loader's {what}") from exc
            raise _pinned_gone(self._failed(exc, self.path / name), self.path / name) from None
        _check_pinned(fd, self.path / name)
        return Dir._with_made(fd, self.path / name, self._in_made(name))

    def walk(self, relpath: str, *, create: bool = False) -> Dir:
        """The directory ``relpath`` (``a/b/c``) below this one, one name at a time."""
        current = self
        opened: list[Dir] = []
        try:
            for part in relpath.split("/"):
                current = current.sub(part, create=create)
                opened.append(current)
        finally:
            for d in opened[:-1]:
                d.close()
        return current

    def walk_in(self, names: tuple[str, ...], *, create: bool = False) -> Dir:
        """The directory ``names`` below this one, entered one name at a time (never through a
        link); this directory is handed over: closed, or returned when ``names`` is empty."""
        current = self
        try:
            for name in names:
                following = current.sub(name, create=create)
                current.close()
                current = following
        except BaseException:
            current.close()
            raise
        return current

    def mkdir(
        self, name: str, mode: int = 0o755, *, exist_ok: bool = False, what: str = "directory"
    ) -> bool:
        """Create the directory ``name``; True when this call created it. With ``exist_ok`` an
        existing directory is fine (a link or a file is :class:`NotOursError`)."""
        _seam("mkdir", self.path / name)
        pending = self._pending(name, "d")
        try:
            with self._naming(self.path / name):
                os.mkdir(_component(name), mode, dir_fd=self.fd)
        except BaseException as exc:
            if pending:
                self._not_made(name)
            if not isinstance(exc, FileExistsError) or not exist_ok:
                raise
            found = self.lstat(name)
            if found is None and self._removed():  # this directory was removed meanwhile
                raise DirectoryRemovedError(self.path, self.path / name) from None
            if found is None or not stat.S_ISDIR(found.st_mode):
                raise self.not_ours(name, f"the loader's {what}") from None
            if self.made is not None:
                # Taken now if a create of it was stopped before its record (while it is
                # still empty: what the loader then puts into it is no proof of that).
                self._made_by_loader(name, found)
            return False
        try:
            with self._naming(self.path / name):
                made = _give_mode(_component(name), mode, dir_fd=self.fd)  # the umask took bits
            self._record(name, made)
        except BaseException:
            self._unmade(name)
            raise
        return True

    def _unmade(self, name: str) -> None:
        """Remove the directory ``name`` this process just created, whose mode or record could
        not be written (descriptors ran out: the record is appended through one): still empty,
        its removal needs no descriptor. It stayed, and the typed error left it (in
        ``.staging``, until the next loader of the key). Anything put into it meanwhile keeps
        it (the pending line of its record says whose it is)."""
        with contextlib.suppress(OSError):
            _seam("rmdir", self.path / name)
            os.rmdir(_component(name), dir_fd=self.fd)

    def make_marked(self, name: str, marker: str, owner_line: str) -> bool:
        """Create the directory ``name`` holding the regular file ``marker`` whose first line
        is ``owner_line``, in one step: made under a temporary name (``.<name>.<owner>.tmp``),
        the marker written and fsynced, then renamed to ``name`` without replacing anything.
        A directory of the loader's never exists without its marker (a failure between the
        two leaves only the temporary name). False when ``name`` exists already.

        The tree also holds its record (:data:`MADE`, made first, naming the marker): every
        file and directory the loader creates in it from then on is recorded there, after it
        is created, and only what is recorded is ever removed from it."""
        tmp = f".{name}.{owner()}.{secrets.token_hex(4)}.tmp"
        self.mkdir(tmp)
        try:
            with self.sub(tmp) as d:
                d._new_record(MADE, marker)
                d.made = (_register_made(d.fd, d.path), ())
                d.write(marker, f"{owner_line}\n".encode())
                d.fsync()
            try:
                self.rename(tmp, self, name, how="noreplace")
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    self.remove_tree(tmp)
                    return False
                if exc.errno not in NO_RENAMEAT2:
                    raise
                if self.lstat(name) is not None:
                    self.remove_tree(tmp)
                    return False
                self.rename(tmp, self, name, how="replace")  # never onto a non-empty directory
        except BaseException:
            try:
                self.remove_tree(tmp)
            except OSError:  # it opens the tree and its record: none left to open?
                self._unmade(tmp)  # the record's create failed: still empty
            raise
        self.fsync()
        return True

    def _new_record(self, name: str, marker: str) -> os.stat_result:
        """Create the file ``name`` (``O_EXCL``) holding a new tree's record: its first line
        naming ``marker`` and its own entry (what becomes :data:`MADE`), fsynced; its
        ``fstat``. A failure removes the file only while it is the very file created
        (:meth:`_unlink_same`): a user's file renamed to ``name`` meanwhile stays."""
        fd = self.open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            made = os.fstat(fd)
            write_fd(fd, made_header(marker) + made_line((MADE,), made), self.path / name)
            fsync_fd(fd, self.path / name)
            return made
        except BaseException:
            with contextlib.suppress(OSError):  # only the very file made (not by name)
                found = os.fstat(fd)
                self._unlink_same(name, (found.st_dev, found.st_ino))
            os.close(fd)
            fd = -1
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    def mark_in_place(self, marker: str, owner_line: str) -> None:
        """Make this directory (one the user named, such as ``fetch``'s DEST) the top of a
        marked tree where it stands: its record (:data:`MADE`, naming ``marker``) and
        ``marker`` (first line ``owner_line``) written into it. What is in it already stays
        unrecorded: someone else's, never replaced or removed; what the loader creates here
        from now on is recorded, and only that is ever replaced or removed. Nothing to do in
        a marked tree already (a run's download directory). A record a stop left before its
        marker is taken up; anything else at either name is a :class:`NotOursError`. What a
        loader stopped while it marked this directory left is removed first
        (:meth:`_clear_stopped_marking`)."""
        self._clear_stopped_marking(marker)
        if self.made is not None:
            return
        if self.lstat(MADE) is None:
            # Written whole under a name of this process's, then linked into place: another
            # loader marking the same directory at once finds a whole record or none.
            tmp = f"{MADE}.{owner()}.{secrets.token_hex(4)}.tmp"
            made = self._new_record(tmp, marker)  # (a failure removes what it made: see below)
            try:
                with contextlib.suppress(FileExistsError):  # another loader's came first
                    self.link(tmp, MADE)
            finally:
                self._unlink_same(tmp, made)  # only the very file made (not by name)
            self.fsync()
        try:
            head = self.read(MADE, limit=SMALL_FILE_BYTES) or b""
        except (TooLargeError, IsADirectoryError):
            head = b""
        if parse_made(head.split(b"\n", 1)[0])[0] != marker:
            raise self.not_ours(MADE, f"the loader's record of what it made here ({MADE})")
        self.made = (_register_made(self.fd, self.path), ())
        with contextlib.suppress(NameTakenError):  # another loader's marker came first
            self.write(marker, f"{owner_line}\n".encode())
        there = self.lstat(marker)
        if there is None or not stat.S_ISREG(there.st_mode):
            raise self.not_ours(marker, "the loader's marker file")

    def _clear_stopped_marking(self, marker: str) -> None:
        """Remove the temporary records (``<MADE>.<owner>.<hex>.tmp``, or moved aside to be
        removed: :data:`_GONE`) that loaders of this host, gone now, left here when they were
        stopped inside :meth:`mark_in_place`: each told by its content, a beginning of the very
        record that loader wrote into that file (it names the file's own inode). Any other file
        of such a name is someone else's."""
        for name in self.names():
            match = _MARKING_TMP.fullmatch(name) or _GONE.fullmatch(name)
            if match is None or not owner_gone(match[1]):
                continue
            found = self.lstat(name)
            if found is None or not stat.S_ISREG(found.st_mode) or found.st_size > 4096:
                continue
            try:
                read = self.read_judged(name, limit=4096)
            except (NotOursError, OSError):
                continue
            whole = made_header(marker) + made_line((MADE,), found)
            if read is not None and whole.startswith(read[0]):
                log.info("removing %s: a loader stopped while it marked this directory", name)
                self._unlink_same(name, read[1])  # only the very file read (not by name)

    def unfinished_marked(
        self, prefix: str, marker: str, owner_line: str, *, idle_s: float
    ) -> list[str]:
        """The temporary directories :meth:`make_marked` left here for names starting with
        ``prefix`` (its process stopped before the rename): holding ``marker`` whose first line
        is ``owner_line`` (so the loader's), made by a process of this host that is gone, or
        unchanged for ``idle_s`` seconds (the step between the two takes milliseconds). Call
        where only one process may make such a name (under the key's lock).

        One such directory stopped before its marker was whole (holding nothing, or only its
        record, empty or naming ``marker``, and ``marker`` holding a beginning of
        ``owner_line``: all :meth:`make_marked` writes first) is removed here, as abandoned as
        the others: nothing names its key for a caller to find it by."""
        found = []
        for name in self.names():
            if not (name.startswith(f".{prefix}") and name.endswith(".tmp")):
                continue
            tag = owner_in(name[: -len(".tmp")])
            if tag is None or tag == owner():  # this process's own, in the making
                continue
            if not self.marked(name, marker, owner_line):
                half = self._half_made(name, marker, owner_line)
                if half is not None and self._abandoned(name, tag, idle_s):
                    log.info("removing %s: a loader stopped while it made it", self.path / name)
                    with self.sub(name) as d:
                        for entry in sorted(half, key=lambda n: n == MADE):  # record last
                            d._unlink_same(entry, half[entry], recorded=False)  # (that file)
                    try:
                        self.rmdir(name)
                    except OSError as exc:  # something put into it meanwhile: someone's
                        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                            raise
                        log.warning("kept %s: something was put into it", self.path / name)
                continue
            if self._abandoned(name, tag, idle_s):
                found.append(name)
        return found

    def _abandoned(self, name: str, tag: str, idle_s: float) -> bool:
        """Whether the directory ``name`` of the owner ``tag`` is abandoned: its process, of
        this host, is gone, or nothing in it changed for ``idle_s`` seconds."""
        if owner_gone(tag):
            return True
        try:
            with self.sub(name) as d:
                stamps = [d.stat(), *(d.lstat(n) for n in d.names())]
        except (FileNotFoundError, NotOursError):
            return False
        changed = max(entry.st_mtime for entry in stamps if entry is not None)
        return time.time() - changed >= idle_s

    def _half_made(
        self, name: str, marker: str, owner_line: str
    ) -> dict[str, tuple[int, int]] | None:
        """Whether the directory ``name`` holds only what :meth:`make_marked` writes before
        its marker is whole: nothing, its record (:func:`_half_made_record`) and ``marker``
        (empty, or a beginning of ``owner_line``), both regular files, either
        perhaps moved aside to be removed (:data:`_GONE`: a removal of them stopped there). If
        so, the device and inode of each file read (None: not so)."""
        try:
            with self.sub(name) as d:
                names = d.names()
                if any(n not in (MADE, marker) and not _GONE.fullmatch(n) for n in names):
                    return None
                read = {entry: d.read_judged(entry, limit=4096) for entry in names}
        except (NotOursError, OSError):
            return None
        whole = f"{owner_line}\n".encode()
        judged = {}
        for entry, found in read.items():
            if found is None:
                return None
            data = found[0]
            record = _half_made_record(data, marker)
            mark = whole.startswith(data) and data != whole
            if not (record if entry == MADE else mark if entry == marker else record or mark):
                return None
            judged[entry] = found[1]
        return judged

    # -- looking ---------------------------------------------------------------------------

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry ``name`` itself (a link is not followed); None when absent."""
        _seam("stat", self.path / name)
        try:
            with _naming(self.path / name, relative=True):
                return os.stat(_component(name), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def stat(self) -> os.stat_result:
        """This directory itself (``fstat`` of its descriptor)."""
        _seam("stat", self.path)
        with _naming(self.path):
            return os.fstat(self.fd)

    def kind(self, name: str) -> str | None:
        """What ``name`` is (:func:`kind_of`: ``a directory``, ``a file``, ``a FIFO``, ...), or
        None when absent."""
        found = self.lstat(name)
        return None if found is None else kind_of(found.st_mode)

    def is_dir(self, name: str) -> bool:
        found = self.lstat(name)
        return found is not None and stat.S_ISDIR(found.st_mode)

    def names(self) -> list[str]:
        """The entries of this directory, sorted."""
        _seam("list", self.path)
        with _naming(self.path):
            return sorted(os.listdir(self.fd))

    def not_ours(self, name: str, expected: str) -> NotOursError:
        """The error for ``name`` holding something else than ``expected``."""
        return NotOursError(self.path / name, self._found(name), expected)

    def _found(self, name: str) -> str:
        """What ``name`` is, for a message (a look on a failure's path, not through the
        seam)."""
        try:
            found = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return "something else"
        what = kind_of(found.st_mode)
        if stat.S_ISLNK(found.st_mode):
            with contextlib.suppress(OSError):
                what += f" to {os.readlink(name, dir_fd=self.fd)}"
        return what

    # -- files -----------------------------------------------------------------------------

    def open_file(self, name: str, flags: int, mode: int = 0o644) -> int:
        """``openat`` of the file ``name`` with ``O_NOFOLLOW``: a link there is
        :class:`NotOursError`; with ``O_EXCL``, anything there is a
        :class:`~loader.errors.NameTakenError` (a ``FileExistsError``); returns the
        descriptor.

        In a marked tree, a file this call creates is recorded (:data:`MADE`), and an existing
        one is opened for writing only when the record names it (anything else there is
        someone else's: :class:`NotOursError`, never truncated or written)."""
        writing = flags & (os.O_WRONLY | os.O_RDWR)
        if self.made is None or not (writing or flags & os.O_CREAT):
            return self._open_file(name, flags, mode)
        if flags & os.O_CREAT:
            pending = self._pending(name, "f")
            try:
                fd = self._open_file(name, (flags & ~os.O_TRUNC) | os.O_EXCL, mode)
            except BaseException as exc:
                if pending:
                    self._not_made(name)
                if not isinstance(exc, FileExistsError) or flags & os.O_EXCL:
                    raise
            else:
                try:
                    self._record(name, os.fstat(fd))
                except BaseException:
                    os.close(fd)
                    raise
                return fd
        fd = self._open_file(name, flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC), mode)
        try:
            if not self._made_by_loader(name, os.fstat(fd)):
                raise self.not_ours(name, "a file the loader made (it writes only its own)")
            if flags & os.O_TRUNC:
                truncate(fd, 0, self.path / name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_file(self, name: str, flags: int, mode: int) -> int:
        _seam("open", self.path / name)
        try:
            return os.open(
                _component(name), flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd
            )
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO or socket (O_NONBLOCK)
                raise self.not_ours(name, "a file the loader writes") from exc
            if exc.errno == errno.EEXIST and flags & os.O_EXCL:  # not made by this call
                raise NameTakenError(self.path / name, self._found(name)) from None
            raise self._failed(exc, self.path / name) from None

    def read(self, name: str, *, limit: int = SMALL_FILE_BYTES) -> bytes | None:
        """The content of the regular file ``name`` (at most ``limit`` bytes); None when
        absent. A link is :class:`NotOursError`; a directory there is ``IsADirectoryError``."""
        found = self.read_judged(name, limit=limit)
        return None if found is None else found[0]

    def read_judged(
        self, name: str, *, limit: int = SMALL_FILE_BYTES
    ) -> tuple[bytes, tuple[int, int]] | None:
        """:meth:`read`, and the device and inode of the very file read (for
        :meth:`unlink_judged`: a file judged by its content is removed only while it is that
        file)."""
        try:
            fd = self.open_file(name, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise self.not_ours(name, "a file the loader writes")
            os.set_blocking(fd, True)
            return read_fd(fd, self.path / name, limit=limit), (found.st_dev, found.st_ino)
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes, *, exclusive: bool = True, sync: bool = True) -> Stamp:
        """Write the file ``name`` (created with ``O_EXCL`` unless ``exclusive`` is False:
        then an existing regular file is overwritten, anything else there is
        :class:`NotOursError`); fsynced unless ``sync`` is False. Returns the :data:`Stamp`
        of the descriptor written through, after the write (the file that holds ``data``)."""
        return self._write(name, data, os.O_EXCL if exclusive else os.O_TRUNC, sync=sync)

    def _write(self, name: str, data: bytes, mode: int, *, sync: bool) -> Stamp:
        """``data`` into the regular file ``name``, opened with ``O_CREAT`` and ``mode``."""
        fd = self._open_regular(name, os.O_WRONLY | os.O_CREAT | mode, "a file the loader writes")
        try:
            write_fd(fd, data, self.path / name)
            if sync:
                fsync_fd(fd, self.path / name)
            return stamp(os.fstat(fd))
        finally:
            os.close(fd)

    def _open_regular(self, name: str, flags: int, expected: str) -> int:
        """``openat`` of the regular file ``name`` (:meth:`open_file`), opened without blocking
        on a FIFO: a link, FIFO, socket, device or directory there is a :class:`NotOursError`
        (never read or written: it may block forever or never end)."""
        fd = self.open_file(name, flags | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise self.not_ours(name, expected)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def owns(self, name: str) -> bool:
        """Whether ``name`` is a regular file or directory the loader made, so that it may move,
        replace or remove it: outside a marked tree any such entry (only what a caller found
        in the loader's own place is asked about); inside one, only what its record names."""
        found = self.lstat(name)
        return (
            found is not None
            and (stat.S_ISREG(found.st_mode) or stat.S_ISDIR(found.st_mode))
            and self._made_by_loader(name, found)
        )

    def replaceable(self, name: str) -> bool:
        """Whether the loader may put a file of its own at ``name`` (a rename with
        ``how="replace"``): nothing is there, or a regular file it may replace (in a marked
        tree: one its record names)."""
        found = self.lstat(name)
        return found is None or (stat.S_ISREG(found.st_mode) and self._made_by_loader(name, found))

    def regular_size(self, name: str) -> int | None:
        """The size of the regular file ``name``; None when nothing is there, or something
        else (a link, a directory, a FIFO)."""
        found = self.lstat(name)
        return found.st_size if found is not None and stat.S_ISREG(found.st_mode) else None

    def create(self, name: str) -> BinaryIO:
        """The new file ``name`` (``O_EXCL``, never through a link), open for unbuffered
        writing."""
        fd = self.open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        return open(fd, "wb", buffering=0, closefd=True)

    def append(self, name: str, data: bytes, *, sync: bool = False) -> None:
        """Append ``data`` to the regular file ``name`` (created if absent); fsynced with
        ``sync``."""
        self._write(name, data, os.O_APPEND, sync=sync)

    def open_read(self, name: str) -> BinaryIO:
        """The regular file ``name`` open for reading (anything else: :class:`NotOursError`)."""
        return open(self._open_regular(name, os.O_RDONLY, "a file the loader reads"), "rb")

    def open_update(self, name: str) -> BinaryIO:
        """The existing regular file ``name`` open for reading and writing in place,
        unbuffered (anything else: :class:`NotOursError`)."""
        fd = self._open_regular(name, os.O_RDWR, "a file the loader writes")
        return open(fd, "r+b", buffering=0)

    def fsync_file(self, name: str) -> None:
        """Make the content of the regular file ``name`` durable."""
        fd = self._open_regular(name, os.O_RDONLY, "a file the loader writes")
        try:
            fsync_fd(fd, self.path / name)
        finally:
            os.close(fd)

    def enter(self, names: tuple[str, ...] | list[str], *, create: bool = False) -> Dir:
        """A new :class:`Dir` of ``names`` below this one (this one stays open), entered one
        name at a time, never through a link (each level created if absent with ``create``);
        this directory again when ``names`` is empty."""
        if not names:
            _seam("open", self.path)
            return Dir(os.dup(self.fd), self.path, self.made)
        return self.sub(names[0], create=create).walk_in(tuple(names[1:]), create=create)

    def makedirs(self, names: tuple[str, ...] | list[str]) -> Dir:
        """A new :class:`Dir` of ``names`` below this one (this one stays open), each level
        created if absent and entered one name at a time, never through a link (a link or a
        file where a directory belongs is a :class:`NotOursError`)."""
        return self.enter(names, create=True)

    def copy_in(self, name: str, source: Path, *, checked: Stamp | None = None) -> Stamp:
        """Copy the file ``source`` (a path the user named, or the loader's own package file:
        read as given, :func:`open_read`) to the new file ``name`` (``O_EXCL``, never through
        a link), in bounded chunks; ``checked``: see :func:`as_checked`. Returns the
        :data:`Stamp` of the copy's descriptor after its last write (the file written)."""
        target = self.path / name
        with open_read(source) as src:
            as_checked(src.fileno(), source, checked)
            with self.create(name) as dst:
                while True:
                    _seam("read", source)
                    with _naming(source):
                        chunk = src.read(_COPY_CHUNK)
                    if not chunk:
                        break
                    write_fd(dst.fileno(), chunk, target)
                copied = stamp(os.fstat(dst.fileno()))
            as_checked(src.fileno(), source, checked)  # and unwritten while it was copied
        return copied

    def marked(self, name: str, marker: str, owner: str) -> bool:
        """Whether the directory ``name`` is a real directory holding the regular file
        ``marker`` whose first line is ``owner``: the loader made it (the only kind of tree it
        removes)."""
        if not self.is_dir(name):
            return False
        try:
            with self.sub(name) as d:
                content = d.read(marker, limit=4096)
        except (NotOursError, FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        except TooLargeError:
            return False  # larger than any marker the loader writes: not its mark
        return content is not None and content.decode("utf-8", "replace").split("\n")[0] == owner

    # -- failures ------------------------------------------------------------------------

    def _failed(
        self, exc: OSError, path: object, path2: object | None = None, *, to: Dir | None = None
    ) -> OSError:
        """``exc`` of a call relative to this directory (and ``to``), naming ``path``: an
        ``ENOENT`` because one of the two directories was itself removed meanwhile (by another
        process: its descriptor still names it) is a
        :class:`~loader.errors.DirectoryRemovedError` naming that directory."""
        if exc.errno == errno.ENOENT:
            for d in (self, to):
                if d is not None and d._removed():
                    return DirectoryRemovedError(d.path, path)
        return _named(exc, path, path2)

    def _removed(self) -> bool:
        """Whether this directory was removed since it was opened (no name links to it: a
        look on a failure's path, like :meth:`not_ours`, not through the seam)."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return False

    @contextlib.contextmanager
    def _naming(self, path: object) -> Iterator[None]:
        """:func:`_naming` of a call on a name relative to this directory, and
        :meth:`_failed`'s look at whether the directory was removed."""
        try:
            yield
        except OSError as exc:
            if exc.errno is None:
                raise
            raise self._failed(exc, path) from None

    # -- changing --------------------------------------------------------------------------

    def rename_back(self, name: str, to: Dir, to_name: str) -> None:
        """Put ``name`` back at (or aside to) the absent ``to/to_name`` (``noreplace``: what
        stands there by then is never replaced, a ``FileExistsError``); where the file
        system lacks ``renameat2`` (:data:`NO_RENAMEAT2`), with ``rename(2)`` after a look that
        finds nothing there: a put-back that only ``renameat2`` could do failed on such a file
        system every time, leaving what it moved where it had gone."""
        try:
            self.rename(name, to, to_name, how="noreplace")
            return
        except OSError as exc:
            if exc.errno not in NO_RENAMEAT2:
                raise
            if to.lstat(to_name) is not None:
                raise FileExistsError(
                    errno.EEXIST, os.strerror(errno.EEXIST), str(to.path / to_name)
                ) from None
        self.rename(name, to, to_name, how="replace")

    def rename(self, name: str, to: Dir, to_name: str, *, how: str = "noreplace") -> None:
        """Rename ``name`` to ``to/to_name`` in one step. ``how``: ``noreplace`` (fails with
        EEXIST when the target exists, even as an empty directory), ``exchange`` (swaps two
        existing entries atomically) or ``replace`` (``renameat``). A file system without
        ``renameat2`` raises an ``OSError`` whose errno is in :data:`NO_RENAMEAT2`.

        In a marked tree, only what its record names is moved or replaced (anything else is
        someone else's: :class:`NotOursError`), and what is moved into one is recorded under
        its new name (a directory: with what the record of its old place names below it)
        before the rename: a rename never leaves the loader's entry unrecorded (a record of a
        rename that did not happen names an inode that is the loader's file's elsewhere)."""
        src, dst = self.path / name, to.path / to_name
        moved = self.lstat(name) if self.made is not None or to.made is not None else None
        if self.made is not None and moved is not None and not self._made_by_loader(name, moved):
            raise self.not_ours(name, "a file or directory the loader made (to move)")
        there = None
        if how == "replace":  # the loader makes only files and directories: it replaces no other
            there = to.lstat(to_name)
            if there is not None and not to._made_by_loader(to_name, there):
                raise to.not_ours(to_name, "a file or directory of the loader's (to replace)")
        if moved is not None and to.made is not None:
            self._record_moved(name, to.made[0], (*to.made[1], to_name), moved)
        if how == "replace" and to.made is not None and moved is not None:
            self._replace_judged(name, to, to_name, moved, there)
        else:
            self._rename(name, to, to_name, how, src, dst)
        _trees_moved(src, dst, exchange=how == "exchange")

    def _replace_judged(
        self,
        name: str,
        to: Dir,
        to_name: str,
        moved: os.stat_result,
        there: os.stat_result | None,
    ) -> None:
        """Rename ``name`` to ``to/to_name`` in a marked tree, replacing only what the look
        found there (``there``: nothing, or the loader's own file): ``rename(2)`` would replace
        whatever stands there by then (a user's file renamed to ``to_name`` after the look).
        Where nothing was, nothing is replaced, a directory moved neither (something there since
        is refused, unless it is the loader's own again); the loader's file is swapped out in
        one exchange and removed only while it is that very file (anything else is swapped back,
        and refused unless it is the loader's own: another loader placing the same file); a
        name another loader's file holds at every look is refused as
        contention (:class:`NameContendedError`). The loader's directory
        there (rename(2) replaces only an empty one), and a file system without ``renameat2``,
        are renamed as before."""
        src, dst = self.path / name, to.path / to_name
        for _ in range(3):  # (another loader's file may come and go meanwhile)
            whole = stat.S_ISREG(moved.st_mode) and (there is None or stat.S_ISREG(there.st_mode))
            try:
                if there is None:  # a directory too: rename(2) replaced an empty one put there
                    self._rename(name, to, to_name, "noreplace", src, dst)
                    return
                if not whole:
                    break
                if self.made is not None:  # what comes back to ``name`` is the loader's there
                    self._record(name, there)
                self._rename(name, to, to_name, "exchange", src, dst)
            except OSError as exc:
                if exc.errno in NO_RENAMEAT2:
                    break
                gone = exc.errno == errno.ENOENT and not isinstance(exc, DirectoryRemovedError)
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) and not (there and gone):
                    raise
                there = to.lstat(to_name)  # came or went since the look: judged again
                if there is not None and not to._made_by_loader(to_name, there):
                    raise NameTakenError(dst, kind_of(there.st_mode)) from None
                continue
            back = self.lstat(name)
            if back is not None and (back.st_dev, back.st_ino) == (there.st_dev, there.st_ino):
                if self._unlink_same(name, back) is False:
                    log.warning("kept %s: put there after the loader looked", src)
                return
            self._rename(name, to, to_name, "exchange", src, dst)  # the other's goes back
            there = to.lstat(to_name)  # another loader's own (placing the same file): again
            if there is not None and not to._made_by_loader(to_name, there):
                raise NameTakenError(dst, "a file put there after the loader looked")
        else:  # the loader's own at every look (a user's was refused): other loaders contend
            raise NameContendedError(dst)  # (rename(2) would replace what stands there by then)
        self._rename(name, to, to_name, "replace", src, dst)

    def _record_moved(
        self, name: str, into: _Made, rel: tuple[str, ...], moved: os.stat_result
    ) -> None:
        """Record in ``into`` at ``rel`` this directory's ``name`` (``moved``: its ``lstat``),
        about to be renamed there: the entry itself, and below a directory what the record of
        its place names there (anything, outside a marked tree)."""
        if not (stat.S_ISREG(moved.st_mode) or stat.S_ISDIR(moved.st_mode)):
            return
        into.record(rel, moved)
        if stat.S_ISDIR(moved.st_mode):
            with self.sub(name) as d:
                d._record_below(into, rel)

    def _record_below(self, into: _Made, rel: tuple[str, ...]) -> None:
        for entry in self.names():
            found = self.lstat(entry)
            if found is None or not self._made_by_loader(entry, found):
                continue  # not the loader's where it is: not the loader's where it goes
            into.record((*rel, entry), found)
            if stat.S_ISDIR(found.st_mode):
                with self.sub(entry) as sub:
                    sub._record_below(into, (*rel, entry))

    def _rename(self, name: str, to: Dir, to_name: str, how: str, src: Path, dst: Path) -> None:
        _seam("rename" if how == "replace" else f"rename-{how}", f"{src} -> {dst}")
        if how == "replace":
            try:
                os.rename(_component(name), _component(to_name), src_dir_fd=self.fd,
                          dst_dir_fd=to.fd)  # fmt: skip
            except OSError as exc:
                raise self._failed(exc, src, dst, to=to) from None
            return
        flags = {"noreplace": _RENAME_NOREPLACE, "exchange": _RENAME_EXCHANGE}[how]
        if _renameat2 is None:
            raise OSError(errno.ENOSYS, "renameat2 is not available", str(src), None, str(dst))
        result = _renameat2(
            self.fd, os.fsencode(_component(name)), to.fd, os.fsencode(_component(to_name)), flags
        )
        if result != 0:
            err = ctypes.get_errno()
            exc = OSError(err, os.strerror(err), str(src), None, str(dst))
            raise self._failed(exc, src, dst, to=to)

    def link(self, name: str, to_name: str) -> None:
        """A hard link ``to_name`` to the file ``name`` (both in this directory)."""
        _seam("link", f"{self.path / name} -> {self.path / to_name}")
        with self._naming(self.path / to_name):
            os.link(_component(name), _component(to_name), src_dir_fd=self.fd,
                    dst_dir_fd=self.fd, follow_symlinks=False)  # fmt: skip
        if self.made is not None:
            found = self.lstat(to_name)
            if found is not None and self._made_by_loader(name, found):
                self._record(to_name, found)

    def unlink(self, name: str, *, missing_ok: bool = False) -> None:
        """Remove the file ``name``. The loader makes only files and directories: a symbolic
        link, FIFO, socket or device there is someone else's and stays (a warning names it;
        the caller then finds the name taken where it writes, an error naming it). In a
        marked tree so is a file its record does not name."""
        found = self.lstat(name)
        if found is not None and not (
            stat.S_ISREG(found.st_mode) and self._made_by_loader(name, found)
        ):
            log.warning(
                "kept %s (%s): the loader did not make it, so it is someone else's; "
                "remove it when it is not needed",
                self.path / name,
                kind_of(found.st_mode),
            )
            return
        if found is not None and self.made is not None:  # judged by its inode: only that file
            removed = self._unlink_same(name, found)
            if removed is None and not missing_ok:
                raise FileNotFoundError(
                    errno.ENOENT, os.strerror(errno.ENOENT), str(self.path / name)
                )
            if removed is False:
                log.warning("kept %s: put there after the loader looked, so someone else's",
                            self.path / name)  # fmt: skip
            return
        _seam("unlink", self.path / name)
        try:
            os.unlink(_component(name), dir_fd=self.fd)
        except FileNotFoundError as exc:
            if not missing_ok:
                raise self._failed(exc, self.path / name) from None
        except OSError as exc:
            raise _named(exc, self.path / name) from None

    def _unlink_same(
        self,
        name: str,
        judged: os.stat_result | tuple[int, int],
        *,
        aside: str | None = None,
        recorded: bool = True,
    ) -> bool | None:
        """Remove the regular file ``name`` only while it is the very file ``judged`` (its
        ``lstat`` when the loader judged it its own, or its device and inode as
        :meth:`read_judged` or ``fstat`` told them) names: a removal by name would take
        whatever stands there by then (a user's file renamed to ``name`` after the look). It
        is moved to ``aside`` (by default a fresh name of this directory) in one rename that
        replaces nothing, and removed there only if what moved is that file; anything else
        goes back to ``name`` untouched (left at ``aside``, with a warning, when something new
        is at ``name`` by then). Something at ``aside`` already is never replaced: it is a
        :class:`NameTakenError`, and nothing moved. In a marked tree (with ``recorded``, and
        ``judged`` an ``lstat``) ``aside`` is recorded as the loader's file before the rename,
        and ``name`` as gone: a loader stopped in between leaves a file the next one removes.
        True when the file was removed; False when something else was at ``name``; None when
        nothing was."""
        if isinstance(judged, os.stat_result):
            identity = (judged.st_dev, judged.st_ino)
        else:
            identity, judged = (judged[0], judged[1]), None
        aside = aside or f".{MARKER_PREFIX[1:]}gone.{owner()}.{secrets.token_hex(6)}"
        if recorded and judged is not None:
            self._record(aside, judged)
            self._record(name, judged, gone=True)
        try:
            self._rename_fresh(name, aside)
        except FileNotFoundError as exc:
            if isinstance(exc, DirectoryRemovedError):
                raise
            return None  # removed meanwhile: nothing left to remove
        except FileExistsError:
            raise NameTakenError(self.path / aside, self._found(aside)) from None
        now = self.lstat(aside)
        if now is None:
            return None
        if (now.st_dev, now.st_ino) == identity and stat.S_ISREG(now.st_mode):
            if recorded and judged is not None:
                self._record(aside, now, gone=True)
            self._unlink_own(aside)
            return True
        try:
            self._rename_fresh(aside, name)
        except OSError as exc:
            log.warning("%s was replaced after the loader looked at it, and could not be put "
                        "back (%s): left at %s", self.path / name, exc.strerror or exc,
                        self.path / aside)  # fmt: skip
        return False

    def _rename_fresh(self, name: str, to_name: str) -> None:
        """Rename ``name`` to ``to_name`` of this directory, where nothing stands: without
        replacing anything (``rename(2)`` after a look where the file system lacks
        ``renameat2``). No judgment of what moves: the caller's."""
        src, dst = self.path / name, self.path / to_name
        try:
            self._rename(name, self, to_name, "noreplace", src, dst)
            return
        except OSError as exc:
            if exc.errno not in NO_RENAMEAT2:
                raise
        if self.lstat(to_name) is not None:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        self._rename(name, self, to_name, "replace", src, dst)

    def unlink_judged(self, name: str, expected: tuple[int, int], aside: str) -> bool:
        """Remove the file ``name`` only while it is the very file ``expected`` (its device and
        inode, as :meth:`read_judged` or ``fstat`` told them) names, moved to ``aside`` (a fresh
        name in this directory) first: :meth:`_unlink_same`. True when the file was removed."""
        return self._unlink_same(name, expected, aside=aside) is True

    def rmdir(self, name: str) -> None:
        """Remove the empty directory ``name``; in a marked tree only one its record names
        (another stays, a warning naming it)."""
        if self.made is not None:
            found = self.lstat(name)
            if found is not None and not self._made_by_loader(name, found):
                log.warning("kept the directory %s: the loader did not make it", self.path / name)
                return
            if found is not None:
                self._record(name, found, gone=True)
        else:
            found = None
        _seam("rmdir", self.path / name)
        try:
            with self._naming(self.path / name):
                os.rmdir(_component(name), dir_fd=self.fd)
        except OSError:
            if found is not None:
                self._still_there(name, found)
            raise

    def rmdir_made(self, name: str, made: tuple[int, int]) -> bool:
        """Remove the empty directory ``name`` only while it is that very directory ``made``
        (its device and inode, as this process made it): anything else at ``name``, or
        anything put into it meanwhile, stays. True when it was removed."""
        found = self.lstat(name)
        if found is None or (found.st_dev, found.st_ino) != tuple(made):
            return False
        if not stat.S_ISDIR(found.st_mode):
            return False
        with self.sub(name) as d:
            now = d.stat()
            if (now.st_dev, now.st_ino) != tuple(made) or d.names():
                return False
            return not self._rmdir_opened(name, d)

    def _still_there(self, name: str, found: os.stat_result) -> None:
        """Record again the directory ``name`` (``found``: its ``lstat`` before) whose removal,
        recorded as about to happen, failed (another process put something into it): it is
        still the loader's, whatever its change time becomes."""
        with contextlib.suppress(OSError):
            now = self.lstat(name)
            if now is not None and now.st_ino == found.st_ino and stat.S_ISDIR(now.st_mode):
                self._record(name, now)

    def remove_tree(
        self, name: str, *, marks: tuple[str, ...] = (), expected: tuple[int, int] | None = None
    ) -> list[Path]:
        """Remove ``name`` and everything below it, relative to descriptors, never following a
        link; nothing outside ``name`` is touched. Callers remove only trees carrying the
        loader's marker (:meth:`marked`). The loader makes only files and directories: a
        symbolic link, FIFO, socket or device in the tree is someone else's and stays where it
        is, with the directories holding it (a warning names it); returns what stayed.

        What makes the tree the loader's goes last: everything below it first, then its own
        files (a repository's manifest among them), its marker (:data:`MARKER_PREFIX`) and
        record last of all, so a removal stopped anywhere (a kill, a failed call) leaves a tree
        that is still recognisably the loader's and that the next loader removes.

        In a marked tree (``name`` is its top, holding its record :data:`MADE`, or lies in
        one) only what the record names is removed: a file or directory someone else put
        there stays too. When anything stays in a tree removed from its top, the tree's
        marker and record go (the tree is no longer the loader's: later runs refuse its name
        and say to move it). In a tree copied file by file (its record names other inodes:
        :func:`_copied`) what the record names is told by name. A tree without a record (made
        before the loader kept one) is removed as before: its files and directories; with
        ``marks``, only when one of those names is a regular file at its top (the loader's
        marker, a published key's manifest): a directory without either is someone else's,
        kept whole.

        The tree's top is opened once: what its record and marks are read from is the very
        directory emptied, and it is removed only while it is still at ``name`` (a directory
        someone renamed to ``name`` meanwhile, after the caller looked, is never emptied).
        With ``expected`` (a device and inode), only that very directory is removed: whatever
        else is at ``name`` is kept whole."""
        found = self.lstat(name)
        if found is not None and stat.S_ISDIR(found.st_mode) and self.made is None:
            with self.sub(name) as d:
                now = d.stat()
                if expected is not None and (now.st_dev, now.st_ino) != tuple(expected):
                    kept = [(d.path, "not the directory the loader made there: all kept")]
                else:
                    kept = self._remove_opened(name, d, marks)
        elif expected is not None:  # not the directory expected, nor one to enter
            kept = [] if found is None else [(self.path / name, "not the loader's: kept")]
        else:
            kept = self._remove_tree(name, top=True)
        if kept:
            log.warning(
                "kept %s in %s: the loader did not make them, so they are someone else's; "
                "remove them (and the directories holding them) when they are not needed",
                ", ".join(f"{p} ({kind})" for p, kind in kept[:3])
                + (f" and {len(kept) - 3} more" if len(kept) > 3 else ""),
                self.path / name,
            )
        return [p for p, _ in kept]

    def _remove_opened(self, name: str, d: Dir, marks: tuple[str, ...]) -> list[tuple[Path, str]]:
        """Remove the tree ``name`` of this directory (no marked tree's), open as ``d``."""
        if d.made is not None:
            return self._remove_top(name, d.made[0], d)
        record = None if d._record_copied() else d.kind(MADE)
        if record is not None:  # something else at the record's name: nothing is known
            return [(d.path / MADE, f"{record}, not the loader's record: all kept")]
        if marks and not any(d.regular_size(mark) is not None for mark in marks):
            return [(d.path, "a directory without the loader's record or marker: all kept")]
        kept: list[tuple[Path, str]] = []
        for entry in d._mark_last(d.names()):
            kept += d._remove_tree(entry, depth=1)
        return kept or self._rmdir_opened(name, d)

    def _rmdir_opened(self, name: str, d: Dir) -> list[tuple[Path, str]]:
        """Remove the directory ``name``, emptied through ``d``, while it is still that very
        directory: another one renamed to ``name`` meanwhile stays (the emptied one is left
        empty where it went)."""
        now, emptied = self.lstat(name), d.stat()
        if now is None or (now.st_dev, now.st_ino) != (emptied.st_dev, emptied.st_ino):
            return [] if now is None else [(self.path / name, "a directory put there meanwhile")]
        return self._rmdir_emptied(name)

    def _remove_top(self, name: str, top: _Made, d: Dir) -> list[tuple[Path, str]]:
        """Remove the marked tree ``name`` (open as ``d``) whose record is ``top`` (see
        :meth:`remove_tree`)."""
        top.records()  # read before anything goes
        marker = top.marker
        record = d.lstat(MADE)
        kept: list[tuple[Path, str]] = []
        spared = {MADE} if marker is None else {MADE, marker}
        mark = None if marker is None else d.lstat(marker)
        if marker is not None and mark is not None and not d._made_by_loader(marker, mark):
            # Someone else's file at the marker's name (put where the loader's was, or
            # named by a first line someone rewrote): it stays, and the record with it.
            kept.append((d.path / marker, kind_of(mark.st_mode)))
            marker = None
        for entry in d._mark_last([n for n in d.names() if n not in spared]):
            kept += d._remove_tree(entry, forget=False, depth=1)  # the record goes whole
        if kept and marker is None:  # the tree stays marked: its record stays with it
            return kept
        # When something stays, the mark goes before the record: a tree never stays
        # marked without its record (it would be taken for one made before records, and
        # removed whole). When nothing stays, the record goes first and the mark last: a
        # removal stopped between leaves a marked tree holding nothing else, which the next
        # loader removes.
        # Each only while it is the very file judged above (a file renamed to its name since is
        # someone else's, and stays). The mark that goes last of all is removed by name after a
        # last look: moved aside, it would leave (if stopped there) a tree no loader knows.
        judged = {MADE: record, marker: mark}
        for entry in (marker, MADE) if kept else (MADE, marker):
            seen = None if entry is None else judged[entry]
            if seen is None or not stat.S_ISREG(seen.st_mode):
                continue
            if kept or entry == MADE:
                if d._unlink_same(entry, seen, recorded=False) is False:
                    kept.append((d.path / entry, "a file put there meanwhile"))
                continue
            now = d.lstat(entry)
            if now is not None and (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino):
                d._unlink_own(entry)
            elif now is not None:
                kept.append((d.path / entry, "a file put there meanwhile"))
        _forget_made(top)
        if not kept:
            kept = self._rmdir_opened(name, d)
        return kept

    def _record_copied(self) -> bool:
        """Whether this directory holds a copied tree's record (:func:`_copied`)."""
        _seam("open", self.path / MADE)
        try:
            fd = os.open(MADE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.fd)  # fmt: skip
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link or FIFO: not a record
                return False
            raise _named(exc, self.path / MADE) from None
        try:
            with _naming(self.path / MADE):
                return stat.S_ISREG(os.fstat(fd).st_mode) and _copied(fd)
        finally:
            os.close(fd)

    def _mark_last(self, entries: list[str]) -> list[str]:
        """``entries`` of this directory in the order a tree's top is emptied: directories
        (and anything else) first, then files, those marking the tree as the loader's
        (:data:`MARKER_PREFIX`) last."""
        files = [n for n in entries if self.kind(n) == "a file"]
        return [n for n in entries if n not in files] + sorted(
            files, key=lambda n: n.startswith(MARKER_PREFIX)
        )

    def _remove_tree(
        self, name: str, *, forget: bool = True, top: bool = False, depth: int = 0
    ) -> list[tuple[Path, str]]:
        found = self.lstat(name)
        if found is None:
            return []
        ours = self._made_by_loader(name, found)
        if stat.S_ISREG(found.st_mode) and ours:
            if self.made is None:  # no record: any file of a tree the caller judged is its own
                self._unlink_own(name)
            elif self._unlink_same(name, found) is False:
                return [(self.path / name, "a file put there meanwhile")]
            return []
        if not stat.S_ISDIR(found.st_mode):
            return [(self.path / name, kind_of(found.st_mode))]
        if depth >= MAX_TREE_DEPTH:
            return [(self.path / name, f"a directory nested over {MAX_TREE_DEPTH} levels deep")]
        kept: list[tuple[Path, str]] = []
        with self.sub(name) as d:  # what the loader made below a directory it did not is its own
            entries = d.names()
            for entry in d._mark_last(entries) if top else entries:  # see remove_tree
                kept += d._remove_tree(entry, forget=forget, depth=depth + 1)
        if kept:
            return kept
        if not ours:
            return [(self.path / name, "a directory")]
        if not forget:
            return self._rmdir_emptied(name)
        self._record(name, found, gone=True)
        kept = self._rmdir_emptied(name)
        if kept:  # filled meanwhile: still the loader's directory
            self._still_there(name, found)
        return kept

    def _rmdir_emptied(self, name: str) -> list[tuple[Path, str]]:
        """Remove the directory ``name`` a removal has just emptied; one someone put something
        into meanwhile stays (returned as kept, not a failure)."""
        _seam("rmdir", self.path / name)
        try:
            with self._naming(self.path / name):
                os.rmdir(_component(name), dir_fd=self.fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            return [(self.path / name, "a directory something was put into meanwhile")]
        return []

    def _unlink_own(self, name: str) -> None:
        _seam("unlink", self.path / name)
        with contextlib.suppress(FileNotFoundError), _naming(self.path / name, relative=True):
            os.unlink(_component(name), dir_fd=self.fd)

    def chmod(self, name: str, mode: int) -> None:
        """Set the mode of ``name`` (not through a link: a link is skipped) unless it has it
        already (a mode change moves the ctime, which sealed files keep). In a marked tree,
        a file or directory its record does not name is someone else's: :class:`NotOursError`,
        its mode unchanged."""
        found = self.lstat(name)
        if found is None or stat.S_ISLNK(found.st_mode) or stat.S_IMODE(found.st_mode) == mode:
            return
        if self.made is not None and not self._made_by_loader(name, found):
            raise self.not_ours(name, "a file or directory the loader made (to seal)")
        _seam("chmod", self.path / name)
        # Opened without following a link and changed through the descriptor: a link swapped
        # in since the look above is not followed (``chmod`` by name would follow it).
        try:
            fd = os.open(
                _component(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=self.fd,
            )  # fmt: skip
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link now: skipped, as above
                return
            raise _named(exc, self.path / name) from None
        try:
            with _naming(self.path / name):
                if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                    os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def set_mode(self, mode: int) -> None:
        """Give this directory itself ``mode`` unless it has it already: through its
        descriptor, so a directory someone renamed to its name since it was opened keeps its
        own."""
        _seam("chmod", self.path)
        with _naming(self.path):
            if stat.S_IMODE(os.fstat(self.fd).st_mode) != mode:
                os.fchmod(self.fd, mode)

    def fsync(self) -> None:
        """Make this directory's entries durable."""
        fsync_fd(self.fd, self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Dir({str(self.path)!r})"


@contextlib.contextmanager
def _naming(path: object, *, relative: bool = False) -> Iterator[None]:
    """An ``OSError`` of a call on a descriptor (or, with ``relative``, on a name relative to
    one), given the whole path it concerns: the errno mapping's message and hint name it."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None or (exc.filename is not None and not relative):
            raise
        raise _named(exc, path) from None


def _named(exc: OSError, path: object, path2: object | None = None) -> OSError:
    """``exc`` with the path it concerns (errors raised relative to a descriptor name only the
    relative name)."""
    if exc.errno is None:
        return exc
    return type(exc)(
        exc.errno, exc.strerror, str(path), None, None if path2 is None else str(path2)
    )


# --- descriptors and paths -------------------------------------------------------------------


def read_fd(fd: int, path: object, *, limit: int) -> bytes:
    """Read a whole file from ``fd``; more than ``limit`` bytes is a :class:`TooLargeError`."""
    _seam("read", path)
    chunks, size = [], 0
    with _naming(path):
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise TooLargeError(path, limit)
    return b"".join(chunks)


def write_fd(fd: int, data: bytes | memoryview, path: object) -> None:
    """Write all of ``data`` to ``fd``."""
    _seam("write", path)
    view = memoryview(data).cast("B")
    with _naming(path):
        while view:
            written = os.write(fd, view)
            view = view[written:]


def rewrite_fd(fd: int, data: bytes, path: object) -> None:
    """Make the file open at ``fd`` hold exactly ``data`` (written at offset 0, truncated)."""
    _seam("write", path)
    with _naming(path):
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))


def fsync_fd(fd: int, path: object) -> None:
    _seam("fsync", path)
    with _naming(path):
        os.fsync(fd)


# --- reading a source by path ------------------------------------------------------------------
#
# What the loader takes by path is only ever read, and is a source: a checkpoint, tokenizer or
# token file the user named (followed as given, its links too: :func:`followed`), or a
# checkpoint downloaded below ``ROOT`` or ``--work-dir`` (below a :func:`confined` tree: walked
# from its anchor one name at a time, never through a link). Nothing here writes: what the
# loader writes is a :class:`Dir` and one name.


def _open_below(path: Path, flags: int) -> int | None:
    """``openat`` of a confined ``path`` (never through a link); None for a path followed as
    given."""
    located = _locate(path)
    if located is None:
        return None
    d, name = located
    with d:
        return d.open_file(name, flags)


def stat_path(path: Path) -> os.stat_result:
    """The entry at ``path``, a link followed (a path the user named); below a
    :func:`confined` tree no level is followed (a link there is a :class:`NotOursError`)."""
    located = _locate(path)
    if located is not None:
        d, name = located
        with d:
            found = d.lstat(name)
            if found is not None and stat.S_ISLNK(found.st_mode):
                raise d.not_ours(name, "a file or directory the loader reads")
        if found is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return found
    _seam("stat", path)
    return os.stat(path)


def regular_size(path: Path) -> int | None:
    """The size of the regular file at ``path`` (:func:`stat_path`); None when nothing is
    there, or something else (a directory, a FIFO)."""
    try:
        found = stat_path(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return found.st_size if stat.S_ISREG(found.st_mode) else None


def what_stands_at(path: Path, wanted: str = "") -> str:
    """What stands at ``path``, for a message: ``does not exist``, ``is a directory``, ``is a
    FIFO``, ``is a dangling symbolic link``, ``is a symbolic link to a file``, ``lies below
    something that is no directory``; with ``wanted`` (``a file``), an entry of
    another kind says so (``is a FIFO, not a file``). Only looks (:func:`stat_path`);
    below a :func:`confined` tree a link is never followed (it is ``a symbolic link``)."""
    given = True
    try:
        below = _below(path, reading=True)
        given = below is None or not below[1]  # a path the user named: followed as given
        found = stat_path(path)
    except FileNotFoundError as exc:
        if exc.filename is None:  # no working directory (deleted): nothing relative resolves
            raise
        return "is a dangling symbolic link" if given and os.path.islink(path) else "does not exist"
    except NotOursError as exc:
        if exc.path == Path(path).absolute() and os.path.islink(path):
            return "is a symbolic link"
        return "lies below a symbolic link the loader does not follow there"
    except NotADirectoryError:
        return "lies below something that is no directory"
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror})"
    what = kind_of(found.st_mode)
    if given and os.path.islink(path):
        what = f"a symbolic link to {what}"
    return f"is {what}, not {wanted}" if wanted and what != wanted else f"is {what}"


def not_a_directory(path: Path) -> str:
    """What keeps ``path`` from being a directory, for a message: ``does not exist``, ``is a
    FIFO, not a directory``, ``is a dangling symbolic link``, ``is a symbolic link to a file,
    not a directory``, ``lies below something that is no directory`` (``is a directory`` when
    it is one)."""
    what = what_stands_at(path, "a directory")
    return "is a symbolic link, not a directory" if what == "is a symbolic link" else what


def read_file(path: Path, *, limit: int, checked: Stamp | None = None) -> bytes:
    """The content of the regular file at ``path`` (links followed: sources may use them;
    below a :func:`confined` tree never), at most ``limit`` bytes (:class:`TooLargeError`
    beyond); ``checked``: see :func:`as_checked`."""
    fd = _open_regular(path)
    try:
        as_checked(fd, path, checked)
        data = read_fd(fd, path, limit=limit)
        as_checked(fd, path, checked)  # and unwritten while it was read
        return data
    finally:
        os.close(fd)


def as_checked(fd: int, path: object, checked: Stamp | None) -> None:
    """The file ``fd`` has open (at ``path``) must be the one a download verified against its
    checksum (``checked``: its :data:`Stamp` then; None: none did, a local source's file): one
    renamed over it, or written in place, since is another process's, never read as the
    source's (:class:`~loader.errors.ReplacedDownloadError`). The one comparison of every
    reader of a download (:func:`read_file`, :meth:`Dir.copy_in`, the weight files'
    openers: :data:`loader.checkpoint.OPENERS`, the tokenizer check), made before a byte is
    read (a file that is not the one verified is never judged by its content, corrupt or
    not JSON, nor blamed on the source) and again once what is kept of it was read (bytes
    written in place meanwhile move its modification time)."""
    if checked is not None and stamp(os.fstat(fd)) != checked:
        raise ReplacedDownloadError(path)


def _regular(fd: int, path: object) -> None:
    """A FIFO, device or socket is never read (it may block forever or never end)."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        raise SpecialFileError(path, _special(mode))


def open_read(path: Path) -> BinaryIO:
    """``path`` open for reading (a checkpoint file; links followed, below a :func:`confined`
    tree never). Anything but a regular file is refused (:func:`_regular`)."""
    return open(_open_regular(path), "rb")


def by_descriptor(path: Path, fd: int) -> str:
    """A name that opens the file ``fd`` has open, for a library that takes a name and opens
    it itself (``torch.load(mmap=True)``, the tokenizers library), whatever is at ``path``
    now: ``/proc/self/fd/<fd>``; ``path`` itself where there is no ``/proc``."""
    by_fd = f"/proc/self/fd/{fd}"
    return by_fd if os.path.exists(by_fd) else str(path)


def _open_regular(path: Path) -> int:
    """A descriptor of the regular file ``path``, opened without blocking on a FIFO: a FIFO,
    device or socket is never read (it may block forever or never end)."""
    fd = _open_below(path, os.O_RDONLY | os.O_NONBLOCK)
    if fd is None:
        _seam("open", path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _regular(fd, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def truncate(fd: int, size: int, path: object) -> None:
    _seam("write", path)
    with _naming(path):
        os.ftruncate(fd, size)


def copy_range(src_fd: int, dst_fd: int, count: int, offset: int, path: object) -> int:
    """``copy_file_range`` of ``count`` bytes at ``offset`` of ``src_fd`` to ``dst_fd``."""
    _seam("copy", path)
    with _naming(path):
        return os.copy_file_range(src_fd, dst_fd, count, offset)


def pread(fd: int, count: int, offset: int, path: object) -> bytes:
    _seam("read", path)
    with _naming(path):
        return os.pread(fd, count, offset)
