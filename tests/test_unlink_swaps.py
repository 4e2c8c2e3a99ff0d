"""A file the loader judged its own in a marked tree is removed only while it is that very
file: a user's file renamed to its name after the look (at any call up to the removal) stays,
whatever else of the tree goes; so does the mark of a tree that stays. (Not covered: the last
mark of a tree removed whole, removed by name right after a last look, and the fresh name a
file is moved to.) A user's file moved aside in the loader's place goes back without replacing
anything. A removal stopped after the file moved aside, or a replace right after its exchange,
leaves a file the next loader still knows as its own."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from loader import fs
from loader.errors import NotOursError

MARKER = fs.MARKER_PREFIX + "staging"
MINE = "the user's\n"


@pytest.fixture(autouse=True)
def _confined(tmp_path):
    with fs.confined(tmp_path):
        yield


def _tree(base: Path) -> Path:
    """``base/staging/t``: a marked tree the loader filled, and a user's file beside it."""
    with fs.Dir.open(base / "staging", create=True) as parent:
        assert parent.make_marked("t", MARKER, "m@r/v")
        with parent.sub("t") as t:
            t.write("top.bin", b"top")
            with t.makedirs(("a",)) as a:
                a.write("w.bin", b"w")
    (base / "users.txt").write_text(MINE)
    return base / "staging" / "t"


def _names(tree: Path) -> set[Path]:
    return {p for p in tree.rglob("*") if p.is_file()}


def _kept_anywhere(base: Path) -> bool:
    return any(p.is_file() and p.read_text() == MINE for p in base.rglob("*"))


class _RenameOver:
    """At the ``step``-th call of the seam, if it names a file the tree held before the
    removal began, rename the user's file onto it (as someone may at any moment)."""

    def __init__(self, base: Path, step: int, names: set[Path]) -> None:
        self.base, self.step, self.names, self.calls = base, step, names, 0
        self.at: Path | None = None

    def __call__(self, op: str, path: str) -> None:
        self.calls += 1
        if self.calls - 1 != self.step or self.at is not None:
            return
        target = Path(path.split(" -> ")[0])
        if op == "unlink" and target.name == MARKER:
            return  # the tree's last mark goes by name right after a last look (see fs)
        if target in self.names and target.is_file():
            os.rename(self.base / "users.txt", target)
            self.at = target


def _remove_tree(base: Path) -> None:
    with fs.Dir.open(base / "staging") as parent:
        parent.remove_tree("t", marks=(MARKER,))


def _unlink(base: Path) -> None:
    with fs.Dir.open(base / "staging" / "t") as t:
        t.unlink("top.bin", missing_ok=True)
        with t.sub("a") as a:
            a.unlink("w.bin", missing_ok=True)


@pytest.mark.parametrize("remove", [_remove_tree, _unlink], ids=["remove_tree", "unlink"])
def test_a_users_file_renamed_onto_a_judged_files_name_at_any_step_stays(tmp_path, remove):
    counted: list[str] = []
    _tree(tmp_path / "count")
    with fs.inject(lambda op, path: counted.append(op)):
        remove(tmp_path / "count")
    met = 0
    for step in range(len(counted)):
        base = tmp_path / f"at-{step}"
        tree = _tree(base)
        hook = _RenameOver(base, step, _names(tree) - {tree / fs.MADE})
        with fs.inject(hook):
            remove(base)
        if hook.at is None:
            continue
        met += 1
        assert _kept_anywhere(base), f"the user's file renamed to {hook.at} at call {step} went"
        assert hook.at.read_text() == MINE, f"not put back at {hook.at} (call {step})"
    assert met >= 4, met


class Stopped(BaseException):
    """The loader stopped at a call (as a kill would: nothing after it runs)."""


