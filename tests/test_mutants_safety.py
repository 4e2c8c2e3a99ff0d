"""Safety lines no other test pinned: each test here fails when its one line of the loader is
removed or weakened (found by mutating the line and running the fast tier; the fast tier
itself, no server, nothing slow).

* ``loader.fs``: an empty file a user hard-linked at a name a stopped create left pending is
  never taken as the loader's (writing it would write the user's other name); a marker name
  taken by something that is not a file makes no marked tree; what marks a tree as the
  loader's goes last when it is removed; a file read whole past its limit is too large;
  a name linked to a user's file in a marked tree stays the user's; a rename never replaces
  a link or FIFO outside a marked tree either; a marked directory's record is durable before
  the directory gets its name; a user's file at the record's name of DEST is never taken as
  the record; a user's empty directory in a marked tree is never removed by ``rmdir``, nor with the tree; nor is a user's file's mode changed (``chmod``, as sealing does);
  a judged removal to a fresh name something stands at is refused and moves nothing; a file
  at a stopped removal's fresh name whose change time moved is not the loader's;
* the publish lock: a holder that saw its lock taken over stays lost; a user's file at a
  lock's path is never judged stale and removed;
* prune: the newest keys it keeps are the newest by their manifests' ``created_at``, not by
  their directories' times; under a key's lock it puts a replaced copy back before it
  judges, and keeps a key whose manifest changed, or a staging directory the loader wrote to
  again, since it looked, or a user's directory put in its place; a file named like a moved
  lock that holds no lock record stays; a download directory's marker is the loader's only
  at its key's name, a copy's in ``.trash`` only under its key's name; a live holder's lock keeps its key in a dry run too; a leftover it removes is
  judged the key's once more as it is removed; a user's file at a
  key's lock path keeps the key and stops nothing; a moved lock whose fresh name is taken
  stays, and one removed by someone else first is not reported removed; a put-back without
  ``renameat2`` that finds a directory come at the key leaves the copy in ``.trash``;
* a remote listing's names: each kind of name the rule refuses is refused, a name that only
  fits without its download suffix among them; a path below DEST with a ``..`` or a file on
  the way is a typed error; a link left at a gone owner's partial name is never adopted;
* a checkpoint that declares no dtype: its output dtype is the one most of its bytes are in,
  also when most of its tensors are in the other; a weight stored in an integer dtype is a
  typed error; a tensor whose byte span is not what its dtype and shape take is refused when
  the file is opened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loader import fs
from loader.errors import NameTakenError, NotOursError
from tests.races import when_locked
from tests.runs import forged_key

MARKER = ".model-loader-staging"
KEY = "m@r/v"


@pytest.fixture(autouse=True)
def _confined(tmp_path):
    with fs.confined(tmp_path):
        yield


class Stopped(BaseException):
    """The loader stopped at a call (as a kill would: nothing after it runs)."""


def _stop_at(op: str, suffix: str):
    """A hook stopping the loader at the first call ``op`` on a path ending in ``suffix``,
    and at every call after it."""
    stopped = []

    def hook(called: str, path: str) -> None:
        if stopped or (called == op and path.endswith(suffix)):
            stopped.append(path)
            raise Stopped(path)

    return hook


def _tree(base: Path) -> Path:
    """``base/staging/t``: a marked tree."""
    with fs.Dir.open(base / "staging", create=True) as parent:
        assert parent.make_marked("t", MARKER, KEY)
    return base / "staging" / "t"


# --- loader.fs -------------------------------------------------------------------------------


def test_a_users_hard_linked_empty_file_at_a_pending_name_is_never_written_or_removed(tmp_path):
    """A create recorded as pending whose file never came (the loader stopped before it): an
    empty file that is also another name of the user's, put there afterwards, looks like what
    a stopped create leaves but for its second link. Writing it would write the user's other
    name; it is never taken as the loader's (``Dir._empty``: one link only)."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t, fs.inject(_stop_at("open", "/late.bin")), pytest.raises(Stopped):
        t.write("late.bin", b"late")
    assert not (tree / "late.bin").exists()
    users = tmp_path / "users-empty-file"
    users.write_bytes(b"")
    os.link(users, tree / "late.bin")
    fs._made_trees.clear()  # the next loader, reading the record anew
    with fs.Dir.open(tree) as t, pytest.raises(NotOursError):
        t.write("late.bin", b"the loader's data", exclusive=False)
    assert users.read_bytes() == b""
    with fs.Dir.open(tree.parent) as parent:
        kept = parent.remove_tree(tree.name)
    assert kept == [tree / "late.bin"]
    assert (tree / "late.bin").exists() and os.stat(users).st_nlink == 2


