"""Someone else's entries planted in the loader's own directories under ROOT (``.locks/``, ...):
each stays exactly as it was, and what the loader says about it is a typed error."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.errors import NotOursError, RepositoryError
from loader.repository.key import key_filename
from loader.repository.lock import (
    LOCKS_DIR,
    RECORD_FIELDS,
    RECORD_START,
    PublishLock,
    lock_like,
    lock_path,
)
from loader.repository.prune import lock_live, prune

KEY = "m@r/tp1-pp1-i1-abcdef01"
REPO = Path(__file__).resolve().parent.parent


def _old(path: Path, age_s: float = 10_000) -> None:
    then = time.time() - age_s
    os.utime(path, (then, then), follow_symlinks=False)


# --- .locks/ ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "notes.lock.stale-1",
        f"{key_filename(KEY)}.lock.stale-0123456789abcdef",
        ".lock.stale-",
    ],
)
@pytest.mark.parametrize("content", [b"a user's notes\n", b"{" + b" " * 2**17])
def test_prune_keeps_a_users_file_named_like_a_moved_away_lock(tmp_path, name, content):
    """Only a lock file a take-over moved aside (a lock record, at the name a take-over gives
    it) is the loader's; a user's file of a similar name, with other content (or larger than
    any lock record), stays, and prune goes on."""
    (tmp_path / LOCKS_DIR).mkdir()
    planted = tmp_path / LOCKS_DIR / name
    planted.write_bytes(content)
    report = prune(tmp_path, keep=1)
    assert planted.read_bytes() == content
    assert planted not in [r.path for r in report.removed]


def test_prune_still_removes_a_lock_a_take_over_moved_away(tmp_path):
    (tmp_path / LOCKS_DIR).mkdir()
    moved = tmp_path / LOCKS_DIR / f"{key_filename(KEY)}.lock.stale-0123456789abcdef"
    moved.write_text(json.dumps({"key": KEY, "pid": 1, "host": "gone", "token": "x"}))
    report = prune(tmp_path, keep=1)
    assert not moved.exists()
    assert [r.path for r in report.removed] == [moved]


def test_prune_says_what_to_do_with_a_name_taken_where_it_moves_a_stale_lock(tmp_path, caplog):
    """A user's file is put at the fresh name prune moves a moved-away lock to before removing
    it: both stay, and the warning says which name holds what and what to do about it."""
    (tmp_path / LOCKS_DIR).mkdir()
    moved = tmp_path / LOCKS_DIR / f"{key_filename(KEY)}.lock.stale-0123456789abcdef"
    moved.write_text(json.dumps({"key": KEY, "pid": 1, "host": "gone", "token": "x"}))
    taken: list[str] = []

    def plant(op: str, path: str) -> None:
        if op == "rename-noreplace" and path.startswith(f"{moved} -> ") and not taken:
            taken.append(path.split(" -> ")[1])
            Path(taken[0]).write_text("a user's notes\n")

    with fs.inject(plant), caplog.at_level("WARNING"):
        report = prune(tmp_path, keep=1)
    assert taken and Path(taken[0]).read_text() == "a user's notes\n"
    assert moved.exists() and moved not in [r.path for r in report.removed]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert taken[0] in said and "holds a file" in said, said
    assert "move" in said and "away" in said and "prune again" in said, said


def test_prune_never_removes_a_users_file_renamed_over_a_moved_lock_at_any_step(tmp_path):
    """A lock a take-over moved aside, judged by its content: a user's file renamed to its
    name at any call prune makes on that name after it looked (before the removal too) is
    kept, with its content, mode and inode."""
    name = f"{key_filename(KEY)}.lock.stale-0123456789abcdef"
    record = json.dumps({"key": KEY, "pid": 1, "host": "gone", "token": "x"})

    def planted(root: Path) -> Path:
        (root / LOCKS_DIR).mkdir(parents=True)
        (root / LOCKS_DIR / name).write_text(record)
        return root / LOCKS_DIR / name

    calls: list[str] = []
    counted = planted(tmp_path / "count")
    with fs.inject(lambda op, path: calls.append(op) if path == str(counted) else None):
        prune(tmp_path / "count", keep=1)
    assert not counted.exists() and calls
    for step in range(1, len(calls) + 1):
        root = tmp_path / f"at-{step}"
        moved = planted(root)
        theirs = tmp_path / f"theirs-{step}"
        theirs.write_text("a user's notes\n")
        theirs.chmod(0o600)
        seen = os.stat(theirs)
        seen_calls: list[str] = []

        def swap(op: str, path: str, moved=moved, theirs=theirs, seen_calls=seen_calls):
            if path != str(moved) or not theirs.exists():
                return
            seen_calls.append(op)
            if len(seen_calls) == step:  # noqa: B023 (called while this step runs)
                os.rename(theirs, moved)

        with fs.inject(swap):
            prune(root, keep=1)
        assert not theirs.exists(), step
        now = os.lstat(moved)
        assert (now.st_ino, now.st_mode) == (seen.st_ino, seen.st_mode), (step, calls[step - 1])
        assert moved.read_text() == "a user's notes\n"
        assert os.listdir(root / LOCKS_DIR) == [name], step


def test_a_take_over_never_removes_a_users_file_renamed_over_the_lock_it_moved_at_any_step(
    tmp_path,
):
    """A take-over moves the stale lock aside, reads it and removes it: a user's file renamed
    to the name it moved the lock to, at any call the take-over makes on that name after the
    move, is kept whole in ``.locks`` (it was removed by name after the read)."""
    record = json.dumps({"key": KEY, "pid": 1, "host": "gone", "token": "x"})

    def take_over(root: Path, hook) -> None:
        path = lock_path(root, KEY)
        path.parent.mkdir(parents=True)
        path.write_text(record)
        _old(path)
        lock = PublishLock(root, KEY, expiry_s=0.2, timeout_s=5, poll_s=0.05)
        lock.token = "0123456789abcdef"  # the name the lock is moved to
        with fs.inject(hook), contextlib.suppress(NotOursError), lock:
            pass

    moved = f"{key_filename(KEY)}.lock.stale-0123456789abcdef"

    def on_moved(path: str) -> bool:  # a call on the name moved to (not the move itself)
        return path.split(" -> ")[0].endswith(f"/{moved}")

    calls: list[str] = []
    take_over(tmp_path / "count", lambda op, path: calls.append(op) if on_moved(path) else 0)
    assert calls
    for step in range(1, len(calls) + 1):
        root = tmp_path / f"at-{step}"
        theirs = tmp_path / f"theirs-{step}"
        theirs.write_text("a user's notes\n")
        seen = os.stat(theirs)
        seen_calls: list[str] = []

        def swap(op: str, path: str, root=root, theirs=theirs, seen_calls=seen_calls):
            if not on_moved(path) or not theirs.exists():
                return
            seen_calls.append(op)
            if len(seen_calls) == step:  # noqa: B023 (called while this step runs)
                os.rename(theirs, root / LOCKS_DIR / moved)

        take_over(root, swap)
        assert not theirs.exists(), step
        kept = [p for p in (root / LOCKS_DIR).iterdir() if os.lstat(p).st_ino == seen.st_ino]
        assert kept, (step, calls[step - 1])
        assert kept[0].read_text() == "a user's notes\n"


def test_a_take_over_never_removes_a_users_file_put_at_the_locks_name_after_its_look(tmp_path):
    """A waiter judged the lock stale; a user's file is renamed to the lock's path before the
    take-over moves it aside, and a new lock is made there before the take-over looks at what
    it moved: the user's file is never removed (left beside the new lock, and named)."""
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": KEY, "pid": 1, "host": "gone", "token": "x"}))
    _old(path)
    theirs = tmp_path / "theirs"
    theirs.write_text("a user's notes\n")
    seen = os.stat(theirs)
    other: list[PublishLock] = []

    def race(op: str, where: str) -> None:
        if op.startswith("rename") and where.startswith(f"{path} -> ") and theirs.exists():
            os.rename(theirs, path)
        elif op == "open" and ".stale-" in where and not other and not theirs.exists():
            other.append(PublishLock(tmp_path, KEY, expiry_s=60, timeout_s=0).acquire())

    lock = PublishLock(tmp_path, KEY, expiry_s=0.2, timeout_s=5, poll_s=0.05)
    try:
        with fs.inject(race), pytest.raises(NotOursError):
            lock.acquire()
        assert other and other[0].held()
    finally:
        for held in other:
            held.release()
    (left,) = [p for p in path.parent.iterdir()]
    now = os.lstat(left)
    assert (now.st_ino, now.st_mode) == (seen.st_ino, seen.st_mode)
    assert left.read_text() == "a user's notes\n"