def test_a_removal_stopped_after_moving_a_file_aside_leaves_it_the_loaders(tmp_path):
    tree = _tree(tmp_path)
    moved: list[str] = []

    def hook(op: str, path: str) -> None:
        if moved or (op.startswith("rename") and "/top.bin -> " in path):
            moved.append(path)
            if len(moved) > 1:  # the file is aside now: stopped before it is removed
                raise Stopped(path)

    with fs.Dir.open(tree) as t, fs.inject(hook), pytest.raises(Stopped):
        t.unlink("top.bin")
    assert not (tree / "top.bin").exists() and len(_names(tree)) == 4  # aside, w, record, mark
    fs._made_trees.clear()  # the next loader reads the record anew
    with fs.Dir.open(tree.parent) as parent:
        assert parent.remove_tree("t", marks=(MARKER,)) == []
    assert not tree.exists()


@pytest.mark.parametrize("before", ["nothing", "the loaders file"])
@pytest.mark.parametrize(
    "at", ["stat", "open", "rename"], ids=["at-look", "after-look", "at-rename"]
)
def test_a_users_file_renamed_to_the_name_a_file_is_renamed_onto_is_never_replaced(
    tmp_path, before, at
):
    """A file of the loader's renamed over a name (a finished download, an output written
    under a temporary name): a user's file renamed to that name after the loader looked stays,
    and the rename is refused naming it; the loader's file it meant to replace goes."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t:
        t.write("partial", b"new")
        if before != "nothing":
            t.write("out", b"old")
        looked = []

        def hook(op: str, path: str) -> None:
            if path.endswith("/out") and op == "stat":
                looked.append(path)  # the loader's look at the name it renames onto
            if looked and op.startswith(at) and (tmp_path / "users.txt").exists():
                os.rename(tmp_path / "users.txt", tree / "out")

        with fs.inject(hook), pytest.raises((FileExistsError, NotOursError)) as info:
            t.rename("partial", t, "out", how="replace")
    assert "out" in str(info.value)
    assert (tree / "out").read_text() == MINE
    assert (tree / "partial").read_bytes() == b"new"
    assert {p.name for p in tree.iterdir()} == {"out", "partial", "a", "top.bin", fs.MADE, MARKER}


def test_a_file_renamed_onto_the_loaders_own_replaces_it(tmp_path):
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t:
        t.write("partial", b"new")
        t.rename("partial", t, "top.bin", how="replace")
        t.write("partial", b"newer")
        t.rename("partial", t, "top.bin", how="replace")
    assert (tree / "top.bin").read_bytes() == b"newer"
    assert {p.name for p in tree.iterdir()} == {"a", "top.bin", fs.MADE, MARKER}
    with fs.Dir.open(tree.parent) as parent:
        assert parent.remove_tree("t", marks=(MARKER,)) == []


def test_another_loaders_file_placed_at_the_name_after_the_look_is_replaced_in_turn(tmp_path):
    """Two loaders place the same file (fetches into one DEST): the other's, renamed onto the
    name between this one's look and its exchange, is the loader's too. This one's file
    replaces it in turn (it was swapped back and refused as a user's, exit 2); the other's
    goes, nothing else does."""
    tree = _tree(tmp_path)
    with fs.Dir.open(tree) as t:
        for name, data in (("partial", b"this one's"), ("others", b"the other's")):
            t.write(name, data)
    placed: list[str] = []

    def hook(op: str, path: str) -> None:
        exchange = op == "rename-exchange" and path.endswith(f"/partial -> {tree / 'top.bin'}")
        if exchange and not placed:
            placed.append(path)
            with fs.Dir.open(tree) as other:
                other.rename("others", other, "top.bin", how="replace")

    with fs.Dir.open(tree) as t, fs.inject(hook):
        t.rename("partial", t, "top.bin", how="replace")
    assert placed and (tree / "top.bin").read_bytes() == b"this one's"
    assert {p.name for p in tree.iterdir()} == {"a", "top.bin", fs.MADE, MARKER}
    assert (tmp_path / "users.txt").read_text() == MINE


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "no-renameat2"])
def test_a_users_file_moved_aside_in_the_loaders_place_never_replaces_a_newer_one(
    tmp_path, fallback
):
    """A user's file renamed onto the loader's file's name as it is moved aside is what moved:
    it goes back, without replacing anything (also where ``renameat2`` is missing). A second
    file of the user's put at the name by then stays there, and the first is left at the fresh
    name (with a warning): neither goes."""
    tree = _tree(tmp_path)
    (tmp_path / "second.txt").write_text("the user's second\n")

    def hook(op: str, path: str) -> None:
        src, _, dst = path.partition(" -> ")
        if not op.startswith("rename"):
            return
        if src == str(tree / "top.bin") and (tmp_path / "users.txt").exists():
            os.rename(tmp_path / "users.txt", tree / "top.bin")  # the user's goes aside
        elif dst == str(tree / "top.bin") and (tmp_path / "second.txt").exists():
            os.rename(tmp_path / "second.txt", tree / "top.bin")  # before it comes back
        if fallback and op in ("rename-exchange", "rename-noreplace"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)

    with fs.Dir.open(tree) as t, fs.inject(hook):
        t.unlink("top.bin")
    assert not (tmp_path / "users.txt").exists() and not (tmp_path / "second.txt").exists()
    assert (tree / "top.bin").read_text() == "the user's second\n"
    assert _kept_anywhere(tmp_path), "the user's file moved aside was replaced"


def test_a_replace_stopped_right_after_its_exchange_leaves_the_old_file_the_loaders(tmp_path):
    """The loader's file a rename replaces in a marked tree is swapped out to the renamed
    file's name in one exchange, then removed: a loader stopped between the two leaves it
    there, recorded as its own, and the next loader removes it with the tree."""
    tree = _tree(tmp_path)
    swapped: list[str] = []

    def hook(op: str, path: str) -> None:
        if swapped:
            raise Stopped(path)  # the exchange is done: nothing after it runs
        if op == "rename-exchange" and path.endswith("/partial -> " + str(tree / "top.bin")):
            swapped.append(path)

    with fs.Dir.open(tree) as t:
        t.write("partial", b"new")
        with fs.inject(hook), pytest.raises(Stopped):
            t.rename("partial", t, "top.bin", how="replace")
    assert (tree / "top.bin").read_bytes() == b"new" and (tree / "partial").read_bytes() == b"top"
    fs._made_trees.clear()  # the next loader reads the record anew
    with fs.Dir.open(tree.parent) as parent:
        assert parent.remove_tree("t", marks=(MARKER,)) == []
    assert not tree.exists()


@pytest.mark.parametrize("missing_ok", [True, False])
def test_a_judged_file_removed_by_someone_else_before_it_moves_aside_is_missing(
    tmp_path, missing_ok
):
    """The loader's file went (another's removal) between the look and its move aside: with
    ``missing_ok`` nothing is said; without, it is missing (FileNotFoundError), as where
    nothing was at the look."""
    tree = _tree(tmp_path)

    def hook(op: str, path: str) -> None:
        if op.startswith("rename") and path.startswith(str(tree / "top.bin") + " -> "):
            (tree / "top.bin").unlink(missing_ok=True)

    with fs.Dir.open(tree) as t, fs.inject(hook):
        if missing_ok:
            t.unlink("top.bin", missing_ok=True)
        else:
            with pytest.raises(FileNotFoundError):
                t.unlink("top.bin")
    assert not (tree / "top.bin").exists()


def test_a_users_file_renamed_onto_the_mark_of_a_tree_that_stays_is_kept(tmp_path):
    """A tree holding a user's file stays (that file kept), and its mark goes first, removed
    only while it is the very file judged: a user's file renamed onto the mark's name after
    the last look stays. (Where nothing is kept, the mark goes last, by name: see fs.)"""
    tree = _tree(tmp_path)
    (tree / "notes.txt").write_text("the user's notes\n")

    def hook(op: str, path: str) -> None:
        at_mark = op != "stat" and path.split(" -> ")[0] == str(tree / MARKER)
        if at_mark and (tmp_path / "users.txt").exists():
            os.rename(tmp_path / "users.txt", tree / MARKER)

    with fs.Dir.open(tree.parent) as parent, fs.inject(hook):
        kept = parent.remove_tree("t", marks=(MARKER,))
    assert tree / "notes.txt" in kept
    assert (tree / MARKER).read_text() == MINE, "the user's file at the mark's name went"
