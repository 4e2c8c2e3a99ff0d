"""A directory of the user's renamed to the name of a tree the loader is removing, at any
moment after the loader looked: it is never emptied. ``remove_tree`` reads the record and the
marks from the very directory it empties (one descriptor), and ``prune`` puts back what its
rename into ``.trash`` moved when that is not the key it judged."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.errors import NotOursError
from loader.repository import manifest
from loader.repository.prune import prune
from tests.at_step import AtStep
from tests.runs import forged_key, published, run_argv

MARKER = fs.MARKER_PREFIX + "staging"


def _loader_tree(parent: Path, *, recorded: bool) -> Path:
    """A tree of the loader's at ``parent/tree``: marked with its record, or (``recorded``
    False) as a loader that kept no record made it (its marker only)."""
    tree = parent / "tree"
    if recorded:
        with fs.Dir.open(parent, create=True) as p:
            assert p.make_marked("tree", MARKER, "m@r/v")
            with p.sub("tree") as t:
                t.write("weights.bin", b"w" * 100)
                with t.makedirs(("sub",)) as s:
                    s.write("config.ini", b"[x]\n")
    else:
        (tree / "sub").mkdir(parents=True)
        (tree / MARKER).write_text("m@r/v\n")
        (tree / "weights.bin").write_bytes(b"w" * 100)
        (tree / "sub" / "config.ini").write_text("[x]\n")
    return tree


def _renamed_in(tree: Path) -> None:
    """The loader's tree moved away and a directory of the user's made at its name."""
    tree.rename(tree.with_name("tree.moved"))
    tree.mkdir()


def _calls(parent: Path, recorded: bool) -> int:
    _loader_tree(parent, recorded=recorded)
    seen: list[str] = []
    with fs.Dir.open(parent) as p, fs.inject(lambda op, path: seen.append(op)):
        assert p.remove_tree("tree", marks=(MARKER,)) == []
    assert not (parent / "tree").exists()
    return len(seen)


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "marker-only"])
def test_a_users_directory_renamed_to_the_trees_name_at_any_step_stays_whole(
    tmp_path: Path, recorded: bool
):
    steps = _calls(tmp_path / "count", recorded)
    for step in range(1, steps + 1):
        parent = tmp_path / f"at-{step}"
        tree = _loader_tree(parent, recorded=recorded)

        def swap(tree: Path) -> None:
            _renamed_in(tree)
            (tree / "notes.txt").write_text("mine")
            (tree / "sub").mkdir()
            (tree / "sub" / "data.csv").write_text("1,2\n")

        with fs.Dir.open(parent) as p, fs.inject(AtStep(step, lambda op, path, t=tree: t, swap)):
            p.remove_tree("tree", marks=(MARKER,))
        assert (tree / "notes.txt").read_text() == "mine", step
        assert (tree / "sub" / "data.csv").read_text() == "1,2\n", step


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "marker-only"])
def test_a_users_empty_directory_renamed_to_the_trees_name_at_any_step_stays(
    tmp_path: Path, recorded: bool
):
    """An empty directory (a mount point a user made) is what ``rmdir`` would remove at the
    tree's name: the tree emptied is removed only while it is still at its name (up to its
    last look at that name: a rename in the instant between that look and the ``rmdir``, the
    last two calls, is not told apart)."""
    steps = _calls(tmp_path / "count", recorded)
    for step in range(1, steps - 1):
        parent = tmp_path / f"at-{step}"
        tree = _loader_tree(parent, recorded=recorded)

        with (
            fs.Dir.open(parent) as p,
            fs.inject(AtStep(step, lambda op, path, t=tree: t, _renamed_in)),
        ):
            p.remove_tree("tree", marks=(MARKER,))
        assert tree.is_dir(), step


@pytest.mark.parametrize("kind", ["file", "link", "fifo"])
def test_a_users_entry_at_the_name_of_a_judged_tree_is_kept(tmp_path: Path, kind: str):
    """The loader judged a directory its own (``expected``: its device and inode), and a user
    put a file, a link or a FIFO at its name since: nothing is removed."""
    target = tmp_path / "elsewhere.txt"
    target.write_text("theirs")
    entry = tmp_path / "tree"
    if kind == "file":
        entry.write_text("theirs")
    elif kind == "link":
        entry.symlink_to(target)
    else:
        os.mkfifo(entry)
    with fs.Dir.open(tmp_path) as p:
        kept = p.remove_tree("tree", marks=(MARKER,), expected=(1, 2))
    assert kept == [entry]
    assert os.path.lexists(entry) and target.read_text() == "theirs"


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "no-renameat2"])
def test_prune_puts_back_a_users_directory_renamed_to_an_old_keys_name_as_it_moves_it(
    tmp_path: Path, fallback: bool
):
    """prune checked the old key under its lock; the user then moves the key away and puts a
    directory of theirs at its name, just before prune's rename into ``.trash``: that
    directory goes back to the key's name, whole, and the key is reported kept."""
    root = tmp_path / "models"
    forged_key(root, "m@r2/v", "2026-01-02T00:00:00Z")
    old = forged_key(root, "m@r1/v", "2026-01-01T00:00:00Z")
    done: list[bool] = []

    def swap(op: str, path: str) -> None:
        if fallback:
            _no_renameat2(op, path)
        if not done and op.startswith("rename") and path.split(" -> ")[0] == str(old):
            done.append(True)
            old.rename(old.with_name("v.moved"))
            old.mkdir()
            (old / "notes.txt").write_text("mine")

    with fs.inject(swap):
        report = prune(root, keep=1)
    assert done
    assert (old / "notes.txt").read_text() == "mine"
    assert not report.removed
    assert ("m@r1/v", "m@r1/v was replaced by another directory meanwhile") in report.kept
    assert not [p for p in (root / ".trash").iterdir()]
    assert (old.with_name("v.moved") / "manifest.json").is_file()
    assert os.listdir(old) == ["notes.txt"]