def _moves_aside(root: Path) -> dict:
    """What moves a lock file of ``root`` aside to a fresh ``.stale-`` name: prune removing a
    moved-away lock, a holder's release, a waiter's take-over of a dead holder's lock."""
    path = lock_path(root, KEY)
    path.parent.mkdir(parents=True)
    dead = {"key": KEY, "pid": 1, "host": "gone", "token": "x"}

    def prune_it() -> None:
        moved = path.with_name(f"{path.name}.stale-0123456789abcdef")
        moved.write_text(json.dumps(dead))
        prune(root, keep=1)

    def release() -> None:
        PublishLock(root, KEY, heartbeat_s=0.05).acquire().release()

    def take_over() -> None:
        path.write_text(json.dumps(dead))
        _old(path)
        PublishLock(root, KEY, expiry_s=0.2, timeout_s=0, judge_by_age=True).acquire().release()

    return {"prune": prune_it, "release": release, "take-over": take_over}


@pytest.mark.parametrize("who", ["prune", "release", "take-over"])
@pytest.mark.parametrize("kind", ["file", "dir", "link"])
def test_a_users_entry_at_the_name_a_lock_is_moved_aside_to_is_never_replaced(tmp_path, who, kind):
    """A user's entry renamed to the fresh name a lock file is about to be moved aside to (after
    the look, in the instant before the rename): it is never replaced (a rename over it lost a
    user's file), nothing is moved there, and what stops is a typed error or nothing."""
    done: list[Path] = []

    def plant(op: str, where: str) -> None:
        src, _, dst = where.partition(" -> ")
        if done or not op.startswith("rename") or ".stale-" not in dst or src == dst:
            return
        done.append(Path(dst))
        if kind == "file":
            Path(dst).write_text("a user's notes\n")
        elif kind == "dir":
            Path(dst).mkdir()
            (Path(dst) / "notes.txt").write_text("a user's notes\n")
        else:
            Path(dst).symlink_to("elsewhere")

    stopped: list[OSError | RepositoryError] = []
    try:
        with fs.inject(plant):
            _moves_aside(tmp_path)[who]()
    except (RepositoryError, FileExistsError) as exc:  # (a NameTakenError is exit 2)
        stopped.append(exc)
    assert not stopped or who == "take-over", stopped  # prune and a release go on
    (theirs,) = done
    if kind == "file":
        assert theirs.read_text() == "a user's notes\n"
    elif kind == "dir":
        assert os.listdir(theirs) == ["notes.txt"]
    else:
        assert os.readlink(theirs) == "elsewhere"


