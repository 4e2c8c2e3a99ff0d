"""``fs.pinned``: a directory the loader made, entered by its path (the run's staging directory
while it converts and builds), is entered only while it is that very directory: one renamed to
its path, or its parent swapped for another holding a directory of that name, is refused
(exit 2), and one removed is the transient error of a directory removed while the loader worked
(exit 75); entered from a confined tree or by the path as given alike."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

from loader import fs
from loader.errors import DirectoryRemovedError, NotOursError


def _made(path: Path) -> tuple[int, int]:
    path.mkdir(parents=True)
    found = os.stat(path)
    return found.st_dev, found.st_ino


def _users(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "secret.txt").write_text("mine")


def _entered(path: Path) -> list[type[BaseException] | None]:
    """What entering ``path`` raises: by :meth:`Dir.open`, and by :meth:`Dir.sub` from its
    parent."""

    def by_sub() -> None:
        with fs.Dir.open(path.parent) as parent:
            parent.sub(path.name).close()

    results: list[type[BaseException] | None] = []
    for enter in (lambda: fs.Dir.open(path).close(), by_sub):
        try:
            enter()
        except (NotOursError, FileNotFoundError) as exc:
            results.append(type(exc))
        else:
            results.append(None)
    return results


@pytest.mark.parametrize("confined", [False, True], ids=["as-given", "confined"])
@pytest.mark.parametrize("swap", ["renamed-over", "parent-swapped", "removed", "removed-only"])
def test_a_pinned_directory_is_entered_only_while_it_is_the_one_made(tmp_path, confined, swap):
    made = tmp_path / ".staging" / "k.1-h.0123456789ab"
    identity = _made(made)
    zone = fs.confined(tmp_path) if confined else contextlib.nullcontext()
    with zone, fs.pinned(made, identity):
        assert _entered(made) == [None, None]
        if swap == "renamed-over":
            made.rename(tmp_path / "aside")
            _users(made)
        elif swap == "parent-swapped":
            made.parent.rename(tmp_path / ".staging-aside")
            _users(made)
        else:
            shutil.rmtree(made)
            if swap == "removed":
                _users(made)
        expected = DirectoryRemovedError if swap.startswith("removed") else NotOursError
        assert _entered(made) == [expected, expected]
        assert swap == "removed-only" or os.listdir(made) == ["secret.txt"]
    if swap != "removed-only":
        assert _entered(made) == [None, None]  # no longer pinned once the block ends


def test_the_pinned_directory_moved_into_a_new_parent_is_still_the_one_made(tmp_path):
    """The parent swapped, the directory itself moved into the new one: it is the directory the
    loader made, and entered."""
    made = tmp_path / ".staging" / "k.1-h.0123456789ab"
    identity = _made(made)
    with fs.confined(tmp_path), fs.pinned(made, identity):
        made.parent.rename(tmp_path / ".staging-aside")
        made.parent.mkdir()
        (tmp_path / ".staging-aside" / made.name).rename(made)
        assert _entered(made) == [None, None]


def test_pinning_a_directory_removed_since_it_was_made_is_a_removed_directory(tmp_path):
    made = tmp_path / ".staging" / "k.1-h.0123456789ab"
    identity = _made(made)
    shutil.rmtree(made)
    with fs.confined(tmp_path), pytest.raises(DirectoryRemovedError), fs.pinned(made, identity):
        pass


@pytest.mark.parametrize("at", ["rename-noreplace", "open"])
def test_a_staging_directory_removed_as_it_is_published_is_a_removed_directory(tmp_path, at):
    """Removed between the last look at it and its rename to the key (or as the check before
    the rename enters it): the removed directory's error, and nothing at the key."""
    from loader.repository import publish

    root = tmp_path / "models"
    key = "m@r1/v"
    staging = publish.new_staging_dir(root, key)
    made = publish.identity(staging)
    sealed: list[str] = []

    def remove(op: str, path: str) -> None:
        if op == "mkdir" and path == str(root / "m@r1"):
            sealed.append(op)  # the key's directory made: the publish's own steps follow
        elif sealed and op == at and path.startswith(str(staging)) and staging.exists():
            shutil.rmtree(staging)

    with fs.confined(root), fs.inject(remove), pytest.raises(DirectoryRemovedError):
        publish.publish(staging, root, key, expected=made)
    assert sealed and not (root / key).exists()
