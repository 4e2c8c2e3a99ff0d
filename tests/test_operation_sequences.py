"""Generated sequences of what an operator of a shared model volume sees happen to one ROOT:
runs of two revisions (plain, ``--force``), ``prune --keep N``, a run SIGKILLed at its k-th
file-system call, a user planting a file, directory, link or FIFO at a name inside the loader's
directories (a name of the user's, one the loader would use, or one a loader gone now would
have moved its own file to before removing it), a user's text at a lock's name beginning as a
lock record does, a user changing a byte of a published weight, and the local source changing
between operations.

After every step:

* every published copy under a key directory that holds ``.ready`` verifies, unless the user
  changed one of its bytes since (then the next run of that revision that exits 0 must publish
  one that does);
* a run that exits 0 printed a path that verifies and whose manifest records the source as it
  is now;
* every entry the user planted is as the user left it;
* every exit is 0, 2 or 75 (or the SIGKILL the step sent);
* nothing outside ROOT changed but what the step itself changed (the source).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader import fs
from loader.cli import main
from loader.repository import manifest
from loader.repository.key import key_filename
from loader.sources import FetchOptions, parse_uri
from loader.sources.local import fingerprint_source
from tests.runs import run_argv, tree_digest

pytestmark = pytest.mark.slow  # a few dozen forked loaders

REVISIONS = ("r1", "r2")
PLACES = (".staging", ".work", ".trash", ".locks", "tiny@r1", "tiny@r2")
KINDS = ("file", "dir", "link", "fifo")
KILLED = -signal.SIGKILL
#: A user's text at a lock's name that begins as a lock record does, and is none.
LOCK_TEXTS = ('{"key": "my-setting", "value": 1}\n{"key": "other", "value": 2}\n',
              '{"key": "tiny"} notes on this key\n')  # fmt: skip


def forked(argv: list[str], hook: Callable[[str, str], None] | None = None) -> tuple[int, str, str]:
    """``model-loader argv`` in a forked copy of this process (``hook`` on the file-system
    seam): its exit code (minus the signal that ended it), stdout and stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            code = 99
            try:
                sys.stdout = open(out, "w")  # noqa: SIM115
                sys.stderr = open(err, "w")  # noqa: SIM115
                os.dup2(sys.stdout.fileno(), 1)
                os.dup2(sys.stderr.fileno(), 2)
                for handler in logging.root.handlers[:]:
                    logging.root.removeHandler(handler)
                with fs.inject(hook or (lambda op, path: None)):
                    code = main(argv)
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return code, out.read_text(errors="replace"), err.read_text(errors="replace")


def _kill_at(k: int) -> Callable[[str, str], None]:
    calls = itertools.count(1)  # one number per call, whichever thread makes it

    def hook(op: str, path: str) -> None:
        if next(calls) == k:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


@dataclass(frozen=True)
class Planted:
    path: Path
    kind: str
    ino: int
    what: str  # a file's text, a link's target, a directory's listing
    movable: bool = False  # planted inside a copy of the loader's (published or staged)

    @classmethod
    def make(cls, path: Path, kind: str, target: Path, movable: bool = False) -> Planted:
        if kind == "file":
            path.write_text("the user's")
        elif kind == "dir":
            path.mkdir()
            (path / "inside").write_text("the user's")
        elif kind == "link":
            path.symlink_to(target)
        else:
            os.mkfifo(path)
        return cls(path, kind, path.lstat().st_ino, cls._what(path, kind), movable)

    @staticmethod
    def _what(path: Path, kind: str) -> str:
        if kind == "file":
            return path.read_text()
        if kind == "dir":
            return json.dumps({p.name: p.read_text() for p in sorted(path.iterdir())})
        if kind == "link":
            return os.readlink(path)
        return "fifo"

    def untouched(self, root: Path) -> str | None:
        path = self.path
        try:
            info = path.lstat()
        except FileNotFoundError:
            info = None
        if self.movable and (info is None or info.st_ino != self.ino):
            # In a copy of the loader's: the copy may move (aside, back into .staging) with
            # it, the entry kept in it.
            path = next((p for p in root.rglob(path.name) if p.lstat().st_ino == self.ino), path)
            info = path.lstat() if os.path.lexists(path) else None
        if info is None:
            return f"the user's {self.kind} {self.path} was removed"
        kinds = {"file": stat.S_ISREG, "dir": stat.S_ISDIR, "link": stat.S_ISLNK}
        if not kinds.get(self.kind, stat.S_ISFIFO)(info.st_mode) or info.st_ino != self.ino:
            return f"the user's {self.kind} {self.path} was replaced"
        if self._what(path, self.kind) != self.what:
            return f"the user's {self.kind} {self.path} was changed"
        return None