@pytest.mark.parametrize(
    "content",
    [
        b"a user's notes at the lock's name\n",
        b"#!/bin/sh\n",
        b"{" + b" " * 2**17,
        # JSON objects of the user's: no loader's record begins other than with its key
        b'{"name": "my-app", "files": []}\n',
        b"{}",
        b'{"key"}',
        b'{"pid": 1, "host": "gone", "notes": "mine"}',
        # ... nor one whose first field is a key, as a record's is (judged by that alone before)
        b'{"key": "m@r/tp1-pp1-i1-abcdef01", "notes": "mine"}',
        b'{"key": "my-setting", "value": [1, 2]}\n',
        # ... nor what is no whole object but begins as a record does: JSON lines, an object
        # followed by notes, a record's beginning in another encoding, one cut short naming
        # another field (each judged by its beginning alone before)
        b'{"key": "my-setting", "value": 1}\n{"key": "other", "value": 2}\n',
        b'{"key": "m@r/tp1-pp1-i1-abcdef01"} my notes on this key\n',
        b'{"key": "m@r/tp1-pp1-i1-abcdef01"}{"notes": "mine"}',
        '{"key": "caf\u00e9", "pid": 1'.encode("latin-1"),
        b'{"key": "my-setting", "value": [1, ',
    ],
)
def test_a_users_file_at_a_locks_name_is_never_taken_over(tmp_path, content):
    """A file at the lock's path that holds no lock record is no lock of a loader (however
    long it has not changed): the run is refused naming it, and the file stays."""
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    _old(path)
    lock = PublishLock(tmp_path, KEY, expiry_s=0.2, timeout_s=2, poll_s=0.05)
    with pytest.raises(NotOursError) as info:
        lock.acquire()
    assert str(path) in info.value.message
    assert path.read_bytes() == content
    assert sorted(os.listdir(path.parent)) == [path.name]
    # prune leaves the key alone: what holds its lock's name is not a lock it may judge
    assert lock_live(tmp_path, key_filename(KEY), expiry_s=0.2)


