"""The run's staging directory removed whole (``rm -rf``) at any call the run makes below it:
the run stops with a typed error, never a traceback (exit 1, "a bug"), and nothing is
published: 75 (a directory removed while the loader worked in it: running again starts anew)
where it enters, checks or renames the directory by its name; a write into it that finds a
file of its record gone may still be the refusal of exit 2."""

from __future__ import annotations

import shutil
from pathlib import Path

from loader import fs
from loader.cli import main
from tests.runs import run_argv


def _staging_of(staging_dir: Path, path: str) -> Path | None:
    """The staging directory ``path`` (a seam call's) is below, or is."""
    prefix = f"{staging_dir}/"
    if not path.startswith(prefix) or " -> " in path:
        return None
    name = path[len(prefix) :].split("/")[0]
    return None if name.startswith(".") or name.endswith(".tmp") else staging_dir / name


def test_a_staging_directory_removed_at_any_call_below_it_is_a_typed_error(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys
):
    counted = tmp_path / "count"
    calls: list[str] = []

    def count(op: str, path: str) -> None:
        if _staging_of(counted / ".staging", path) is not None:
            calls.append(f"{op} {path}")

    with fs.inject(count):
        assert main(run_argv(tiny_checkpoint_with_tokenizer, counted)) == 0
    assert calls
    capsys.readouterr()
    stride = max(1, len(calls) // 40)
    failed: list[str] = []
    for step in range(1, len(calls) + 1, stride):
        root = tmp_path / f"at-{step}"
        staging_dir = root / ".staging"
        seen: list[str] = []
        done: list[Path] = []

        def rm(op: str, path: str, staging_dir: Path = staging_dir, seen=seen, done=done):
            top = _staging_of(staging_dir, path)
            if top is None or done or not top.is_dir():
                return
            seen.append(op)
            if len(seen) == step:  # noqa: B023 (called while this step runs)
                shutil.rmtree(top)
                done.append(top)

        with fs.inject(rm):
            code = main(run_argv(tiny_checkpoint_with_tokenizer, root))
        err = capsys.readouterr().err
        if not done:
            continue
        if code not in (2, 75) or "Traceback" in err:
            last = err.strip().splitlines()[-1:] or [""]
            failed.append(f"{step} {calls[step - 1]}: exit {code}: {last[0][:200]}")
        assert not list(root.glob("tiny@*/*")), step
    assert not failed, "\n".join(failed)