class Volume:
    """One ROOT, its source and what the steps expect of them."""

    def __init__(self, base: Path, template: Path, keys: dict[str, str]) -> None:
        self.base = base
        shutil.copytree(template, base, symlinks=True)
        self.root, self.source, self.outside = base / "root", base / "source", base / "outside"
        self.keys = keys  # revision -> key ("tiny@r1/tp1-...")
        self.planted: list[Planted] = []
        self.damaged: set[str] = set()  # revisions whose published copy the user changed
        self.log: list[str] = []
        self.outside_digest = self._outside()

    def _outside(self) -> str:
        return tree_digest(self.outside) + tree_digest(self.source)

    def argv(self, revision: str, *extra: str) -> list[str]:
        return run_argv(self.source, self.root, "--revision", revision, "--lock-timeout", "5",
                        *extra)  # fmt: skip

    # -- steps ---------------------------------------------------------------------------

    def run(self, revision: str, force: bool, option: str = "") -> None:
        extra = [*(["--force"] if force else []), *option.split()]
        code, out, err = forked(self.argv(revision, *extra))
        self.log.append(f"run {revision} {' '.join(extra)}: exit {code}")
        self._exited(code, err)
        if code == 0:
            path = Path(out.splitlines()[-1])
            assert path == self.root / self.keys[revision], (path, self.log)
            assert manifest.verify(path) == [], (path, self.log, err[-2000:])
            recorded = (manifest.read_manifest(path) or {}).get(manifest.SOURCE_FINGERPRINT)
            now = fingerprint_source(parse_uri(str(self.source)), FetchOptions())
            assert (recorded or {}).get("files") == now.as_dict().get("files"), (
                f"{path} was reported for a source that is no longer what it was built from",
                self.log,
            )
            self.damaged.discard(revision)

    def killed_run(self, revision: str, force: bool, k: int) -> None:
        argv = self.argv(revision, *(["--force"] if force else []))
        code, _, err = forked(argv, _kill_at(k))
        self.log.append(f"run {revision}{' --force' if force else ''} killed at call {k}: {code}")
        if code != KILLED:
            self._exited(code, err)

    def prune(self, keep: int) -> None:
        argv = ["prune", "--repository", str(self.root), "--keep", str(keep)]
        code, _, err = forked(argv)
        self.log.append(f"prune --keep {keep}: exit {code}")
        self._exited(code, err)
        for revision in list(self.damaged):  # a pruned key is no longer the user's damage
            if not (self.root / self.keys[revision]).exists():
                self.damaged.discard(revision)

    def killed_prune(self, keep: int, k: int) -> None:
        argv = ["prune", "--repository", str(self.root), "--keep", str(keep)]
        code, _, err = forked(argv, _kill_at(k))
        self.log.append(f"prune --keep {keep} killed at call {k}: {code}")
        if code != KILLED:
            self._exited(code, err)
        for revision in list(self.damaged):
            if not (self.root / self.keys[revision]).exists():
                self.damaged.discard(revision)

    def plant(self, place: str, kind: str, loader_name: bool, revision: str) -> None:
        key = self.keys[revision]
        if loader_name:  # the name the loader would give its own entry there
            names = {
                ".locks": f"{key_filename(key)}.lock",
                ".work": key_filename(key),
                ".staging": key_filename(key),
                ".trash": key_filename(key),
            }
            name = names.get(place, key.split("/")[1])
        else:
            name = f"users-{len(self.planted)}"
        folder = self.root / place
        if not folder.is_dir() or folder.is_symlink():
            return
        path = folder / name
        if os.path.lexists(path):
            return
        target = self.outside / ("dir" if len(self.planted) % 2 else "file")
        self.planted.append(Planted.make(path, kind, target))
        self.log.append(f"plant {kind} {path.relative_to(self.root)}")

    def plant_top(self, name: str, kind: str, inside: bool) -> None:
        """An entry of the user's where the loader keeps its directories, when none is there
        yet; a link points outside ROOT or at a published key."""
        path = self.root / name
        if os.path.lexists(path):
            return
        target = self.root / self.keys["r1"] if inside else self.outside / "dir"
        self.planted.append(Planted.make(path, kind, target))
        self.log.append(f"plant {kind} {name}{f' -> {target}' if kind == 'link' else ''}")

    def plant_gone(self, place: str, kind: str) -> None:
        """An entry of the user's at the name a loader, gone now, would have moved a file of
        its own to before removing it (``.model-loader-gone.<owner>.<hex>``)."""
        folder = self.root / place
        if not folder.is_dir() or folder.is_symlink():
            return
        owner = f"{fs.PID_MAX + 1}-{fs.host_digest()}"  # no process has that pid: gone
        path = folder / f"{fs.MARKER_PREFIX}gone.{owner}.{len(self.planted):012x}"
        self.planted.append(Planted.make(path, kind, self.outside / "file"))
        self.log.append(f"plant {kind} {path.relative_to(self.root)}")

    def plant_lock_text(self, revision: str, which: int) -> None:
        """A file of the user's at the key's lock name, unchanged for a day, beginning as a
        lock record does but none (JSON lines, an object followed by notes)."""
        path = self.root / ".locks" / f"{key_filename(self.keys[revision])}.lock"
        if not path.parent.is_dir() or os.path.lexists(path):
            return
        path.write_text(LOCK_TEXTS[which])
        os.utime(path, (path.stat().st_atime - 86400, path.stat().st_mtime - 86400))
        self.planted.append(Planted(path, "file", path.stat().st_ino, LOCK_TEXTS[which]))
        self.log.append(f"plant lock text {which} {path.relative_to(self.root)}")

    def plant_in_key(self, revision: str, kind: str, deep: bool) -> None:
        key = self.root / self.keys[revision]
        if not (key / manifest.READY).exists():
            return
        folder = next((key / "fastertransformer" / "1").glob("*-gpu")) if deep else key
        path = folder / f"users-{len(self.planted)}"
        self.planted.append(Planted.make(path, kind, self.outside / "file", movable=True))
        self.damaged.add(revision)  # not the copy the loader published any more
        self.log.append(f"plant {kind} {path.relative_to(self.root)}")

    def plant_during_run(self, revision: str, kind: str, deep: bool, k: int, where: str) -> None:
        """At the k-th file-system call of a run (``--force`` when ``where`` is the key), the
        user plants an entry inside the staging directory it builds or the published key it
        replaces."""
        record = self.base.parent / "planted.json"
        name, target = f"users-{len(self.planted)}", self.outside / "file"
        staging, key = self.root / ".staging", self.root / self.keys[revision]
        calls, lock = 0, threading.Lock()  # the hashing workers call the seam too

        def hook(op: str, seen: str) -> None:
            with lock:
                nonlocal calls
                calls += 1
                if calls >= k and not record.exists():
                    plant()

        def plant() -> None:
            tops = (
                [key] if where == "key" else sorted(staging.iterdir()) if staging.is_dir() else []
            )
            for top in tops:
                folder = (
                    next((top / "fastertransformer" / "1").glob("*-gpu"), None) if deep else top
                )
                if folder is None or not folder.is_dir() or folder.is_symlink():
                    continue
                planted = Planted.make(folder / name, kind, target, movable=True)
                record.write_text(json.dumps([str(planted.path), planted.ino, planted.what]))
                return

        extra = ["--force"] if where == "key" else []
        code, _, err = forked(self.argv(revision, *extra), hook)
        self.log.append(
            f"run {revision} {extra} with a {kind} planted in the {where} at {k}: {code}"
        )
        self._exited(code, err)
        if record.exists():
            path, ino, what = json.loads(record.read_text())
            record.unlink()
            self.planted.append(Planted(Path(path), kind, ino, what, movable=True))
            self.log.append(f"  planted {Path(path).relative_to(self.root)}")
            self.damaged.add(revision)  # the copy published may hold the user's entry

    def damage(self, revision: str, which: int) -> None:
        key = self.root / self.keys[revision]
        if not (key / manifest.READY).exists():
            return
        (folder,) = (key / "fastertransformer" / "1").glob("*-gpu")
        files = sorted(p for p in folder.iterdir() if p.suffix == ".bin")
        path = files[which % len(files)]
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        os.chmod(path, 0o644)
        path.write_bytes(bytes(data))
        self.damaged.add(revision)
        self.log.append(f"damage {revision} {path.name}")

    def change_source(self) -> None:
        (weights,) = self.source.glob("*.safetensors")
        data = bytearray(weights.read_bytes())
        data[-4] ^= 0x01  # the lowest mantissa bit of the last fp32 value
        weights.write_bytes(bytes(data))
        self.outside_digest = self._outside()
        self.log.append("source changed")

    # -- invariants ----------------------------------------------------------------------

    def _exited(self, code: int, err: str) -> None:
        assert code in (0, 2, 75), (self.log, err[-3000:])
        assert "Traceback" not in err, (self.log, err[-3000:])

    def check(self) -> None:
        for revision, key in self.keys.items():
            path = self.root / key
            if revision in self.damaged or not (path / manifest.READY).exists():
                continue
            assert manifest.verify(path) == [], (f"{key} is published but broken", self.log)
        for planted in self.planted:
            problem = planted.untouched(self.root)
            assert problem is None, (problem, self.log)
        assert self._outside() == self.outside_digest, ("something outside ROOT changed", self.log)