def test_a_lock_record_of_a_newer_loader_is_never_to_be_moved_away(tmp_path):
    """A record of this key with a field this loader does not know (a newer loader's, which may
    be live): refused, and the remediation says to upgrade or wait, never to move the lock away
    (the lock stays as it is)."""
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    record = {"key": KEY, "pid": 1, "host": "another-node", "token": "t", "lease_id": "x"}
    content = json.dumps(record).encode()
    path.write_bytes(content)
    lock = PublishLock(tmp_path, KEY, expiry_s=0.2, timeout_s=2, poll_s=0.05)
    with pytest.raises(RepositoryError) as info:
        lock.acquire()
    assert info.value.exit_code == 2
    assert str(path) in info.value.message and "newer loader" in info.value.message
    hint = info.value.remediation
    assert "upgrade" in hint.lower() and "wait" in hint.lower(), hint
    assert "move" not in hint.lower() or "never move" in hint.lower(), hint
    assert path.read_bytes() == content and sorted(os.listdir(path.parent)) == [path.name]


def test_the_record_a_loader_writes_is_told_as_one_whole_and_cut_short(tmp_path):
    with PublishLock(tmp_path, KEY, expiry_s=5) as lock:
        record = lock.path.read_bytes()
        written = []  # records of every length, as beats and times go by
        for lock._beats in (0, 9, 10**3, 10**6, 10**9):
            written.append(lock._content())
            lock.expiry_s /= 7
    assert record.startswith(RECORD_START) and set(json.loads(record)) == RECORD_FIELDS
    assert all(lock_like(record[:n]) for n in range(len(record) + 1))
    # a rewrite stopped before its truncation (an older, longer record's tail after the new
    # one), and zeros a crash left after a record
    torn = [new + old[len(new) :] for new in written for old in written if len(old) > len(new)]
    assert torn and all(lock_like(content) for content in torn)
    assert lock_like(record + b"\0" * 100)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00" * 64,
        b'{"key": "m@r/tp1-pp1-i1-abcdef01", "pid": 1, "host": "gone"}',
        b'{"ke',
        # a rewrite stopped before its truncation: the tail of a longer record after it
        b'{"key": "m@r/tp1-pp1-i1-abcdef01", "pid": 1, "host": "gone"}"beats": 10}',
    ],
)
def test_what_a_stopped_loader_may_leave_at_its_locks_name_is_still_taken_over(tmp_path, content):
    """Nothing written yet, zeros (a crash before the write reached the disk), a record cut
    short: a lock a loader left, taken over once it has not changed for the expiry."""
    path = lock_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with PublishLock(tmp_path, KEY, expiry_s=0.2, timeout_s=5, poll_s=0.05) as lock:
        assert lock.held()
    assert sorted(os.listdir(path.parent)) == []


def test_a_run_refuses_a_users_file_at_its_locks_name(tiny_checkpoint_with_tokenizer, tmp_path):
    root = tmp_path / "root"
    argv = ["run", "--source", str(tiny_checkpoint_with_tokenizer), "--repository", str(root),
            "--model-name", "tiny", "--tp-size", "1", "--pp-size", "1", "--instance-count", "1",
            "--backend", "python", "--lock-expiry-s", "1"]  # fmt: skip
    assert main(argv) == 0
    assert not list((root / LOCKS_DIR).iterdir())  # released
    (published,) = root.glob("tiny@*/*")
    path = lock_path(root, f"{published.parent.name}/{published.name}")
    path.write_text("a user's notes\n")
    _old(path)
    assert main([*argv, "--force"]) == 2
    assert path.read_text() == "a user's notes\n"
    assert main(["prune", "--repository", str(root), "--keep", "1"]) == 0
    assert path.read_text() == "a user's notes\n"


