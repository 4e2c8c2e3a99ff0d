"""What the loader made in its marked trees, and only that, is removed, replaced or written
again (:data:`loader.fs.MADE`): a file or directory someone else put into a tree carrying the
loader's marker stays exactly as it was, whatever the record of the tree says.

Every test works below a :func:`loader.fs.confined` directory, as every command does: a
directory deep in a tree is entered from there one name at a time, and so knows its tree."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader import fs
from loader.errors import EXIT_TRANSIENT, NotOursError, typed_os_error
from tests.at_step import AtStep, picked_calls
from tests.fault_sweep import snapshot as _snapshot
from tests.tiers import examples

MARKER = ".model-loader-staging"
KEY = "m@r/v"


@pytest.fixture(autouse=True)
def _confined(tmp_path):
    with fs.confined(tmp_path):
        yield


def _tree(base: Path) -> Path:
    """``base/staging/t``: a marked tree the loader filled (a file at its top, one in a
    directory two levels down)."""
    with fs.Dir.open(base / "staging", create=True) as parent:
        assert parent.make_marked("t", MARKER, KEY)
        with parent.sub("t") as t:
            t.write("top.bin", b"top")
            with t.makedirs(("a", "b")) as b:
                b.write("w.bin", b"w" * 100)
    return base / "staging" / "t"


def _remove(tree: Path) -> list[Path]:
    with fs.Dir.open(tree.parent) as parent:
        return parent.remove_tree(tree.name)


def _plant(tree: Path) -> dict[str, str]:
    """A user's file at the top and deep in the tree, and a user's directory: what they hold."""
    (tree / "notes.txt").write_text("mine\n")
    (tree / "a" / "b" / "notes.txt").write_text("mine too\n")
    (tree / "a" / "mine").mkdir()
    (tree / "a" / "mine" / "data").write_text("keep\n")
    return {
        rel: v
        for rel, v in _snapshot(tree).items()
        if rel.endswith("notes.txt") or "/mine" in f"/{rel}"
    }


def test_a_tree_with_nothing_else_in_it_is_removed_whole(tmp_path):
    tree = _tree(tmp_path)
    assert (tree / fs.MADE).is_file()
    assert _remove(tree) == []
    assert not tree.exists()


def test_a_users_files_and_directories_in_a_marked_tree_stay_exactly_as_they_were(tmp_path, caplog):
    tree = _tree(tmp_path)
    planted = _plant(tree)
    with caplog.at_level(logging.WARNING, logger="loader.fs"):
        kept = _remove(tree)
    after = _snapshot(tree)
    assert {rel: after.get(rel) for rel in planted} == planted
    # What the loader made is gone, the user's directories' parents stay to hold them.
    assert set(after) == set(planted) | {"a", "a/b"}
    assert tree / "notes.txt" in kept and tree / "a" / "b" / "notes.txt" in kept
    # The tree is no longer the loader's: no marker, no record (later runs refuse its name).
    assert not (tree / MARKER).exists() and not (tree / fs.MADE).exists()
    with fs.Dir.open(tree.parent) as parent:
        assert not parent.marked("t", MARKER, KEY)
    assert "notes.txt" in caplog.text and "someone else's" in caplog.text


def test_a_users_file_put_where_the_loaders_was_is_kept(tmp_path):
    """Same name, another inode: the record names the loader's file, not the name. (A file
    made after the loader's was removed may get its inode number again: at the same name, it
    cannot be told from the loader's.)"""
    tree = _tree(tmp_path)
    (tree / "users").write_text("a user's, at the loader's old name\n")
    os.replace(tree / "users", tree / "top.bin")
    _remove(tree)
    assert (tree / "top.bin").read_text() == "a user's, at the loader's old name\n"
    assert not (tree / "a").exists()


