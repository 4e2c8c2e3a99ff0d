"""`model-loader run` from hf:// converting while it downloads (loader.convert.overlapped).

Against the real olah Hub mirror: the overlapped run publishes the same weights as the
sequential one, holds a few shards at a time, and a shard whose bytes do not match the Hub's
hash aborts without publishing (the rerun resumes with the outputs already written).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from loader.cli import main
from loader.convert import overlapped as overlap
from loader.convert.overlapped import Journal
from loader.convert.schedule import DEFAULT_WINDOW
from loader.errors import ChecksumMismatchError
from loader.repository import manifest
from loader.repository.publish import STAGING_DIR
from tests.servers import OlahServer, git
from tests.tinymodels import make_sharded_fp16_checkpoint

#: Shards of the test checkpoint: enough that a window of two is a small part of it.
SHARDS_AT_LEAST = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = make_sharded_fp16_checkpoint(tmp_path_factory.mktemp("sharded-fp16") / "ckpt")
    assert len(list(path.glob("model-*.safetensors"))) >= SHARDS_AT_LEAST
    return path


def _files(checkpoint: Path) -> dict[str, Path]:
    return {p.name: p for p in checkpoint.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, checkpoint):
    srv = OlahServer(tmp_path_factory.mktemp("olah"))
    srv.make_repo("org/sharded", _files(checkpoint))
    srv.late_corrupt = srv.make_repo("org/late-corrupt", _files(checkpoint))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def endpoint(monkeypatch, hub, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)


def _argv(source: str, root: Path, *extra: str) -> list[str]:
    return ["run", "--source", source, "--repository", str(root), "--model-name", "tiny",
            "--tp-size", "2", "--pp-size", "1", "--instance-count", "1", *extra]  # fmt: skip


def _weights(published: Path) -> dict[str, bytes]:
    folder = published / "fastertransformer" / "1" / "2-gpu"
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _published(root: Path) -> Path:
    (path,) = root.glob("tiny@*/*")
    return path


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def sequential(hub, tmp_path_factory) -> Path:
    """The repository the download-then-convert path publishes (the reference)."""
    root = tmp_path_factory.mktemp("sequential")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(root.parent / "hf-home-seq")}
    proc = subprocess.run(
        [sys.executable, "-m", "loader", *_argv("hf://org/sharded", root, "--no-overlap")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "while it downloads" not in proc.stderr
    return _published(root)


def test_the_overlapped_hf_run_publishes_what_the_sequential_one_does_holding_few_shards(
    sequential, checkpoint, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="loader")
    root = tmp_path / "models"
    shards = sorted(checkpoint.glob("model-*.safetensors"))
    largest = max(p.stat().st_size for p in shards)
    order: list[str] = []  # every file the fetch reported, in order
    on_disk: list[int] = []  # shard bytes in the download directory at each shard's arrival
    peaks: list[int] = []  # the whole repository root at each shard's arrival
    real_arrived = overlap.OverlappedConversion.arrived

    def arrived(self, rel, path):
        order.append(rel)
        if rel.endswith(".safetensors"):
            on_disk.append(sum(p.stat().st_size for p in path.parent.glob("model-*.safetensors")))
            peaks.append(_tree_bytes(root))
        return real_arrived(self, rel, path)

    real_write = overlap.write_file

    def slow_write(*args, **kwargs):
        # Writers slower than the download: only the window keeps the shards from piling up.
        time.sleep(0.4)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(overlap.OverlappedConversion, "arrived", arrived)
    monkeypatch.setattr(overlap, "write_file", slow_write)
    assert main(_argv("hf://org/sharded", root)) == 0
    published = _published(root)
    assert "converting hf://org/sharded while it downloads" in caplog.text
    assert manifest.verify(published) == []
    assert _weights(published) == _weights(sequential)
    ours = {e["path"]: e["sha256"] for e in manifest.read_manifest(published)["files"]}
    theirs = {e["path"]: e["sha256"] for e in manifest.read_manifest(sequential)["files"]}
    assert ours == theirs

    # The small files came in the first fetch; the second reports them (already present)
    # before the shards, which arrive one by one in name order.
    weights = [rel for rel in order if rel.endswith(".safetensors")]
    assert weights == [p.name for p in shards]
    assert order.index(weights[0]) > order.index("config.json")
    assert order.index(weights[0]) > order.index("model.safetensors.index.json")

    # The disk accounting: at most window + 1 shards on disk at once, never the checkpoint.
    assert max(on_disk) <= (DEFAULT_WINDOW + 1) * largest
    assert max(on_disk) < sum(p.stat().st_size for p in shards) / 2
    outputs = _tree_bytes(published / "fastertransformer")
    assert max(peaks) <= outputs + (DEFAULT_WINDOW + 1) * largest + 2**20
    assert not (root / ".work").exists() or not any((root / ".work").iterdir())


def _rewrite_blob(repo: Path, name: str, data: bytes) -> None:
    """Replace the bytes git stores for ``name`` at HEAD, keeping its object id (so the Hub's
    listing still names the original hash)."""
    blob = git(repo, "rev-parse", f"HEAD:{name}")
    obj = repo / ".git" / "objects" / blob[:2] / blob[2:]
    obj.chmod(0o644)
    obj.write_bytes(zlib.compress(b"blob %d\0" % len(data) + data))


def test_a_shard_not_matching_the_hubs_hash_aborts_without_publishing_and_the_rerun_resumes(
    hub, sequential, checkpoint, tmp_path, caplog, capsys
):
    caplog.set_level(logging.INFO, logger="loader")
    last = sorted(checkpoint.glob("model-*.safetensors"))[-1]
    good = last.read_bytes()
    bad = bytearray(good)
    bad[-100:-96] = b"\xff\xfe\xfd\xfc"
    _rewrite_blob(hub.late_corrupt, last.name, bytes(bad))
    root = tmp_path / "models"
    source = "hf://org/late-corrupt"
    try:
        assert main(_argv(source, root)) == ChecksumMismatchError.exit_code
        err = capsys.readouterr().err
        assert f"{last.name}: downloaded bytes do not match the Hub's hash" in err
        assert not list(root.glob("tiny@*/*"))  # nothing published
        assert not (root / STAGING_DIR).exists() or not any((root / STAGING_DIR).iterdir())
        (converted,) = root.glob(".work/*/converted/2-gpu")
        journal = (converted / Journal.NAME).read_text().splitlines()
        assert len(journal) > 10  # outputs of the earlier shards were written before the failure
        (source_dir,) = root.glob(".work/*/source")
        assert not (source_dir / last.name).exists()  # the mismatching download was discarded
    finally:
        _rewrite_blob(hub.late_corrupt, last.name, good)

    caplog.clear()
    assert main(_argv(source, root)) == 0
    assert f"resuming: {len(journal) - 1} output file(s) already written" in caplog.text
    fetched = [r.getMessage() for r in caplog.records if "to fetch" in r.getMessage()]
    to_fetch, of = (int(w) for w in fetched[0].split(", ")[1].split()[0:3:2])
    assert 1 <= to_fetch < of
    published = _published(root)
    assert manifest.verify(published) == []
    assert _weights(published) == _weights(sequential)