# --- directories nested deeper than any the loader makes ---------------------------------------

#: Far deeper than Python's recursion limit allows a recursive walk to go.
DEEP = 1500


@pytest.fixture(autouse=True)
def _chains_removed(tmp_path):
    """Each test's directory goes with it: the chains below are too deep for the recursive
    removal pytest does of earlier runs' directories (``rm`` walks any depth)."""
    yield
    subprocess.run(["rm", "-rf", "--", str(tmp_path)], check=False)


def _nest(top: Path, depth: int = DEEP) -> Path:
    """A chain of ``depth`` directories below ``top`` (made relative to each, as any user can)
    with a file at its end; the file's path, for a check from outside (too long for a path)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        leaf = os.open("leaf", os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=fd)
        os.write(leaf, b"a user's\n")
        os.close(leaf)
    finally:
        os.close(fd)
    return top


def _leaf_left(top: Path, depth: int = DEEP) -> bool:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        leaf = os.open("leaf", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
        try:
            return os.read(leaf, 100) == b"a user's\n"
        finally:
            os.close(leaf)
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def _run_argv(source: Path, root: Path, *extra: str) -> list[str]:
    return ["run", "--source", str(source), "--repository", str(root), "--model-name", "tiny",
            "--tp-size", "1", "--pp-size", "1", "--instance-count", "1", "--backend", "python",
            "--lock-expiry-s", "1", *extra]  # fmt: skip


@pytest.mark.parametrize("where", ["", "llm/1"])
def test_a_directory_nested_deeper_than_any_the_loader_makes_is_kept_never_a_crash(
    tiny_checkpoint_with_tokenizer, tmp_path, where, capsys
):
    """A published key holding a chain of directories deeper than a recursive walk can go:
    checked (not complete: published again), replaced, pruned, each a typed exit; the chain
    stays, with the user's file at its end."""
    root = tmp_path / "root"
    argv = _run_argv(tiny_checkpoint_with_tokenizer, root)
    assert main(argv) == 0
    (published,) = root.glob("tiny@*/*")
    planted = _nest(published / where if where else published)
    trees = [planted]
    for step in ([*argv], [*argv, "--force"], ["prune", "--repository", str(root), "--keep", "1"]):
        code = main(step)
        err = capsys.readouterr().err
        assert code in (0, 2), err[-2000:]
        assert "Traceback" not in err and "this is a bug" not in err
        assert any(_leaf_left(t) for t in _trees_holding_leaf(root, trees)), step
    assert main(_run_argv(tiny_checkpoint_with_tokenizer, root)) in (0, 2)


def _trees_holding_leaf(root: Path, known: list[Path]) -> list[Path]:
    """Where the chain may be now: where it was planted, or in a copy of the key the loader
    moved aside (``.trash/...``) or replaced, at the same place below it."""
    out = list(known)
    for base in [root / ".trash", root / ".staging", *root.glob("tiny@*")]:
        if base.is_dir():
            for top in base.iterdir():
                for rel in ("", "llm/1"):
                    if (top / rel / "d").is_dir():
                        out.append(top / rel)
    return out