@pytest.mark.parametrize("how", ["unlink", "remove_tree"])
def test_a_users_file_at_the_name_of_one_the_loader_removed_is_kept(tmp_path, how):
    """What the loader removes it records as gone first: a file made there afterwards (which
    may well get the removed file's inode number: it is free again) is someone else's."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tmp_path / "staging") as parent, parent.sub("t") as t:
        if how == "unlink":
            t.unlink("top.bin")
        else:
            assert t.remove_tree("a") == []
    if how == "unlink":
        (tree / "top.bin").write_text("a user's\n")
    else:
        (tree / "a" / "b").mkdir(parents=True)
        (tree / "a" / "b" / "w.bin").write_text("a user's\n")
    users = ("top.bin",) if how == "unlink" else ("a", "a/b", "a/b/w.bin")
    before = _snapshot(tree)
    _remove(tree)
    assert _snapshot(tree) == {rel: before[rel] for rel in users}


@pytest.mark.parametrize("how", ["overwrite", "append", "unlink", "exclusive"])
def test_a_users_file_in_a_marked_tree_is_never_written_or_removed(tmp_path, how, caplog):
    tree = _tree(tmp_path)
    (tree / "a" / "b" / "config.ini").write_text("the user's\n")
    with fs.Dir.open(tree / "a" / "b") as b:
        if how == "overwrite":
            with pytest.raises(NotOursError) as info:
                b.write("config.ini", b"the loader's", exclusive=False)
            assert "config.ini" in str(info.value)
        elif how == "append":
            with pytest.raises(NotOursError):
                b.append("config.ini", b"more")
        elif how == "unlink":
            with caplog.at_level(logging.WARNING, logger="loader.fs"):
                b.unlink("config.ini")
            assert "config.ini" in caplog.text
        else:
            with pytest.raises(FileExistsError):
                b.write("config.ini", b"the loader's")
        # the loader's own file there is written again as before
        b.write("w.bin", b"again", exclusive=False)
        b.append("w.bin", b"+")
    assert (tree / "a" / "b" / "config.ini").read_text() == "the user's\n"
    assert (tree / "a" / "b" / "w.bin").read_bytes() == b"again+"


def test_what_the_loader_renames_in_its_trees_stays_its_own(tmp_path):
    tree = _tree(tmp_path)
    other = _tree(tmp_path / "other")
    with fs.Dir.open(tree) as t, fs.Dir.open(other) as o:
        t.rename("top.bin", t, "renamed.bin", how="noreplace")
        t.write("partial", b"p")
        t.rename("partial", t, "renamed.bin", how="replace")  # onto its own file
        t.rename("a", o, "moved", how="noreplace")  # a directory into another tree
    (other / "moved" / "b" / "notes.txt").write_text("mine\n")
    assert _remove(tree) == [] and not tree.exists()
    _remove(other)
    assert _snapshot(other) == {
        "moved": "dir",
        "moved/b": "dir",
        "moved/b/notes.txt": _snapshot(other)["moved/b/notes.txt"],
    }


def test_a_users_entry_is_never_moved_or_replaced_in_a_marked_tree(tmp_path):
    tree = _tree(tmp_path)
    (tree / "notes.txt").write_text("mine\n")
    with fs.Dir.open(tree) as t:
        with pytest.raises(NotOursError):
            t.rename("notes.txt", t, "x", how="noreplace")
        t.write("partial", b"p")
        with pytest.raises(NotOursError):
            t.rename("partial", t, "notes.txt", how="replace")
    assert (tree / "notes.txt").read_text() == "mine\n" and (tree / "partial").exists()


def _theirs(at: Path, kind: str) -> Path:
    """A user's entry of ``kind`` at ``at``: a file, an empty directory (a mount point) or a
    link."""
    if kind == "file":
        at.write_text("mine\n")
    elif kind == "empty directory":
        at.mkdir()
    else:
        at.symlink_to("elsewhere")
    return at


@pytest.mark.parametrize(
    ("moved", "there"),
    [("file", None), ("directory", None), ("file", "file")],
    ids=["file-where-nothing-was", "directory-where-nothing-was", "file-over-its-own"],
)
@pytest.mark.parametrize("kind", ["file", "empty directory", "link"])
def test_a_users_entry_renamed_to_the_target_of_a_replace_at_any_step_stays(
    tmp_path, moved, there, kind
):
    """The loader renames its file or directory over a name of its tree (where nothing was, or
    its own file was); a user's entry is renamed to that name at any call of the rename: it is
    never replaced (rename(2) replaced a user's empty directory put where nothing was), and
    stays whole, at that name or where the loader moved it back from."""

    def setup(base: Path) -> Path:
        tree = _tree(base)
        with fs.Dir.open(tree) as t:
            if moved == "file":
                t.write("new", b"new")
            else:
                t.mkdir("new")
            if there is not None:
                t.write("target", b"old")
        return tree

    def replace(tree: Path) -> None:
        with fs.Dir.open(tree) as t:
            t.rename("new", t, "target", how="replace")

    counted = setup(tmp_path / "count")
    steps, _ = picked_calls(lambda op, path: path, lambda: replace(counted))
    assert steps
    for step in range(1, len(steps) + 1):
        tree = setup(tmp_path / f"at-{step}")
        planted: list[os.stat_result] = []

        def plant(_: str, tree: Path = tree, step: int = step, planted=planted) -> None:
            theirs = _theirs(tmp_path / f"theirs-{step}", kind)
            planted.append(os.lstat(theirs))
            try:
                os.rename(theirs, tree / "target")
            except OSError:  # the loader's entry there is of another kind: moved away first
                os.rename(tree / "target", tmp_path / f"moved-{step}")
                os.rename(theirs, tree / "target")

        hook = AtStep(step, lambda op, path: path, plant)
        with contextlib.suppress(FileExistsError, NotOursError), fs.inject(hook):
            replace(tree)
        assert hook.done, step
        mine = [p for p in tree.iterdir() if os.lstat(p).st_ino == planted[0].st_ino]
        assert len(mine) == 1, (step, steps[step - 1], os.listdir(tree))
        assert kind != "file" or mine[0].read_text() == "mine\n"
        assert kind != "empty directory" or os.listdir(mine[0]) == []


def test_a_target_that_changes_at_every_look_is_refused_never_replaced(tmp_path):
    """Another loader's file comes and goes at the name the loader renames its file over, at
    every try: the rename is refused (exit 2) and replaces nothing (after its tries it fell
    back to rename(2), which replaced whatever stood there by then: a user's file renamed there
    in that instant)."""
    tree = _tree(tmp_path)
    target, theirs = tree / "target", tmp_path / "theirs"
    theirs.write_text("mine\n")
    tries: list[str] = []

    def come_and_go(op: str, path: str) -> None:
        if not path.endswith(f"/new -> {target}") or len(tries) > 3:
            return
        tries.append(op)
        if len(tries) > 3 or op == "rename":  # the last: a user's file renamed there
            os.rename(theirs, target)
        elif target.exists():
            target.unlink()
        else:
            with fs.inject(lambda op, path: None), fs.Dir.open(tree) as t:
                t.write("target", b"another loader's")

    with fs.Dir.open(tree) as t:
        t.write("new", b"new")
        with fs.inject(come_and_go), pytest.raises(FileExistsError):
            t.rename("new", t, "target", how="replace")
    assert tries == ["rename-noreplace", "rename-exchange", "rename-noreplace"]
    assert target.read_bytes() == b"another loader's" and (tree / "new").read_bytes() == b"new"
    assert theirs.read_text() == "mine\n"


def test_a_target_other_loaders_keep_replacing_is_transient(tmp_path):
    """Another loader's file is at the name at every look (other loaders contending for the
    same name): the rename replaces nothing and fails as contention, worth running again (exit
    75), not as a user's entry in the way (exit 2)."""
    tree = _tree(tmp_path)
    target = tree / "target"
    tries: list[str] = []
    exchanges: list[str] = []

    def come_and_go(op: str, path: str) -> None:
        if not path.endswith(f"/new -> {target}"):
            return
        if op == "rename-exchange":
            exchanges.append(path)
            if len(exchanges) % 2 == 0:
                return  # (the exchange back of the other's file swapped in)
        tries.append(op)
        with fs.inject(lambda op, path: None), fs.Dir.open(tree) as t:
            t.rename("target", t, f"target.{len(tries)}")  # (kept: no inode used again)
            t.write("target", f"loader {len(tries)}".encode())

    with fs.Dir.open(tree) as t:
        t.write("new", b"new")
        t.write("target", b"loader 0")
        with fs.inject(come_and_go), pytest.raises(FileExistsError) as raised:
            t.rename("new", t, "target", how="replace")
    assert len(tries) == 3
    assert target.read_bytes() == b"loader 3" and (tree / "new").read_bytes() == b"new"
    typed = typed_os_error(raised.value)
    assert typed is not None and typed.exit_code == EXIT_TRANSIENT, typed
    assert "another loader" in str(typed) and "run" in typed.remediation.lower()


