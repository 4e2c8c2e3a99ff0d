"""`model-loader run` from gs:// converting while it downloads (loader.run.strategies.Overlapped).

Against the real fake-gcs-server: the overlapped run publishes the same repository as the
sequential one, holds a few shards at a time, aborts without publishing on a corrupt shard found
late, and a killed run resumes with the outputs it wrote and the shards it verified.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader.cli import main
from loader.convert.overlapped import Journal, OverlappedConversion
from loader.convert.schedule import DEFAULT_WINDOW
from loader.errors import ChecksumMismatchError
from loader.repository import manifest
from loader.repository.publish import STAGING_DIR
from loader.sources import gcs
from tests import runs
from tests.servers import GcsServer, ThrottleProxy

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)


BUCKET = "models"
SOURCE = f"gs://{BUCKET}/org/sharded"
#: Shards of the test checkpoint: enough that a window of two is a small part of it.
SHARDS_AT_LEAST = 8


@pytest.fixture(scope="module")
def checkpoint(sharded_fp16_checkpoint) -> Path:
    assert len(list(sharded_fp16_checkpoint.glob("model-*.safetensors"))) >= SHARDS_AT_LEAST
    return sharded_fp16_checkpoint


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
    return runs.run_argv(source, root, *extra, tp=2, backend=None)


@pytest.fixture(scope="module")
def sequential(server, tmp_path_factory) -> Path:
    """The repository the download-then-convert strategy publishes (the reference)."""
    root = tmp_path_factory.mktemp("sequential")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STORAGE_EMULATOR_HOST", server.url)
        runs.never_overlap(patch)
        assert main(_argv(SOURCE, root, "--no-overlap")) == 0
    return runs.published(root)


def test_the_overlapped_run_publishes_what_the_sequential_one_does_holding_few_shards(
    sequential, checkpoint, tmp_path, monkeypatch
):
    root = tmp_path / "models"
    shards = sorted(checkpoint.glob("model-*.safetensors"))
    largest = max(p.stat().st_size for p in shards)
    arrivals = runs.record_arrivals(monkeypatch, root)
    assert main(_argv(SOURCE, root)) == 0
    repository = runs.published(root)
    assert arrivals.shards == [p.name for p in shards]  # each through the overlapped conversion
    assert manifest.verify(repository) == []
    assert runs.weights(repository) == runs.weights(sequential)
    ours = {e["path"]: e["blake3"] for e in manifest.read_manifest(repository)["files"]}
    theirs = {e["path"]: e["blake3"] for e in manifest.read_manifest(sequential)["files"]}
    assert ours == theirs

    # The disk accounting: at most window + 1 shards were on disk at once (the window, and the
    # one let in when those held wait for it), never the checkpoint.
    assert max(arrivals.shards_on_disk) <= (DEFAULT_WINDOW + 1) * largest
    assert max(arrivals.shards_on_disk) < sum(p.stat().st_size for p in shards) / 2
    outputs = runs.tree_bytes(repository / "fastertransformer")
    assert max(arrivals.root_bytes) <= outputs + (DEFAULT_WINDOW + 1) * largest + 2**20
    assert not (root / ".work").exists() or not any((root / ".work").iterdir())


def test_shards_are_neither_fsynced_nor_read_back_and_every_output_is_made_durable(
    sequential, tmp_path, monkeypatch
):
    """A shard is deleted once converted: verified from the bytes as they arrived, never read
    back, never forced to the disk (the kernel may drop it before writing it back). The
    outputs are fsynced before the journal records them."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    read_back: list[str] = []

    def recording(real):
        def read(fh, *args, **kwargs):
            read_back.append(Path(os.readlink(f"/proc/self/fd/{fh.fileno()}")).name)
            return real(fh, *args, **kwargs)

        return read

    monkeypatch.setattr(os, "fsync", fsync)
    for name in ("crc32c_of", "md5_of"):
        monkeypatch.setattr(gcs, name, recording(getattr(gcs, name)))
    root = tmp_path / "models"
    assert main(_argv(SOURCE, root)) == 0
    published = runs.published(root)
    assert runs.weights(published) == runs.weights(sequential)
    shard = re.compile(r"model-\d+-of-\d+\.safetensors")
    assert [p for p in synced if shard.search(p)] == []
    assert [name for name in read_back if shard.search(name)] == []
    outputs = {n for n in runs.weights(published) if n.endswith(".bin")}
    assert outputs <= {Path(p).name for p in synced}


