"""Small things a run gets right: a key found published still loses what an interrupted run
left; a repository path with a line break is refused (the last line printed is the path)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader import fs
from loader.cli import build_parser
from loader.cli.run import request_from_args
from loader.repository.key import key_filename
from loader.repository.publish import STAGING_MARKER
from tests.runs import cli, run_argv


@pytest.mark.parametrize("dead", ["reaped", "not reaped yet"])
def test_a_run_that_finds_its_key_published_removes_a_dead_runs_staging(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, dead
):
    """Also when the dead run is not reaped yet and still holds its lock (a run started within
    milliseconds of a group SIGKILL of the one before: its child is a zombie until its reaper
    waits for it): a dead holder's lock is taken over, not left with the staging directory."""
    root = tmp_path / "root"
    argv = run_argv(tiny_checkpoint_with_tokenizer, root)
    assert cli(capsys, *argv)[0] == 0
    key = request_from_args(build_parser().parse_args(argv)).key
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    if dead == "reaped":
        proc.wait()
    else:
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)  # exited, not reaped
        lock = root / ".locks" / f"{key_filename(key)}.lock"
        lock.parent.mkdir(exist_ok=True)
        record = {"pid": proc.pid, "host": socket.gethostname(), "pid_space": fs.pid_space()}
        lock.write_text(json.dumps({**record, "token": "0123", "beats": 1}))
    try:
        left = root / ".staging" / f"{key_filename(key)}.{proc.pid}-{fs.host_digest()}.0123456789ab"
        (left / "fastertransformer").mkdir(parents=True)
        (left / STAGING_MARKER).write_text(f"{key}\n")
        code, _, err = cli(capsys, *argv)
    finally:
        proc.wait()
    assert code == 0, err
    assert not left.exists()
    assert not (root / ".locks" / f"{key_filename(key)}.lock").exists()


@pytest.mark.parametrize("holder", ["dead", "live"])
def test_a_run_that_finds_its_key_published_removes_a_dead_holders_lock_alone(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, holder
):
    """A run killed after it published and removed its staging directory, before it released
    its lock, leaves the lock alone: the next run found the key published and left that lock
    for good (only ``prune`` removed it). Now it takes a dead holder's lock over and releases
    it; a live holder's stays."""
    root = tmp_path / "root"
    argv = run_argv(tiny_checkpoint_with_tokenizer, root)
    assert cli(capsys, *argv)[0] == 0
    key = request_from_args(build_parser().parse_args(argv)).key
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    pid = proc.pid if holder == "dead" else os.getpid()
    lock = root / ".locks" / f"{key_filename(key)}.lock"
    lock.parent.mkdir(exist_ok=True)
    record = {"pid": pid, "host": socket.gethostname(), "pid_space": fs.pid_space()}
    lock.write_text(json.dumps({**record, "key": key, "token": "0123", "beats": 1}))
    code, _, err = cli(capsys, *argv, "--lock-expiry-s", "60")
    assert code == 0, err
    assert lock.exists() == (holder == "live"), err
    assert list(root.glob("tiny@*/*")) and not any((root / ".staging").iterdir())


def test_an_up_to_date_run_writes_nothing_when_nothing_was_left(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    root = tmp_path / "root"
    argv = run_argv(tiny_checkpoint_with_tokenizer, root)
    assert cli(capsys, *argv)[0] == 0
    writes = []
    with fs.inject(lambda op, path: writes.append(op) if op != "stat" and op != "open" else None):
        assert cli(capsys, *argv)[0] == 0
    assert [op for op in writes if op not in ("list", "read")] == []


def test_a_repository_path_with_a_line_break_is_refused(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    root = tmp_path / "a\nb"
    code, _, err = cli(capsys, *run_argv(tiny_checkpoint_with_tokenizer, root))
    assert code == 2 and "line break" in err and "hint:" in err, err
    assert not os.path.lexists(root)
