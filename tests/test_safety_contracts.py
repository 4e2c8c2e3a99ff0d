"""The contracts that keep the loader safe, one unit test per line that holds them (the fast
tier): each test fails when that one line is removed or weakened. ``tests/test_safety_lines.py``
drives whole runs; these call the piece itself, so the cases a run rarely meets are pinned too:

* ``loader.fs``: a ``..`` below a confined tree, a link or a file where ``Dir.mkdir`` finds its
  directory, a link at a name ``Dir.chmod`` is given, a special file at a marker, the owner tag
  of another host;
* the publish lock: a lock moved by a waiter while it changed, a lock file removed under its
  holder, a lock whose first write failed;
* publish and prune: the host of a staging directory's owner, a key replaced meanwhile, a
  replaced copy that is incomplete, the order of fsyncs and renames;
* the download area and partial downloads of a remote source: what the loader did not create
  is never used or removed;
* the source fingerprint: every kind of change is a change;
* what is published loads: the tokenizer's ids and size, ``config.ini``'s numbers at their
  bounds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from loader import fs
from loader.errors import NotOursError
from loader.repository.key import key_filename
from tests.at_step import AtStep
from tests.races import when_locked

# --- loader.fs --------------------------------------------------------------------------------


def test_a_dot_dot_below_a_confined_tree_is_refused_as_not_ours(tmp_path):
    """``..`` is never taken below ROOT: a typed error naming the path (exit 2), not a
    traceback, whichever operation is asked."""
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "outside").write_text("not the loader's\n")
    up = tmp_path / "root" / "sub" / ".." / ".." / "outside"
    with fs.confined(tmp_path / "root"):
        for call in (
            lambda: fs.read_file(up, limit=100),
            lambda: fs.open_read(up),
            lambda: fs.stat_path(up),
            lambda: fs.Dir.open(tmp_path / "root" / "sub" / ".."),
        ):
            with pytest.raises(NotOursError, match=r"'\.\.'"):
                call()
    assert (tmp_path / "outside").read_text() == "not the loader's\n"


@pytest.mark.parametrize("planted", ["link", "file"])
def test_mkdir_of_an_existing_name_accepts_only_a_real_directory(tmp_path, planted):
    """``Dir.mkdir(exist_ok=True)`` answers a link or a file at the name with
    :class:`NotOursError`: the callers that go on into the directory must never get there."""
    (tmp_path / "outside").mkdir()
    entry = tmp_path / "root" / "entry"
    entry.parent.mkdir()
    if planted == "link":
        entry.symlink_to(tmp_path / "outside")
    else:
        entry.write_text("a user's file\n")
    with fs.Dir.open(tmp_path / "root") as d:
        with pytest.raises(NotOursError):
            d.mkdir("entry", exist_ok=True)
        assert d.mkdir("entry2", exist_ok=True) and not d.mkdir("entry2", exist_ok=True)
    assert entry.is_symlink() if planted == "link" else entry.read_text() == "a user's file\n"


def test_a_marked_directory_is_durable_with_its_marker_before_it_gets_its_name(tmp_path):
    """``make_marked``: the marker and the temporary directory's entry for it are fsynced before
    the rename gives the directory its name, and the parent after: a crash never leaves the name
    without its marker."""
    calls: list[tuple[str, str]] = []
    with fs.Dir.open(tmp_path) as d, fs.inject(lambda op, path: calls.append((op, path))):
        assert d.make_marked("made", ".marker", "the-key")
    (rename,) = [i for i, (op, _) in enumerate(calls) if op.startswith("rename")]
    tmp = calls[rename][1].split(" -> ")[0]
    synced = [path for op, path in calls[:rename] if op == "fsync"]
    assert f"{tmp}/.marker" in synced and tmp in synced, calls
    assert ("fsync", str(tmp_path)) in calls[rename:], calls
    assert (tmp_path / "made" / ".marker").read_text() == "the-key\n"


@pytest.mark.parametrize("first_line", ["m@r/tp1-pp1-i1-0123abcd.old", "m@r/tp1-pp1-i1-0123abc"])
def test_a_marker_is_the_loaders_only_when_its_first_line_is_the_key_itself(tmp_path, first_line):
    """A marker whose first line merely starts with the key (or is the start of it) names
    another tree: the directory is not the loader's for that key, so it is never removed."""
    key = "m@r/tp1-pp1-i1-0123abcd"
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / ".marker").write_text(f"{first_line}\n")
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / ".marker").write_text(f"{key}\nanything after the first line\n")
    with fs.Dir.open(tmp_path) as d:
        assert not d.marked("tree", ".marker", key)
        assert d.marked("ours", ".marker", key)


def test_a_fifo_at_a_file_the_loader_reads_is_refused_never_read(tmp_path):
    """``Dir.read`` (markers, locks, journals, manifests) refuses a FIFO: read, it would block
    while a writer holds it open, or pass for an empty file."""
    os.mkfifo(tmp_path / "lock")
    with fs.Dir.open(tmp_path) as d, pytest.raises(NotOursError, match="is a FIFO"):
        d.read("lock")


def test_dir_chmod_never_changes_what_a_link_points_to(tmp_path):
    """``Dir.chmod`` skips a link (``chmod`` follows one): a file outside the tree keeps its
    mode."""
    (tmp_path / "outside").write_text("a user's file\n")
    os.chmod(tmp_path / "outside", 0o600)
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "entry").symlink_to(tmp_path / "outside")
    with fs.Dir.open(tmp_path / "tree") as d:
        d.chmod("entry", 0o644)
    assert stat.S_IMODE((tmp_path / "outside").stat().st_mode) == 0o600


def test_dir_chmod_never_follows_a_link_swapped_in_after_it_looked(tmp_path):
    """Someone who can write the volume swaps a link in between ``Dir.chmod``'s look at the
    entry and its chmod (the seam runs there): the file outside the tree keeps its mode, the
    link is left as it is."""
    (tmp_path / "outside").write_text("a user's file\n")
    os.chmod(tmp_path / "outside", 0o600)
    (tmp_path / "tree").mkdir()
    entry = tmp_path / "tree" / "entry"
    entry.write_text("the loader's file\n")
    os.chmod(entry, 0o600)

    def swap(op: str, path: str) -> None:
        if op == "chmod" and path == str(entry):
            entry.unlink()
            entry.symlink_to(tmp_path / "outside")

    with fs.Dir.open(tmp_path / "tree") as d, fs.inject(swap):
        d.chmod("entry", 0o644)
    assert stat.S_IMODE((tmp_path / "outside").stat().st_mode) == 0o600
    assert entry.is_symlink()


def test_a_fifo_with_a_reader_is_never_written_to(tmp_path):
    """A FIFO someone reads from opens for writing without blocking: the file the loader
    writes (a journal, a manifest) is refused there by its kind, and nothing reaches the
    reader."""
    os.mkfifo(tmp_path / "journal")
    reader = os.open(tmp_path / "journal", os.O_RDONLY | os.O_NONBLOCK)
    try:
        with fs.Dir.open(tmp_path) as d:
            for call in (
                lambda: d.write("journal", b"written\n", exclusive=False),
                lambda: d.append("journal", b"written\n"),
                lambda: d.open_update("journal"),
            ):
                with pytest.raises(NotOursError):
                    call()
        assert os.read(reader, 100) == b""  # nothing was written into it
    finally:
        os.close(reader)


