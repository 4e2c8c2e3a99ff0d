"""An overlapped run killed (SIGKILL) once its outputs were moved into its staging directory
keeps them: the rerun re-verifies every output and downloads no shard again. The kill points
are the file-system call sites the run makes after the move (``tests/faults.py``), against the
GCS emulator; the killing is ``tests/test_kill_points.py``'s. ``make test`` kills at every
third of those sites, ``make test-faults`` at every one.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.repository import manifest
from tests.fault_sweep import scratch
from tests.faults import FailAt, Recorder, Site, describe
from tests.servers import GcsServer
from tests.test_kill_points import KILLED, _argv, _call_sites, _kill_self, forked

pytestmark = pytest.mark.server

BUCKET = "models"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny fp16 GPT-J checkpoint in three safetensors shards, with its tokenizer."""
    from tests.tinymodels import make_sharded_checkpoint

    path = make_sharded_checkpoint(tmp_path_factory.mktemp("sharded") / "ckpt", seed=5)
    assert len(list(path.glob("model-*.safetensors"))) >= 3
    return path


@pytest.fixture(scope="module")
def gcs(tmp_path_factory, sharded):
    server = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    server.upload_dir(BUCKET, "org/sharded", sharded)
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", server.url)
    yield server
    mp.undo()
    server.stop()


def _after_the_move(sites: list[Site]) -> list[Site]:
    """The sites first seen once the outputs were recorded as moved into staging."""
    moved = next(
        i for i, (_, frames) in enumerate(sites) if any(f.endswith(":record_move") for f in frames)
    )
    return sites[moved + 1 :]


def _overlap_sweep(gcs, every: bool, caplog) -> None:
    source = f"gs://{BUCKET}/org/sharded"
    with scratch() as base:
        recorder = Recorder()
        with fs.inject(recorder), contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, base / "root", "--retry-deadline", "10")) == 0
        sites = _call_sites(list(recorder.sites))
    later = _after_the_move(sites)
    if not every:
        later = later[::3]
    assert later
    failures = []
    for site in later:
        with scratch() as base:
            root = base / "root"
            code = forked(_argv(source, root, "--retry-deadline", "10"),
                          FailAt(site, action=_kill_self))  # fmt: skip
            if code != KILLED:
                failures.append(f"{describe(site)}: not killed there (exit {code})")
                continue
            caplog.clear()
            with contextlib.redirect_stdout(sys.stderr):
                rerun = main(_argv(source, root, "--retry-deadline", "10"))
            text = caplog.text
            published = list(root.glob("tiny@r1/*"))
            if rerun != 0 or len(published) != 1 or manifest.verify(published[0]) != []:
                failures.append(f"{describe(site)}: the rerun did not publish ({rerun})")
            elif "nothing to do" in text:
                continue  # killed after the rename: already published
            elif "resuming:" not in text or " 0 of " not in text:
                failures.append(f"{describe(site)}: the rerun converted again")
    assert not failures, f"{len(failures)} of {len(later)} kill points:\n" + "\n".join(failures)


def test_outputs_moved_into_staging_survive_a_kill(gcs, caplog):
    caplog.set_level(logging.INFO, logger="loader")
    _overlap_sweep(gcs, every=False, caplog=caplog)


@pytest.mark.exhaustive
@pytest.mark.slow
def test_outputs_moved_into_staging_survive_a_kill_at_every_later_site(gcs, caplog):
    caplog.set_level(logging.INFO, logger="loader")
    _overlap_sweep(gcs, every=True, caplog=caplog)
