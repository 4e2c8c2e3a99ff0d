"""The fault-injection sweep: scenarios (a command and the tree it starts from), what must
hold after each, and the sweep that fails every call site in turn (``tests/test_fault_*.py``).

The call sites are not listed here: a clean run of each scenario records every call the seam
of ``loader.fs`` sees (``tests/faults.py``: the operation and the loader's frames that made it),
then each site's first call fails with an errno of ``loader.errors.ERRNO_CLASSES``. Runs are
in-process, on a tiny model, in a tmpfs where there is one (fsync costs nothing there). After
each: exit 0, or 2/75 with an error and a hint; no traceback; nothing half-published; no lock
file another loader could not take over at once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.errors import ERRNO_CLASSES
from loader.repository import manifest, publish
from loader.repository.key import key_filename
from loader.repository.lock import LOCKS_DIR
from tests.faults import FailAt, Recorder, Site, describe, normal

SHM = Path("/dev/shm")


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A fresh directory, in a tmpfs when the machine has one (parallel-safe names)."""
    parent = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="faults-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def snapshot(path: Path) -> dict[str, str]:
    """Every entry under ``path`` (links not followed): what it is and holds."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(path).as_posix()
            if p.is_symlink():
                found[rel] = "link:" + os.readlink(p)
            elif p.is_fifo():
                found[rel] = "fifo"
            elif p.is_file():
                found[rel] = "file:" + hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                found[rel] = "dir"
    return found


def _run_argv(source: str, root: Path, *extra: str) -> list[str]:
    return ["run", "--source", source, "--repository", str(root), "--model-name", "tiny",
            "--tp-size", "1", "--pp-size", "1", "--instance-count", "1", *extra]  # fmt: skip


def _complete(root: Path, key: str) -> bool:
    path = root / key
    return path.is_dir() and manifest.verify(path, key=key) == []


def _absent_or_complete(root: Path, key: str) -> str | None:
    path = root / key
    if not os.path.lexists(path) or _complete(root, key):
        return None
    return f"{key} is half-published: {manifest.verify(path, key=key)[:3]}"


def _locks_left(root: Path) -> list[str]:
    """Lock files a next loader could not take over at once: empty, or not naming their
    holder's pid and host. (A lock whose removal failed names this process: once the command's
    process exits, it is stale, and taken over at once on this host.)"""
    locks = root / LOCKS_DIR
    if not locks.is_dir():
        return []
    bad = []
    for path in locks.iterdir():
        if not path.name.endswith(".lock"):
            continue
        try:
            record = json.loads(path.read_text())
        except ValueError:
            record = None
        if not isinstance(record, dict) or not {"pid", "host"} <= set(record):
            bad.append(f"{path.name}: {path.read_text()[:40]!r}")
    return bad


@dataclass
class Scenario:
    """A command, the tree it starts from, and what must hold after it whatever failed."""

    name: str
    #: (template directory, scratch directory) -> argv; the template is copied first.
    argv: Callable[[Path], list[str]]
    #: (scratch directory) -> problems with the tree after the command.
    check: Callable[[Path], list[str]]
    template: Path | None = None


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    bugs: list[str]


def _execute(scenario: Scenario, base: Path, hook, caplog) -> Outcome:
    if scenario.template is not None:
        shutil.copytree(scenario.template, base, symlinks=True, dirs_exist_ok=True)
    argv = scenario.argv(base)
    caplog.clear()
    out, err = Path(base / ".out"), Path(base / ".err")
    with (
        open(out, "w") as o,
        open(err, "w") as e,
        contextlib.redirect_stdout(o),
        contextlib.redirect_stderr(e),
        fs.inject(hook),
    ):
        code = main(argv)
    bugs = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and (r.exc_info or "bug" in r.getMessage())
    ]
    result = Outcome(code, out.read_text(), err.read_text(), bugs)
    out.unlink()
    err.unlink()
    return result


def _judge(scenario: Scenario, base: Path, outcome: Outcome, fail: FailAt) -> list[str]:
    problems = []
    if fail.hit is None:
        problems.append("the site was not reached")
    if outcome.code not in (0, 2, 75):
        problems.append(f"exit {outcome.code}")
    if outcome.bugs or "Traceback" in outcome.err or "this is a bug" in outcome.err:
        problems.append(f"a traceback: {outcome.bugs[:1] or outcome.err[-300:]}")
    if outcome.code in (2, 75) and not ("error:" in outcome.err and "hint:" in outcome.err):
        problems.append(f"no error and hint: {outcome.err[-300:]}")
    problems += scenario.check(base)
    locks = _locks_left(base / "root")
    if locks:
        problems.append(f"lock files no loader can take over: {locks}")
    return problems


def sweep(
    scenario: Scenario, sites: list[Site], errnos: Callable[[int], list[int]], caplog
) -> list[str]:
    """Fail each site with the errnos ``errnos(index)``; the problems found, one line each."""
    failures = []
    for index, site in enumerate(sites):
        for code in errnos(index):
            fail = FailAt(site, code)
            with scratch() as base:
                outcome = _execute(scenario, base, fail, caplog)
                problems = _judge(scenario, base, outcome, fail)
                if problems:
                    where = normal(fail.hit or "", base)
                    failures.append(
                        f"{errno.errorcode[code]} at {describe(site)} ({where}): "
                        + "; ".join(problems)
                    )
    return failures


def record(scenario: Scenario, caplog) -> list[Site]:
    """The sites a clean run of ``scenario`` makes (it must succeed)."""
    recorder = Recorder()
    with scratch() as base:
        outcome = _execute(scenario, base, recorder, caplog)
        assert outcome.code == 0, outcome.err[-2000:]
        assert scenario.check(base) == []
    return list(recorder.sites)


# --- the scenarios ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _published_key(out: str) -> str:
    return "/".join(Path(out.splitlines()[-1]).parts[-2:])


@pytest.fixture(scope="module")
def key(tiny_checkpoint_with_tokenizer) -> str:
    from loader.cli import build_parser
    from loader.cli.run import request_from_args

    argv = _run_argv(str(tiny_checkpoint_with_tokenizer), Path("/nonexistent"))
    return request_from_args(build_parser().parse_args(argv)).key


@pytest.fixture(scope="module")
def published(tiny_checkpoint_with_tokenizer, key, dead_pid, tmp_path_factory) -> Path:
    """A template: the key published, and what a killed loader of it left (a staging directory
    and a lock of a dead process on this host)."""
    template = tmp_path_factory.mktemp("published")
    root = template / "root"
    assert main(_run_argv(str(tiny_checkpoint_with_tokenizer), root)) == 0
    staging = publish.new_staging_dir(root, key)
    (staging / "fastertransformer").mkdir()
    (staging / "fastertransformer" / "half-written.bin").write_bytes(b"\0" * 64)
    staging.rename(staging.with_name(staging.name.replace(f".{os.getpid()}-", f".{dead_pid}-")))
    lock = root / LOCKS_DIR / f"{key_filename(key)}.lock"
    lock.parent.mkdir(exist_ok=True)
    host = os.uname().nodename
    lock.write_text(f'{{"pid": {dead_pid}, "host": "{host}", "token": "x", "beats": 1}}')
    return template


@pytest.fixture(scope="module")
def keys_to_prune(tiny_checkpoint_with_tokenizer, dead_pid, tmp_path_factory) -> Path:
    """A template: tiny@r1, r2, r3 published, and leftovers of every kind."""
    template = tmp_path_factory.mktemp("prune")
    root = template / "root"
    source = str(tiny_checkpoint_with_tokenizer)
    for rev in ("r1", "r2", "r3"):
        assert main(_run_argv(source, root, "--revision", rev)) == 0
    (old,) = root.glob("tiny@r1/*")
    key = "/".join(old.parts[-2:])
    staging = publish.new_staging_dir(root, key)
    staging.rename(staging.with_name(staging.name.replace(f".{os.getpid()}-", f".{dead_pid}-")))
    download = root / publish.WORK_DIR / key_filename(key)
    (download / "source").mkdir(parents=True)
    (download / publish.DOWNLOAD_MARKER).write_text(f"{key}\n")
    (root / LOCKS_DIR / f"{key_filename(key)}.lock.stale-0123456789abcdef").write_text("{}")
    return template


def _keys_absent_or_complete(base: Path) -> list[str]:
    root = base / "root"
    return [p for k in _keys(root) if (p := _absent_or_complete(root, k))]


def remote_scenarios(sharded: Path, gs: str) -> dict[str, Scenario]:
    return _remote_scenarios(sharded, gs, fetch="fetch-gs", run="run-overlapped")


def _remote_scenarios(sharded: Path, uri: str, *, fetch: str, run: str) -> dict[str, Scenario]:
    """A fetch of the remote ``uri`` and an overlapped run of it, under these names."""
    return {
        fetch: Scenario(
            fetch,
            lambda base: ["fetch", uri, str(base / "copy"), *REMOTE],
            lambda base: _same_files(sharded, base / "copy"),
        ),
        run: Scenario(
            run,
            lambda base: _run_argv(uri, base / "root", "--revision", "r1", *REMOTE),
            _keys_absent_or_complete,
        ),
    }


def _keys(root: Path) -> list[str]:
    return sorted("/".join(p.parts[-2:]) for p in root.glob("tiny@*/*"))


def _same_files(source: Path, dest: Path) -> list[str]:
    """Every visible file under ``dest`` is the source's file of that name, byte for byte."""
    problems = []
    for path in dest.rglob("*"):
        rel = path.relative_to(dest)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        if not (source / rel).is_file() or (source / rel).read_bytes() != path.read_bytes():
            problems.append(f"{rel} is not the source's")
    return problems