def test_the_loaders_new_names_never_take_over_an_existing_entry(tmp_path):
    """``make_marked`` never replaces what is at its name (an empty directory of a user's
    included), and ``Dir.write`` creates its file: a hard link planted at the name is
    refused, the file it shares keeps its bytes."""
    (tmp_path / "theirs").mkdir()
    inode = (tmp_path / "theirs").stat().st_ino
    (tmp_path / "users.txt").write_text("a user's data\n")
    (tmp_path / "fresh").mkdir()
    os.link(tmp_path / "users.txt", tmp_path / "fresh" / ".marker")
    with fs.Dir.open(tmp_path) as d:
        assert not d.make_marked("theirs", ".marker", KEY)
        with d.sub("fresh") as fresh, pytest.raises(FileExistsError):
            fresh.write(".marker", b"the key\n")
    assert (tmp_path / "theirs").stat().st_ino == inode
    assert os.listdir(tmp_path / "theirs") == []
    assert (tmp_path / "users.txt").read_text() == "a user's data\n"


def test_a_file_the_loader_creates_never_reuses_an_existing_one(tmp_path):
    """``Dir.create`` (the converter's outputs) and ``Dir.copy_in`` (copied files) make a new
    file: a hard link planted at its name (``O_NOFOLLOW`` cannot tell one) is refused, and the
    file it shares with a user's keeps its bytes."""
    (tmp_path / "users.bin").write_bytes(b"a user's data\n")
    (tmp_path / "source.bin").write_bytes(b"the source\n")
    (tmp_path / "out").mkdir()
    os.link(tmp_path / "users.bin", tmp_path / "out" / "model.wte.bin")
    with fs.Dir.open(tmp_path / "out") as d:
        for call in (
            lambda: d.create("model.wte.bin"),
            lambda: d.copy_in("model.wte.bin", tmp_path / "source.bin"),
        ):
            with pytest.raises(FileExistsError):
                call()
    assert (tmp_path / "users.bin").read_bytes() == b"a user's data\n"


@pytest.mark.parametrize("kind", ["link", "dangling link", "fifo", "directory", "file"])
@pytest.mark.parametrize("call", ["create", "write", "copy_in"])
def test_a_name_taken_before_the_loader_creates_its_file_is_not_ours(tmp_path, kind, call):
    """What stands at the name of a file the loader creates new (an output, a marker, a copied
    file), planted after the loader looked, fails the ``O_EXCL`` create with ``EEXIST``: that
    is a ``NotOursError`` naming what is there (exit 2), not the exit 1 of a bug's errno, and
    what is there is never written through; competing callers still see a
    ``FileExistsError``."""
    from loader.errors import EXIT_USER_ERROR, typed_os_error

    (tmp_path / "outside").write_text("not the loader's\n")
    (tmp_path / "source.bin").write_bytes(b"the source\n")
    out = tmp_path / "out"
    out.mkdir()
    planted = out / "model.wte.bin"
    if kind == "link":
        planted.symlink_to(tmp_path / "outside")
    elif kind == "dangling link":
        planted.symlink_to(tmp_path / "nothing-here")
    elif kind == "fifo":
        os.mkfifo(planted)
    elif kind == "directory":
        planted.mkdir()
    else:
        planted.write_text("a user's file\n")
    with fs.Dir.open(out) as d, pytest.raises(FileExistsError) as raised:
        {
            "create": lambda: d.create("model.wte.bin"),
            "write": lambda: d.write("model.wte.bin", b"bytes"),
            "copy_in": lambda: d.copy_in("model.wte.bin", tmp_path / "source.bin"),
        }[call]()
    typed = typed_os_error(raised.value)
    assert isinstance(typed, NotOursError) and typed.exit_code == EXIT_USER_ERROR
    found = {"fifo": "a FIFO", "directory": "a directory", "file": "a file"}
    assert f"{planted} is {found.get(kind, 'a symbolic link')}" in typed.message
    assert (tmp_path / "outside").read_text() == "not the loader's\n"
    assert not (tmp_path / "nothing-here").exists()


_IN_A_REMOVED_DIRECTORY = {
    "create": lambda d: d.create("model.wte.bin"),
    "write": lambda d: d.write("journal", b"a line\n"),
    "mkdir": lambda d: d.mkdir("2-gpu"),
    "make_marked": lambda d: d.make_marked("tiny@r1", ".marker", KEY),
    "rename": lambda d: d.rename("partial", d, "config.json"),
    "link": lambda d: d.link("partial", "config.json"),
    "unlink": lambda d: d.unlink("partial"),
    "sub": lambda d: d.sub("converted"),
}


@pytest.mark.parametrize("call", sorted(_IN_A_REMOVED_DIRECTORY))
def test_a_directory_removed_under_the_loader_is_an_error_of_the_environment(tmp_path, call):
    """A directory the loader works in, removed meanwhile by another process (a user clearing
    ``.work`` or ``.staging`` under a live run), fails the loader's next call there with
    ``ENOENT``: that is a typed error naming the directory (75: running again starts anew),
    not the exit 1 of a name the loader lost (``ENOENT`` is a bug's errno) with a traceback;
    callers that take a missing name for absent still see a ``FileNotFoundError``."""
    from loader.errors import EXIT_TRANSIENT, DirectoryRemovedError, typed_os_error

    work = tmp_path / "work"
    work.mkdir()
    with fs.Dir.open(work) as d:
        shutil.rmtree(work)
        (tmp_path / "canary").mkdir()
        work.symlink_to(tmp_path / "canary")  # what stands there now is someone else's
        with pytest.raises(FileNotFoundError) as raised:
            _IN_A_REMOVED_DIRECTORY[call](d)
    assert isinstance(raised.value, DirectoryRemovedError)
    typed = typed_os_error(raised.value)
    assert typed is not None and typed.exit_code == EXIT_TRANSIENT
    assert str(work) in typed.message and "removed" in typed.message
    assert os.listdir(tmp_path / "canary") == []


def test_a_name_missing_in_a_directory_still_there_stays_a_bugs_errno(tmp_path):
    """Only a removed directory makes ``ENOENT`` an error of the environment: a name missing
    in a directory that is still there is what the loader should have handled (exit 1)."""
    from loader.errors import DirectoryRemovedError, typed_os_error

    with fs.Dir.open(tmp_path) as d, pytest.raises(FileNotFoundError) as raised:
        d.rename("partial", d, "config.json")
    assert not isinstance(raised.value, DirectoryRemovedError)
    assert typed_os_error(raised.value) is None