def test_prune_keeps_a_deep_chain_planted_in_a_dead_loaders_staging_directory(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    from loader.repository import publish

    root = tmp_path / "root"
    assert main(_run_argv(tiny_checkpoint_with_tokenizer, root)) == 0
    (published,) = root.glob("tiny@*/*")
    key = "/".join(published.parts[-2:])
    staging = publish.new_staging_dir(root, key)
    dead = staging.with_name(staging.name.replace(f".{os.getpid()}-", ".999999999-"))
    staging.rename(dead)
    _nest(dead)
    code = main(["prune", "--repository", str(root), "--keep", "1", "--lock-expiry-s", "1"])
    err = capsys.readouterr().err
    assert code in (0, 2), err[-2000:]
    assert _leaf_left(dead)


@pytest.mark.parametrize("command", ["run", "fetch"])
def test_a_local_source_nested_deeper_than_a_walk_goes_is_refused_typed(
    tiny_checkpoint_with_tokenizer, tmp_path, command, capsys
):
    """A local source holding a chain of directories deeper than a recursive walk can go:
    refused naming it (exit 2), never a crash; a chain under a hidden directory is skipped
    like everything hidden."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoint_with_tokenizer, source)
    (source / ".cache").mkdir()
    _nest(source / ".cache")
    argv = (
        _run_argv(source, tmp_path / "root")
        if command == "run"
        else ["fetch", "--copy", str(source), str(tmp_path / "copy")]
    )
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    _nest(source)
    code = main([*argv, "--force"] if command == "run" else argv)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "nested" in err and "hint:" in err
    assert _leaf_left(source)


# --- names read from a remote listing: no deeper than the loader's walks go ---------------------


def test_a_listed_name_nested_deeper_than_the_loader_removes_is_refused():
    """An object or Hub file nested more levels than the loader's own walks go would be
    downloaded into a directory its next run could not remove (kept as if someone else's):
    refused before anything is written, naming it."""
    from loader import fs
    from loader.errors import SourceError
    from loader.sources import parse_uri
    from loader.sources.gcs import _relpath
    from loader.sources.hf import _names

    deep = "/".join(["d"] * fs.MAX_NAME_LEVELS) + "/model.safetensors"
    fine = "/".join(["d"] * (fs.MAX_NAME_LEVELS - 1)) + "/model.safetensors"
    with pytest.raises(SourceError, match="levels"):
        _relpath(parse_uri("gs://bucket/p"), f"p/{deep}")
    with pytest.raises(SourceError, match="levels"):
        _names(parse_uri("hf://org/name"), deep)
    assert _relpath(parse_uri("gs://bucket/p"), f"p/{fine}") == fine
    assert _names(parse_uri("hf://org/name"), fine) == fine.split("/")
    assert fs.MAX_NAME_LEVELS + 8 <= fs.MAX_TREE_DEPTH  # a download's tree holds it, and more


def test_a_published_keys_record_grown_huge_never_stops_its_key_or_prune(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """Someone grows a published key's record past what the loader reads: replacing the key,
    clearing the replaced copy and pruning go on (exit 0), and the copy, whose record tells
    nothing, is kept whole."""
    from loader import fs

    root = tmp_path / "root"
    argv = _run_argv(tiny_checkpoint_with_tokenizer, root)
    assert main(argv) == 0
    (published,) = root.glob("tiny@*/*")
    with open(published / fs.MADE, "r+b") as made:
        made.truncate(fs.SMALL_FILE_BYTES + 2**20)
    weights = sorted(p.name for p in (published / "fastertransformer" / "1" / "1-gpu").iterdir())
    # each in a process of its own, gone before the next (whose leftovers it may clear)
    for step in ([*argv, "--force"], ["prune", "--repository", str(root), "--keep", "1"],
                 [*argv, "--force"]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "loader", *step], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    kept = [p for p in root.rglob(fs.MADE) if p.stat().st_size > fs.SMALL_FILE_BYTES]
    assert len(kept) == 1
    assert (
        sorted(p.name for p in (kept[0].parent / "fastertransformer" / "1" / "1-gpu").iterdir())
        == weights
    )


@pytest.mark.parametrize("name", [".ready", ".model-loader-staging"])
def test_a_published_keys_small_file_grown_huge_never_stops_its_key(
    tiny_checkpoint_with_tokenizer, tmp_path, name, capsys
):
    """Someone grows a published key's ``.ready`` or marker past what the loader reads of
    them: the key is checked (not complete: published again), replaced and pruned, each
    exit 0, never a refusal that no later run gets past."""
    root = tmp_path / "root"
    argv = _run_argv(tiny_checkpoint_with_tokenizer, root)
    assert main(argv) == 0
    (published,) = root.glob("tiny@*/*")
    with open(published / name, "r+b") as grown:
        grown.truncate(2**20)
    for step in (argv, [*argv, "--force"], ["prune", "--repository", str(root), "--keep", "1"]):
        code = main(step)
        assert code == 0, capsys.readouterr().err[-2000:]
    (published,) = root.glob("tiny@*/*")
    assert (published / name).stat().st_size < 4096


# --- a conversion's journal grown past what the loader reads -------------------------------------


def test_a_journal_grown_past_what_the_loader_reads_resumes_nothing_never_fails(tmp_path):
    """A journal someone grew past any the loader writes tells nothing: a resume keeps no
    output and goes on (a failure would stop every later run of the key at its resume)."""
    from loader import fs
    from loader.convert.overlapped import Journal

    (tmp_path / "work" / "out").mkdir(parents=True)
    with fs.confined(tmp_path / "work"):
        journal = Journal(tmp_path / "work" / "out", "h")
        with open(journal.path, "wb") as grown:
            grown.write(b"h b3\nmoved-into x\n")
            grown.truncate(fs.SMALL_FILE_BYTES + 2**20)
        try:
            assert journal.moved_to() is None
            assert journal.resume() == {}
        finally:
            journal.close()


def test_a_slice_journal_grown_past_what_the_loader_reads_resumes_no_slice(tmp_path):
    """A gs:// download's slice journal someone grew past any the loader writes tells
    nothing: the partial file's slices are all fetched again, never a stop."""
    from types import SimpleNamespace

    from loader import fs
    from loader.sources.gcs import _load_journal, _Object

    partial = tmp_path / "x.safetensors.partial"
    partial.write_bytes(b"\0" * 100)
    with open(str(partial) + ".slices", "wb") as grown:
        grown.write(b"0 99\n")
        grown.truncate(fs.SMALL_FILE_BYTES + 2**20)
    blob = SimpleNamespace(size=100)
    obj = _Object(blob, "x.safetensors", tmp_path / "x.safetensors", partial, [(0, 99)])
    with fs.confined(tmp_path), fs.Dir.open(tmp_path) as d:
        obj.where = d
        _load_journal(obj)
    assert obj.done == set()
    assert partial.read_bytes() == b"\0" * 100


# --- prune: one key holding someone else's entry at its manifest's name --------------------------


@pytest.mark.parametrize("kind", ["fifo", "link", "dir"])
def test_prune_skips_a_key_whose_manifest_was_replaced_and_prunes_the_others(
    tiny_checkpoint_with_tokenizer, tmp_path, kind, capsys
):
    """A FIFO, link or directory put at one key's ``manifest.json`` makes that directory no
    key prune recognises (kept, never read through): prune goes on with the others."""
    root = tmp_path / "root"
    for revision in ("r1", "r2", "r3"):
        assert main(_run_argv(tiny_checkpoint_with_tokenizer, root, "--revision", revision)) == 0
    (odd,) = root.glob("tiny@r2/*")
    (outside := tmp_path / "outside").write_text("a user's\n")
    (odd / "manifest.json").unlink()
    if kind == "fifo":
        os.mkfifo(odd / "manifest.json")
    elif kind == "link":
        (odd / "manifest.json").symlink_to(outside)
    else:
        (odd / "manifest.json").mkdir()
    code = main(["prune", "--repository", str(root), "--keep", "1"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert not list(root.glob("tiny@r1/*"))  # the oldest recognised key went
    assert list(root.glob("tiny@r3/*"))
    assert os.path.lexists(odd / "manifest.json")
    assert outside.read_text() == "a user's\n"


# --- the server's view of a repository: no recursion however deep ------------------------------


def test_the_servers_view_mirrors_a_repository_and_refuses_one_nested_too_deep(tmp_path):
    """``link_tree`` (what ``serve`` hands tritonserver) links every file, links a linked
    directory whole, leaves ``__pycache__`` out; a repository nested deeper than any model is a
    typed error, never a ``RecursionError`` (a walk that recursed broke near 1,000 levels)."""
    from loader import fs
    from loader.errors import RepositoryError
    from loader.serving import link_tree

    repo = tmp_path / "repo"
    (repo / "m" / "1" / "__pycache__").mkdir(parents=True)
    (repo / "m" / "1" / "model.py").write_text("x = 1\n")
    (repo / "m" / "config.pbtxt").write_text('name: "m"\n')
    (tmp_path / "shared").mkdir()
    (repo / "m" / "shared").symlink_to(tmp_path / "shared")
    view = link_tree(repo, tmp_path / "view")
    assert os.readlink(view / "m" / "1" / "model.py") == str(repo / "m" / "1" / "model.py")
    assert os.readlink(view / "m" / "shared") == str(repo / "m" / "shared")
    assert not (view / "m" / "1" / "__pycache__").exists()
    assert (view / "m" / "1").is_dir() and not (view / "m" / "1").is_symlink()

    deep = tmp_path / "deep"
    level = deep
    for _ in range(fs.MAX_TREE_DEPTH + 1):
        level = level / "d"
    os.makedirs(level)
    with pytest.raises(RepositoryError, match="nested"):
        link_tree(deep, tmp_path / "deep-view")


# --- fetch's DEST: only what a fetch wrote is ever replaced -------------------------------------


def _fetch_copy(capsys, source: Path, dest: Path) -> tuple[int, str]:
    code = main(["fetch", "--copy", str(source), str(dest)])
    return code, capsys.readouterr().err


def test_fetch_never_replaces_a_file_of_dests_that_no_fetch_wrote(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """Before: ``fetch --copy SRC DEST`` replaced the user's own ``DEST/config.json`` with the
    source's whenever the two differed. Now DEST carries the loader's record: a file no fetch
    wrote is refused, named, and kept; what a fetch wrote is replaced when its source changes."""
    import shutil

    from loader import fs

    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint_with_tokenizer, source)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "config.json").write_text('{"mine": true}\n')
    (dest / "notes.txt").write_text("mine\n")
    code, err = _fetch_copy(capsys, source, dest)
    assert code == 2 and "config.json" in err and "hint:" in err, err
    assert (dest / "config.json").read_text() == '{"mine": true}\n'
    assert (dest / "notes.txt").read_text() == "mine\n"

    (dest / "config.json").unlink()  # the user moves theirs away: the fetch goes through
    code, err = _fetch_copy(capsys, source, dest)
    assert code == 0, err
    assert (dest / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert (dest / fs.MADE).is_file() and (dest / "notes.txt").read_text() == "mine\n"

    changed = json.loads((source / "config.json").read_text()) | {"comment": "changed"}
    (source / "config.json").write_text(json.dumps(changed))
    code, err = _fetch_copy(capsys, source, dest)  # the fetch's own file: replaced
    assert code == 0, err
    assert json.loads((dest / "config.json").read_text())["comment"] == "changed"


def test_a_record_in_dest_naming_another_marker_is_someone_elses_and_refused(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """A file at the record's name that is not a fetch's record (a user's, another tool's)
    is neither read as one nor overwritten: the fetch stops, naming it."""
    from loader import fs

    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / fs.MADE).write_text("not a record\n")
    code, err = _fetch_copy(capsys, tiny_checkpoint_with_tokenizer, dest)
    assert code == 2 and fs.MADE in err, err
    assert (dest / fs.MADE).read_text() == "not a record\n"
    assert sorted(p.name for p in dest.iterdir()) == [fs.MADE]


def _mark(dest: str, start: float) -> None:
    from loader.fs import Dir
    from loader.sources.transfer import mark_dest

    while time.time() < start:
        pass
    with Dir.open(dest) as d:
        mark_dest(d)


def test_fetches_marking_one_dest_at_once_all_go_on_and_leave_one_whole_record(tmp_path):
    """Several fetches into one DEST mark it at the same moment: none fails, none sees half a
    record, and DEST holds one record and one marker (no temporary name left)."""
    import multiprocessing

    from loader import fs
    from loader.sources.transfer import FETCH_MARKER

    for attempt in range(5):
        dest = tmp_path / f"dest{attempt}"
        dest.mkdir()
        start = time.time() + 0.3
        ctx = multiprocessing.get_context("fork")
        procs = [ctx.Process(target=_mark, args=(str(dest), start)) for _ in range(4)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(30)
        assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
        assert sorted(p.name for p in dest.iterdir()) == sorted([fs.MADE, FETCH_MARKER])
        marker, _ = fs.parse_made((dest / fs.MADE).read_bytes())
        assert marker == FETCH_MARKER