@pytest.fixture(scope="module")
def template(tiny_checkpoint_with_tokenizer, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A volume ``v``: a source, a ROOT with r1 published and entries outside ROOT for links
    to point at, saved as ``template``; every example starts from a copy of it at the same
    path (the source's URI is part of what a key was built from). The keys of both
    revisions."""
    base = tmp_path_factory.mktemp("sequences")
    volume = base / "v"
    shutil.copytree(tiny_checkpoint_with_tokenizer, volume / "source")
    (volume / "outside" / "dir").mkdir(parents=True)
    (volume / "outside" / "dir" / "kept").write_text("outside ROOT")
    (volume / "outside" / "file").write_text("outside ROOT")
    keys = {}
    for revision in REVISIONS:
        argv = run_argv(volume / "source", volume / "root", "--revision", revision)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(argv) == 0
        keys[revision] = str(Path(out.getvalue().splitlines()[-1]).relative_to(volume / "root"))
    shutil.rmtree(volume / "root" / "tiny@r2")
    shutil.copytree(volume, base / "template", symlinks=True)
    return base, keys


_revision = st.sampled_from(REVISIONS)
STEPS = st.one_of(
    st.tuples(
        st.just("run"),
        _revision,
        st.booleans(),
        st.sampled_from(["", "--follow-source", "--no-verify-checksums", "--verify full"]),
    ),
    st.tuples(st.just("killed_prune"), st.integers(1, 2), st.integers(1, 60)),
    st.tuples(st.just("killed_run"), _revision, st.booleans(), st.integers(1, 2600)),
    st.tuples(st.just("prune"), st.integers(1, 2)),
    st.tuples(
        st.just("plant"), st.sampled_from(PLACES), st.sampled_from(KINDS), st.booleans(), _revision
    ),
    st.tuples(st.just("damage"), _revision, st.integers(0, 50)),
    st.tuples(
        st.just("plant_top"),
        st.sampled_from([".staging", ".work", ".trash", ".locks", "tiny@r2"]),
        st.sampled_from(KINDS),
        st.booleans(),
    ),
    st.tuples(st.just("plant_in_key"), _revision, st.sampled_from(KINDS), st.booleans()),
    st.tuples(
        st.just("plant_during_run"),
        _revision,
        st.sampled_from(KINDS),
        st.booleans(),
        st.integers(1, 2600),
        st.sampled_from(["staging", "key"]),
    ),
    st.tuples(st.just("change_source")),
    st.tuples(st.just("plant_gone"), st.sampled_from(PLACES), st.sampled_from(KINDS)),
    st.tuples(st.just("plant_lock_text"), _revision, st.integers(0, 1)),
)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(STEPS, min_size=1, max_size=8))
def test_any_sequence_of_operations_keeps_the_volume_sound(template, steps):
    base, keys = template
    shutil.rmtree(base / "v", ignore_errors=True)
    volume = Volume(base / "v", base / "template", keys)
    volume.check()
    for name, *args in steps:
        getattr(volume, name)(*args)
        volume.check()
    volume.run("r1", False)  # whatever came before, a run of the source ends sound
    volume.check()
