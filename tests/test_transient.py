"""Transient is transient, on the sequential and the overlapped path alike: an object replaced
while it downloads, a server answering 200 with a page of its own, a stalled loader whose
downloads still land after its successor took over. Each ends as exit 75 (worth running again)
or succeeds, never as exit 2 or a traceback; two loaders never write the same partial file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.repository import manifest
from tests import runs
from tests.servers import GcsServer, ThrottleProxy

BUCKET = "models"
PATHS = {"sequential": ("--no-overlap",), "overlapped": ()}


pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny fp16 GPT-J checkpoint in three safetensors shards, with its tokenizer."""
    from tests.tinymodels import make_sharded_checkpoint

    path = make_sharded_checkpoint(tmp_path_factory.mktemp("sharded") / "ckpt", seed=7)
    return path


@pytest.fixture
def gcs(tmp_path, sharded):
    server = GcsServer(tmp_path / "gcs").start()
    server.upload_dir(BUCKET, "org/sharded", sharded)
    yield server
    server.stop()


def _argv(root: Path, *extra: str) -> list[str]:
    return ["run", "--source", f"gs://{BUCKET}/org/sharded", "--repository", str(root),
            "--model-name", "tiny", "--revision", "r1", "--tp-size", "1", "--pp-size", "1",
            "--instance-count", "1", "--retry-deadline", "5", "--workers", "1",
            *extra]  # fmt: skip


def _outcome(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "this is a bug" not in err, err[-2000:]
    return code, err


def _published(root: Path) -> list[Path]:
    return sorted(root.glob("tiny@r1/*"))


@pytest.mark.parametrize("path", PATHS)
def test_an_object_replaced_while_it_downloads_is_transient_or_published_as_listed(
    gcs, sharded, tmp_path, capsys, monkeypatch, path
):
    """The last shard is re-uploaded once the downloads began. Downloads pin the generation
    listed: the run ends 75 (the old generation is gone, or refused: 404, 412), or it publishes
    the generation it listed, and then the next run says the source changed."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    last = sorted(sharded.glob("model-*.safetensors"))[-1]
    replaced = []

    def reupload_the_last_shard(op: str, where: str) -> None:
        if op == "write" and "/.partial/" in where and not replaced:
            replaced.append(where)
            blob = gcs.client().bucket(BUCKET).blob(f"org/sharded/{last.name}")
            blob.upload_from_string(last.read_bytes()[:-8] + b"\0" * 8)

    root = tmp_path / "root"
    with fs.inject(reupload_the_last_shard):
        code, err = _outcome(capsys, _argv(root, *PATHS[path]))
    assert replaced
    assert code in (0, 75), err[-2000:]
    if code == 75:
        assert "error:" in err and "hint:" in err
        assert _published(root) == []
        return
    (published,) = _published(root)
    assert manifest.verify(published) == []
    # Published as recorded: the rerun finds it up to date, or says the source changed.
    code, err = _outcome(capsys, _argv(root, *PATHS[path]))
    assert code == 0 or (code == 2 and "no longer holds what" in err), err[-2000:]


@pytest.mark.parametrize("status", [404, 412])
@pytest.mark.parametrize("path", PATHS)
def test_a_shard_gone_or_replaced_since_the_listing_is_transient(
    gcs, sharded, tmp_path, capsys, monkeypatch, path, status
):
    last = sorted(sharded.glob("model-*.safetensors"))[-1]
    proxy = ThrottleProxy(gcs.port, status=status, fail_path=last.name).start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        root = tmp_path / "root"
        code, err = _outcome(capsys, _argv(root, *PATHS[path]))
        assert proxy.requests >= 1
        assert code == 75, err[-2000:]
        assert "while it was being downloaded" in err
        assert _published(root) == []
    finally:
        proxy.stop()


@pytest.mark.parametrize("path", PATHS)
def test_a_server_answering_200_with_a_page_is_transient_and_a_rerun_succeeds(
    gcs, tmp_path, capsys, monkeypatch, path
):
    page = b"<html><body>Please sign in to the network.</body></html>\n"
    proxy = ThrottleProxy(gcs.port, status=200, body=page, fail_path="alt=media", fail_first=1)
    proxy.start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        root = tmp_path / "root"
        code, err = _outcome(capsys, _argv(root, *PATHS[path]))
        assert proxy.requests == 1
        assert code == 75, err[-2000:]
        assert _published(root) == []
        code, err = _outcome(capsys, _argv(root, *PATHS[path]))
        assert code == 0, err[-2000:]
        (published,) = _published(root)
        assert manifest.verify(published) == []
    finally:
        proxy.stop()


def _partials(root: Path) -> set[str]:
    found = set()
    for path in root.glob(".work/*/source/.partial/**/*"):
        if path.is_file() and not path.name.endswith(".slices"):
            found.add(path.name)
    return found


@pytest.mark.parametrize("path", PATHS)
def test_a_stalled_loader_and_its_successor_never_share_a_partial_file(
    gcs, tmp_path, capsys, monkeypatch, caplog, path
):
    """A loader stopped mid-download (SIGSTOP) loses its lock to a successor, which fetches
    and publishes; the stopped one, resumed, stops with exit 75. Their partial files never
    have one name."""
    caplog.set_level(logging.INFO, logger="loader")
    proxy = ThrottleProxy(gcs.port, rate=50_000.0).start()
    root = tmp_path / "root"
    env = {**os.environ, "STORAGE_EMULATOR_HOST": proxy.url}
    stalled = subprocess.Popen(
        [sys.executable, "-m", "loader", *_argv(root, "--lock-expiry-s", "1", *PATHS[path])],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stopped: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not _partials(root):
            assert stalled.poll() is None, stalled.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first loader never started downloading"
            time.sleep(0.02)
        stopped = runs.loader_processes(stalled)  # its supervised child too
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        theirs = _partials(root)

        ours: set[str] = set()

        def record(op: str, where: str) -> None:
            if op == "open" and "/.partial/" in where and not where.endswith(".slices"):
                ours.add(Path(where).name)

        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
        with fs.inject(record):
            code, err = _outcome(
                capsys, _argv(root, "--lock-expiry-s", "1", "--lock-timeout-s", "60", *PATHS[path])
            )
        assert code == 0, err[-2000:]
        assert "taking it over" in caplog.text
        assert ours and not ours & theirs, (ours, theirs)
        (published,) = _published(root)
        assert manifest.verify(published) == []
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        proxy.stop()
    _, stderr = stalled.communicate(timeout=120)
    assert stalled.returncode in (0, 75), stderr[-2000:]
    assert "Traceback" not in stderr
    assert manifest.verify(published) == []  # what the resumed loader wrote changed nothing