@pytest.mark.parametrize("kind", ["link", "directory"])
def test_mark_in_place_refuses_a_marker_name_that_holds_no_file(tmp_path, kind):
    """``Dir.mark_in_place`` in a directory (a fetch's DEST) whose marker's name holds a link
    or a directory: the marker cannot be written, so no marked tree is made there (a
    :class:`NotOursError` naming it), and what stood there is left as it was."""
    dest = tmp_path / "dest"
    dest.mkdir()
    marker = fs.MARKER_PREFIX + "fetch"
    if kind == "link":
        (tmp_path / "elsewhere").write_text("theirs\n")
        (dest / marker).symlink_to(tmp_path / "elsewhere")
    else:
        (dest / marker).mkdir()
    with fs.Dir.open(dest) as d, pytest.raises(NotOursError, match=marker):
        d.mark_in_place(marker, "model-loader fetch")
    if kind == "link":
        assert (dest / marker).is_symlink() and (tmp_path / "elsewhere").read_text() == "theirs\n"
    else:
        assert (dest / marker).is_dir() and not any((dest / marker).iterdir())


def test_a_file_read_whole_past_its_limit_is_too_large_never_read_to_its_end(tmp_path):
    """``Dir.read`` of a file longer than its ``limit``: a :class:`loader.fs.TooLargeError`
    (what the loader writes of its own is never that large), not the first bytes or all."""
    (tmp_path / "big").write_bytes(b"{" + b" " * 100)
    with fs.Dir.open(tmp_path) as d:
        assert d.read("big", limit=101) == b"{" + b" " * 100
        with pytest.raises(fs.TooLargeError):
            d.read("big", limit=100)


def test_a_file_at_a_lock_path_larger_than_any_lock_record_is_never_taken_over(tmp_path):
    """A file at a publish lock's path that starts like a lock record but is larger than any
    (someone else's) is refused, never judged stale after the expiry and removed."""
    from loader.repository.lock import PublishLock, lock_path

    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    content = b"{" + b" " * (64 * 1024)
    path.write_bytes(content)
    lock = PublishLock(tmp_path, KEY, expiry_s=0.2, heartbeat_s=0.05, timeout_s=2, poll_s=0.05)
    with pytest.raises(NotOursError, match="larger than any lock record"):
        lock.acquire()
    assert path.read_bytes() == content


def _unlinks(calls: list[tuple[str, str]], tree: Path) -> list[str]:
    """The names at the top of ``tree`` unlinked, in order (a file moved aside to be removed
    goes from its name when it is moved)."""
    gone = []
    for op, path in calls:
        src = Path(path.split(" -> ")[0])
        aside = " -> " in path and Path(path.split(" -> ")[1]).name.startswith(fs.MARKER_PREFIX)
        if src.parent == tree and (op == "unlink" or (op.startswith("rename") and aside)):
            gone.append(src.name)
    return [n for n in gone if not n.startswith(fs.MARKER_PREFIX + "gone.")]


def test_a_tree_without_a_record_loses_its_marker_last(tmp_path):
    """A marked tree made before records were kept is removed with its marker file last (after
    ``manifest.json`` and ``.ready``): a removal stopped anywhere leaves a tree that is still
    recognisably the loader's, which the next loader removes."""
    tree = tmp_path / "staging" / "t"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "w.bin").write_bytes(b"w")
    for name in (MARKER, "manifest.json", ".ready", "zz.bin"):
        (tree / name).write_text(f"{KEY}\n")
    calls: list[tuple[str, str]] = []
    with fs.Dir.open(tree.parent) as parent, fs.inject(lambda op, p: calls.append((op, p))):
        assert parent.remove_tree("t") == []
    assert not tree.exists()
    order = _unlinks(calls, tree)
    assert sorted(order) == sorted([MARKER, "manifest.json", ".ready", "zz.bin"])
    assert order[-1] == MARKER


@pytest.mark.parametrize("kept", [False, True])
def test_a_marked_trees_record_and_marker_go_in_the_order_that_never_leaves_it_misread(
    tmp_path, kept
):
    """Removing a marked tree whole: its record goes before its marker (stopped between, a
    marked tree holding nothing else is left, which the next loader removes). When a user's
    file stays: the marker goes before the record (a tree never stays marked without its
    record: it would be taken for one made before records, and removed whole)."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t:
        t.write("loaders.bin", b"x")
    if kept:
        (tree / "users.txt").write_text("mine\n")
    calls: list[tuple[str, str]] = []
    with fs.Dir.open(tree.parent) as parent, fs.inject(lambda op, p: calls.append((op, p))):
        stayed = parent.remove_tree("t")
    order = [n for n in _unlinks(calls, tree) if n in (MARKER, fs.MADE)]
    if kept:
        assert stayed == [tree / "users.txt"] and (tree / "users.txt").read_text() == "mine\n"
        assert order == [MARKER, fs.MADE]
    else:
        assert stayed == [] and not tree.exists()
        assert order == [fs.MADE, MARKER]


def test_a_name_linked_to_a_users_file_in_a_marked_tree_stays_the_users(tmp_path):
    """``Dir.link`` in a marked tree records the new name only when what it links is the
    loader's: a second name of a user's file is never written through, nor removed."""
    tree = _tree(tmp_path)
    (tree / "users.txt").write_text("mine\n")
    with fs.Dir.open(tree) as t:
        t.link("users.txt", "second.txt")
        with pytest.raises(NotOursError):
            t.write("second.txt", b"the loader's", exclusive=False)
    assert (tree / "users.txt").read_text() == "mine\n"
    with fs.Dir.open(tree.parent) as parent:
        assert sorted(parent.remove_tree("t")) == [tree / "second.txt", tree / "users.txt"]
    assert (tree / "second.txt").read_text() == "mine\n"


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_rename_outside_a_marked_tree_never_replaces_a_link_or_fifo(tmp_path, kind):
    """The loader makes only files and directories: a ``replace`` rename onto a link or FIFO,
    in a directory no marked tree holds, is a :class:`NotOursError`; both stay."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "new.bin").write_bytes(b"new")
    if kind == "link":
        (tmp_path / "elsewhere").write_text("theirs\n")
        (plain / "target").symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(plain / "target")
    with fs.Dir.open(plain) as d, pytest.raises(NotOursError):
        d.rename("new.bin", d, "target", how="replace")
    assert (plain / "new.bin").read_bytes() == b"new"
    if kind == "link":
        assert (plain / "target").is_symlink()
    else:
        assert (plain / "target").is_fifo()