# --- partial downloads: whose they are, and when they are whole ----------------------------


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_partial_downloads_of_a_live_owner_or_another_host_are_never_adopted_or_removed(
    tmp_path, dead_pid
):
    """A partial file is taken over (:func:`adopt`) or removed (:func:`clear_partials`) only
    when its owner ran on this host, in this pid space, and is gone: a live loader's, or one of
    another host whose pid means nothing here, may still be written."""
    from loader.sources.transfer import PARTIAL_DIR, adopt, clear_partials, own_partial

    dest = tmp_path / "dest"
    partial = dest / PARTIAL_DIR
    partial.mkdir(parents=True)
    live = partial / f"w.safetensors.{os.getppid()}-{fs.host_digest()}"
    other_host = partial / f"w.safetensors.{dead_pid}-0a1b2c3d"
    for path in (live, other_host):
        path.write_bytes(b"being written\n")
    assert not fs.owner_gone(other_host.name.rsplit(".", 1)[1])
    with fs.confined(dest):
        assert not adopt(own_partial(dest, "w.safetensors"))
        clear_partials(dest)
    assert live.read_bytes() == other_host.read_bytes() == b"being written\n"
    dead = partial / f"w.safetensors.{dead_pid}-{fs.host_digest()}"
    dead.write_bytes(b"left by a killed run\n")
    with fs.confined(dest):
        clear_partials(dest)
    assert not dead.exists() and live.exists() and other_host.exists()


def test_what_names_no_owner_under_partial_is_the_users_and_stays(tmp_path, dead_pid, caplog):
    """Only a gone owner's partial files are cleared: entries naming no owner, a link and a
    file where ``.partial`` goes were not written by this loader and stay (a warning names
    them); a gone owner's file beside them goes."""
    from loader.sources.transfer import PARTIAL_DIR, clear_partials

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"the user's\n")
    dest = tmp_path / "dest"
    partial = dest / PARTIAL_DIR
    (partial / "notes").mkdir(parents=True)
    (partial / "notes" / "todo.txt").write_bytes(b"the user's\n")
    (partial / "w.safetensors").write_bytes(b"the user's\n")
    (partial / "elsewhere").symlink_to(outside)
    dead = partial / f"x.safetensors.{dead_pid}-{fs.host_digest()}"
    dead.write_bytes(b"left by a killed run\n")
    with fs.confined(dest), caplog.at_level("WARNING"):
        clear_partials(dest)
    assert not dead.exists()
    assert sorted(p.name for p in partial.iterdir()) == ["elsewhere", "notes", "w.safetensors"]
    assert (partial / "notes" / "todo.txt").read_bytes() == b"the user's\n"
    assert (partial / "elsewhere").is_symlink() and (outside / "keep").exists()
    assert "3 entries this loader did not write" in caplog.text
    for planted in ("file", "link"):
        other = tmp_path / f"dest-{planted}"
        other.mkdir()
        if planted == "file":
            (other / PARTIAL_DIR).write_bytes(b"the user's\n")
        else:
            (other / PARTIAL_DIR).symlink_to(outside)
        with fs.confined(other):
            clear_partials(other)
        assert (other / PARTIAL_DIR).is_symlink() == (planted == "link")
        assert (other / PARTIAL_DIR).exists() and (outside / "keep").exists()


def test_a_fetch_removes_only_its_own_partial_files(tmp_path, dead_pid):
    """At its end a fetch removes its own partial files: another owner's, even a gone one's
    (the next run resumes or clears them), stay."""
    from loader.sources.transfer import PARTIAL_DIR, own_partial, remove_own_partials

    dest = tmp_path / "dest"
    (dest / PARTIAL_DIR).mkdir(parents=True)
    others = [
        dest / PARTIAL_DIR / f"w.safetensors.{pid}-{fs.host_digest()}"
        for pid in (os.getppid(), dead_pid)
    ]
    for path in others:
        path.write_bytes(b"another loader's\n")
    with fs.confined(dest):
        own_partial(dest, "w.safetensors").write_bytes(b"ours\n")
        remove_own_partials(dest)
    assert sorted((dest / PARTIAL_DIR).iterdir()) == sorted(others)


def test_a_download_is_durable_before_it_gets_its_final_name(tmp_path):
    """``place``: a verified download is fsynced under its temporary name, then renamed: a
    file under its final name after a crash is whole."""
    from loader.sources.transfer import partial_path, place

    dest = tmp_path / "dest"
    dest.mkdir()
    tmp = partial_path(dest, "w.bin")
    tmp.write_bytes(b"downloaded\n")
    events: list[tuple[str, str]] = []
    with fs.confined(dest), fs.inject(lambda op, path: events.append((op, path))):
        place(tmp, dest / "w.bin", dest=dest)
    renamed = next(i for i, (op, _) in enumerate(events) if op.startswith("rename"))
    assert ("fsync", str(tmp)) in events[:renamed], events
    assert (dest / "w.bin").read_bytes() == b"downloaded\n"


# --- the publish lock -------------------------------------------------------------------------

KEY = "m@r/tp1-pp1-i1-0123abcd"


def _holder(root):
    """A holder whose heartbeat does not beat during the test: only ``held()`` can tell."""
    from loader.repository.lock import PublishLock

    return PublishLock(root, KEY, expiry_s=600, heartbeat_s=300).acquire()


def test_a_take_over_of_a_lock_that_changed_since_it_was_judged_puts_it_back(tmp_path):
    """A waiter judged a lock stale, and its holder beat meanwhile: the waiter moves the lock
    it no longer judged, sees that, and puts it back: the holder keeps it."""
    from loader.repository.lock import LOCKS_DIR, PublishLock

    holder = _holder(tmp_path)
    try:
        waiter = PublishLock(tmp_path, KEY, expiry_s=600)
        with fs.Dir.open(tmp_path) as r:
            waiter._dir = r.sub(LOCKS_DIR)
        judged = b'{"pid": 1, "beats": 0}'  # what the waiter read before the holder's beat
        try:
            waiter._take_over(judged)
        finally:
            waiter._dir.close()
        assert holder.held()
        holder.check_held()
        assert os.listdir(tmp_path / LOCKS_DIR) == [holder.path.name]
    finally:
        holder.release()


@pytest.mark.parametrize("kind", ["link", "dangling link", "fifo", "directory"])
def test_a_take_over_never_removes_what_replaced_the_stale_lock_after_it_was_judged(tmp_path, kind):
    """A waiter judged a dead holder's lock stale; before its move, someone put a link, a
    FIFO or a directory at the lock's path. The waiter moves that aside with the lock's
    rename, finds it is no lock file, and puts it back where it was: refused (2, naming it),
    never read through, never removed."""
    from loader.repository.lock import LOCKS_DIR, PublishLock

    (tmp_path / "outside").write_text("not the loader's\n")
    locks = tmp_path / LOCKS_DIR
    locks.mkdir()
    waiter = PublishLock(tmp_path, KEY, expiry_s=600)
    judged = b'{"pid": 1, "beats": 0}'
    waiter.path.write_bytes(judged)

    def plant(op: str, path: str) -> None:
        if op.startswith("rename") and path.startswith(f"{waiter.path} -> "):
            waiter.path.unlink()
            if kind == "link":
                waiter.path.symlink_to(tmp_path / "outside")
            elif kind == "dangling link":
                waiter.path.symlink_to(tmp_path / "nothing-here")
            elif kind == "fifo":
                os.mkfifo(waiter.path)
            else:
                waiter.path.mkdir()
                (waiter.path / "users.txt").write_text("keep me\n")

    with fs.Dir.open(tmp_path) as r:
        waiter._dir = r.sub(LOCKS_DIR)
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.alarm(30)  # a FIFO opened for reading without O_NONBLOCK waits for a writer forever
    try:
        with fs.inject(plant), pytest.raises(NotOursError) as raised:
            waiter._take_over(judged)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        waiter._dir.close()
    assert str(waiter.path) in raised.value.message
    assert os.listdir(locks) == [waiter.path.name]
    assert (tmp_path / "outside").read_text() == "not the loader's\n"
    assert not (tmp_path / "nothing-here").exists()
    if kind == "directory":
        assert (waiter.path / "users.txt").read_text() == "keep me\n"
    else:
        assert waiter.path.is_symlink() or waiter.path.is_fifo()


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_holder_notices_at_once_that_its_lock_file_is_no_longer_its(tmp_path, how):
    """``check_held`` looks at the lock path itself (not only at what the heartbeat saw): a lock
    file removed, or taken over and created anew, between two beats stops the holder before it
    publishes; and its release leaves the new holder's file alone."""
    from loader.errors import LockLostError

    holder = _holder(tmp_path)
    try:
        os.unlink(holder.path)
        if how == "replaced":
            holder.path.write_text('{"token": "the new holder"}')
        assert not holder.held()
        with pytest.raises(LockLostError):
            holder.check_held()
    finally:
        holder.release()
    if how == "replaced":
        assert holder.path.read_text() == '{"token": "the new holder"}'