def local_scenarios(
    source: Path, key: str, published: Path, keys_to_prune: Path
) -> dict[str, Scenario]:
    src = str(source)

    def run_new_check(base: Path) -> list[str]:
        problem = _absent_or_complete(base / "root", key)
        return [problem] if problem else []

    def always_complete(base: Path) -> list[str]:
        return [] if _complete(base / "root", key) else [f"{key} has no complete copy"]

    def prune_check(base: Path) -> list[str]:
        root = base / "root"
        problems = [p for k in _keys(root) if (p := _absent_or_complete(root, k))]
        newest = next((k for k in _keys(root) if k.startswith("tiny@r3/")), None)
        if newest is None or not _complete(root, newest):
            problems.append("the newest key was removed")
        return problems

    def convert_check(base: Path) -> list[str]:
        out = base / "out" / "2-gpu"
        if not out.exists():
            return []
        names = sorted(p.name for p in out.iterdir())
        return [] if "config.ini" in names and len(names) > 10 else [f"half-written: {names}"]

    return {
        "run": Scenario(
            "run",
            lambda base: _run_argv(src, base / "root", "--backend", "python"),
            run_new_check,
        ),
        "run-force": Scenario(
            "run-force",
            lambda base: _run_argv(src, base / "root", "--force"),
            always_complete,
            template=published,
        ),
        "run-verify-full": Scenario(
            "run-verify-full",
            lambda base: _run_argv(src, base / "root", "--verify", "full"),
            always_complete,
            template=published,
        ),
        "prune": Scenario(
            "prune",
            lambda base: ["prune", "--repository", str(base / "root"), "--keep", "1"],
            prune_check,
            template=keys_to_prune,
        ),
        "convert": Scenario(
            "convert",
            lambda base: ["convert", src, str(base / "out"), "--tp-size", "2", "--workers", "1"],
            convert_check,
        ),
        "fetch-copy": Scenario(
            "fetch-copy",
            lambda base: ["fetch", src, str(base / "copy"), "--copy"],
            lambda base: _same_files(source, base / "copy"),
        ),
    }