def test_a_marked_directorys_record_is_durable_before_the_directory_gets_its_name(tmp_path):
    """``make_marked``: the record (what tells the loader's entries from a user's) is fsynced
    under the temporary name before the rename names the directory."""
    calls: list[tuple[str, str]] = []
    with fs.Dir.open(tmp_path) as d, fs.inject(lambda op, path: calls.append((op, path))):
        assert d.make_marked("made", MARKER, KEY)
    (rename,) = [i for i, (op, _) in enumerate(calls) if op.startswith("rename")]
    tmp = calls[rename][1].split(" -> ")[0]
    assert ("fsync", f"{tmp}/{fs.MADE}") in calls[:rename], calls


def test_a_users_file_at_dests_record_name_is_never_taken_as_the_record(tmp_path):
    """``mark_in_place`` in a directory holding a user's file at the record's name (its first
    line names no marker of the loader's): a :class:`NotOursError`, and the file is never
    written (taken as the record, every create would be appended to it)."""
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / fs.MADE).write_text("my notes\n")
    with fs.Dir.open(dest) as d, pytest.raises(NotOursError, match=fs.MADE):
        d.mark_in_place(fs.MARKER_PREFIX + "fetch", "model-loader fetch")
    with fs.Dir.open(dest) as d:
        d.write("model.bin", b"weights")
    assert (dest / fs.MADE).read_text() == "my notes\n"


def test_rmdir_in_a_marked_tree_keeps_a_users_empty_directory(tmp_path, caplog):
    """``Dir.rmdir`` in a marked tree of a directory its record does not name (a user's, even
    empty): it stays, and a warning names it."""
    tree = _tree(tmp_path)
    (tree / "mine").mkdir()
    with fs.Dir.open(tree) as t:
        t.mkdir("ours")
        t.rmdir("ours")
        t.rmdir("mine")
    assert (tree / "mine").is_dir() and not (tree / "ours").exists()
    assert "kept the directory" in caplog.text and str(tree / "mine") in caplog.text


def test_removing_a_marked_tree_keeps_a_users_empty_directory_in_it(tmp_path):
    """A user's empty directory in a marked tree (no record names it) stays when the tree is
    removed, with the tree's directories holding it; everything the loader made goes."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t, t.makedirs(("a", "b")) as b:
        b.write("w.bin", b"w")
    (tree / "a" / "mine").mkdir()
    with fs.Dir.open(tree.parent) as parent:
        assert parent.remove_tree("t") == [tree / "a" / "mine"]
    assert (tree / "a" / "mine").is_dir() and not (tree / "a" / "b").exists()


def test_chmod_in_a_marked_tree_never_changes_a_users_file(tmp_path):
    """``Dir.chmod`` (how a staged tree is sealed) of a file in a marked tree its record does
    not name: a :class:`NotOursError`, its mode unchanged; the loader's own file is changed."""
    tree = _tree(tmp_path)
    (tree / "users.txt").write_text("mine\n")
    os.chmod(tree / "users.txt", 0o600)
    with fs.Dir.open(tree) as t:
        t.write("ours.bin", b"x")
        os.chmod(tree / "ours.bin", 0o600)
        t.chmod("ours.bin", 0o644)
        with pytest.raises(NotOursError):
            t.chmod("users.txt", 0o644)
    assert (tree / "users.txt").stat().st_mode & 0o777 == 0o600
    assert (tree / "ours.bin").stat().st_mode & 0o777 == 0o644


def test_chmod_never_follows_a_link_swapped_in_after_its_look(tmp_path):
    """A file of the loader's that someone replaces with a link to their own file between
    ``Dir.chmod``'s look at it and the change (sealing a staged tree): the link is skipped,
    the file it names keeps its mode."""
    tree = _tree(tmp_path)
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("mine\n")
    os.chmod(theirs, 0o600)
    with fs.Dir.open(tree) as t:
        t.write("ours.bin", b"x")
        os.chmod(tree / "ours.bin", 0o600)

        def swap(op: str, path: str) -> None:
            if op == "chmod" and path.endswith("/ours.bin"):
                os.unlink(path)
                os.symlink(theirs, path)

        with fs.inject(swap):
            t.chmod("ours.bin", 0o644)
    assert theirs.stat().st_mode & 0o777 == 0o600
    assert (tree / "ours.bin").is_symlink()


