"""A publish lock held by a live loader in another pid namespace of the same host (another
container of a pod sharing the volume, with the same host name): a loader or ``prune`` there
cannot see the holder's pid, so it must not judge it gone, only wait for its heartbeat to stop.

The holder runs here; the other loaders run in a new pid namespace (``unshare``, which needs
the privilege to make one: skipped where it is missing), where the holder's pid does not
exist. While the holder beats, ``run`` there times out (exit 75) and ``prune`` there leaves its
lock and staging directory; once the holder is killed, ``run`` there takes the lock over after
the expiry, removes the staging directory and publishes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loader.repository import manifest
from loader.repository.key import key_filename
from loader.repository.publish import STAGING_DIR
from tests.runs import run_argv

pytestmark = pytest.mark.slow  # loaders in a pid namespace of their own, waiting out a lock

UNSHARE = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


#: Holds the key's publish lock (expiry 10 s, beating) and a staging directory of the key.
_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from loader.repository import publish
    from loader.repository.lock import PublishLock

    root, key, ready = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    with PublishLock(root, key, expiry_s=10.0):
        staging = publish.new_staging_dir(root, key)
        ready.write_text(str(staging))
        time.sleep(600)
    """
)


def _in_namespace(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([*UNSHARE, sys.executable, "-m", "loader", *argv],
                          capture_output=True, timeout=timeout)  # fmt: skip


@pytest.mark.skipif(not _can_unshare(), reason="cannot make a pid namespace here")
def test_a_live_holder_in_another_pid_namespace_is_waited_for_never_taken_over(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    root = tmp_path / "root"
    argv = run_argv(tiny_checkpoint_with_tokenizer, root)
    probe = run_argv(tiny_checkpoint_with_tokenizer, tmp_path / "probe")
    assert subprocess.run([sys.executable, "-m", "loader", *probe],
                          capture_output=True, timeout=60).returncode == 0  # fmt: skip
    (published,) = (tmp_path / "probe").glob("tiny@*/*")
    key = str(published.relative_to(tmp_path / "probe"))
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root), key, str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        staging = Path(ready.read_text())
        lock = root / ".locks" / f"{key_filename(key)}.lock"
        before = lock.stat().st_ino

        waited = _in_namespace([*argv, "--lock-expiry-s", "10", "--lock-timeout", "3"], 60)
        assert waited.returncode == 75, waited.stderr.decode()[-2000:]
        assert b"Waited 3 s for the publish lock" in waited.stderr
        pruned = _in_namespace(["prune", "--repository", str(root), "--lock-expiry-s", "10"], 60)
        assert pruned.returncode == 0, pruned.stderr.decode()[-2000:]
        assert staging.is_dir() and lock.stat().st_ino == before  # the holder's, untouched
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
    # Gone now: its heartbeat stops, and after the expiry the lock is taken over.
    took = _in_namespace([*argv, "--lock-expiry-s", "2", "--lock-timeout", "30"], 90)
    assert took.returncode == 0, took.stderr.decode()[-2000:]
    assert b"has had no heartbeat" in took.stderr
    (key_dir,) = root.glob("tiny@*/*")
    assert manifest.verify(key_dir) == []
    assert list((root / STAGING_DIR).iterdir()) == []