def _no_renameat2(op: str, path: str) -> None:
    if op in ("rename-exchange", "rename-noreplace"):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "no-renameat2"])
def test_a_users_directory_renamed_to_the_key_as_run_replaces_it_stays_at_the_key(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, fallback: bool
):
    """``run --force`` checked the published copy; the user then moves it away and puts a
    directory of theirs at the key's name, just before the replacement: that directory stays
    at the key, whole, and the run refuses (exit 2) instead of publishing over it."""
    root = tmp_path / "models"
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root)) == 0
    key = published(root)
    capsys.readouterr()
    done: list[bool] = []

    def swap(op: str, path: str) -> None:
        if not done and op.startswith("rename") and f" -> {key}" in path:
            done.append(True)
            key.rename(key.with_name("moved"))
            key.mkdir()
            (key / "notes.txt").write_text("mine")
        if fallback:
            _no_renameat2(op, path)

    with fs.inject(swap):
        code = main(run_argv(tiny_checkpoint_with_tokenizer, root, "--force"))
    assert done and code == 2
    assert "notes.txt" in os.listdir(key) and (key / "notes.txt").read_text() == "mine"
    assert os.listdir(key) == ["notes.txt"]
    assert not list((root / ".staging").iterdir())
    assert manifest.verify(key.with_name("moved")) == []


def _at_created(op: str, rel: str) -> bool:
    return True


def _at_converting(op: str, rel: str) -> bool:
    return op == "write" and rel.endswith(".bin")


def _at_building(op: str, rel: str) -> bool:
    return op == "mkdir" and rel.endswith("/preprocessing")


def _at_publishing(op: str, rel: str) -> bool:
    """The rename of the staging directory to the key (after the last look at it)."""
    return op.startswith("rename") and " -> " in rel and "/.staging/" not in rel


@pytest.mark.parametrize(
    "force",
    [False, "new-no-renameat2", True, "no-renameat2"],
    ids=["new", "new-no-renameat2", "force", "force-no-renameat2"],
)
@pytest.mark.parametrize("moment", [_at_created, _at_converting, _at_building, _at_publishing],
                         ids=["created", "converting", "building", "publishing"])  # fmt: skip
