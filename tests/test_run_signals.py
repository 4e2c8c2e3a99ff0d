"""`model-loader run` stopped from outside: SIGTERM, a stalled holder that lost its lock, lock
flags that would break the lock, and the exit code of a source that keeps failing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loader.cli import main
from loader.errors import EXIT_TRANSIENT
from loader.repository import manifest
from loader.repository.lock import LOCKS_DIR
from loader.repository.publish import STAGING_DIR
from tests.runs import run_argv
from tests.servers import free_port

#: Runs `model-loader run`, pausing in the main thread once the weights are converted into
#: the staging directory (before the model directories are written) until the file ``resume``
#: exists; ``marker`` says it got there.
_DRIVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path

    marker, resume, argv = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    import loader.repository.layout as layout
    real_write_models = layout.write_models

    def write_models(*args, **kwargs):
        marker.write_text("paused")
        while not resume.exists():
            time.sleep(0.05)
        return real_write_models(*args, **kwargs)

    layout.write_models = write_models
    from loader.cli import main
    sys.exit(main(argv))
    """
)


def _argv(source: Path | str, root: Path, *extra: str) -> list[str]:
    return run_argv(source, root, *extra, tp=2)


def _start_paused(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen, Path]:
    marker, resume = tmp_path / "paused", tmp_path / "resume"
    child = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(marker), str(resume), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 90
    while not marker.exists():
        assert child.poll() is None, child.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the loader never reached the pause"
        time.sleep(0.05)
    return child, resume


def _entries(path: Path) -> list[Path]:
    return sorted(path.iterdir()) if path.exists() else []


@pytest.mark.slow
def test_sigterm_stops_run_cleanly_releasing_its_lock_and_removing_its_staging(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    root = tmp_path / "root"
    child, _ = _start_paused(tmp_path, _argv(tiny_checkpoint_with_tokenizer, root))
    try:
        assert len(_entries(root / LOCKS_DIR)) == 1 and len(_entries(root / STAGING_DIR)) == 1
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 143, err[-3000:]
    assert "terminated (SIGTERM)" in err
    assert "Traceback" not in err
    assert out == ""
    assert _entries(root / LOCKS_DIR) == []  # the next loader does not wait for an expiry
    assert _entries(root / STAGING_DIR) == []
    assert [p for p in root.glob("tiny@*/*")] == []


@pytest.mark.slow
def test_a_stalled_holder_whose_lock_was_taken_over_stops_without_publishing(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    root = tmp_path / "root"
    argv = _argv(tiny_checkpoint_with_tokenizer, root, "--lock-expiry-s", "2")
    stalled, resume = _start_paused(tmp_path, argv)
    try:
        os.kill(stalled.pid, signal.SIGSTOP)  # the whole process stalls, heartbeat included
        assert main(argv) == 0  # takes the lock over after 2 s without a heartbeat
        published = Path(capsys.readouterr().out.splitlines()[-1])
        assert manifest.verify(published) == []
        before = (published / manifest.MANIFEST).read_bytes()
        resume.write_text("go")
        os.kill(stalled.pid, signal.SIGCONT)
        _, err = stalled.communicate(timeout=90)
    finally:
        if stalled.poll() is None:
            stalled.kill()
            stalled.wait()
    assert stalled.returncode == EXIT_TRANSIENT, err[-3000:]
    assert "was taken over by another loader" in err
    assert "Traceback" not in err
    assert (published / manifest.MANIFEST).read_bytes() == before
    assert manifest.verify(published) == []
    assert _entries(root / STAGING_DIR) == []


@pytest.mark.parametrize("expiry", ["0", "-5", "0.5"])
def test_lock_expiry_that_would_take_over_live_holders_is_refused(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, expiry
):
    root = tmp_path / "root"
    code = main(_argv(tiny_checkpoint_with_tokenizer, root, "--lock-expiry-s", expiry))
    err = capsys.readouterr().err
    assert code == 2
    assert "--lock-expiry-s must be at least 1" in err
    assert "hint:" in err
    assert not root.exists()


def test_negative_lock_timeout_and_retry_deadline_are_refused(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    for flag in ("--lock-timeout-s", "--retry-deadline"):
        code = main(_argv(tiny_checkpoint_with_tokenizer, tmp_path / "root", flag, "-1"))
        assert code == 2
        assert flag in capsys.readouterr().err


def test_a_source_failing_past_the_retry_deadline_exits_with_the_transient_code(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    code = main(_argv("gs://models/ckpt", tmp_path / "root", "--retry-deadline", "2"))
    err = capsys.readouterr().err
    assert code == EXIT_TRANSIENT == 75
    assert "kept failing" in err and "hint:" in err
    assert time.monotonic() - started < 30


def test_a_bad_argument_still_exits_2_not_the_transient_code(tmp_path, capsys):
    code = main(_argv(tmp_path / "missing", tmp_path / "root"))
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.server
def test_sigterm_during_an_hf_download_stops_run_at_once(tmp_path):
    """The Hub library's download pool would finish its queue first (30 s here). The config
    is too thin to convert, so the download runs on the sequential path (the overlapped one
    checks config.json before fetching any weight)."""
    from tests.servers import OlahServer, ThrottleProxy

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "gptj"}')
    (src / "model.safetensors").write_bytes(os.urandom(3_000_000))
    hub = OlahServer(tmp_path / "olah")
    hub.make_repo("org/big", {p.name: p for p in src.iterdir()})
    hub.start()
    proxy = ThrottleProxy(hub.port, rate=100_000).start()  # 3 MB take 30 s
    root = tmp_path / "root"
    env = {**os.environ, "HF_ENDPOINT": proxy.url, "HF_HOME": str(tmp_path / "hf-home")}
    child = subprocess.Popen(
        [sys.executable, "-m", "loader", *_argv("hf://org/big", root, "--no-overlap")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any(root.rglob("*.incomplete")):
            assert child.poll() is None, child.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the download never started"
            time.sleep(0.1)
        child.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, err = child.communicate(timeout=60)
        stopped_after = time.monotonic() - started
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        proxy.stop()
        hub.stop()
    assert child.returncode == 143, err[-3000:]
    assert stopped_after < 10  # not after the remaining download
    assert _entries(root / LOCKS_DIR) == []
    assert _entries(root / STAGING_DIR) == []