def test_a_lock_whose_first_write_fails_is_removed(tmp_path):
    """An empty lock file would make every later loader wait for the expiry: a lock whose
    record could not be written (ENOSPC) is removed before the error goes up."""
    import errno

    from loader.repository.lock import PublishLock, lock_path

    def full(op: str, path: str) -> None:
        if op == "write" and path.endswith(".lock"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    with fs.inject(full), pytest.raises(OSError, match="No space"):
        PublishLock(tmp_path, KEY, expiry_s=600).acquire()
    assert not os.path.lexists(lock_path(tmp_path, KEY))
    _holder(tmp_path).release()


def test_a_lock_of_another_host_is_never_taken_over_by_its_pid(tmp_path, dead_pid):
    """A lock record of another host (an older loader's, without its pid space) names a pid
    that means nothing here: absent here, it is still not judged dead; only the expiry
    tells."""

    from loader.errors import LockTimeoutError
    from loader.repository.lock import PublishLock, lock_path

    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    record = json.dumps({"pid": dead_pid, "host": "another-node", "token": "t", "beats": 1})
    path.write_text(record)
    with pytest.raises(LockTimeoutError):
        PublishLock(tmp_path, KEY, expiry_s=600, timeout_s=0.5, poll_s=0.05).acquire()
    assert path.read_text() == record


# --- durability order -------------------------------------------------------------------------


def _staged(root, key: str, content: bytes):
    from loader.repository import manifest, publish

    staging = publish.new_staging_dir(root, key)
    (staging / "m").mkdir()
    (staging / "m" / "weights.bin").write_bytes(content)
    manifest.write_manifest(staging, manifest.build_manifest(staging, {"key": key}))
    manifest.write_ready(staging, key)
    return staging


def test_a_replaced_copy_is_removed_only_once_the_new_one_is_durable_under_the_key(tmp_path):
    """``--force``: the exchange puts the new copy under the key; the key's directory is fsynced
    before the old copy is deleted, so a crash never leaves the key without either."""
    from loader.repository import publish

    publish.publish(_staged(tmp_path, KEY, b"old"), tmp_path, KEY)
    staging = _staged(tmp_path, KEY, b"new")
    events: list[tuple[str, str]] = []
    with fs.inject(lambda op, path: events.append((op, path))):
        publish.publish(staging, tmp_path, KEY, replace=True)
    swapped = events.index(("rename-exchange", f"{staging} -> {tmp_path / KEY}"))
    deleted = next(
        i for i, (op, path) in enumerate(events) if op in ("unlink", "rmdir") and i > swapped
    )
    assert ("fsync", str((tmp_path / KEY).parent)) in events[swapped:deleted], events[swapped:]
    assert (tmp_path / KEY / "m" / "weights.bin").read_bytes() == b"new"


def test_the_manifest_and_ready_are_durable_when_written(tmp_path):
    """``manifest.json`` is fsynced when written, ``.ready`` too, and then the directory that
    names them: a reader after a crash never finds a ``.ready`` without its manifest."""
    from loader.repository import manifest

    tree = tmp_path / "tree"
    (tree / "m").mkdir(parents=True)
    (tree / "m" / "weights.bin").write_bytes(b"w")
    events: list[tuple[str, str]] = []
    with fs.inject(lambda op, path: events.append((op, path))):
        manifest.write_manifest(tree, manifest.build_manifest(tree, {"key": KEY}))
        manifest.write_ready(tree, KEY)
    wrote_manifest = events.index(("write", str(tree / manifest.MANIFEST)))
    wrote_ready = events.index(("write", str(tree / manifest.READY)))
    assert ("fsync", str(tree / manifest.MANIFEST)) in events[wrote_manifest:wrote_ready]
    assert ("fsync", str(tree / manifest.READY)) in events[wrote_ready:]
    assert events[-1] == ("fsync", str(tree)), events[wrote_ready:]


def test_a_replacement_without_renameat2_that_fails_puts_the_previous_copy_back(tmp_path):
    """Where the file system lacks ``RENAME_EXCHANGE`` the published copy is moved aside into
    ``.trash`` first; when the new copy cannot then be renamed into place, the previous copy
    goes back under the key at once: the key is never left absent by a failure."""
    import errno

    from loader.repository import manifest, publish

    publish.publish(_staged(tmp_path, KEY, b"old"), tmp_path, KEY)
    staging = _staged(tmp_path, KEY, b"new")

    def no_exchange(op: str, path: str) -> None:
        if op == "rename-exchange":
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        if op == "rename" and path.startswith(f"{staging} -> "):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    with fs.inject(no_exchange), pytest.raises(OSError, match="Input/output"):
        publish.publish(staging, tmp_path, KEY, replace=True)
    assert (tmp_path / KEY / "m" / "weights.bin").read_bytes() == b"old"
    assert manifest.verify(tmp_path / KEY, key=KEY) == []


def test_without_renameat2_a_key_that_appeared_meanwhile_is_never_replaced(tmp_path):
    """Where ``RENAME_NOREPLACE`` is missing, ``rename(2)`` would replace an empty directory:
    a key that appeared while the loader published (another loader's, still empty) is a
    :class:`PublishError`, nothing is renamed onto it."""
    import errno

    from loader.errors import PublishError
    from loader.repository import publish

    staging = _staged(tmp_path, KEY, b"w")
    target = tmp_path / KEY

    def appears(op: str, path: str) -> None:
        if op == "rename-noreplace" and path.endswith(f"-> {target}"):
            target.mkdir()
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)

    with fs.inject(appears), pytest.raises(PublishError, match="appeared"):
        publish.publish(staging, tmp_path, KEY)
    assert list(target.iterdir()) == [] and staging.is_dir()


# --- publish: what is the loader's --------------------------------------------------------------


def test_seal_refuses_a_link_in_the_tree_it_makes_durable(tmp_path):
    """The staged tree holds only files and directories the loader wrote: ``seal`` (modes,
    fsyncs) answers a link with :class:`NotOursError`, never follows it to chmod or fsync."""
    from loader.repository import publish

    (tmp_path / "outside").write_text("a user's file\n")
    os.chmod(tmp_path / "outside", 0o600)
    staging = publish.new_staging_dir(tmp_path / "root", KEY)
    (staging / "m").mkdir()
    (staging / "m" / "planted").symlink_to(tmp_path / "outside")
    with pytest.raises(NotOursError, match="planted"):
        publish.seal(staging)
    assert stat.S_IMODE((tmp_path / "outside").stat().st_mode) == 0o600