def test_a_users_directory_renamed_to_the_runs_staging_name_is_never_built_sealed_or_published(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, moment, force
):
    """While a run works, the user moves its staging directory away and renames a directory
    of theirs to its name: the run stops (exit 2) before it seals or publishes anything
    there; the user's directory keeps its files and their modes, and no key is published
    (with ``--force``: the published copy stays the one that was)."""
    root = tmp_path / "models"
    staging_dir = root / ".staging"
    before = None
    fallback = force == "new-no-renameat2"  # a new key published without renameat2
    force = False if fallback else force
    if force:
        assert main(run_argv(tiny_checkpoint_with_tokenizer, root)) == 0
        before = (published(root) / "manifest.json").read_bytes()

    def users_in_its_place(staging: Path) -> Path | None:
        if not staging.is_dir():  # (a look before it is made, without renameat2)
            return None
        staging.rename(tmp_path / "moved")
        return _users_directory_at(staging)

    at_moment = _OnceInStaging(staging_dir, moment, users_in_its_place)
    done = at_moment.done

    def swap(op: str, path: str) -> None:
        if force == "no-renameat2" and op == "rename-exchange":  # replaced through .trash
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        if fallback:
            _no_renameat2(op, path)
        at_moment(op, path)

    with fs.inject(swap):
        code = main(run_argv(tiny_checkpoint_with_tokenizer, root, *(["--force"] if force else [])))
    assert done and code == 2
    (staging,) = done
    assert sorted(os.listdir(staging)) == ["secret.txt"]
    assert (staging / "secret.txt").read_text() == "mine"
    assert (staging / "secret.txt").stat().st_mode & 0o777 == 0o600
    if force:
        assert (published(root) / "manifest.json").read_bytes() == before
        assert manifest.verify(published(root)) == []
    else:
        assert not list(root.glob("tiny@*/*"))
    capsys.readouterr()


class _OnceInStaging:
    """A hook of the seam: at the first call the run makes at ``moment`` below its staging
    directory (names starting with ``.`` left out), ``act`` is called once with that staging
    directory (the converter writes from several threads); ``act`` returns what it changed, kept
    in ``done``, or None to wait for a later call."""

    def __init__(self, staging_dir: Path, moment, act) -> None:
        self.staging_dir, self.moment, self.act = staging_dir, moment, act
        self.done: list[Path] = []
        self.once = threading.Lock()

    def __call__(self, op: str, path: str) -> None:
        if self.done or not path.startswith(f"{self.staging_dir}/"):
            return
        rel = path[len(f"{self.staging_dir}/") :]
        if rel.startswith(".") or not self.moment(op, rel):
            return
        with self.once:
            if not self.done:
                changed = self.act(self.staging_dir / rel.split(" -> ")[0].split("/")[0])
                if changed is not None:
                    self.done.append(changed)


def _users_directory_at(path: Path) -> Path:
    """A directory of the user's made at ``path``, holding a 0600 file of theirs."""
    path.mkdir()
    (path / "secret.txt").write_text("mine")
    (path / "secret.txt").chmod(0o600)
    return path


@pytest.mark.parametrize("force", [True, "no-renameat2"], ids=["force", "force-no-renameat2"])
def test_a_published_copy_the_failed_put_back_left_at_the_staging_name_is_never_removed(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, force
):
    """A directory of the user's renamed to the run's staging name in the instant before the
    replacement went to the key; the rename that puts it back fails: the run stops (exit 2)
    and removes nothing that is not the very staging directory it made: the previous copy
    (left at the staging name, or in ``.trash``) is kept whole, the user's directory too."""
    root = tmp_path / "models"
    staging_dir = root / ".staging"
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root)) == 0
    before = (published(root) / "manifest.json").read_bytes()
    capsys.readouterr()
    done: list[Path] = []

    def swap(op: str, path: str) -> None:
        if force == "no-renameat2" and op == "rename-exchange":
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        if done and op.startswith("rename"):  # every rename after the swap: the put-back
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        if done or not path.startswith(f"{staging_dir}/"):
            return
        rel = path[len(f"{staging_dir}/") :]
        if rel.startswith(".") or not _at_publishing(op, rel):
            return
        staging = staging_dir / rel.split(" -> ")[0].split("/")[0]
        staging.rename(tmp_path / "moved")
        staging.mkdir()
        (staging / "secret.txt").write_text("mine")
        done.append(staging)

    with fs.inject(swap):
        code = main(run_argv(tiny_checkpoint_with_tokenizer, root, "--force"))
    assert done and code == 2
    copies = [
        p for p in [*root.glob("tiny@*/*"), *staging_dir.iterdir(), *root.glob(".trash/*")]
        if (p / "manifest.json").is_file() and (p / "manifest.json").read_bytes() == before
    ]  # fmt: skip
    assert len(copies) == 1 and manifest.verify(copies[0]) == [], copies
    mine = [
        p for p in [*root.glob("tiny@*/*"), *staging_dir.iterdir()] if (p / "secret.txt").exists()
    ]
    assert len(mine) == 1 and os.listdir(mine[0]) == ["secret.txt"]
    err = capsys.readouterr().err
    assert "putting it back failed" in err and f"previous copy of the key is at {copies[0]}" in err
    # The next run finds the user's directory at the key: it refuses, and removes neither.
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root, "--force")) == 2
    assert manifest.verify(copies[0]) == [] and os.listdir(mine[0]) == ["secret.txt"]
    prune(root, keep=1)  # (nor does prune)
    assert manifest.verify(copies[0]) == [] and os.listdir(mine[0]) == ["secret.txt"]


