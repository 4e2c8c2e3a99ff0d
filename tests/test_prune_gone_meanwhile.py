"""What prune removes may be removed, or replaced, by someone else while it works: an old key
removed (``rm -rf``) at any call prune makes on it is only gone meanwhile (exit 0), and a
directory of the user's that prune moved aside and cannot put back is named, with where it is
(exit 2), never a traceback."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from tests.runs import forged_key

OLD = "m@r1/v"


def _two_keys(root: Path) -> None:
    forged_key(root, "m@r2/v", "2026-01-02T00:00:00Z")
    forged_key(root, OLD, "2026-01-01T00:00:00Z")


def _on_old(root: Path, path: str) -> bool:
    return path.split(" -> ")[0].startswith(str(root / "m@r1"))


@pytest.mark.parametrize("removed", ["m@r1/v", "m@r1"])
def test_an_old_key_removed_by_someone_else_at_any_step_is_gone_meanwhile(
    tmp_path: Path, capsys, removed: str
):
    counted = tmp_path / "count"
    _two_keys(counted)
    calls: list[str] = []
    with fs.inject(lambda op, path: calls.append(op) if _on_old(counted, path) else None):
        assert main(["prune", "--repository", str(counted), "--keep", "1"]) == 0
    assert calls
    for step in range(1, len(calls) + 1):
        root = tmp_path / f"at-{step}"
        _two_keys(root)
        seen: list[str] = []

        def rm(op: str, path: str, root: Path = root, seen=seen, step=step) -> None:
            if not _on_old(root, path) or not (root / removed).exists():
                return
            seen.append(op)
            if len(seen) == step:
                shutil.rmtree(root / removed)

        capsys.readouterr()
        with fs.inject(rm):
            code = main(["prune", "--repository", str(root), "--keep", "1"])
        err = capsys.readouterr().err
        assert code == 0, (step, calls[step - 1], err)
        assert not (root / OLD).exists()
        assert (root / "m@r2" / "v" / "manifest.json").is_file()


def test_a_users_directory_prune_moved_aside_and_cannot_put_back_is_named(tmp_path, capsys):
    """A user renames a directory of theirs to an old key just before prune moves the key into
    ``.trash``, and makes another directory at the key before prune puts theirs back: theirs
    stays whole where prune moved it, and prune stops with exit 2 saying where it is."""
    root = tmp_path / "models"
    _two_keys(root)
    key = root / OLD
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    seen = os.stat(mine)
    steps: list[str] = []

    def race(op: str, path: str) -> None:
        src = path.split(" -> ")[0]
        if " -> " in path and src == str(key) and not steps:
            steps.append(op)
            shutil.rmtree(key)
            mine.rename(key)
        elif " -> " in path and path.endswith(f" -> {key}") and len(steps) == 1:
            steps.append(op)
            key.mkdir()

    capsys.readouterr()
    with fs.inject(race):
        code = main(["prune", "--repository", str(root), "--keep", "1"])
    err = capsys.readouterr().err
    assert len(steps) == 2
    assert code == 2, err
    (moved,) = [p for p in (root / ".trash").iterdir() if p.stat().st_ino == seen.st_ino]
    assert str(moved) in err
    assert os.listdir(moved) == ["notes.txt"] and (moved / "notes.txt").read_text() == "mine"
    assert os.listdir(key) == []
