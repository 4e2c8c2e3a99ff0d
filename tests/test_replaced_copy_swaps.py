"""``run --force``: the previous copy, exchanged to the staging name, is removed only while it
is the very directory judged the previous copy: a directory of the user's renamed there at any
step after the exchange is kept whole."""

from __future__ import annotations

import os
from pathlib import Path

from loader import fs
from loader.cli import main
from loader.repository import manifest
from tests.runs import published, run_argv
from tests.tiers import quartered


def _users_directory(at: Path) -> None:
    at.mkdir()
    (at / "manifest.json").write_text('{"name": "my-app", "files": []}')
    (at / "notes.txt").write_text("mine")


def test_a_users_directory_renamed_to_the_staging_name_as_the_replaced_copy_goes_is_kept(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys
):
    """``run --force`` exchanged its new copy with the published one and judged the one now at
    the staging name the previous copy; the user then moves that away and renames a directory
    of theirs (holding a ``manifest.json``) to the staging name, at any step before it is
    removed: that directory is kept whole."""

    def after_exchange(root: Path, act) -> int:
        exchanged: list[str] = []

        def hook(op: str, path: str) -> None:
            if op == "rename-exchange":
                exchanged.append(path.split(" -> ")[0])
            elif exchanged and path == exchanged[0]:
                act(op, Path(path))

        with fs.inject(hook):
            return main(run_argv(tiny_checkpoint_with_tokenizer, root, "--force"))

    counted = tmp_path / "count"
    assert main(run_argv(tiny_checkpoint_with_tokenizer, counted)) == 0
    steps: list[str] = []
    assert after_exchange(counted, lambda op, path: steps.append(op)) == 0
    assert steps
    for step in quartered(range(1, len(steps) + 1)):
        root = tmp_path / f"at-{step}"
        assert main(run_argv(tiny_checkpoint_with_tokenizer, root)) == 0
        calls: list[str] = []
        done: list[Path] = []

        def swap(op: str, path: Path, calls=calls, done=done, step=step) -> None:
            calls.append(op)
            if len(calls) == step and path.is_dir():
                path.rename(path.parent.parent.parent / f"moved-{step}")
                _users_directory(path)
                done.append(path)

        code = after_exchange(root, swap)
        # Judged before the swap: the new copy stays published. Swapped before the judgment:
        # the directory found is not the previous copy, so the two go back (exit 2).
        assert code in (0, 2), step
        if code == 0:
            assert manifest.verify(published(root)) == [], step
        if done:
            (mine,) = [p.parent for p in root.rglob("notes.txt")]
            assert sorted(os.listdir(mine)) == ["manifest.json", "notes.txt"], step
            assert (mine / "notes.txt").read_text() == "mine"
    capsys.readouterr()
