"""`model-loader run` from gs:// converting while it downloads (loader.convert.overlapped).

Against the real fake-gcs-server: the overlapped run publishes the same repository as the
sequential one, holds a few shards at a time, aborts without publishing on a corrupt shard found
late, and a killed run resumes with the outputs it wrote and the shards it verified.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader.cli import main
from loader.convert import overlapped as overlap
from loader.convert.overlapped import Journal
from loader.convert.schedule import DEFAULT_WINDOW
from loader.errors import ChecksumMismatchError
from loader.repository import manifest
from loader.repository.publish import STAGING_DIR
from tests.servers import GcsServer, ThrottleProxy
from tests.tinymodels import make_sharded_fp16_checkpoint

BUCKET = "models"
#: Shards of the test checkpoint: enough that a window of two is a small part of it.
SHARDS_AT_LEAST = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = make_sharded_fp16_checkpoint(tmp_path_factory.mktemp("sharded-fp16") / "ckpt")
    assert len(list(path.glob("model-*.safetensors"))) >= SHARDS_AT_LEAST
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    srv = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    srv.upload_dir(BUCKET, "org/sharded", checkpoint)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def emulator(monkeypatch, server):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)


def _argv(source: str, root: Path, *extra: str) -> list[str]:
    return ["run", "--source", source, "--repository", str(root), "--model-name", "tiny",
            "--tp-size", "2", "--pp-size", "1", "--instance-count", "1", *extra]  # fmt: skip


def _weights(published: Path) -> dict[str, bytes]:
    folder = published / "fastertransformer" / "1" / "2-gpu"
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _published(root: Path) -> Path:
    (path,) = root.glob("tiny@*/*")
    return path


@pytest.fixture(scope="module")
def sequential(server, tmp_path_factory) -> Path:
    """The repository the download-then-convert path publishes (the reference)."""
    root = tmp_path_factory.mktemp("sequential")
    env = {**os.environ, "STORAGE_EMULATOR_HOST": server.url}
    proc = subprocess.run(
        [sys.executable, "-m", "loader", *_argv(f"gs://{BUCKET}/org/sharded", root, "--no-overlap")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "while it downloads" not in proc.stderr
    return _published(root)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def test_the_overlapped_run_publishes_what_the_sequential_one_does_holding_few_shards(
    sequential, checkpoint, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="loader")
    root = tmp_path / "models"
    shards = sorted(checkpoint.glob("model-*.safetensors"))
    largest = max(p.stat().st_size for p in shards)
    on_disk: list[int] = []  # shard bytes under the download directory at each arrival
    peaks: list[int] = []  # the whole repository root at each arrival
    real_arrived = overlap.OverlappedConversion.arrived

    def arrived(self, rel, path):
        if not rel.endswith(".safetensors"):
            return real_arrived(self, rel, path)
        on_disk.append(sum(p.stat().st_size for p in path.parent.glob("model-*.safetensors")))
        peaks.append(_tree_bytes(root))
        return real_arrived(self, rel, path)

    monkeypatch.setattr(overlap.OverlappedConversion, "arrived", arrived)
    assert main(_argv(f"gs://{BUCKET}/org/sharded", root)) == 0
    published = _published(root)
    assert "converting while it downloads" in caplog.text.replace(
        f"converting gs://{BUCKET}/org/sharded while", "converting while"
    )
    assert manifest.verify(published) == []
    assert _weights(published) == _weights(sequential)
    ours = {e["path"]: e["sha256"] for e in manifest.read_manifest(published)["files"]}
    theirs = {e["path"]: e["sha256"] for e in manifest.read_manifest(sequential)["files"]}
    assert ours == theirs

    # The disk accounting: every shard arrived, at most window + 1 of them were on disk at
    # once (the window, and the one let in when those held wait for it), never the checkpoint.
    assert len(on_disk) == len(shards)
    assert max(on_disk) <= (DEFAULT_WINDOW + 1) * largest
    assert max(on_disk) < sum(p.stat().st_size for p in shards) / 2
    outputs = _tree_bytes(published / "fastertransformer")
    assert max(peaks) <= outputs + (DEFAULT_WINDOW + 1) * largest + 2**20
    assert not (root / ".work").exists() or not any((root / ".work").iterdir())


def test_a_corrupt_shard_found_late_aborts_without_publishing_and_the_rerun_resumes(
    server, sequential, checkpoint, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="loader")
    prefix = "org/late-corrupt"
    server.upload_dir(BUCKET, prefix, checkpoint)
    last = sorted(checkpoint.glob("model-*.safetensors"))[-1].name
    stored = server.stored_path(BUCKET, f"{prefix}/{last}")
    good = stored.read_bytes()
    with open(stored, "r+b") as fh:  # flip bytes behind the server's back; metadata unchanged
        fh.seek(len(good) - 100)
        fh.write(b"\xff\xfe\xfd\xfc")
    root = tmp_path / "models"
    assert main(_argv(f"gs://{BUCKET}/{prefix}", root)) == ChecksumMismatchError.exit_code
    assert not list(root.glob("tiny@*/*"))  # nothing published
    assert not (root / STAGING_DIR).exists() or not any((root / STAGING_DIR).iterdir())
    (converted,) = root.glob(".work/*/converted/2-gpu")
    journal = (converted / Journal.NAME).read_text().splitlines()
    assert len(journal) > 10  # outputs of the earlier shards were written before the failure

    stored.write_bytes(good)
    caplog.clear()
    assert main(_argv(f"gs://{BUCKET}/{prefix}", root)) == 0
    assert f"resuming: {len(journal) - 1} output file(s) already written" in caplog.text
    fetched = [r.getMessage() for r in caplog.records if "to fetch" in r.getMessage()]
    assert fetched and " of " in fetched[0]
    to_fetch, of = (int(w) for w in fetched[0].split(", ")[1].split()[0:3:2])
    assert 1 <= to_fetch < of
    published = _published(root)
    assert manifest.verify(published) == []
    assert _weights(published) == _weights(sequential)


def test_a_killed_overlapped_run_resumes_without_downloading_verified_shards_again(
    checkpoint, sequential, tmp_path
):
    proxy = ThrottleProxy(0, rate=400_000.0)  # slow enough to kill it midway
    slow = GcsServer(tmp_path / "gcs", external_url=proxy.url).start()
    proxy.target_port = slow.port
    proxy.start()
    slow.upload_dir(BUCKET, "org/sharded", checkpoint)
    root = tmp_path / "models"
    source = f"gs://{BUCKET}/org/sharded"
    env = {**os.environ, "STORAGE_EMULATOR_HOST": proxy.url}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "loader", *_argv(source, root), "--workers", "2"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        journal = None
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(root.glob(f".work/*/converted/2-gpu/{Journal.NAME}"))
            if found and len(found[0].read_text().splitlines()) > 10:
                journal = found[0]
                break
            time.sleep(0.05)
        assert journal is not None, proc.communicate()[1]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert not list(root.glob("tiny@*/*"))
        written = len(journal.read_text().splitlines()) - 1
        rerun = subprocess.run(
            [sys.executable, "-m", "loader", *_argv(source, root)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        proxy.stop()
        slow.stop()
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming:" in rerun.stderr
    kept = int(rerun.stderr.split("resuming: ")[1].split()[0])
    assert kept >= written - 2  # the outputs journaled (a write in flight may be redone)
    line = next(x for x in rerun.stderr.splitlines() if "shard(s) to fetch" in x)
    to_fetch, of = (int(w) for w in line.split("output file(s) to write, ")[1].split()[0:3:2])
    assert to_fetch < of
    published = Path(rerun.stdout.splitlines()[-1])
    assert manifest.verify(published) == []
    assert _weights(published) == _weights(sequential)