def test_a_corrupt_shard_found_late_aborts_without_publishing_and_the_rerun_resumes(
    server, sequential, checkpoint, tmp_path, monkeypatch
):
    prefix = "org/late-corrupt"
    server.upload_dir(BUCKET, prefix, checkpoint)
    last = sorted(checkpoint.glob("model-*.safetensors"))[-1].name
    real_admit = OverlappedConversion.admit

    def admit(self, rel):
        """The last shard starts once every output the others complete is journaled (how far
        the writers got before the failure must not depend on the machine's pace)."""
        deadline = time.monotonic() + 120
        while rel == last and (self.schedule.writing or self._syncing):
            assert time.monotonic() < deadline, "the writers never caught up"
            time.sleep(0.01)
        return real_admit(self, rel)

    monkeypatch.setattr(OverlappedConversion, "admit", admit)
    stored = server.stored_path(BUCKET, f"{prefix}/{last}")
    good = stored.read_bytes()
    with open(stored, "r+b") as fh:  # flip bytes behind the server's back; metadata unchanged
        fh.seek(len(good) - 100)
        fh.write(b"\xff\xfe\xfd\xfc")
    root = tmp_path / "models"
    assert main(_argv(f"gs://{BUCKET}/{prefix}", root)) == ChecksumMismatchError.exit_code
    assert not list(root.glob("tiny@*/*"))  # nothing published
    assert not (root / STAGING_DIR).exists() or not any((root / STAGING_DIR).iterdir())
    kept = runs.journaled(root)
    assert len(kept) > 10  # outputs of the earlier shards were written before the failure

    stored.write_bytes(good)
    arrivals = runs.record_arrivals(monkeypatch, root)
    assert main(_argv(f"gs://{BUCKET}/{prefix}", root)) == 0
    repository = runs.published(root)
    assert runs.inodes(repository, kept) == kept  # published as written then, not written again
    assert 1 <= len(arrivals.shards) < len(list(checkpoint.glob("model-*.safetensors")))
    assert manifest.verify(repository) == []
    assert runs.weights(repository) == runs.weights(sequential)


def test_a_killed_overlapped_run_resumes_without_downloading_verified_shards_again(
    checkpoint, sequential, tmp_path, monkeypatch
):
    proxy = ThrottleProxy(0, rate=400_000.0)  # slow enough to kill it midway
    slow = GcsServer(tmp_path / "gcs", external_url=proxy.url).start()
    proxy.target_port = slow.port
    proxy.start()
    slow.upload_dir(BUCKET, "org/sharded", checkpoint)
    root = tmp_path / "models"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "loader", *_argv(SOURCE, root), "--workers", "2"],
            env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(root.glob(f".work/*/converted/2-gpu{Journal.SUFFIX}"))
            if found and found[0].read_text().count("\n") > 10:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err
        assert not list(root.glob("tiny@*/*"))
        kept = runs.journaled(root)
        assert kept, err
        arrivals = runs.record_arrivals(monkeypatch, root)
        assert main(_argv(SOURCE, root)) == 0
    finally:
        proxy.stop()
        slow.stop()
    repository = runs.published(root)
    assert runs.inodes(repository, kept) == kept  # every output journaled was kept as it was
    assert len(arrivals.shards) < len(list(checkpoint.glob("model-*.safetensors")))
    assert manifest.verify(repository) == []
    assert runs.weights(repository) == runs.weights(sequential)


def test_a_run_whose_empty_work_area_another_loader_removed_meanwhile_makes_it_again(
    tmp_path, capsys
):
    """A loader that finished removes ``ROOT/.work`` once it is empty; another loader of
    another key that had just opened it (to make its download directory there) finds it
    removed: it makes it again and goes on, instead of failing."""
    from loader import fs

    root = tmp_path / "models"
    removed = []

    def finished_meanwhile(op: str, path: str) -> None:
        if op == "mkdir" and path.startswith(f"{root / '.work'}/.") and not removed:
            (root / ".work").rmdir()  # what the other loader's clean-up does last
            removed.append(path)

    with fs.inject(finished_meanwhile):
        code = main(_argv(SOURCE, root, "--no-overlap"))
    _, err = capsys.readouterr()
    assert removed
    assert code == 0, err
    assert manifest.verify(runs.published(root)) == []