def test_a_judged_removal_whose_fresh_name_is_taken_is_refused_and_moves_nothing(tmp_path):
    """``Dir.unlink_judged`` of the loader's file to a fresh name something already stands at
    (a user's file put there, as prune's ``<lock>.stale-<hex>``): a :class:`NameTakenError`
    naming it (what prune keeps the lock for), and nothing moved or replaced: the loader's
    file is still at its name, the other one untouched at the fresh one."""
    (tmp_path / "k.lock").write_text("the loader's\n")
    (tmp_path / "k.lock.stale-0").write_text("the user's\n")
    found = os.lstat(tmp_path / "k.lock")
    with fs.Dir.open(tmp_path) as d, pytest.raises(NameTakenError, match="stale-0"):
        d.unlink_judged("k.lock", (found.st_dev, found.st_ino), "k.lock.stale-0")
    assert (tmp_path / "k.lock").read_text() == "the loader's\n"
    assert (tmp_path / "k.lock.stale-0").read_text() == "the user's\n"


def test_a_file_at_a_removals_fresh_name_changed_after_it_stopped_is_not_the_loaders(tmp_path):
    """A removal in a marked tree stopped right before the unlink of the file moved to its
    fresh name (``.model-loader-gone.*``): the record says by then that the loader is about to
    remove it, with its change time. An entry at that name with the same inode number but
    another change time (what a freed inode number given again to someone's file looks like)
    is someone else's: the next loader removing the tree keeps it (the record naming the fresh
    name only as made, not as gone, took any such entry for the loader's)."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t:
        t.write("x.bin", b"x")

    def stop(called: str, path: str) -> None:
        if called == "unlink" and ".model-loader-gone." in path:
            raise Stopped(path)

    with fs.Dir.open(tree) as t, fs.inject(stop), pytest.raises(Stopped):
        t.unlink("x.bin")
    (aside,) = [p for p in tree.iterdir() if ".model-loader-gone." in p.name]
    os.chmod(aside, 0o600)  # its change time moves: another entry, as far as a record tells
    fs._made_trees.clear()  # the next loader, reading the record anew
    with fs.Dir.open(tree.parent) as parent:
        kept = parent.remove_tree(tree.name)
    assert kept == [aside] and aside.read_bytes() == b"x"


# --- the publish lock ------------------------------------------------------------------------


def test_a_lock_records_pid_means_a_process_here_only_in_this_pid_space():
    """A record naming this host and a pid of another pid space (another container's pid
    namespace, an earlier boot) names no process this loader can see: judged by its expiry,
    never by whether that pid is alive here (this very process's pid is)."""
    import socket

    from loader.repository.lock import local_pid

    here = {"host": socket.gethostname(), "pid": os.getpid()}
    assert local_pid({**here, "pid_space": fs.pid_space()}) == os.getpid()
    assert local_pid(here) == os.getpid()  # written by a loader that kept no pid space
    assert local_pid({**here, "pid_space": "another-boot:pid:[4026531836]"}) is None
    assert local_pid({**here, "host": "another-host", "pid_space": fs.pid_space()}) is None


def test_a_holder_that_saw_its_lock_taken_over_stays_lost_when_the_file_comes_back(tmp_path):
    """A holder's heartbeat that finds its lock file no longer at the lock's path (taken over:
    another loader may have held the key and published meanwhile) marks the lock lost for
    good: the file put back at the path later does not make ``check_held`` pass."""
    from loader.errors import LockLostError
    from loader.repository.lock import PublishLock

    lock = PublishLock(tmp_path, KEY, expiry_s=5, heartbeat_s=0.02, timeout_s=1, poll_s=0.01)
    with lock:
        aside = lock.path.with_name(lock.path.name + ".aside")
        os.rename(lock.path, aside)
        thread = lock._thread
        assert thread is not None
        thread.join(timeout=5)  # the heartbeat sees the loss and stops
        os.rename(aside, lock.path)
        assert lock.held()  # the same file is at the path again ...
        with pytest.raises(LockLostError):
            lock.check_held()  # ... but the lock was lost meanwhile


def test_a_users_file_at_a_lock_path_is_refused_never_taken_over_after_the_expiry(tmp_path):
    """A file at a publish lock's path that holds no lock record (a user's) is refused at
    once, never judged by its silence and moved away, however long a waiter may wait."""
    from loader.repository.lock import PublishLock, lock_path

    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_text("my notes\n")
    lock = PublishLock(tmp_path, KEY, expiry_s=0.2, heartbeat_s=0.05, timeout_s=2, poll_s=0.05)
    with pytest.raises(NotOursError, match="no loader's lock record"):
        lock.acquire()
    assert path.read_text() == "my notes\n"


# --- prune -----------------------------------------------------------------------------------


def test_prune_keeps_the_newest_keys_by_their_manifests_creation_time(tmp_path):
    """The ``keep`` newest keys of a model are the newest by ``created_at`` (when the run
    published them): a directory's own time (a restore, a copy, a touch) never makes an older
    key look newer than the one serving."""
    from loader.repository.prune import prune

    root = tmp_path / "models"
    newest = forged_key(root, "m@r2/v", "2026-01-02T00:00:00Z", mtime=1_000_000)
    older = forged_key(root, "m@r1/v", "2026-01-01T00:00:00Z", mtime=2_000_000)
    report = prune(root, keep=1)
    assert [r.path for r in report.removed] == [older]
    assert newest.is_dir() and not older.exists()


OLD, NEW = "m@r1/v", "m@r2/v"


def test_prune_keeps_a_key_whose_manifest_changed_after_it_looked(tmp_path):
    """A key published again after prune looked, in a directory that got the inode of the one
    prune saw (inodes are reused), is told by its manifest's ``created_at``: it is kept."""
    from loader.repository.prune import prune

    root = tmp_path / "models"
    forged_key(root, NEW, "2026-01-02T00:00:00Z", mtime=2_000_000)
    old = forged_key(root, OLD, "2026-01-01T00:00:00Z", mtime=1_000_000)
    republished = {"key": OLD, "created_at": "2026-01-03T00:00:00Z", "files": []}

    def republish() -> None:
        (old / "manifest.json").write_text(json.dumps(republished))

    hook, done = when_locked(OLD, republish)
    with fs.inject(hook):
        report = prune(root, keep=1)
    assert done and json.loads((old / "manifest.json").read_text()) == republished
    assert (OLD, "published again since prune looked") in report.kept


#: When the idle directories below were last changed (2001): any expiry has passed.
_SILENT_SINCE = 1_000_000_000


def _idle_staging_of_another_host(root: Path) -> Path:
    """A staging directory of ``OLD`` named for a loader on another host, silent since 2001:
    prune judges it by its silence alone."""
    from loader.repository import publish

    staging = publish.new_staging_dir(root, OLD)
    staging = staging.rename(staging.with_name(staging.name.replace(fs.host_digest(), "0a1b2c3d")))
    for path in (staging, *staging.iterdir()):
        os.utime(path, (_SILENT_SINCE, _SILENT_SINCE))
    return staging


def test_prune_keeps_a_staging_directory_its_loader_wrote_to_after_prune_looked(tmp_path):
    """A staging directory of a loader on another host (judged by its silence) that prune
    found idle, and that its loader writes to again before prune holds the key's lock, is
    in use: it stays, with what the loader wrote."""
    from loader.repository import publish
    from loader.repository.prune import prune

    root = tmp_path / "models"
    staging = _idle_staging_of_another_host(root)

    def written_again() -> None:
        with fs.Dir.open(staging) as d:
            d.write("weights.bin", b"written again\n")

    hook, done = when_locked(OLD, written_again)
    with fs.inject(hook):
        report = prune(root, lock_expiry_s=60)
    assert done and (staging / "weights.bin").read_bytes() == b"written again\n"
    assert (OLD, f"{publish.STAGING_DIR}/{staging.name} is in use again") in report.kept


def _complete_copy_in_trash(root: Path) -> Path:
    """A complete copy of ``OLD`` in ``root``'s ``.trash`` (manifest and ``.ready``), its key
    absent, as a loader stopped between the two renames of a replacement leaves it."""
    from loader.repository import manifest
    from loader.repository.key import key_filename

    (root / OLD.split("/")[0]).mkdir(parents=True)
    copy = root / ".trash" / f"{key_filename(OLD)}.0123456789ab"
    (copy / "m").mkdir(parents=True)
    (copy / "m" / "weights.bin").write_bytes(b"weights")
    meta = {"key": OLD, "created_at": "2026-01-01T00:00:00Z"}
    manifest.write_manifest(copy, manifest.build_manifest(copy, meta))
    manifest.write_ready(copy, OLD)
    return copy


def test_prune_puts_a_replaced_copy_back_under_its_absent_key_never_removes_it(tmp_path):
    """A complete copy in ``.trash`` whose key is absent (a loader stopped between the two
    renames of a replacement without ``renameat2``) is the key's only copy: prune puts it
    back under the key, never removes it as a leftover."""
    from loader.repository import manifest
    from loader.repository.prune import prune

    root = tmp_path / "models"
    _complete_copy_in_trash(root)
    prune(root, keep=1)
    assert (root / OLD / "m" / "weights.bin").read_bytes() == b"weights"
    assert manifest.verify(root / OLD, key=OLD) == []


def test_a_put_back_without_renameat2_leaves_the_copy_when_a_directory_came_at_the_key(
    tmp_path,
):
    """Without ``renameat2`` a replaced copy goes back under its key by ``rename(2)`` after a
    look: a directory with something in it put at the key after that look makes the rename
    fail (ENOTEMPTY); the copy stays in ``.trash`` with a warning, what came at the key stays,
    and the run goes on (the error escaped, an OSError that is no user's or machine's)."""
    import errno

    from loader.repository import publish

    root = tmp_path / "models"
    copy = _complete_copy_in_trash(root)

    def no_renameat2(op: str, path: str) -> None:
        if op == "rename-noreplace":
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        if op == "rename" and path.endswith(f" -> {root / OLD}"):
            (root / OLD).mkdir()
            (root / OLD / "theirs.txt").write_text("mine\n")

    with fs.inject(no_renameat2):
        assert publish.recover(root, OLD) is None
    assert (copy / "m" / "weights.bin").read_bytes() == b"weights"
    assert (root / OLD / "theirs.txt").read_text() == "mine\n"


def test_prune_leaves_a_file_named_like_a_moved_lock_that_holds_no_lock_record(tmp_path):
    """A file in ``.locks`` named like a lock a take-over moved aside, holding no lock record,
    is someone else's: prune leaves it."""
    from loader.repository.prune import prune

    root = tmp_path / "models"
    locks = root / ".locks"
    locks.mkdir(parents=True)
    theirs = locks / "notes.lock.stale-0123456789abcdef"
    theirs.write_text("a user's notes\n")
    moved = locks / "m@r1~v.lock.stale-fedcba9876543210"
    moved.write_text(json.dumps({"pid": 1, "host": "elsewhere", "token": "0" * 16}))
    report = prune(root)
    assert theirs.read_text() == "a user's notes\n"
    assert [r.path for r in report.removed] == [moved] and not moved.exists()


def test_prune_keeps_a_moved_lock_whose_fresh_name_is_taken_and_goes_on(tmp_path, monkeypatch):
    """A moved-away lock prune removes goes to a fresh name first; something standing at that
    name already (a user's file) is never replaced: the lock stays, with a warning, the user's
    file is untouched, and prune goes on (it failed with the name taken)."""
    import types

    from loader.repository import prune as prune_module

    root = tmp_path / "models"
    locks = root / ".locks"
    locks.mkdir(parents=True)
    moved = locks / "m@r1~v.lock.stale-fedcba9876543210"
    moved.write_text(json.dumps({"pid": 1, "host": "elsewhere", "token": "0" * 16}))
    theirs = locks / "m@r1~v.lock.stale-aaaaaaaaaaaaaaaa"
    theirs.write_text("a user's notes\n")
    monkeypatch.setattr(
        prune_module, "secrets", types.SimpleNamespace(token_hex=lambda n: "a" * 2 * n)
    )
    report = prune_module.prune(root)
    assert report.removed == [] and theirs.read_text() == "a user's notes\n"
    assert json.loads(moved.read_text())["host"] == "elsewhere"


def test_prune_reports_no_removal_of_a_moved_lock_someone_else_removed_first(tmp_path):
    """A moved-away lock another process removes between prune's read and its move aside:
    nothing was removed by prune, and its report says so (it listed the lock as removed)."""
    from loader.repository.prune import prune

    root = tmp_path / "models"
    locks = root / ".locks"
    locks.mkdir(parents=True)
    moved = locks / "m@r1~v.lock.stale-fedcba9876543210"
    moved.write_text(json.dumps({"pid": 1, "host": "elsewhere", "token": "0" * 16}))

    def removed_first(op: str, path: str) -> None:
        if op.startswith("rename") and path.startswith(f"{moved} -> ") and moved.exists():
            moved.unlink()

    with fs.inject(removed_first):
        report = prune(root)
    assert report.removed == [] and not moved.exists()


def test_prune_leaves_a_users_copy_of_a_lock_record_not_named_as_a_take_over_names_it(tmp_path):
    """A take-over names the lock it moves aside ``<lock>.stale-<16 hex digits>``: a user's
    copy of a lock record in ``.locks`` under another name of that kind (a word, a suffix
    after the digits) is the user's, whatever it holds."""
    from loader.repository.prune import prune

    root = tmp_path / "models"
    locks = root / ".locks"
    locks.mkdir(parents=True)
    record = json.dumps({"pid": 1, "host": "elsewhere", "token": "0" * 16})
    theirs = [locks / "m@r1~v.lock.stale-copy", locks / "m@r1~v.lock.stale-fedcba9876543210.bak",
              locks / "m@r1~v.lock.stale-FEDCBA9876543210"]  # fmt: skip
    for path in theirs:
        path.write_text(record)
    report = prune(root)
    assert [path.read_text() for path in theirs] == [record] * len(theirs)
    assert report.removed == []


def test_prune_keeps_a_users_directory_put_where_a_staging_directory_was(tmp_path):
    """A staging directory prune judged a leftover, replaced before prune holds the key's lock
    by a user's old directory of that name (no marker, no record): it is the user's, and
    stays with everything in it."""
    from loader.repository import publish
    from loader.repository.prune import prune

    root = tmp_path / "models"
    staging = _idle_staging_of_another_host(root)

    def replaced() -> None:
        staging.rename(tmp_path / "aside")
        staging.mkdir()
        (staging / "users.txt").write_text("mine\n")
        for path in (staging / "users.txt", staging):
            os.utime(path, (_SILENT_SINCE, _SILENT_SINCE))

    hook, done = when_locked(OLD, replaced)
    with fs.inject(hook):
        report = prune(root, lock_expiry_s=60)
    assert done and (staging / "users.txt").read_text() == "mine\n"
    assert (OLD, f"{publish.STAGING_DIR}/{staging.name} is not the loader's") in report.kept


def test_prune_leaves_a_download_directory_away_from_its_keys_name(tmp_path):
    """A directory in ``.work`` carrying a download marker for a key, at another name than
    that key's (a copy someone made): not the loader's download directory; it stays."""
    from loader.repository.key import key_filename
    from loader.repository.prune import prune
    from loader.repository.publish import DOWNLOAD_MARKER

    root = tmp_path / "models"
    for name in (key_filename(OLD), "my-backup"):
        (root / ".work" / name / "source").mkdir(parents=True)
        (root / ".work" / name / "source" / "model.bin").write_bytes(b"w")
        (root / ".work" / name / DOWNLOAD_MARKER).write_text(f"{OLD}\n")
    report = prune(root)
    assert (root / ".work" / "my-backup" / "source" / "model.bin").read_bytes() == b"w"
    assert [r.path for r in report.removed] == [root / ".work" / key_filename(OLD)]


def test_a_dry_run_keeps_a_key_whose_lock_a_live_process_here_holds(tmp_path):
    """``prune --dry-run`` does not take locks: a key whose lock a live process on this host
    holds is reported kept, never as what would go."""
    from loader.repository.lock import PublishLock
    from loader.repository.prune import prune

    root = tmp_path / "models"
    forged_key(root, NEW, "2026-01-02T00:00:00Z", mtime=2_000_000)
    old = forged_key(root, OLD, "2026-01-01T00:00:00Z", mtime=1_000_000)
    with PublishLock(root, OLD, expiry_s=60):
        lock = next((root / ".locks").iterdir())
        os.utime(lock, (1_000_000, 1_000_000))  # a live holder whose heartbeat is late
        report = prune(root, keep=1, dry_run=True, lock_expiry_s=60)
    assert report.removed == [] and (OLD, "its publish lock is live") in report.kept
    assert old.is_dir()


def test_a_users_file_at_a_keys_lock_path_keeps_the_key_and_prune_goes_on(tmp_path):
    """A user's file at an old key's lock path: the key's lock cannot be told, so the key is
    kept, the file is left as it was, and prune goes on with the other keys."""
    from loader.repository.lock import lock_path
    from loader.repository.prune import prune

    root = tmp_path / "models"
    forged_key(root, "m@r3/v", "2026-01-03T00:00:00Z", mtime=3_000_000)
    forged_key(root, NEW, "2026-01-02T00:00:00Z", mtime=2_000_000)
    old = forged_key(root, OLD, "2026-01-01T00:00:00Z", mtime=1_000_000)
    path = lock_path(root, OLD)
    path.parent.mkdir()
    path.write_text("my notes\n")
    os.utime(path, (1_000_000, 1_000_000))
    report = prune(root, keep=1, lock_expiry_s=60)
    assert path.read_text() == "my notes\n" and old.is_dir()
    assert (OLD, "its publish lock is live") in report.kept
    assert [r.path for r in report.removed] == [root / NEW]


def test_prune_leaves_a_copy_in_trash_not_named_after_its_key(tmp_path):
    """A directory in ``.trash`` whose manifest names a published key, at a name the loader
    never gives a replaced copy (one not starting with the key's file name): someone else's
    copy, left as it is."""
    from loader.repository.prune import prune

    root = tmp_path / "models"
    forged_key(root, OLD, "2026-01-01T00:00:00Z", mtime=1_000_000)
    copy = root / ".trash" / "my-copy"
    copy.mkdir(parents=True)
    (copy / "manifest.json").write_text(json.dumps({"key": OLD, "files": []}))
    (copy / "weights.bin").write_bytes(b"w")
    prune(root)
    assert (copy / "weights.bin").read_bytes() == b"w"


# --- names a remote listing gives ------------------------------------------------------------


@pytest.mark.parametrize(
    "rel",
    [
        "config.json\nINFO forged log line",  # a line break: a log line of its own
        "a\x1b[31mred.bin",  # a terminal escape
        "a/../../outside.bin",
        "./model.bin",
        "a//model.bin",
        "/model.bin",
        "a\0b",
        ".partial/model.bin.1234-0a1b2c3d",  # the loader's own partial downloads
        "/".join(["d"] * (fs.MAX_NAME_LEVELS + 1)),
        "m" * 250,  # fits the file system, not with the 10 bytes its download adds
    ],
)
def test_each_kind_of_listed_name_the_rule_refuses_is_refused(rel):
    """``listed_parts`` refuses, before anything is written, every kind of name its rule
    names: each case here is refused by one of its checks alone."""
    from loader.errors import SourceError
    from loader.sources.names import listed_parts

    with pytest.raises(SourceError, match="nothing was written for it"):
        listed_parts(rel, what="Object gs://b/p", remedy="Rename it.", suffix=10)
    assert listed_parts("a/b/model.bin", what="Object", remedy="Rename it.", suffix=10) == [
        "a",
        "b",
        "model.bin",
    ]


@pytest.mark.parametrize(
    ("rel", "message"),
    [("../outside.bin", "is not a path below the destination"), ("a/b.bin", "a is a file")],
)
def test_a_path_below_dest_through_dot_dot_or_a_file_is_a_source_error(tmp_path, rel, message):
    """``safe_path``: a ``..`` in a path below DEST, or a file where a directory of it would
    be, is a :class:`SourceError` naming it (exit 2), never a traceback; nothing is made."""
    from loader.errors import SourceError
    from loader.sources.transfer import safe_path

    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "a").write_text("the user's\n")
    with pytest.raises(SourceError, match=message):
        safe_path(dest, rel)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]
    assert [p.name for p in dest.iterdir()] == ["a"] and (dest / "a").read_text() == "the user's\n"


