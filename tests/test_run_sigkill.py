"""A loader killed with SIGKILL leaves ROOT/<key> absent or complete, and a rerun completes.

The loader runs in a child process that stops at a chosen point (it writes a marker file and
sleeps there); the test then kills it with SIGKILL, as the kernel's OOM killer or a deleted
Kubernetes pod would, inspects the repository root and runs the loader again.
"""

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
from loader.repository import manifest
from loader.repository.config import BUILDERS
from loader.repository.publish import STAGING_DIR
from tests.runs import run_argv

pytestmark = (
    pytest.mark.slow
)  # loaders in subprocesses of their own, killed (see markers in pyproject.toml)

#: Runs `model-loader run` with one function wrapped so that it stops at the chosen point.
_DRIVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path

    point, marker, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]

    def stop_here():
        marker.write_text("stopped")
        time.sleep(600)

    if point == "converting":
        # Stop inside the converter's write loop after the first bytes were written.
        import loader.convert.sequential as convert
        real_progress = convert.byte_progress

        class Stopping:
            def __init__(self, inner):
                self.inner = inner
            def update(self, n):
                self.inner.update(n)
                stop_here()

        def progress(*args, **kwargs):
            import contextlib
            @contextlib.contextmanager
            def wrapped():
                with real_progress(*args, **kwargs) as inner:
                    yield Stopping(inner)
            return wrapped()

        convert.byte_progress = progress
    elif point == "writing":
        # Stop after the first config.pbtxt of the repository was written.
        import loader.repository.layout as layout
        real_write = layout.write_config

        def write_config(*args, **kwargs):
            path = real_write(*args, **kwargs)
            stop_here()
            return path

        layout.write_config = write_config
    elif point == "renaming":
        # Stop with everything staged (.ready written), just before the rename.
        from loader import fs

        def before_rename(op, path):
            source, _, target = path.partition(" -> ")
            if op.startswith("rename") and "/.staging/" in source and "/.staging/" not in target:
                stop_here()

        hooked = fs.inject(before_rename)
        hooked.__enter__()
    else:
        raise SystemExit(f"unknown point {point}")

    from loader.cli import main
    sys.exit(main(argv))
    """
)


def _argv(source: Path, root: Path) -> list[str]:
    return run_argv(source, root, tp=2)


def _staged(root: Path) -> list[Path]:
    base = root / STAGING_DIR
    return sorted(base.iterdir()) if base.exists() else []


@pytest.mark.parametrize("point", ["converting", "writing", "renaming"])
def test_sigkill_leaves_the_key_absent_and_a_rerun_completes(
    point, tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    root, marker = tmp_path / "root", tmp_path / "stopped"
    argv = _argv(tiny_checkpoint_with_tokenizer, root)
    child = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, point, str(marker), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert child.poll() is None, child.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the loader never reached the kill point"
            time.sleep(0.05)
        # The loader is stopped mid-way: something is staged, nothing is published.
        (staging,) = _staged(root)
        weights = staging / "fastertransformer" / "1" / "2-gpu"
        configs = list(staging.glob("*/config.pbtxt"))
        assert weights.exists() == (point != "converting")  # the converter renames it last
        assert any(staging.rglob("*.bin"))  # weights were being written
        # Every model's config once the staging directory is complete (BUILDERS: one each).
        assert len(configs) == {"converting": 0, "writing": 1, "renaming": len(BUILDERS)}[point]
        assert (staging / manifest.READY).exists() == (point == "renaming")
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    published = [p for p in root.glob("tiny@*/*") if p.is_dir()]
    assert published == []  # absent, not half-written

    # A rerun takes over the dead loader's lock, clears its staging and completes.
    assert main(argv) == 0
    path = Path(capsys.readouterr().out.splitlines()[-1])
    assert path.parent.parent == root
    assert manifest.verify(path) == []
    assert _staged(root) == []
