"""Putting a replaced copy back from ``.trash`` (``recover``) under an absent key: a user's
entry named like a copy there is skipped, never entered, moved or refused over, and a directory
the user makes at the key while the copy is checked is never replaced by the put-back."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.repository import manifest
from loader.repository.key import key_filename
from tests.runs import published, run_argv


def _replaced_copy_waiting(source: Path, root: Path) -> tuple[Path, Path]:
    """A key published from ``source``, then moved into ``.trash`` as a replacement stopped
    between its two renames leaves it: the key's path and the copy's."""
    assert main(run_argv(source, root)) == 0
    key = published(root)
    keyfile = key_filename(key.relative_to(root).as_posix())
    (root / ".trash").mkdir(exist_ok=True)
    copy = root / ".trash" / f"{keyfile}.0123456789ab"
    key.rename(copy)
    return key, copy


def _users_entry(at: Path, kind: str, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(exist_ok=True)
    (mine / "notes.txt").write_text("mine")
    if kind == "file":
        at.write_text("mine")
        at.chmod(0o600)
    elif kind == "link":
        at.symlink_to(mine)
    else:  # a directory whose manifest is a link to a file of the user's
        at.mkdir()
        (at / "manifest.json").symlink_to(mine / "notes.txt")


@pytest.mark.parametrize("copy", [True, False], ids=["with-a-copy", "no-copy"])
@pytest.mark.parametrize("kind", ["file", "link", "manifest-link"])
def test_a_users_entry_named_like_a_replaced_copy_is_skipped(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, kind: str, copy: bool
):
    root = tmp_path / "models"
    key, previous = _replaced_copy_waiting(tiny_checkpoint_with_tokenizer, root)
    if not copy:
        shutil.rmtree(previous)
    before = None if not copy else (previous / "manifest.json").read_bytes()
    entry = previous.with_name(previous.name.rsplit(".", 1)[0] + ".-mine")  # sorts first
    _users_entry(entry, kind, tmp_path)
    seen = os.lstat(entry)
    capsys.readouterr()
    code = main(run_argv(tiny_checkpoint_with_tokenizer, root))
    err = capsys.readouterr().err
    assert code == 0, err
    assert manifest.verify(key) == []
    if before is not None:  # the copy went back: nothing was converted again
        assert (key / "manifest.json").read_bytes() == before
    now = os.lstat(entry)
    assert (now.st_ino, now.st_mode, now.st_mtime_ns) == (
        seen.st_ino,
        seen.st_mode,
        seen.st_mtime_ns,
    )
    if kind == "file":
        assert entry.read_text() == "mine"
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "no-renameat2"])
def test_a_directory_made_at_the_key_while_the_copy_is_checked_is_never_replaced(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, fallback: bool
):
    """The key is absent, a replaced copy waits in ``.trash``; while the loader checks that
    copy, the user makes an (empty) directory at the key: the put-back never replaces it (a
    ``rename(2)`` would, silently; without ``renameat2`` the put-back looks first); it stays,
    and so does the copy."""
    root = tmp_path / "models"
    key, previous = _replaced_copy_waiting(tiny_checkpoint_with_tokenizer, root)
    made: list[os.stat_result] = []

    def make_at_key(op: str, path: str) -> None:
        if fallback and op in ("rename-exchange", "rename-noreplace"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        if not made and path.startswith(f"{previous}/"):
            key.mkdir()
            key.chmod(0o700)
            made.append(os.stat(key))

    capsys.readouterr()
    with fs.inject(make_at_key):
        code = main(run_argv(tiny_checkpoint_with_tokenizer, root))
    err = capsys.readouterr().err
    assert made
    now = os.lstat(key)
    assert (now.st_ino, now.st_mode) == (made[0].st_ino, made[0].st_mode), err
    assert os.listdir(key) == []
    assert code == 2, err
    assert manifest.verify(previous) == []


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "no-renameat2"])
@pytest.mark.parametrize("kind", ["directory", "link"])
def test_what_is_renamed_to_the_copys_name_after_it_was_checked_never_goes_to_the_key(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, fallback: bool, kind: str
):
    """The key is absent, a replaced copy waits in ``.trash``; after the loader checked that
    copy and before its put-back, the user moves it away and puts a directory (or a link) of
    theirs at its name: the put-back never moves theirs to the key (Triton would load it as
    the key); it goes back to its name untouched, and the run publishes a fresh copy."""
    root = tmp_path / "models"
    key, previous = _replaced_copy_waiting(tiny_checkpoint_with_tokenizer, root)
    swapped: list[os.stat_result] = []

    def swap(op: str, path: str) -> None:
        if fallback and op in ("rename-exchange", "rename-noreplace"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        if swapped or not path.startswith(f"{previous} -> "):
            return
        previous.rename(tmp_path / "moved")
        if kind == "directory":
            previous.mkdir()
            (previous / "notes.txt").write_text("mine")
            previous.chmod(0o700)
        else:
            previous.symlink_to(tmp_path / "moved")
        swapped.append(os.lstat(previous))

    capsys.readouterr()
    with fs.inject(swap):
        code = main(run_argv(tiny_checkpoint_with_tokenizer, root))
    err = capsys.readouterr().err
    assert swapped
    now = os.lstat(previous)
    assert (now.st_ino, now.st_mode) == (swapped[0].st_ino, swapped[0].st_mode), err
    if kind == "directory":
        assert os.listdir(previous) == ["notes.txt"]
        assert (previous / "notes.txt").read_text() == "mine"
    assert code == 0, err
    assert not key.is_symlink() and manifest.verify(key) == []


def test_a_copy_removed_by_someone_else_after_it_was_checked_is_only_gone(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys
):
    """The copy the loader checked is removed (``rm -rf``) before its put-back: nothing is put
    back, and the run publishes a fresh copy (exit 0), not a traceback (exit 1)."""
    root = tmp_path / "models"
    key, previous = _replaced_copy_waiting(tiny_checkpoint_with_tokenizer, root)
    removed: list[str] = []

    def remove(op: str, path: str) -> None:
        if not removed and path.startswith(f"{previous} -> "):
            shutil.rmtree(previous)
            removed.append(op)

    capsys.readouterr()
    with fs.inject(remove):
        code = main(run_argv(tiny_checkpoint_with_tokenizer, root))
    err = capsys.readouterr().err
    assert removed
    assert code == 0, err
    assert manifest.verify(key) == []


@pytest.mark.parametrize("case", ["made-by-recover", "there-before", "users-file-put-into-it"])
def test_a_put_back_that_fails_leaves_no_key_directory_it_made(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, case: str
):
    """The put-back of a replaced copy fails (an I/O error): the key's directory recover made
    for it is removed again (an empty ``<name>@<rev>`` was left behind); one that was there
    before stays, and so does one a user put a file into meanwhile; the copy stays in
    ``.trash``."""
    from loader.repository.publish import recover

    root = tmp_path / "models"
    key, previous = _replaced_copy_waiting(tiny_checkpoint_with_tokenizer, root)
    if case != "there-before":
        key.parent.rmdir()

    def fail(op: str, path: str) -> None:
        if path.startswith(f"{previous} -> "):
            if case == "users-file-put-into-it":
                (key.parent / "notes.txt").write_text("mine")
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    with fs.inject(fail), pytest.raises(OSError) as raised:
        recover(root, key.relative_to(root).as_posix())
    assert raised.value.errno == errno.EIO
    assert key.parent.is_dir() == (case != "made-by-recover")
    if case == "users-file-put-into-it":
        assert os.listdir(key.parent) == ["notes.txt"]
    assert manifest.verify(previous) == []
