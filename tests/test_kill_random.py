"""Loaders killed (SIGKILL) at random moments, many times over, with the source changing in
between: whatever the schedule, a published key always verifies and holds what its source held
at one moment, and the last run publishes what the source holds then, with nothing of the
loader's left behind and nothing of the user's lost.

Each schedule comes from a seed (printed with every failure; ``ADVERSARY_SEED=<n>`` replays
one): per cycle the source may be rewritten (another model's weights), a ``model-loader run``
(the console entry: supervised, so the supervisor or its child or both are killed) starts,
with ``--force`` or not, and something is killed after a random delay. The loader's own
directories hold a file of the user's throughout.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader.repository import manifest
from tests import procs
from tests.runs import run_argv, weights

pytestmark = pytest.mark.slow  # a dozen loader processes per schedule, killed

SEEDS = [int(os.environ["ADVERSARY_SEED"])] if "ADVERSARY_SEED" in os.environ else [1, 2]
CYCLES = 10
LOADER_DIRS = (".staging", ".locks", ".trash", ".work")


def _loader(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "loader", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _children(proc: subprocess.Popen) -> list[int]:
    return procs.children(proc.pid)


def _kill(proc: subprocess.Popen, how: str) -> None:
    children = _children(proc)
    if how == "group":
        os.killpg(proc.pid, signal.SIGKILL)
    elif how == "child" and children:
        os.kill(children[0], signal.SIGKILL)  # the supervisor sees it die and cleans up
    else:
        os.kill(proc.pid, signal.SIGKILL)  # the child dies with it (PR_SET_PDEATHSIG)


def _finishes(proc: subprocess.Popen, root: Path, where: str) -> None:
    """``proc`` (a run) ends with 0 within a minute; else the failure says what it said and
    what the lock directory held (a run that waits on a lock says whose)."""
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    if code != 0:
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        locks = {p.name: p.read_bytes()[:300] for p in (root / ".locks").glob("*") if p.is_file()}
        pytest.fail(f"{where}: the last run ended with {code}\n{err[-3000:]}\nlocks: {locks}")


def _published(root: Path) -> list[Path]:
    return [p for p in root.glob("tiny@*/*") if p.is_dir()]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_kills_never_leave_a_broken_or_stale_key(seed, tmp_path):
    from tests.tinymodels import make_sharded_checkpoint

    rng = random.Random(seed)
    where = f"seed {seed} (ADVERSARY_SEED={seed} replays it)"
    models = [make_sharded_checkpoint(tmp_path / f"m{i}", seed=40 + i) for i in range(2)]
    source, root = tmp_path / "source", tmp_path / "root"
    shutil.copytree(models[0], source)
    for name in LOADER_DIRS:
        (root / name).mkdir(parents=True)
        (root / name / "users-file").write_text("the user's")
    argv = run_argv(source, root, "--follow-source", "--lock-timeout", "60")
    started = time.monotonic()
    assert _loader(argv).wait(timeout=60) == 0
    clean_s = time.monotonic() - started
    holds = 0
    for cycle in range(CYCLES):
        if rng.random() < 0.3:  # the source is rewritten in place, file by file
            holds = 1 - holds
            for path in models[holds].iterdir():
                shutil.copyfile(path, source / path.name)
        proc = _loader(argv + (["--force"] if rng.random() < 0.5 else []))
        delay, how = rng.uniform(0, clean_s * 1.2), rng.choice(["group", "child", "parent"])
        time.sleep(delay)
        _kill(proc, how)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{where}, cycle {cycle}: the loader hangs after a kill of the {how}")
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert code in (0, -signal.SIGKILL, 128 + signal.SIGKILL), (
            f"{where}, cycle {cycle} ({how} killed after {delay:.2f} s): exit {code}\n{err[-2000:]}"
        )
        for key in _published(root):
            assert manifest.verify(key) == [], f"{where}, cycle {cycle}: {key} is incomplete"
    _finishes(_loader(argv), root, where)
    (key,) = _published(root)
    assert manifest.verify(key) == [], where
    reference = tmp_path / "reference"
    shutil.copytree(source, tmp_path / "source-now")
    fresh = run_argv(tmp_path / "source-now", reference)
    assert _loader(fresh).wait(timeout=60) == 0, where
    (expected,) = _published(reference)
    ours, theirs = weights(key), weights(expected)
    ours.pop("config.ini"), theirs.pop("config.ini")  # it names the source directory
    assert ours == theirs, f"{where}: the key does not hold what the source holds now"
    for name in LOADER_DIRS:
        left = sorted(p.name for p in (root / name).iterdir())
        assert left == ["users-file"], f"{where}: {name} holds {left}"
        assert (root / name / "users-file").read_text() == "the user's"