class _FifoAtOpen:
    """A hook of the seam that puts a FIFO in place of the file ``path`` just before the
    loader opens it (after it looked: a swap by anyone who can write the volume)."""

    def __init__(self, path) -> None:
        self.path, self.swapped = path, False

    def __call__(self, op: str, path: str) -> None:
        if op == "open" and path == str(self.path) and not self.swapped:
            self.swapped = True
            self.path.unlink()
            os.mkfifo(self.path)


@contextlib.contextmanager
def _no_hang(seconds: int = 30):
    """A FIFO opened for reading without ``O_NONBLOCK`` waits for a writer forever: fail."""
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("kind", ["link", "directory"])
def test_a_new_staging_directory_whose_name_was_taken_meanwhile_is_refused(tmp_path, kind):
    """The staging directory is made under a temporary name, then renamed to its own (new,
    random) name: something put at that name in between (its temporary name shows it) is
    refused (``NotOursError``: 2, naming it), not an ``EEXIST`` (exit 1), and left alone."""
    from loader.repository import publish

    (tmp_path / "outside").mkdir()
    planted = []

    def plant(op: str, path: str) -> None:
        if op == "rename-noreplace" and "/.staging/." in path and not planted:
            final = Path(path.split(" -> ")[1])
            if kind == "link":
                final.symlink_to(tmp_path / "outside")
            else:
                final.mkdir()
                (final / "users.txt").write_text("keep me\n")
            planted.append(final)

    with fs.inject(plant), pytest.raises(NotOursError) as raised:
        publish.new_staging_dir(tmp_path / "root", KEY)
    (final,) = planted
    assert str(final) in raised.value.message
    assert os.listdir(final.parent) == [final.name]  # the temporary directory is gone
    assert os.listdir(tmp_path / "outside") == []
    assert kind == "link" or (final / "users.txt").read_text() == "keep me\n"


def test_seal_never_opens_a_fifo_swapped_in_for_a_file_after_it_looked(tmp_path):
    """``seal`` fsyncs each file it found regular: one replaced by a FIFO between its look
    and its open is refused, never opened to block."""
    from loader.repository import publish

    staging = publish.new_staging_dir(tmp_path / "root", KEY)
    (staging / "m").mkdir()
    (staging / "m" / "config.pbtxt").write_text("name: 'm'\n")
    hook = _FifoAtOpen(staging / "m" / "config.pbtxt")
    with _no_hang(), fs.inject(hook), pytest.raises(NotOursError, match=r"config\.pbtxt"):
        publish.seal(staging)
    assert hook.swapped


def test_a_resumed_journal_never_opens_a_fifo_swapped_in_for_an_output_after_it_looked(
    tmp_path,
):
    """A resumed conversion digests each output its journal names and it found regular, with
    the inode and time it recorded: one replaced by a FIFO between that look and the open is
    refused, never opened to block."""
    from loader import digest
    from loader.convert.overlapped import Journal

    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    (out / "model.wte.bin").write_bytes(b"weights")
    st = (out / "model.wte.bin").stat()
    with fs.confined(tmp_path / "work"):
        journal = Journal(out, "h")
        hexdigest = digest.of_bytes(b"weights")
        line = f"model.wte.bin {st.st_size} {hexdigest} {st.st_ino} {st.st_mtime_ns}"
        journal.path.write_text(f"{journal.header}\n{line}\n")
        hook = _FifoAtOpen(out / "model.wte.bin")
        try:
            with _no_hang(), fs.inject(hook), pytest.raises(NotOursError, match=r"model\.wte"):
                journal.resume()
        finally:
            journal.close()
    assert hook.swapped


@pytest.mark.parametrize("found", ["another key's marker", "no marker"])
def test_a_failed_run_discards_its_staging_directory_only_while_it_is_the_loaders(tmp_path, found):
    """``discard_staging`` removes the staging directory of a failed run only if it still
    carries the marker naming the run's key: what was put in its place is left alone. Even
    then only what the loader made goes: a user's file stays, and the directory holding it
    is no longer marked."""
    from loader.repository import publish

    staging = publish.new_staging_dir(tmp_path, KEY)
    with fs.Dir.open(staging) as d:
        d.write("weights.bin", b"w")
    marker = staging / publish.STAGING_MARKER
    original = marker.stat().st_ino
    if found == "no marker":
        marker.unlink()
    else:
        marker.write_text("other@r/tp1-pp1-i1-0123abcd\n")
    (staging / "users-data.txt").write_text("keep me\n")
    publish.discard_staging(staging, KEY)
    assert (staging / "users-data.txt").read_text() == "keep me\n"
    assert (staging / "weights.bin").exists()
    marker.write_text(f"{KEY}\n")
    # A marker made again by someone else (another inode than the loader's) is theirs: it
    # stays, with the record (the tree stays marked by it).
    theirs = marker.stat().st_ino != original
    publish.discard_staging(staging, KEY)
    assert sorted(p.name for p in staging.iterdir()) == sorted(
        ["users-data.txt", *([fs.MADE, publish.STAGING_MARKER] if theirs else [])]
    )
    assert (staging / "users-data.txt").read_text() == "keep me\n"
    publish.discard_staging(staging, KEY)  # no longer the loader's: left alone
    assert (staging / "users-data.txt").read_text() == "keep me\n"
    (staging / "users-data.txt").unlink()
    marker.write_text(f"{KEY}\n")
    publish.discard_staging(staging, KEY)  # marked, without a record: removed as before
    if theirs:  # (the record stayed with the marker someone made: that marker stays too)
        assert sorted(p.name for p in staging.iterdir()) == [fs.MADE, publish.STAGING_MARKER]
    else:
        assert not staging.exists()


def test_only_a_complete_replaced_copy_is_put_back_under_its_key(tmp_path):
    """``recover`` (a replacement stopped between its two renames): a copy in ``.trash`` goes
    back under the absent key only if it verifies complete; an incomplete one stays where it
    is, and the key stays absent (the run publishes it again), without a directory made for
    it (an empty ``m@r`` was left)."""
    from loader.repository import publish

    publish.publish(_staged(tmp_path, KEY, b"w"), tmp_path, KEY)
    trash = tmp_path / publish.TRASH_DIR
    trash.mkdir()
    copy = trash / f"{key_filename(KEY)}.0123456789ab"
    (tmp_path / KEY).rename(copy)
    (tmp_path / KEY).parent.rmdir()
    (copy / "m" / "weights.bin").unlink()  # incomplete: a file the manifest lists is missing
    assert publish.recover(tmp_path, KEY) is None
    assert not (tmp_path / KEY).parent.exists() and copy.is_dir()
    (copy / "m" / "weights.bin").write_bytes(b"w")
    assert publish.recover(tmp_path, KEY) == tmp_path / KEY
    assert (tmp_path / KEY / "m" / "weights.bin").read_bytes() == b"w"