@pytest.mark.parametrize("moment", [_at_converting, _at_building], ids=["converting", "building"])
def test_the_runs_staging_directory_removed_while_it_works_is_a_transient_failure(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, moment
):
    """Someone removes the run's staging directory (``rm -rf``) while the run converts or
    builds, and makes a directory of theirs at its name: the run stops with exit 75 naming
    the directory removed (the record it appends to is gone with it; exit 2 when a thread
    finds the record gone while the directory is still there), never a traceback (exit 1); the new directory stays as it is, and nothing is published."""
    root = tmp_path / "models"
    staging_dir = root / ".staging"

    def users_in_its_place(staging: Path) -> Path:
        for _ in range(100):  # as `rm -rf` again: the converter's threads may add a file
            shutil.rmtree(staging, ignore_errors=True)  # while it empties a directory
            if not staging.exists():
                break
        return _users_directory_at(staging)

    remove = _OnceInStaging(staging_dir, moment, users_in_its_place)
    done = remove.done
    with fs.inject(remove):
        code = main(run_argv(tiny_checkpoint_with_tokenizer, root))
    err = capsys.readouterr().err
    # (another converting thread may find the record gone before the directory: exit 2)
    assert done and code in (75, 2), err
    (staging,) = done
    assert "was removed (or replaced) by another process" in err or "no file" in err
    assert str(staging) in err
    assert os.listdir(staging) == ["secret.txt"]
    assert (staging / "secret.txt").stat().st_mode & 0o777 == 0o600
    assert not list(root.glob("tiny@*/*"))


def test_the_record_of_the_runs_staging_directory_removed_while_it_works_is_refused(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys
):
    """Someone removes only the record of the run's staging directory while it converts: the
    run stops with exit 2 naming the record, never a traceback, and publishes nothing."""
    root = tmp_path / "models"
    staging_dir = root / ".staging"

    def remove_its_record(staging: Path) -> Path:
        (staging / fs.MADE).unlink()
        return staging / fs.MADE

    remove = _OnceInStaging(staging_dir, _at_converting, remove_its_record)
    done = remove.done
    with fs.inject(remove):
        code = main(run_argv(tiny_checkpoint_with_tokenizer, root))
    err = capsys.readouterr().err
    assert done and code == 2, err
    assert f"{done[0]} is no file" in err or str(done[0]) in err
    assert not list(root.glob("tiny@*/*"))


def test_the_runs_staging_directory_emptied_and_filled_by_someone_else_is_never_sealed(
    tmp_path: Path,
):
    """Someone empties the run's staging directory (its record with it) and puts files of
    theirs in it: the same directory, device and inode, but no longer the loader's: it is
    refused before the build, the seal and the rename, and their file keeps its mode."""
    from loader.repository import publish

    root = tmp_path / "models"
    staging = publish.new_staging_dir(root, "m@r/v")
    made = publish.identity(staging)
    for entry in staging.iterdir():
        entry.unlink()
    (staging / "secret.txt").write_text("mine")
    (staging / "secret.txt").chmod(0o600)
    with pytest.raises(NotOursError):
        publish.check_staging(staging, made)
    with pytest.raises(NotOursError):
        publish.seal(staging, made)
    with pytest.raises(NotOursError):
        publish.publish(staging, root, "m@r/v", expected=made)
    assert os.listdir(staging) == ["secret.txt"]
    assert (staging / "secret.txt").stat().st_mode & 0o777 == 0o600
    assert not (root / "m@r").exists() or not os.listdir(root / "m@r")