class Stopped(BaseException):
    """The loader stopped at a call (as a kill would: nothing after it runs)."""


def _stop_at(op: str, suffix: str, nth: int = 1):
    """A hook stopping the loader at the ``nth`` call ``op`` on a path ending in ``suffix``:
    that call and every one after it fail (no clean-up runs, as after a kill)."""
    seen = []

    def hook(called: str, path: str) -> None:
        if len(seen) >= nth or (called == op and path.endswith(suffix)):
            seen.append(path)
            if len(seen) >= nth:
                raise Stopped(path)

    return hook


def _stop_moving(source: str, *, after: bool = False):
    """A hook stopping the loader at the first rename whose source ends ``source`` (a path
    and `` -> ``), or (``after``) at the next call after it: every call from there fails."""
    seen: list[str] = []

    def hook(called: str, path: str) -> None:
        if seen or (called.startswith("rename") and source in path):
            seen.append(path)
            if len(seen) > after:
                raise Stopped(path)

    return hook


def _fresh_process() -> None:
    """Forget the records this process keeps open (the next loader reads them anew)."""
    fs._made_trees.clear()


@pytest.mark.parametrize("what", ["file", "directory"])
def test_what_a_loader_stopped_between_its_create_and_its_record_made_is_its_own(tmp_path, what):
    """A create is recorded as pending first, then done with its inode: a loader stopped
    between the two left an empty file or directory at a pending name, which the next one
    takes as its own (removed with the tree, or used again), never a user's entry."""
    tree = _tree(tmp_path)
    # The second call opening the record: the first records the pending create.
    with fs.Dir.open(tree) as t, fs.inject(_stop_at("open", fs.MADE, 2)), pytest.raises(Stopped):
        if what == "file":
            t.write("late.bin", b"late")
        else:
            t.mkdir("late")
    assert (tree / ("late.bin" if what == "file" else "late")).exists()
    _fresh_process()
    assert _remove(tree) == []
    assert not tree.exists()