def test_a_manifest_makes_a_tree_the_loaders_only_for_the_key_it_names(tmp_path):
    """A published copy is recognised by its manifest naming the key: a directory at the key's
    path (or in ``.trash`` under its name) whose manifest names another key is neither
    replaced by ``--force`` nor cleared as a leftover."""

    from loader.repository import manifest, publish

    root = tmp_path / "root"
    theirs = root / KEY
    theirs.mkdir(parents=True)
    (theirs / manifest.MANIFEST).write_text(json.dumps({"key": "other@r/v", "files": []}))
    (theirs / "users-data.txt").write_text("keep me\n")
    trash = root / publish.TRASH_DIR / f"{key_filename(KEY)}.0123456789ab"
    shutil.copytree(theirs, trash)
    with pytest.raises(NotOursError):
        publish.publish(_staged(root, KEY, b"w"), root, KEY, replace=True)
    assert publish.clear_leftovers(root, KEY, idle_s=0) == []
    for tree in (theirs, trash):
        assert (tree / "users-data.txt").read_text() == "keep me\n"


def test_a_marker_makes_a_tree_the_loaders_only_for_the_very_key_on_its_first_line(tmp_path):
    """A staging marker whose first line is the key with more after it (another key's, or a
    user's note that starts with it) does not make the tree the loader's for that key: it is
    never judged its own, so never removed as its staging directory."""
    from loader import fs
    from loader.repository import publish

    base = tmp_path / "base"
    for name, first in (("longer", KEY + "-copy"), ("spaced", KEY + " "), ("exact", KEY)):
        tree = base / name
        tree.mkdir(parents=True)
        (tree / publish.STAGING_MARKER).write_text(first + "\nmore\n")
        (tree / "users-data.txt").write_text("keep me\n")
    with fs.Dir.open(base) as d:
        assert publish.ours(d, "longer", KEY) is None
        assert publish.ours(d, "spaced", KEY, manifests=False) is None
        assert publish.ours(d, "exact", KEY) is not None
    publish.discard_staging(base / "longer", KEY)
    assert (base / "longer" / "users-data.txt").read_text() == "keep me\n"


# --- the download area of a remote source -------------------------------------------------------


def _remote(root):
    from loader.cli import build_parser
    from loader.cli.run import request_from_args
    from tests.runs import run_argv

    request = request_from_args(build_parser().parse_args(run_argv("gs://b/m", root)))
    return request, root / ".work" / key_filename(request.key)


def test_a_download_directory_the_loader_did_not_make_is_neither_used_nor_removed(tmp_path):
    """``WORK/<key>`` holding a user's file and no marker for the key: a run refuses it
    (:class:`NotOursError`) before writing into it, and removing an earlier run's download
    directory leaves it alone."""
    from loader.run.strategies import remove_download, strategy_for

    root = tmp_path / "root"
    request, download = _remote(root)
    download.mkdir(parents=True)
    (download / "users-data.txt").write_text("keep me\n")
    with fs.confined(root):
        with (
            pytest.raises(NotOursError, match="download directory") as refused,
            strategy_for(request, root, request.key),
        ):
            pass
        remove_download(request, root, request.key)
    assert sorted(p.name for p in download.iterdir()) == ["users-data.txt"]
    # The message says what is missing (the marker) and what to do (move the directory).
    assert f"without the loader's marker for {request.key}" in str(refused.value)
    assert refused.value.remediation.startswith(f"Move {download} away")


@pytest.mark.parametrize("staging_is", ["a dead loader's", "another key's", "a live loader's"])
def test_outputs_are_taken_back_only_from_a_dead_loaders_staging_directory_of_the_key(
    tmp_path, dead_pid, staging_is
):
    """A journal under ``WORK/<key>/converted`` says the outputs moved into a staging directory:
    they come back only from one that carries the key's marker and whose loader is gone; from
    another key's, or from a loader still at work, nothing is taken."""
    from loader.convert.overlapped import MOVED, Journal
    from loader.repository.publish import DOWNLOAD_MARKER, STAGING_MARKER
    from loader.run.strategies import strategy_for

    root = tmp_path / "root"
    request, download = _remote(root)
    pid = os.getppid() if staging_is == "a live loader's" else dead_pid
    name = f"{key_filename(request.key)}.{pid}-{fs.host_digest()}.0123456789ab"
    staging = root / ".staging" / name
    outputs = staging / "fastertransformer" / "1" / "1-gpu"
    outputs.mkdir(parents=True)
    (outputs / "model.wte.bin").write_bytes(b"converted\n")
    marked = "other@r/tp1-pp1-i1-0123abcd" if staging_is == "another key's" else request.key
    (staging / STAGING_MARKER).write_text(f"{marked}\n")
    (download / "converted").mkdir(parents=True)
    (download / DOWNLOAD_MARKER).write_text(f"{request.key}\n")
    (download / "converted" / f"1-gpu{Journal.SUFFIX}").write_text(f"header\n{MOVED}{name}\n")
    with fs.confined(root), strategy_for(request, root, request.key):
        taken = (download / "converted" / "1-gpu" / "model.wte.bin").exists()
    assert taken == (staging_is == "a dead loader's")
    assert (outputs / "model.wte.bin").exists() == (not taken)


# --- prune decides again under the key's lock ---------------------------------------------------

OLD, NEW = "m@r1/tp1-pp1-i1-0123abcd", "m@r2/tp1-pp1-i1-0123abcd"


def _two_keys(root) -> None:
    """``OLD`` and ``NEW`` of one model, published: ``prune --keep 1`` removes ``OLD``."""

    from loader.repository import manifest, publish

    for key, created in ((OLD, "2026-01-01T00:00:00Z"), (NEW, "2026-01-02T00:00:00Z")):
        staging = _staged(root, key, key.encode())
        data = json.loads((staging / manifest.MANIFEST).read_text())
        (staging / manifest.MANIFEST).write_text(json.dumps({**data, "created_at": created}))
        publish.publish(staging, root, key)


def test_prune_keeps_a_key_replaced_by_an_identical_copy_after_it_looked(tmp_path):
    """A key published again after prune looked is kept, even with the same manifest and
    creation time (another copy: other inodes)."""
    from loader.repository.prune import prune

    root = tmp_path / "root"
    _two_keys(root)

    def republish() -> None:
        shutil.copytree(root / OLD, tmp_path / "copy")
        (root / OLD).rename(tmp_path / "aside")
        (tmp_path / "copy").rename(root / OLD)

    hook, done = when_locked(OLD, republish)
    with fs.inject(hook):
        report = prune(root, keep=1)
    assert done and (root / OLD / "m" / "weights.bin").read_bytes() == OLD.encode()
    assert (OLD, "published again since prune looked") in report.kept


