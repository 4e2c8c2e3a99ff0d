"""A directory of the user's renamed to the run's staging name at any look the run takes at
that name after it made it: nothing is ever written into it, its mode is never changed, and
nothing is published (the build and the seal work in the very directory the run made, opened
once and checked to be it)."""

from __future__ import annotations

import os
from pathlib import Path

from loader import fs
from loader.cli import main
from tests.at_step import AtStep, picked_calls
from tests.runs import run_argv
from tests.tiers import quartered


def _at_top(staging_dir: Path, path: str) -> str | None:
    """The staging directory's name when ``path`` (a seam call's) is the directory itself."""
    prefix = f"{staging_dir}/"
    if not path.startswith(prefix):
        return None
    rel = path[len(prefix) :]
    return None if rel.startswith(".") or "/" in rel or " -> " in rel else rel


def _users_private_directory(path: Path) -> None:
    path.mkdir()
    (path / "secret.txt").write_text("mine")
    (path / "secret.txt").chmod(0o600)
    path.chmod(0o700)


def test_a_users_directory_renamed_to_the_staging_name_at_any_look_is_never_written_or_sealed(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys
):
    def staging_name_in(root: Path):
        return lambda op, path: _at_top(root / ".staging", path)

    counted = tmp_path / "count"
    looks, code = picked_calls(
        staging_name_in(counted), lambda: main(run_argv(tiny_checkpoint_with_tokenizer, counted))
    )
    assert code == 0
    assert looks
    capsys.readouterr()
    for step in quartered(range(1, len(looks) + 1)):
        root = tmp_path / f"at-{step}"

        def swap(name: str, root: Path = root, step: int = step) -> None:
            (root / ".staging" / name).rename(root.parent / f"moved-{step}")
            _users_private_directory(root / ".staging" / name)

        hook = AtStep(step, staging_name_in(root), swap)
        with fs.inject(hook):
            code = main(run_argv(tiny_checkpoint_with_tokenizer, root))
        err = capsys.readouterr().err
        assert hook.done, step
        mine = root / ".staging" / hook.done[0]
        assert code == 2, (step, looks[step - 1], err)
        assert os.listdir(mine) == ["secret.txt"], (step, looks[step - 1])
        assert mine.stat().st_mode & 0o777 == 0o700, (step, looks[step - 1])
        assert (mine / "secret.txt").stat().st_mode & 0o777 == 0o600
        assert (mine / "secret.txt").read_text() == "mine"
        assert not list(root.glob("tiny@*/*")), step
