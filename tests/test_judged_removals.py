"""What ``prune`` judged the loader's (a staging directory of a loader that is gone, a replaced
copy in ``.trash``, an old key moved there) is the very directory it removes: a directory of the
user's renamed to that name at any step after the judgment, even one holding a file named like
a mark of the loader's (``manifest.json``), is kept whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from loader import fs
from loader.repository.key import key_filename
from loader.repository.prune import prune
from loader.repository.publish import STAGING_MARKER, host_digest
from tests.at_step import AtStep, picked_calls
from tests.runs import forged_key
from tests.tiers import quartered

KEY = "m@r1/v"
KEYFILE = key_filename(KEY)


def _leftovers(root: Path) -> None:
    """An old key, a replaced copy of a newer one, and a dead loader's staging directory."""
    forged_key(root, "m@r2/v", "2026-01-02T00:00:00Z")
    forged_key(root, KEY, "2026-01-01T00:00:00Z")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    newer = key_filename("m@r2/v")
    with fs.Dir.open(root / ".staging", create=True) as staging:
        name = f"{newer}.{dead.pid}-{host_digest()}.0123456789ab"
        assert staging.make_marked(name, STAGING_MARKER, "m@r2/v")
        with staging.sub(name) as d, d.makedirs(("w",)) as w:
            w.write("weights.bin", b"w" * 64)
    with fs.Dir.open(root / ".trash", create=True) as trash:
        assert trash.make_marked(f"{newer}.aaaaaaaaaaaa", STAGING_MARKER, "m@r2/v")
        with trash.sub(f"{newer}.aaaaaaaaaaaa") as d:
            d.write("manifest.json", json.dumps({"key": "m@r2/v", "files": []}).encode())


def _top(root: Path, path: str) -> Path | None:
    """The tree ``path`` (a seam call's) is the top of: a staging directory, a ``.trash``
    entry, or the old key."""
    p = Path(path)
    if " -> " in path:
        return None
    if p.parent in (root / ".staging", root / ".trash") and not p.name.startswith("."):
        return p
    return p if p == root / KEY else None


def _users_directory(at: Path) -> None:
    at.mkdir()
    (at / "manifest.json").write_text('{"name": "my-app", "files": []}')
    (at / "notes.txt").write_text("mine")


def _kept_at_every_step(tmp_path: Path, judge_and_remove, removed: int) -> None:
    """``judge_and_remove(root)`` (returning what it removed) run once per step of its own on
    the leftovers, a directory of the user's renamed to the judged tree's name at that step:
    it is kept whole, wherever the step falls."""

    def judged_tree(root: Path):
        def match(op: str, path: str) -> Path | None:
            top = _top(root, path)
            return top if top is not None and top.is_dir() else None

        return match

    counted = tmp_path / "count"
    _leftovers(counted)
    steps, done = picked_calls(judged_tree(counted), lambda: judge_and_remove(counted))
    assert len(done) == removed
    for step in quartered(range(1, len(steps) + 1)):
        root = tmp_path / f"at-{step}"
        _leftovers(root)

        def swap(top: Path, root: Path = root, step: int = step) -> None:
            top.rename(root.parent / f"moved-{step}")
            _users_directory(top)

        hook = AtStep(step, judged_tree(root), swap)
        with fs.inject(hook):
            judge_and_remove(root)
        if not hook.done:
            continue
        mine = [p.parent for p in root.rglob("notes.txt")]
        assert len(mine) == 1, (step, steps[step - 1])
        assert sorted(os.listdir(mine[0])) == ["manifest.json", "notes.txt"], step
        assert (mine[0] / "notes.txt").read_text() == "mine"


def test_a_users_directory_renamed_to_a_judged_trees_name_at_any_step_is_kept(tmp_path: Path):
    """``prune`` removes an old key, a replaced copy and a dead loader's staging directory: a
    directory of the user's renamed to any of those names at any step after is kept whole."""
    _kept_at_every_step(tmp_path, lambda root: prune(root, keep=1).removed, 3)


def test_a_users_directory_renamed_to_a_leftovers_name_while_a_run_clears_it_is_kept(
    tmp_path: Path,
):
    """The clean-up a run of the key makes under its lock (``clear_leftovers``: a dead loader's
    staging directory, a replaced copy in ``.trash``) removes only the very directory it judged
    the loader's: one of the user's renamed to that name at any step after is kept whole."""
    from loader.repository.publish import clear_leftovers

    _kept_at_every_step(tmp_path, lambda root: clear_leftovers(root, "m@r2/v", idle_s=60), 2)