def test_a_link_at_a_gone_owners_partial_name_is_never_adopted(tmp_path):
    """A symbolic link named like the partial download of a gone owner of this host: not a
    partial download (the loader writes none), never taken over; it stays at its name."""
    import subprocess
    import sys

    from loader.sources.transfer import adopt

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    partial = tmp_path / "dest" / ".partial"
    partial.mkdir(parents=True)
    (tmp_path / "elsewhere").write_bytes(b"theirs")
    theirs = partial / f"model.bin.{dead.pid}-{fs.host_digest()}"
    theirs.symlink_to(tmp_path / "elsewhere")
    assert not adopt(partial / f"model.bin.{fs.owner()}")
    assert theirs.is_symlink() and sorted(p.name for p in partial.iterdir()) == [theirs.name]


# --- the dtype of a checkpoint that declares none ---------------------------------------------


@pytest.mark.parametrize("most", ["F16", "F32"])
def test_an_undeclared_dtype_follows_the_bytes_not_the_count_of_tensors(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, most
):
    """The largest tensors (most of the bytes, a quarter of the tensors) in one dtype, the many
    small ones in the other: the output is written in the dtype of the bytes."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from tests.runs import checkpoint_copy, cli, published, run_argv

    source, weights = checkpoint_copy(
        tiny_checkpoint_with_tokenizer, tmp_path / "ckpt", undeclared=True
    )
    tensors = load_file(weights)
    big, small = (np.float16, np.float32) if most == "F16" else (np.float32, np.float16)
    largest = sorted(tensors, key=lambda n: tensors[n].size, reverse=True)[: len(tensors) // 4]
    converted = {n: t.astype(big if n in largest else small) for n, t in tensors.items()}
    in_big = [t for t in converted.values() if t.dtype == big]
    assert len(in_big) < len(converted) / 2  # most tensors are in the other dtype ...
    assert sum(t.nbytes for t in in_big) > sum(t.nbytes for t in converted.values()) / 2
    save_file(converted, weights)  # ... most bytes in this one
    code, _, err = cli(capsys, *run_argv(source, tmp_path / "root"))
    assert code == 0, err
    ini = next((published(tmp_path / "root") / "fastertransformer" / "1").rglob("config.ini"))
    expected = "fp16" if most == "F16" else "fp32"
    assert f"weight_data_type = {expected}" in ini.read_text()


def test_a_weight_stored_as_integers_is_a_dtype_error_before_anything_is_written(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """A weight the plan converts stored in an integer dtype: a typed error (exit 2) naming the
    tensor and the dtypes weights may have; nothing is published."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from tests.runs import checkpoint_copy, cli, run_argv

    source, weights = checkpoint_copy(tiny_checkpoint_with_tokenizer, tmp_path / "ckpt")
    tensors = load_file(weights)
    name = max(tensors, key=lambda n: tensors[n].size)
    tensors[name] = tensors[name].astype(np.int32)
    save_file(tensors, weights)
    code, _, err = cli(capsys, *run_argv(source, tmp_path / "root"))
    assert code == 2, err
    assert f"Tensor {name} in" in err and "weights must be fp32, fp16, bf16" in err
    assert not any(p.name.startswith("tiny") for p in (tmp_path / "root").glob("*@*"))