def test_an_empty_directory_a_stopped_create_left_is_taken_when_used_again(tmp_path):
    """A directory a loader stopped after creating (unrecorded) and the next loader fills
    (a download resumed into it) is the loader's, and goes with the tree."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t, fs.inject(_stop_at("open", fs.MADE, 2)), pytest.raises(Stopped):
        t.mkdir("source")
    _fresh_process()
    with fs.Dir.open(tree) as t, t.makedirs(("source", "deeper")) as deeper:
        deeper.write("w.bin", b"w")
    _fresh_process()
    assert _remove(tree) == []
    assert not tree.exists()


@pytest.mark.parametrize("what", ["file", "directory"])
def test_a_users_entry_at_a_pending_name_is_kept(tmp_path, what):
    """A pending create whose entry never came (stopped before it): what someone puts at that
    name afterwards, holding anything, is theirs."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t, fs.inject(_stop_at("mkdir", "/late")), pytest.raises(Stopped):
        t.mkdir("late")
    with fs.Dir.open(tree) as t, fs.inject(_stop_at("open", "/late.bin")), pytest.raises(Stopped):
        t.write("late.bin", b"late")
    assert not (tree / "late").exists() and not (tree / "late.bin").exists()
    (tree / "late.bin").write_text("mine\n")
    (tree / "late").mkdir()
    (tree / "late" / "data").write_text("keep\n")
    planted = {r: v for r, v in _snapshot(tree).items() if r.startswith("late")}
    _fresh_process()
    assert sorted(_remove(tree)) == [tree / "late" / "data", tree / "late.bin"]
    assert {r: v for r, v in _snapshot(tree).items() if r.startswith("late")} == planted