@pytest.mark.parametrize("change", ["marker", "activity"])
def test_prune_keeps_a_staging_directory_that_changed_after_it_looked(tmp_path, change):
    """A staging directory prune judged a leftover is removed only if, under the key's lock, it
    still carries the key's marker and is still idle: a user's directory put in its place, or
    one its loader (on another host: judged by its silence) writes to again, stays."""
    from loader.repository import publish
    from loader.repository.prune import prune

    root = tmp_path / "root"
    staging = publish.new_staging_dir(root, OLD)
    staging = staging.rename(staging.with_name(staging.name.replace(fs.host_digest(), "0a1b2c3d")))
    then = 1_000_000_000
    for path in (staging, *staging.iterdir()):
        os.utime(path, (then, then))

    def changed() -> None:
        (staging / "weights.bin").write_bytes(b"written again\n")
        if change == "marker":  # an old directory of a user's: idle, without the marker
            (staging / publish.STAGING_MARKER).write_text("a user's file\n")
            for path in (staging, *staging.iterdir()):
                os.utime(path, (then, then))

    hook, done = when_locked(OLD, changed)
    with fs.inject(hook):
        prune(root, lock_expiry_s=60)
    assert done and (staging / "weights.bin").read_bytes() == b"written again\n"


def test_prune_leaves_a_key_alone_when_a_link_is_at_its_lock_path(tmp_path):
    """A link at a key's lock path: prune neither follows it nor stops; that key is kept (its
    lock cannot be told) and the others are pruned."""
    from loader.repository.lock import lock_path
    from loader.repository.prune import prune

    root = tmp_path / "root"
    _two_keys(root)
    (tmp_path / "outside").write_text("{}")
    lock = lock_path(root, OLD)
    lock.parent.mkdir(exist_ok=True)
    lock.symlink_to(tmp_path / "outside")
    report = prune(root, keep=1)
    assert (root / OLD).is_dir() and lock.is_symlink()
    assert (OLD, "its publish lock is live") in report.kept


def test_prune_counts_a_lock_of_another_host_live_while_its_file_is_fresh(tmp_path):
    """A lock of another host (its pid means nothing here) is live while its file was written
    within the expiry: its key is kept, and ``--dry-run`` says so rather than listing it."""

    from loader.repository.lock import lock_path
    from loader.repository.prune import prune

    root = tmp_path / "root"
    _two_keys(root)
    lock = lock_path(root, OLD)
    lock.parent.mkdir(exist_ok=True)
    lock.write_text(json.dumps({"pid": 1, "host": "another-node", "token": "t", "beats": 9}))
    for dry_run in (True, False):
        report = prune(root, keep=1, dry_run=dry_run)
        assert (OLD, "its publish lock is live") in report.kept
        assert report.removed == []
    assert (root / OLD).is_dir()


def test_prune_counts_only_trees_whose_manifest_names_their_own_key(tmp_path):
    """A directory at a key's place whose manifest names another key (a copy, a user's tree)
    is not a published key: it is neither removed nor counted among the newest, so the real
    newest key stays."""

    from loader.repository import manifest
    from loader.repository.prune import prune

    root = tmp_path / "root"
    _two_keys(root)
    planted = root / "m@r3" / "tp1-pp1-i1-0123abcd"
    shutil.copytree(root / NEW, planted)
    data = json.loads((planted / manifest.MANIFEST).read_text())
    data.update(key="m@r9/tp1-pp1-i1-0123abcd", created_at="2026-01-03T00:00:00Z")
    (planted / manifest.MANIFEST).write_text(json.dumps(data))
    prune(root, keep=1)
    assert not (root / OLD).exists() and (root / NEW).is_dir() and planted.is_dir()


# --- the source fingerprint -------------------------------------------------------------------


def test_every_kind_of_source_change_is_a_change():
    """A changed source is never reported as the one a key was built from: another URI, another
    commit (``hf://``), a file changed, removed or added; the stat stamps alone (a cache) are
    no change."""
    from loader.sources.fingerprint import Fingerprint

    files = {
        "config.json": {"size": 2, "blake3": "a" * 64},
        "w.bin": {"size": 4, "blake3": "b" * 64},
    }
    built = Fingerprint("hf://org/m", commit="c" * 40, files=files, stamps={"w.bin": [1, 2, 3]})
    same = Fingerprint.from_dict(
        {**built.as_dict(), "stamps": {"w.bin": [4, 5, 6]}}  # touched, same content
    )
    assert built.changes(same) == []
    variants = {
        "uri": Fingerprint("hf://org/other", commit="c" * 40, files=files),
        "commit": Fingerprint("hf://org/m", commit="d" * 40, files=files),
        "changed": Fingerprint("hf://org/m", commit="c" * 40,
                               files={**files, "w.bin": {"size": 4, "blake3": "e" * 64}}),
        "removed": Fingerprint("hf://org/m", commit="c" * 40, files={"w.bin": files["w.bin"]}),
        "added": Fingerprint("hf://org/m", commit="c" * 40,
                             files={**files, "x.bin": {"size": 1, "blake3": "f" * 64}}),
    }  # fmt: skip
    for what, now in variants.items():
        assert len(built.changes(now)) == 1, (what, built.changes(now))


# --- what a complete published key is -----------------------------------------------------------


def _plant_link(d) -> None:
    (d / "m" / "planted").symlink_to("/etc/hostname")


def _manifest_of_another_key(d) -> None:

    data = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**data, "key": "other@r/tp1-pp1-i1-0123abcd"}))


def _remove_directory(d) -> None:
    (d / "m" / "weights.bin").unlink()
    (d / "m").rmdir()


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: (d / ".ready").write_text("other@r/tp1-pp1-i1-0123abcd\n"), "names another key"),
        (_plant_link, "unexpected a symbolic link m/planted"),
        (_remove_directory, "missing directory m"),
        (_manifest_of_another_key, "manifest.json names key 'other@r"),
    ],
)
def test_verify_finds_what_the_size_and_digest_checks_cannot(tmp_path, damage, expected):
    """A key is complete only with a ``.ready`` naming it, nothing but what its manifest lists
    (no link), and every directory it lists."""
    from loader.repository import manifest

    staged = _staged(tmp_path, KEY, b"w")
    assert manifest.verify(staged, key=KEY) == []
    damage(staged)
    problems = manifest.verify(staged, key=KEY)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("seal", ["inode only", "none"])
def test_a_quick_verification_trusts_only_a_whole_seal(tmp_path, seal):
    """A quick verification skips re-hashing a file only when the manifest's seal for it has
    the inode and the modification time (and the change time): a seal cut short (a damaged or
    hand-edited manifest) re-hashes, so bytes changed in place are found."""
    from loader.repository import manifest

    staged = _staged(tmp_path, KEY, b"weights!")
    data = json.loads((staged / manifest.MANIFEST).read_text())
    for entry in data["files"]:
        entry["seal"] = entry["seal"][:1] if seal == "inode only" else []
    (staged / manifest.MANIFEST).write_text(json.dumps(data))
    with open(staged / "m" / "weights.bin", "r+b") as fh:  # same inode, same size
        fh.write(b"W")
    problems = manifest.verify(staged, key=KEY, quick=True)
    assert any("m/weights.bin blake3 differs" in p for p in problems), problems


