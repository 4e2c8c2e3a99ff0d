"""A pid read from what the loader keeps under ROOT (a lock record, the owner tag in a staging
or temporary directory's name) that no process can have: a number below 1, or one too large for
a ``pid_t``. It names no live process: a lock holding it is taken over at once, a directory of
the user's carrying it in its name stays; never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loader.cli import main
from loader.fs import host_digest, pid_alive
from loader.repository.key import key_filename
from loader.repository.lock import PublishLock, lock_path
from loader.repository.publish import STAGING_DIR
from tests.runs import published, run_argv

KEY = "m@r/tp1-pp1-i1-abcdef01"
IMPOSSIBLE = [0, -1, -(2**40), 2**31, 2**63, 10**30]


@pytest.mark.parametrize("pid", IMPOSSIBLE)
def test_no_process_has_a_pid_below_1_or_beyond_pid_max(pid: int):
    assert not pid_alive(pid)


@pytest.mark.parametrize("pid", [2**63, 10**30, -1])
def test_a_lock_record_naming_an_impossible_pid_of_this_host_is_taken_over(
    tmp_path: Path, pid: int
):
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": pid, "host": os.uname().nodename, "token": "x"}))
    with PublishLock(tmp_path, KEY, expiry_s=30, timeout_s=5, poll_s=0.05) as lock:
        assert lock.held()


def _key(capsys, checkpoint: Path, root: Path) -> str:
    assert main(run_argv(checkpoint, root)) == 0
    return str(Path(capsys.readouterr().out.splitlines()[-1]).relative_to(root))


def test_run_and_prune_take_a_lock_whose_record_names_a_pid_too_large_for_a_pid_t(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys
):
    root = tmp_path / "models"
    key = _key(capsys, tiny_checkpoint_with_tokenizer, root)
    record = {"pid": 10**30, "host": os.uname().nodename, "token": "x"}
    lock_path(root, key).write_text(json.dumps(record))
    assert main(["prune", "--repository", str(root)]) == 0
    lock_path(root, key).write_text(json.dumps(record))
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root, "--force")) == 0
    assert not lock_path(root, key).exists()


@pytest.mark.parametrize("leading", ["", "."])
def test_a_users_directory_in_staging_named_with_a_pid_too_large_for_a_pid_t_stays(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, leading: str
):
    """A directory named like a staging directory (or one a loader stopped before naming) of
    the key, its owner tag a pid no process has: the user's; a run of the key keeps it."""
    root = tmp_path / "models"
    key = _key(capsys, tiny_checkpoint_with_tokenizer, root)
    name = f"{leading}{key_filename(key)}.{10**30}-{host_digest()}.0123456789ab"
    planted = root / STAGING_DIR / (name + (".tmp" if leading else ""))
    planted.mkdir()
    (planted / "notes.txt").write_text("mine")
    for extra in ((), ("--force",)):
        assert main(run_argv(tiny_checkpoint_with_tokenizer, root, *extra)) == 0
    assert (planted / "notes.txt").read_text() == "mine"
    assert published(root).is_dir()