@pytest.mark.parametrize("how", ["unlink", "rmdir", "subtree"])
def test_what_a_loader_stopped_before_removing_it_left_is_its_own(tmp_path, how):
    """A removal is recorded first (the entry's inode and change time): a loader stopped
    between the two left the entry, which the next one still takes as its own."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t:
        t.mkdir("empty")
    # (a file is moved aside first: removed only while it is the very file judged)
    op, name = {"unlink": ("rename-noreplace", "top.bin"), "rmdir": ("rmdir", "empty"),
                "subtree": ("rename-noreplace", "w.bin")}[how]  # fmt: skip
    hook = _stop_at(op, f"/{name}") if op == "rmdir" else _stop_moving(f"/{name} -> ")
    with fs.Dir.open(tree) as t, fs.inject(hook), pytest.raises(Stopped):
        if how == "unlink":
            t.unlink("top.bin")
        elif how == "rmdir":
            t.rmdir("empty")
        else:
            t.remove_tree("a")
    _fresh_process()
    assert _remove(tree) == []
    assert not tree.exists()


@pytest.mark.parametrize("stop", [("open", fs.MADE, 1), ("write", fs.MADE, 1),
                                  ("open", MARKER, 1), ("write", MARKER, 1)])  # fmt: skip
def test_a_marked_directory_stopped_before_its_marker_was_whole_is_removed(tmp_path, stop):
    """:meth:`loader.fs.Dir.make_marked` stopped before its marker was written: the
    temporary directory (nothing, or a record and a marker not yet whole in it) is removed
    by the next loader looking for unfinished ones once its owner is gone; a user's entry
    in one keeps it."""
    with fs.Dir.open(tmp_path / "staging", create=True) as parent:
        with fs.inject(_stop_at(*stop)), pytest.raises(Stopped):
            parent.make_marked("t", MARKER, KEY)
        (tmp,) = parent.names()
        dead = tmp.replace(f".{fs.owner()}.", ".999999999-" + fs.host_digest() + ".")
        os.rename(tmp_path / "staging" / tmp, tmp_path / "staging" / dead)
        _fresh_process()
        assert parent.unfinished_marked("t.", MARKER, KEY, idle_s=3600) == []
        assert parent.names() == []
        # The same, holding a user's file: kept.
        with fs.inject(_stop_at(*stop)), pytest.raises(Stopped):
            parent.make_marked("t", MARKER, KEY)
        (tmp,) = parent.names()
        os.rename(tmp_path / "staging" / tmp, tmp_path / "staging" / dead)
        (tmp_path / "staging" / dead / "notes.txt").write_text("mine\n")
        _fresh_process()
        assert parent.unfinished_marked("t.", MARKER, KEY, idle_s=3600) == []
        assert (tmp_path / "staging" / dead / "notes.txt").read_text() == "mine\n"


def test_a_users_file_at_the_records_name_makes_no_tree_and_is_never_written(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / fs.MADE).write_text("a user's file\n")
    with fs.Dir.open(plain) as d:
        assert d.made is None
        d.write("f", b"x")
        d.mkdir("sub")
    assert (plain / fs.MADE).read_text() == "a user's file\n"


@pytest.mark.parametrize("kind", ["file", "dir", "link"])
def test_a_marked_tree_whose_record_was_replaced_is_kept_whole(tmp_path, kind):
    tree = _tree(tmp_path)
    (tree / fs.MADE).unlink()
    if kind == "file":
        (tree / fs.MADE).write_text("not a record\n")
    elif kind == "dir":
        (tree / fs.MADE).mkdir()
    else:
        (tree / fs.MADE).symlink_to(tmp_path)
    before = _snapshot(tree)
    assert _remove(tree)
    assert _snapshot(tree) == before


def test_a_tree_made_before_records_were_kept_is_removed_as_before(tmp_path):
    tree = tmp_path / "old"
    (tree / "a").mkdir(parents=True)
    (tree / MARKER).write_text(f"{KEY}\n")
    (tree / "a" / "w.bin").write_bytes(b"w")
    os.mkfifo(tree / "a" / "fifo")
    assert _remove(tree) == [tree / "a" / "fifo"]
    assert _snapshot(tree) == {"a": "dir", "a/fifo": _snapshot(tree)["a/fifo"]}


def test_the_record_names_only_single_names_and_inodes():
    head = fs.made_header(MARKER)
    lines = [
        json.dumps([5, "f", "a/b"]),
        json.dumps([6, "f", "../x"]),
        json.dumps([7, "f", "/etc/passwd"]),
        json.dumps([8, "f", "a//b"]),
        json.dumps([True, "f", "t"]),
        json.dumps([-1, "f", "t"]),
        json.dumps([9, "x", "t"]),
        json.dumps({"marker": "../../x"}),
        "garbage",
        json.dumps([10, "d", "a"]),
        json.dumps([11, "f", "gone"]),
        json.dumps([11, "-", "gone"]),
        json.dumps([12, "f", "back"]),
        json.dumps([12, "-", "back"]),
        json.dumps([12, "f", "back"]),
        json.dumps([13, "-", "never"]),
    ]
    marker, records = fs.parse_made(head + "\n".join(lines).encode())
    assert marker == MARKER
    assert {rel: v for rel, v in records.items() if v} == {
        ("a", "b"): {(5, "f")},
        ("a",): {(10, "d")},
        ("back",): {(12, "f")},
    }
    assert fs.parse_made(json.dumps({"marker": "a/b"}).encode())[0] is None


_GARBAGE = st.lists(
    st.one_of(
        st.binary(max_size=40),
        st.tuples(
            st.integers(min_value=-2, max_value=2**64),
            st.sampled_from(["f", "d", "x"]),
            st.lists(
                st.sampled_from(["a", "b", "..", ".", "", "notes.txt", "/", "mine"]),
                min_size=1,
                max_size=4,
            ).map("/".join),
        ).map(lambda t: json.dumps(list(t)).encode()),
    ),
    max_size=12,
)


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(garbage=_GARBAGE, inode_of_users=st.booleans())
def test_a_forged_or_garbled_record_only_ever_keeps_more(tmp_path_factory, garbage, inode_of_users):
    base = tmp_path_factory.mktemp("forged")
    tree = _tree(base)
    outside = base / "outside"
    outside.mkdir()
    (outside / "precious").write_text("not the loader's\n")
    planted = _plant(tree)
    (tree / "link").symlink_to(outside)
    lines = list(garbage)
    if inode_of_users:  # a record naming a user's entry by another name, or at its name by
        users = os.lstat(tree / "notes.txt").st_ino  # the inode of another entry
        lines.append(fs.made_line(("elsewhere",), os.lstat(tree / "notes.txt")).rstrip())
        lines.append(json.dumps([users + 1, "f", "notes.txt"]).encode())
    with open(tree / fs.MADE, "ab") as fh:
        fh.write(b"\n".join(lines) + b"\n")
    before_outside = _snapshot(outside)
    _remove(tree)
    after = _snapshot(tree)
    assert {rel: after.get(rel) for rel in planted} == planted
    assert after.get("link") == f"link:{outside}"
    assert _snapshot(outside) == before_outside


def test_a_tree_copied_file_by_file_is_removed_whole(tmp_path):
    """A tree copied to another place (``cp -r``, ``rsync`` to a new volume) keeps its record
    but none of its inode numbers: the record names nothing there, so the tree counts as one
    without a record and is removed whole, as before records, instead of being kept for good
    (a key's old copy in ``.staging``, a download directory every later run refused)."""
    import shutil

    tree = _tree(tmp_path)
    copy = tmp_path / "staging" / "copied"
    shutil.copytree(tree, copy, symlinks=True)
    assert _remove(copy) == []
    assert not copy.exists()
    _plant(tree)  # the original's record still names its own inodes: the user's files stay
    kept = _remove(tree)
    assert kept and tree.exists() and (tree / "notes.txt").read_text() == "mine\n"


def test_a_users_files_copied_along_with_a_tree_stay_in_the_copy(tmp_path):
    """A tree copied file by file with a user's files in it (``rsync`` of the whole volume):
    in the copy the loader's names are the loader's, the user's files (at names the loader
    never made) stay exactly as they were; a name the loader removed in the copy is no longer
    its own there."""
    import shutil

    tree = _tree(tmp_path)
    planted = _plant(tree)
    copy = tmp_path / "staging" / "copied"
    shutil.copytree(tree, copy, symlinks=True)
    with fs.Dir.open(copy) as c:
        c.unlink("top.bin")
    (copy / "top.bin").write_text("mine now\n")
    planted["top.bin"] = _snapshot(copy)["top.bin"]
    _fresh_process()
    kept = _remove(copy)
    assert sorted(kept) == sorted(
        [
            copy / "notes.txt",
            copy / "top.bin",
            copy / "a" / "b" / "notes.txt",
            copy / "a" / "mine" / "data",
        ]
    )
    assert {r: v for r, v in _snapshot(copy).items() if r in planted} == planted
    assert not (copy / "a" / "b" / "w.bin").exists()


def test_a_record_naming_its_own_inode_is_no_copy(tmp_path):
    tree = _tree(tmp_path)
    (tree / "notes.txt").write_text("mine\n")
    # The record rewritten in place keeps its inode: still the tree's own record.
    data = (tree / fs.MADE).read_bytes()
    with open(tree / fs.MADE, "r+b") as f:
        f.write(data)
    assert _remove(tree) == [tree / "notes.txt"]


@pytest.mark.parametrize("kind", ["fifo", "link", "directory"])
def test_something_else_put_at_the_records_name_is_refused_naming_it(tmp_path, kind):
    """A FIFO, link or directory put in place of a tree's record while the loader works in
    the tree: the next create there is a NotOursError naming the record where the tree is
    (exit 2), nothing is written through it, and it stays."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t:
        (tree / fs.MADE).unlink()
        if kind == "fifo":
            os.mkfifo(tree / fs.MADE)
        elif kind == "link":
            (tmp_path / "elsewhere").write_text("")
            (tree / fs.MADE).symlink_to(tmp_path / "elsewhere")
        else:
            (tree / fs.MADE).mkdir()
        planted = _snapshot(tree)[fs.MADE]
        with pytest.raises(NotOursError) as failed:
            t.write("late.bin", b"late")
    assert failed.value.path == tree / fs.MADE
    assert _snapshot(tree)[fs.MADE] == planted and not (tree / "late.bin").exists()
    if kind == "link":
        assert (tmp_path / "elsewhere").read_text() == ""


def test_a_records_failure_names_it_where_the_tree_is_now(tmp_path):
    """A tree is made under a temporary name and renamed: a failure writing its record later
    (a FIFO put in its place) names the record at the tree's name, not at the temporary one,
    which is gone."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t, pytest.raises(NotOursError) as failed:
        (tree / fs.MADE).unlink()
        os.mkfifo(tree / fs.MADE)
        t.write("new.bin", b"new")
    assert failed.value.path == tree / fs.MADE


def test_a_record_line_nested_too_deeply_is_skipped(tmp_path):
    """A line nested deeper than the JSON parser's stack (``[[[[...``) appended to a tree's
    record is skipped like any garbled line, not a RecursionError (a traceback, exit 1)."""
    tree = _tree(tmp_path)
    planted = _plant(tree)
    with (tree / fs.MADE).open("ab") as record:
        record.write(b"[" * 100_000 + b"\n")
    _fresh_process()
    assert _remove(tree)
    assert {r: v for r, v in _snapshot(tree).items() if r in planted} == planted
    assert not (tree / "top.bin").exists()


def test_a_record_whose_first_line_names_a_users_file_as_marker_never_removes_it(tmp_path):
    """A record's first line rewritten to name a user's file in the tree as the marker: that
    names no marker (a marker's name starts with the loader's prefix), so the file is never
    taken for the marker, which the removal takes without looking at the record."""
    tree = _tree(tmp_path)
    planted = _plant(tree)
    data = (tree / fs.MADE).read_bytes().split(b"\n", 1)[1]
    with (tree / fs.MADE).open("r+b") as record:  # in place: the same inode
        record.write(fs.made_header("notes.txt")[:-1].ljust(len(fs.made_header(MARKER)) - 1))
        record.write(b"\n" + data)
    assert fs.parse_made(json.dumps({"marker": "notes.txt"}).encode())[0] is None
    _fresh_process()
    _remove(tree)
    assert {r: v for r, v in _snapshot(tree).items() if r in planted} == planted


def test_a_users_file_at_the_markers_name_stays_and_keeps_the_record(tmp_path):
    """The loader's marker replaced by someone else's file (the same first line): the
    record names another inode there, so that file stays, with the record (the tree is
    still marked by it, and never taken for one made before records)."""
    tree = _tree(tmp_path)
    (tmp_path / "theirs").write_bytes((tree / MARKER).read_bytes())
    (tmp_path / "theirs").replace(tree / MARKER)  # (another inode than the loader's had)
    users = _snapshot(tree)[MARKER]
    _fresh_process()
    assert _remove(tree) == [tree / MARKER]
    assert _snapshot(tree)[MARKER] == users and (tree / fs.MADE).is_file()
    assert sorted(_snapshot(tree)) == [fs.MADE, MARKER]
    _fresh_process()
    assert _remove(tree) == [tree / MARKER]  # and again: never removed whole
    assert _snapshot(tree)[MARKER] == users


def test_a_tree_whose_record_went_in_another_process_is_one_without_a_record(tmp_path):
    """A removal killed after the record went, before the marker did, leaves the marker
    alone in the tree: a process that had the tree's record open before (a long-lived one)
    takes it as one without a record, as a new process does, and removes it."""
    import shutil

    tree = _tree(tmp_path)
    for entry in tree.iterdir():  # what the killed removal took (another process)
        if entry.name != MARKER:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    assert _remove(tree) == []
    assert not tree.exists()


def test_a_half_made_directory_someone_fills_meanwhile_is_kept(tmp_path):
    """A file put into a half-made temporary directory while the next loader removes it: the
    directory stays (not a failure of the run, exit 1, for a directory not empty)."""
    with fs.Dir.open(tmp_path / "staging", create=True) as parent:
        with fs.inject(_stop_at("open", MARKER)), pytest.raises(Stopped):
            parent.make_marked("t", MARKER, KEY)
        (tmp,) = parent.names()
        dead = tmp.replace(f".{fs.owner()}.", ".999999999-" + fs.host_digest() + ".")
        os.rename(tmp_path / "staging" / tmp, tmp_path / "staging" / dead)
        _fresh_process()

        def fill(op: str, path: str) -> None:
            if op == "rmdir" and path.endswith(dead):
                (tmp_path / "staging" / dead / "notes.txt").write_text("mine\n")

        with fs.inject(fill):
            assert parent.unfinished_marked("t.", MARKER, KEY, idle_s=3600) == []
    assert (tmp_path / "staging" / dead / "notes.txt").read_text() == "mine\n"


def _half_made(staging: Path, stop) -> str:
    """A temporary directory ``make_marked`` left in ``staging`` when stopped at ``stop``, named
    as one of a process that is gone."""
    with fs.Dir.open(staging, create=True) as parent:
        with fs.inject(stop), pytest.raises(Stopped):
            parent.make_marked("t", MARKER, KEY)
        (tmp,) = parent.names()
    dead = tmp.replace(f".{fs.owner()}.", ".999999999-" + fs.host_digest() + ".")
    os.rename(staging / tmp, staging / dead)
    _fresh_process()
    return dead


@pytest.mark.parametrize("entry", [MARKER, fs.MADE])
def test_a_users_file_renamed_into_a_half_made_directory_at_any_step_is_kept(tmp_path, entry):
    """A loader stopped while it wrote a new tree's marker left a half-made temporary directory;
    the next one judges it by what its record and marker hold, and removes them: a user's file
    renamed to either name at any step after that look (the removal went by name) stays whole,
    and so does the directory holding it."""

    def unfinished(staging: Path) -> list[str]:
        with fs.Dir.open(staging) as parent:
            return parent.unfinished_marked("t.", MARKER, KEY, idle_s=3600)

    counted = tmp_path / "count"
    dead = _half_made(counted, _stop_at("write", MARKER))
    steps, found = picked_calls(lambda op, path: path, lambda: unfinished(counted))
    assert found == [] and not (counted / dead).exists()
    judged = next(i for i, call in enumerate(steps, 1) if call == f"read {counted / dead / entry}")
    for step in range(judged + 1, len(steps) + 1):
        staging = tmp_path / f"at-{step}"
        dead = _half_made(staging, _stop_at("write", MARKER))
        theirs = tmp_path / f"theirs-{step}"
        theirs.write_text("mine\n")

        def plant(_: str, at: Path = staging / dead / entry, theirs: Path = theirs) -> None:
            if at.parent.is_dir():
                os.rename(theirs, at)

        hook = AtStep(step, lambda op, path: path, plant)
        with fs.inject(hook):
            unfinished(staging)
        if theirs.exists():  # the directory was gone already: nothing was put into it
            continue
        assert (staging / dead / entry).read_text() == "mine\n", (step, steps[step - 1])


@pytest.mark.parametrize("at", [fs.MADE, f"{fs.MARKER_PREFIX}gone.999999999-0badcafe.0123456789ab"])
def test_a_users_copy_of_a_record_in_a_half_made_directory_keeps_it(tmp_path, at):
    """A half-made temporary directory is removed only if each file in it is what the loader
    writes there: its record naming itself (by its own inode) and the marker alone. A user's
    copy of another tree's record (its header, other inodes, other names) at the record's name
    or at a removal's fresh name keeps the directory whole (it was judged by its header and
    removed)."""
    staging = tmp_path / "staging"
    dead = _half_made(staging, _stop_at("write", MARKER))
    copy = fs.made_header(MARKER) + b'[123, "f", ".model-loader-made"]\n[456, "f", "notes.txt"]\n'
    (staging / dead / at).unlink(missing_ok=True)
    (staging / dead / at).write_bytes(copy)
    before = sorted(os.listdir(staging / dead))
    with fs.Dir.open(staging) as parent:
        assert parent.unfinished_marked("t.", MARKER, KEY, idle_s=3600) == []
    assert sorted(os.listdir(staging / dead)) == before
    assert (staging / dead / at).read_bytes() == copy


@pytest.mark.parametrize("how", ["make_marked", "mark_in_place"])
def test_a_users_file_renamed_over_a_new_record_whose_write_fails_is_kept(tmp_path, how):
    """A new tree's record (``make_marked``'s, or ``mark_in_place``'s temporary one in a
    fetch's DEST) whose write fails (the disk full) is removed again: only while it is the very
    file created. A user's file renamed to its name after the create stays whole (it was
    removed by name)."""
    top = tmp_path / "top"
    top.mkdir()
    theirs = tmp_path / "theirs"
    theirs.write_text("mine\n")
    at: list[str] = []

    def full(op: str, path: str) -> None:
        name = Path(path).name
        if op == "write" and (name == fs.MADE or name.startswith(f"{fs.MADE}.")) and not at:
            at.append(path)
            os.rename(theirs, path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    with fs.Dir.open(top) as d, fs.inject(full), pytest.raises(OSError) as info:
        if how == "make_marked":
            d.make_marked("t", MARKER, KEY)
        else:
            d.mark_in_place(MARKER, KEY)
    assert info.value.errno == errno.ENOSPC and at
    assert Path(at[0]).read_text() == "mine\n"


@pytest.mark.parametrize("entry", [MARKER, fs.MADE])
def test_a_half_made_directory_whose_removal_was_stopped_is_removed_by_the_next_loader(
    tmp_path, entry
):
    """A loader removing a half-made temporary directory was stopped after it moved the marker
    or the record aside to be removed: the next loader still removes the directory whole."""
    staging = tmp_path / "staging"
    dead = _half_made(staging, _stop_at("write", MARKER))
    with fs.Dir.open(staging) as parent:
        with fs.inject(_stop_moving(f"/{entry} -> ", after=True)), pytest.raises(Stopped):
            parent.unfinished_marked("t.", MARKER, KEY, idle_s=3600)
        assert any(n.startswith(f"{fs.MARKER_PREFIX}gone.") for n in os.listdir(staging / dead))
        _fresh_process()
        assert parent.unfinished_marked("t.", MARKER, KEY, idle_s=3600) == []
    assert os.listdir(staging) == []


def test_a_users_file_at_a_moved_aside_name_in_a_half_made_directory_keeps_it(tmp_path):
    """A half-made temporary directory holding, besides what a stopped ``make_marked`` wrote, a
    file at a name the loader moves its files aside to (``.model-loader-gone.*``) that holds
    neither a beginning of the record nor of the marker (a user's file of that name): it is
    not what a stopped removal leaves, and the directory stays whole with it."""
    staging = tmp_path / "staging"
    dead = _half_made(staging, _stop_at("write", MARKER))
    theirs = staging / dead / f"{fs.MARKER_PREFIX}gone.999999999-{fs.host_digest()}.{'0' * 12}"
    theirs.write_text("mine\n")
    with fs.Dir.open(staging) as parent:
        assert parent.unfinished_marked("t.", MARKER, KEY, idle_s=3600) == []
    assert theirs.read_text() == "mine\n"


@pytest.mark.parametrize("where", ["top", "below"])
def test_a_file_put_into_a_directory_while_it_is_removed_stays(tmp_path, where):
    """Someone puts a file into a directory of the tree just before the loader removes the
    emptied directory: the directory and the file stay (kept, named), the run goes on (the
    rmdir's ENOTEMPTY was a bug's exit 1)."""
    tree = _tree(tmp_path)
    target = tree if where == "top" else tree / "a" / "b"

    def fill(op: str, path: str) -> None:
        if op == "rmdir" and path == str(target):
            (target / "late.txt").write_text("mine\n")

    _fresh_process()
    with fs.inject(fill):
        kept = _remove(tree)
    assert (target / "late.txt").read_text() == "mine\n"
    assert target in kept


def test_a_record_grown_past_what_the_loader_reads_keeps_the_tree_never_fails(tmp_path, caplog):
    """A record someone made larger than any the loader writes (a read of it would be
    refused as too large) tells nothing: the tree is kept whole, with a warning, and no
    removal of it fails (a failure would stop every later run of its key, and all of prune)."""
    tree = _tree(tmp_path)
    planted = _plant(tree)
    with open(tree / fs.MADE, "r+b") as made:
        made.seek(0, os.SEEK_END)
        made.write(b"\n" + b"x" * (fs.SMALL_FILE_BYTES + 1))
    kept = _remove(tree)
    assert kept
    assert (tree / "top.bin").read_bytes() == b"top"
    assert (tree / "a" / "b" / "w.bin").read_bytes() == b"w" * 100
    assert {rel: v for rel, v in _snapshot(tree).items() if rel in planted} == planted
    assert "kept" in caplog.text
    assert _remove(tree)  # again: the same, no failure