#: Commands on local sources (no server) and on a gs:// source (the GCS emulator).
LOCAL = ("run", "run-force", "run-verify-full", "prune", "convert", "fetch-copy")
REMOTE_COMMANDS = ("fetch-gs", "run-overlapped")
BUCKET = "models"
#: A remote source's options in the sweep: one download at a time, a short retry deadline.
REMOTE = ("--workers", "1", "--retry-deadline", "3")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny fp16 GPT-J checkpoint in three safetensors shards, with its tokenizer."""
    from tests.tinymodels import make_sharded_checkpoint

    path = make_sharded_checkpoint(tmp_path_factory.mktemp("sharded") / "ckpt", seed=9)
    return path


@pytest.fixture(scope="module")
def gs(tmp_path_factory, sharded):
    from tests.servers import GcsServer

    server = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    server.upload_dir(BUCKET, "org/sharded", sharded)
    patch = pytest.MonkeyPatch()
    patch.setenv("STORAGE_EMULATOR_HOST", server.url)
    yield f"gs://{BUCKET}/org/sharded"
    patch.undo()
    server.stop()


@pytest.fixture(scope="module")
def hf(tmp_path_factory, sharded):
    """``hf://org/sharded``: the sharded checkpoint on the olah Hub mirror (HF_ENDPOINT)."""
    from tests.runs import use_hub
    from tests.servers import OlahServer

    base = tmp_path_factory.mktemp("olah")
    server = OlahServer(base)
    server.make_repo("org/sharded", {p.name: p for p in sharded.iterdir() if p.is_file()})
    server.start()
    patch = pytest.MonkeyPatch()
    use_hub(patch, server.url, base / "hf-home")
    yield "hf://org/sharded"
    patch.undo()
    server.stop()