def test_a_tensor_spanning_other_than_its_dtype_and_shape_take_is_refused_at_open(tmp_path):
    """A safetensors entry whose byte span is shorter than its dtype and shape take (the rest
    would be read from past its data): the file is refused when opened, naming the tensor."""
    import struct

    from loader.checkpoint import open_checkpoint
    from loader.errors import CheckpointError

    (tmp_path / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + b"\0" * 4
    )
    with pytest.raises(CheckpointError, match="tensor w spans 4 bytes, not 8"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("marker", [None, fs.MARKER_PREFIX + "download"], ids=["staging", "work"])
def test_prune_removes_only_a_tree_it_judges_the_keys_as_it_removes_it(tmp_path, marker):
    """What prune rechecked under the key's lock is judged once more on the descriptor it
    removes: a directory renamed to that name in between, a user's copy of another key's tree
    (its marker or manifest naming that key), stays whole."""
    from loader.repository import manifest, publish
    from loader.repository.prune import _remover

    root = tmp_path / "models"
    directory = publish.STAGING_DIR if marker is None else publish.WORK_DIR
    tree = root / directory / "copy"
    tree.mkdir(parents=True)
    (tree / (marker or publish.STAGING_MARKER)).write_text(NEW + "\n")
    (tree / manifest.MANIFEST).write_text(json.dumps({"key": NEW, "files": []}))
    (tree / "notes.txt").write_text("mine\n")
    outcome = _remover(root, directory, "copy", OLD, marker)()
    assert outcome == f"{directory}/copy is not the loader's"
    assert (tree / "notes.txt").read_text() == "mine\n"
