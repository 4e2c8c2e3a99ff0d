"""Each line that keeps the loader safe has a test that fails without it (the fast tier).

* every open of ``loader.fs`` that must not follow a link refuses one (a link at a lock path
  is never read as a stale lock and taken over);
* a marker is the loader's only for the key it names (a dead loader's staging or download
  directory for another key, with a user's file in it, is left alone);
* ``prune`` holds a key's lock through its recheck and removal;
* the staged files are durable (fsynced) before ``manifest.json`` and ``.ready`` name them;
* a checkpoint that declares no dtype is written in the dtype most of its bytes are in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from loader import fs
from loader.cli import build_parser
from loader.cli.run import request_from_args
from loader.errors import NotOursError
from loader.repository.key import key_filename
from loader.repository.publish import STAGING_MARKER
from tests.runs import checkpoint_copy, cli, published, run_argv


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _key(source: Path, root: Path) -> str:
    return request_from_args(build_parser().parse_args(run_argv(source, root))).key


# --- links ------------------------------------------------------------------------------------


def _opens(d: fs.Dir, path: Path) -> dict:
    """Every way loader.fs opens a file it will read or write, on ``d/name`` or ``path``."""
    name = path.name
    return {
        "Dir.open_file": lambda: os.close(d.open_file(name, os.O_RDONLY)),
        "Dir.read": lambda: d.read(name),
        "Dir.write": lambda: d.write(name, b"x", exclusive=False),
        "Dir.append": lambda: d.append(name, b"x"),
        "Dir.open_update": lambda: d.open_update(name).close(),
        "Dir.open_read": lambda: d.open_read(name).close(),
        "Dir.create": lambda: d.create(name).close(),
        "Dir.fsync_file": lambda: d.fsync_file(name),
        "Dir.enter": lambda: d.enter([name]).close(),
        "Dir.copy_in": lambda: d.copy_in(name, Path(__file__)),
        "Dir.makedirs": lambda: d.makedirs([name]).close(),
        "fs.open_read (confined)": lambda: fs.open_read(path).close(),
        "fs.read_file (confined)": lambda: fs.read_file(path, limit=100),
        "fs.stat_path (confined)": lambda: fs.stat_path(path),
        "fs.regular_size (confined)": lambda: fs.regular_size(path),
        "Dir.sub": lambda: d.sub(name).close(),
        "Dir.open (confined)": lambda: fs.Dir.open(path).close(),
    }


@pytest.mark.parametrize("target", ["file", "dir"])
def test_no_open_of_loader_fs_follows_a_link(tmp_path, target):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "file").write_text("not the loader's\n")
    (root / "sub").mkdir(parents=True)
    link = root / "sub" / "entry"
    link.symlink_to(outside / target)
    with fs.confined(root), fs.Dir.open(root / "sub") as d:
        for what, call in _opens(d, link).items():
            with pytest.raises((NotOursError, OSError)) as caught:
                call()
            if not isinstance(caught.value, NotOursError):
                creates = what in ("Dir.create", "Dir.copy_in")
                allowed = (20, 40, 21, 17) if creates else (20, 40, 21)
                assert caught.value.errno in allowed, (what, caught.value)  # ENOTDIR, ELOOP,
                # EISDIR; EEXIST for O_EXCL
            assert link.is_symlink(), what
    assert (outside / "file").read_text() == "not the loader's\n"
    assert os.listdir(outside / "dir") == []


def test_a_link_at_the_lock_path_is_refused_not_taken_over_as_stale(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, dead_pid
):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    stale = json.dumps({"pid": dead_pid, "host": os.uname().nodename, "token": "x", "beats": 1})
    (outside / "lock.json").write_text(stale)
    key = _key(tiny_checkpoint_with_tokenizer, root)
    (root / ".locks").mkdir(parents=True)
    lock = root / ".locks" / f"{key_filename(key)}.lock"
    lock.symlink_to(outside / "lock.json")
    code, _, err = cli(capsys, *run_argv(tiny_checkpoint_with_tokenizer, root))
    assert code == 2 and "symbolic link" in err and "hint:" in err, err
    assert lock.is_symlink() and (outside / "lock.json").read_text() == stale
    assert not (root / key).exists()


# --- markers name their key ---------------------------------------------------------------------


def test_a_dead_loaders_staging_directory_for_another_key_is_left_alone(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, dead_pid
):
    root = tmp_path / "root"
    key = _key(tiny_checkpoint_with_tokenizer, root)
    other = root / ".staging" / f"{key_filename(key)}.{dead_pid}-{fs.host_digest()}.0123456789ab"
    other.mkdir(parents=True)
    (other / STAGING_MARKER).write_text("someone@else/tp1-pp1-i1-00000000\n")
    (other / "users-data.txt").write_text("keep me\n")
    os.utime(other, (0, 0))
    code, _, err = cli(capsys, *run_argv(tiny_checkpoint_with_tokenizer, root))
    assert code == 0, err
    assert (other / "users-data.txt").read_text() == "keep me\n"
    code, _, err = cli(capsys, "prune", "--repository", str(root), "--lock-expiry-s", "1")
    assert code == 0, err
    assert (other / "users-data.txt").read_text() == "keep me\n"


# --- prune holds the lock -------------------------------------------------------------------


def test_prune_holds_a_keys_lock_through_its_recheck_and_removal(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    root = tmp_path / "root"
    source = tiny_checkpoint_with_tokenizer
    assert cli(capsys, *run_argv(source, root, "--revision", "r1"))[0] == 0
    assert cli(capsys, *run_argv(source, root, "--revision", "r2"))[0] == 0
    old = request_from_args(build_parser().parse_args(run_argv(source, root, "--revision", "r1")))
    lock = root / ".locks" / f"{key_filename(old.key)}.lock"
    seen: list[tuple[str, bool]] = []

    def hook(op: str, path: str) -> None:
        ours = key_filename(old.key) in path or old.key in path
        if op.startswith(("rename", "rmdir", "unlink")) and "/.locks/" not in path and ours:
            seen.append((f"{op} {path}", os.path.lexists(lock)))

    with fs.inject(hook):
        code, _, err = cli(capsys, "prune", "--repository", str(root), "--keep", "1")
    assert code == 0, err
    assert not (root / old.key).exists()
    assert seen and all(held for _, held in seen), seen


# --- durable before named -------------------------------------------------------------------


def test_staged_files_are_fsynced_before_the_manifest_and_ready_are_written(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    calls: list[tuple[str, str]] = []
    with fs.inject(lambda op, path: calls.append((op, path))):
        code, _, err = cli(capsys, *run_argv(tiny_checkpoint_with_tokenizer, tmp_path / "r"))
    assert code == 0, err
    first_manifest = next(
        i for i, (op, p) in enumerate(calls)
        if op == "open" and "/.staging/" in p and p.endswith("/manifest.json")
    )  # fmt: skip
    weights = {p.name for p in (published(tmp_path / "r") / "fastertransformer" / "1").rglob("*")
               if p.is_file()}  # fmt: skip
    synced = {Path(p).name for op, p in calls[:first_manifest] if op == "fsync"}
    assert weights and weights <= synced, sorted(weights - synced)[:5]


# --- the dtype of an undeclared checkpoint ----------------------------------------------------


@pytest.mark.parametrize("most", ["F16", "F32"])
def test_an_undeclared_dtype_is_the_one_most_bytes_are_in(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, most
):
    """Most tensors in one dtype, the small rest in the other: the output follows the most."""
    import numpy as np

    source, weights = checkpoint_copy(
        tiny_checkpoint_with_tokenizer, tmp_path / "ckpt", undeclared=True
    )
    tensors = load_file(weights)
    big, small = (np.float16, np.float32) if most == "F16" else (np.float32, np.float16)
    by_size = sorted(tensors, key=lambda n: tensors[n].size)
    few = set(by_size[: len(by_size) // 4])
    save_file({n: t.astype(small if n in few else big) for n, t in tensors.items()}, weights)
    code, _, err = cli(capsys, *run_argv(source, tmp_path / "root"))
    assert code == 0, err
    ini = next((published(tmp_path / "root") / "fastertransformer" / "1").rglob("config.ini"))
    expected = "fp16" if most == "F16" else "fp32"
    assert f"weight_data_type = {expected}" in ini.read_text()


# --- identity: markers, lock holders, download directories -------------------------------------


def test_a_lock_of_another_pid_space_is_not_taken_over_as_dead(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, dead_pid
):
    """A pid is judged only in the pid space (boot, pid namespace) that wrote it: the same host
    name in another container may hold a live loader whose pid is absent here."""
    root = tmp_path / "root"
    key = _key(tiny_checkpoint_with_tokenizer, root)
    (root / ".locks").mkdir(parents=True)
    lock = root / ".locks" / f"{key_filename(key)}.lock"
    argv = run_argv(tiny_checkpoint_with_tokenizer, root, "--lock-timeout-s", "1",
                    "--lock-expiry-s", "3600")  # fmt: skip
    theirs = {"pid": dead_pid, "host": os.uname().nodename, "token": "t", "beats": 1,
              "pid_space": "another-boot:4026531836"}  # fmt: skip
    lock.write_text(json.dumps(theirs))
    code, _, err = cli(capsys, *argv)
    assert code == 75 and "hint:" in err, err
    assert json.loads(lock.read_text()) == theirs
    ours = {**theirs, "pid_space": fs.pid_space()}  # the same record of this pid space: dead
    lock.write_text(json.dumps(ours))
    code, _, err = cli(capsys, *argv)
    assert code == 0, err


def test_a_marker_that_could_not_be_written_leaves_no_directory_a_rerun_refuses(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """The staging directory appears with its marker or not at all: a failure writing the
    marker (ENOSPC) is transient, and the rerun publishes."""
    import errno

    root = tmp_path / "root"
    failed = []

    def full(op: str, path: str) -> None:
        if op == "open" and path.endswith("/" + STAGING_MARKER) and not failed:
            failed.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    with fs.inject(full):
        code, _, err = cli(capsys, *run_argv(tiny_checkpoint_with_tokenizer, root))
    assert failed and code in (2, 75) and "hint:" in err, err
    staging = root / ".staging"
    assert not staging.exists() or list(staging.iterdir()) == []
    code, _, err = cli(capsys, *run_argv(tiny_checkpoint_with_tokenizer, root))
    assert code == 0, err


def test_two_roots_sharing_a_work_dir_download_into_different_directories(tmp_path):
    from loader.run.strategies import download_name

    argv = run_argv("gs://b/m", tmp_path / "a", "--work-dir", str(tmp_path / "w"))
    request = request_from_args(build_parser().parse_args(argv))
    names = {download_name(request, tmp_path / r, request.key) for r in ("a", "b")}
    assert len(names) == 2 and all(fs.is_name(n) for n in names)


def test_a_fifo_where_the_loader_writes_a_file_is_refused(tmp_path):
    """Opened without blocking: a FIFO with no reader is a NotOursError, never a hang or a
    traceback (ENXIO)."""
    (tmp_path / "sub").mkdir()
    fifo = tmp_path / "sub" / "journal.tmp"
    os.mkfifo(fifo)
    with fs.Dir.open(tmp_path / "sub") as d:  # every way a Dir writes or reads a file
        for call in (
            lambda: d.append(fifo.name, b"x"),
            lambda: d.write(fifo.name, b"x", exclusive=False),
            lambda: d.open_update(fifo.name),
            lambda: d.open_read(fifo.name),
            lambda: d.read(fifo.name),
            lambda: d.fsync_file(fifo.name),
        ):
            with pytest.raises(NotOursError):
                call()
        assert d.regular_size(fifo.name) is None