def test_a_key_holding_another_keys_copy_is_not_already_published(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """A rerun checks that the repository at its key was published for that key: a complete
    copy of another key put there (the same source, another revision) is never reported as
    already published; it is not the loader's for this key either, so it is left as it is
    (exit 2, naming it)."""
    from tests.runs import cli, run_argv

    root, source = tmp_path / "root", tiny_checkpoint_with_tokenizer
    for revision in ("r1", "r2"):
        assert cli(capsys, *run_argv(source, root, "--revision", revision))[0] == 0
    (r1,), (r2,) = (root / "tiny@r1").iterdir(), (root / "tiny@r2").iterdir()
    shutil.rmtree(r2)
    shutil.copytree(r1, r2)
    code, _, err = cli(capsys, *run_argv(source, root, "--revision", "r2"))
    assert code == 2 and "did not create it" in err and "hint:" in err, err
    assert json.loads((r2 / "manifest.json").read_text())["key"] == f"tiny@r1/{r1.name}"


# --- what FasterTransformer and the tokenizer models load -----------------------------------------


def test_the_tokenizers_ids_must_all_index_the_embedding(tiny_checkpoint_with_tokenizer):
    """Every id the tokenizer produces is below ``vocab_size``: the largest one equal to it is
    already one past the embedding."""
    from loader.errors import CheckpointError
    from loader.repository import layout
    from loader.repository.models.tokenization import load_tokenizer
    from loader.repository.validate import check_tokenizer

    checkpoint = tiny_checkpoint_with_tokenizer
    files = layout.tokenizer_files(checkpoint)
    largest = max(load_tokenizer(checkpoint).get_vocab(with_added_tokens=True).values())
    check_tokenizer(checkpoint, files, largest + 1)
    with pytest.raises(CheckpointError, match=f"ids up to {largest}"):
        check_tokenizer(checkpoint, files, largest)


def test_a_tokenizer_file_beyond_its_limit_is_refused_before_it_is_read(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    """A tokenizer file larger than :data:`MAX_TOKENIZER_BYTES` is refused by its size, never
    loaded (a sparse file here: nothing is written)."""
    from loader.errors import CheckpointError
    from loader.repository import layout
    from loader.repository.validate import MAX_TOKENIZER_BYTES, check_tokenizer

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for path in layout.tokenizer_files(tiny_checkpoint_with_tokenizer):
        shutil.copyfile(path, checkpoint / path.name)
    os.truncate(checkpoint / "tokenizer.json", MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(CheckpointError, match="more than a tokenizer file can"):
        check_tokenizer(checkpoint, layout.tokenizer_files(checkpoint), 10**6)


def test_a_fifo_swapped_in_for_a_tokenizer_file_once_it_was_looked_at_is_never_read(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    """The tokenizer is loaded from the very files the check looked at: a FIFO renamed over
    tokenizer.json at the check's first look is refused (exit 2, named), never read (a FIFO
    no one writes would hold the run for good). A thread opens the FIFO for writing and
    closes it at once, so that a reader of it ends, with nothing read: a tokenizer that does
    not load, not the FIFO refused."""
    import threading

    from loader.errors import SpecialFileError
    from loader.repository import layout
    from loader.repository.validate import check_tokenizer

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for path in layout.tokenizer_files(tiny_checkpoint_with_tokenizer):
        shutil.copyfile(path, checkpoint / path.name)
    files = layout.tokenizer_files(checkpoint)
    fifo, held = tmp_path / "fifo", tmp_path / "held"
    os.mkfifo(fifo)
    os.link(fifo, held)  # the writer's name for it, whatever is renamed
    writer = threading.Thread(target=lambda: os.close(os.open(held, os.O_WRONLY)), daemon=True)
    writer.start()  # its open waits for a reader
    swap = AtStep(
        1,
        lambda op, path: path if path.endswith("/tokenizer.json") else None,
        lambda path: os.rename(fifo, path),
    )
    try:
        with fs.inject(swap), pytest.raises(SpecialFileError, match=r"tokenizer\.json is a FIFO"):
            check_tokenizer(checkpoint, files, 10**6)
    finally:
        while writer.is_alive():  # a reader of the test's ends the writer's wait, once it waits
            os.close(os.open(held, os.O_RDONLY | os.O_NONBLOCK))
            writer.join(0.01)
    assert swap.done


def test_a_tokenizer_file_renamed_over_after_the_check_opened_it_is_never_loaded(
    tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch
):
    """The tokenizers library loads the very files the check opened (through their
    descriptors): a file renamed over tokenizer.json after the check opened it, before the
    library reads it, is never what is loaded (by path, the library read the other file)."""
    from loader.repository import layout
    from loader.repository.models import tokenization
    from loader.repository.validate import check_tokenizer

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for path in layout.tokenizer_files(tiny_checkpoint_with_tokenizer):
        shutil.copyfile(path, checkpoint / path.name)
    files = layout.tokenizer_files(checkpoint)
    loaded = tokenization.tokenizer_from

    def renamed_over_first(paths, directory):
        other = tmp_path / "other.json"
        other.write_text("not a tokenizer\n")
        os.rename(other, checkpoint / "tokenizer.json")
        return loaded(paths, directory)

    monkeypatch.setattr(tokenization, "tokenizer_from", renamed_over_first)
    check_tokenizer(checkpoint, files, 10**6)
    assert (checkpoint / "tokenizer.json").read_text() == "not a tokenizer\n"


@pytest.mark.parametrize("field", ["start_id", "end_id", "inter_size"])
def test_a_negative_number_of_config_ini_is_refused(field):
    """FasterTransformer reads each number of ``[gptj]`` as a C ``int`` that is a size or a
    token id: a negative one is refused like one beyond int32."""
    import dataclasses

    from loader.errors import CheckpointError
    from loader.formats.fastertransformer import FTConfig
    from loader.repository.validate import check_ft_config

    config = FTConfig(head_num=2, size_per_head=8, inter_size=64, num_layer=2,
                      rotary_embedding=8, vocab_size=100, start_id=1, end_id=2)  # fmt: skip
    check_ft_config(config)
    with pytest.raises(CheckpointError, match=f"{field} = -1"):
        check_ft_config(dataclasses.replace(config, **{field: -1}))


def test_removing_a_tree_of_the_loaders_keeps_what_the_loader_never_makes(tmp_path, caplog):
    """``Dir.remove_tree`` (a marked staging or download directory, a leftover): the loader
    makes only files and directories, so a link or a FIFO in the tree is someone else's; it
    stays, with the directories holding it, and a warning names it. The rest goes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("the user's\n")
    tree = tmp_path / "root" / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "c").mkdir()
    (tree / "a" / "b" / "weights.bin").write_bytes(b"ours\n")
    (tree / "a" / "b" / "elsewhere").symlink_to(outside)
    (tree / "c" / "out.bin").write_bytes(b"ours\n")
    os.mkfifo(tree / "pipe")
    with fs.Dir.open(tmp_path / "root") as root, caplog.at_level("WARNING"):
        kept = root.remove_tree("tree")
    assert sorted(kept) == [tree / "a" / "b" / "elsewhere", tree / "pipe"]
    assert (tree / "a" / "b" / "elsewhere").is_symlink() and (tree / "pipe").is_fifo()
    assert not (tree / "c").exists() and not (tree / "a" / "b" / "weights.bin").exists()
    assert sorted(os.listdir(tree)) == ["a", "pipe"]
    assert (outside / "keep.txt").read_text() == "the user's\n"
    assert "a symbolic link" in caplog.text and "a FIFO" in caplog.text
    with fs.Dir.open(tmp_path / "root") as root:  # once they are removed, the tree goes too
        (tree / "a" / "b" / "elsewhere").unlink()
        (tree / "pipe").unlink()
        assert root.remove_tree("tree") == []
    assert not tree.exists()
