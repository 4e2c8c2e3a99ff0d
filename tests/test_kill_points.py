"""A loader killed (SIGKILL) at any file-system call site never leaves a key without a complete
copy, and a killed overlapped run keeps the outputs it moved into its staging directory.

The kill points are not listed: a clean run records every call the seam of ``loader.fs`` sees
(``tests/faults.py``), then a forked copy of this process runs the same command and kills
itself at the first call of one site, as the OOM killer or a deleted pod would. What must hold
after each kill:

* ``run --force`` over a published key (with ``renameat2`` and with the fallback of a file
  system without it): a rerun while the source is unreachable still finds a complete copy
  under the key;
* an overlapped ``run`` killed once its outputs were moved into the staging directory:
  ``tests/test_kill_points_overlapped.py``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.repository import manifest
from tests.fault_sweep import scratch
from tests.faults import FailAt, Recorder, Site, describe
from tests.tiers import EXHAUSTIVE, SAMPLED, sampled

# Generated cases by the dozen, each rendering or running a command: in make test, not test-fast.
pytestmark = pytest.mark.slow

KILLED = -signal.SIGKILL


def _argv(source: str, root: Path, *extra: str) -> list[str]:
    return ["run", "--source", source, "--repository", str(root), "--model-name", "tiny",
            "--revision", "r1", "--tp-size", "1", "--pp-size", "1", "--instance-count", "1",
            *extra]  # fmt: skip


def forked(argv: list[str], hook: Callable[[str, str], None]) -> int:
    """Run ``model-loader argv`` in a forked copy of this process with ``hook`` on the seam;
    its exit code, or minus the signal that ended it."""
    pid = os.fork()
    if pid == 0:  # the child: quiet, and never back into pytest
        code = 99
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            logging.disable(logging.CRITICAL)
            with fs.inject(hook):
                code = main(argv)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _kill_self(_path: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _no_renameat2(inner: Callable[[str, str], None]) -> Callable[[str, str], None]:
    """``inner``, on a file system whose ``renameat2`` answers EINVAL (some NFS servers)."""

    def hook(op: str, path: str) -> None:
        inner(op, path)
        if op in ("rename-exchange", "rename-noreplace"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)

    return hook


def _recorded(argv: list[str], hook_around=lambda h: h) -> list[Site]:
    recorder = Recorder()
    with fs.inject(hook_around(recorder)), contextlib.redirect_stdout(sys.stderr):
        assert main(argv) == 0
    return list(recorder.sites)


def _call_sites(sites: list[Site]) -> list[Site]:
    unique: dict[tuple, Site] = {}
    for op, frames in sites:
        unique.setdefault((op, frames[:1]), (op, frames))
    return list(unique.values())


@pytest.fixture(scope="module")
def source(tiny_checkpoint_with_tokenizer) -> str:
    return str(tiny_checkpoint_with_tokenizer)


@pytest.fixture(scope="module")
def template(source, tmp_path_factory) -> Path:
    """A root with the key published."""
    base = tmp_path_factory.mktemp("force")
    with contextlib.redirect_stdout(sys.stderr):
        assert main(_argv(source, base / "root")) == 0
    return base


def _key(root: Path) -> Path:
    (path,) = root.glob("tiny@r1/*")
    return path


def _publishing(site: Site) -> bool:
    """A call publishing itself makes."""
    return bool(site[1]) and site[1][0].startswith("repository/publish.py")


def _force_sweep(source: str, template: Path, *, fallback: bool, publishing: bool) -> None:
    """Kill ``run --force`` at each of its call sites that publishing makes (``publishing``) or
    at each of the others: the two tests below kill it at every site once."""
    around = _no_renameat2 if fallback else (lambda h: h)
    with scratch() as base:
        shutil.copytree(template, base, dirs_exist_ok=True)
        sites = _call_sites(_recorded(_argv(source, base / "root", "--force"), around))
    sites = [s for s in sites if _publishing(s) == publishing]
    assert sites
    sites = sampled(sites)
    failures = []
    for site in sites:
        with scratch() as base:
            shutil.copytree(template, base, dirs_exist_ok=True)
            root = base / "root"
            killer = FailAt(site, action=_kill_self)
            code = forked(_argv(source, root, "--force"), around(killer))
            if code != KILLED:
                failures.append(f"{describe(site)}: not killed there (exit {code})")
                continue
            # The source is unreachable now: the rerun cannot publish; a copy must be there.
            down = _argv(str(base / "gone"), root, "--lock-expiry-s", "1")
            with contextlib.redirect_stdout(sys.stderr):
                rerun = main(down)
            if rerun != 2:
                failures.append(f"{describe(site)}: the rerun exited {rerun}")
            published = root / "tiny@r1"
            keys = list(published.iterdir()) if published.is_dir() else []
            if len(keys) != 1 or manifest.verify(keys[0]) != []:
                failures.append(f"{describe(site)}: no complete copy under the key ({keys})")
    assert not failures, f"{len(failures)} of {len(sites)} kill points:\n" + "\n".join(failures)


@SAMPLED
@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "no-renameat2"])
def test_a_forced_replacement_killed_while_publishing_leaves_a_complete_copy(
    source, template, fallback
):
    _force_sweep(source, template, fallback=fallback, publishing=True)


@pytest.mark.slow
@SAMPLED
@pytest.mark.parametrize("fallback", [False, pytest.param(True, marks=EXHAUSTIVE)],
                         ids=["renameat2", "no-renameat2"])  # fmt: skip
def test_a_forced_replacement_killed_anywhere_leaves_a_complete_copy(source, template, fallback):
    """Anywhere else: every site the test above does not kill at (the same run, the same
    checks). Without renameat2 only the publishing sites differ, which the test above kills at:
    ``make test-faults`` kills there at every other site too."""
    _force_sweep(source, template, fallback=fallback, publishing=False)