def hf_scenarios(sharded: Path, hf: str) -> dict[str, Scenario]:
    return _remote_scenarios(sharded, hf, fetch="fetch-hf", run="run-overlapped-hf")


#: Commands on an hf:// source (the olah Hub mirror).
HF_COMMANDS = ("fetch-hf", "run-overlapped-hf")


def catalog_of(
    all_scenarios: dict[str, Scenario],
    commands: tuple[str, ...],
    *,
    failed_elsewhere: frozenset[Site] = frozenset(),
) -> dict:
    """Each command's sites, each site under the first command that makes it (the later ones
    need not fail it again), less ``failed_elsewhere``: the very sites, with the same callers,
    that another sweep of the same run fails."""
    seen: set[Site] = set(failed_elsewhere)
    found = {}
    for command in commands:
        sites = [s for s in record(all_scenarios[command], _NoLog()) if s not in seen]
        seen.update(sites)
        found[command] = sites
    return found


@pytest.fixture(scope="module")
def local(tiny_checkpoint_with_tokenizer, key, published, keys_to_prune):
    """The local scenarios and their catalog of sites."""
    found = local_scenarios(tiny_checkpoint_with_tokenizer, key, published, keys_to_prune)
    return found, catalog_of(found, LOCAL)


class _NoLog:
    """Stands in for caplog where nothing is judged (a clean run)."""

    def __init__(self) -> None:
        self.records: list = []

    def clear(self) -> None:
        pass


def call_sites(sites: list[Site]) -> list[Site]:
    """One site per operation and innermost frame: the call site itself."""
    unique: dict[Site, Site] = {}
    for op, frames in sites:
        unique.setdefault((op, frames[:1]), (op, frames))
    return list(unique.values())


def rotation(index: int) -> list[int]:
    return [ERRNO_CLASSES[index % len(ERRNO_CLASSES)]]


def every_errno_of(codes: tuple[int, ...], local, caplog) -> None:
    """Exhaustive: every call site of every local command with each errno of ``codes``."""
    caplog.set_level(logging.INFO)
    scenarios, catalog = local
    failures = []
    for code in codes:
        for command in LOCAL:
            failures += sweep(scenarios[command], call_sites(catalog[command]), lambda _, c=code: [c],
                              caplog)  # fmt: skip
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
