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
from tests.at_step import AtStep, picked_calls
from tests.runs import run_argv
from tests.tiers import quartered


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
    def staging_dir_in(root: Path):
        def match(op: str, path: str) -> Path | None:
            top = _staging_of(root / ".staging", path)
            return top if top is not None and top.is_dir() else None

        return match

    counted = tmp_path / "count"
    calls, code = picked_calls(
        staging_dir_in(counted), lambda: main(run_argv(tiny_checkpoint_with_tokenizer, counted))
    )
    assert code == 0
    assert calls
    capsys.readouterr()
    stride = max(1, len(calls) // 40)
    failed: list[str] = []
    for step in quartered(range(1, len(calls) + 1, stride)):
        root = tmp_path / f"at-{step}"
        hook = AtStep(step, staging_dir_in(root), shutil.rmtree)
        with fs.inject(hook):
            code = main(run_argv(tiny_checkpoint_with_tokenizer, root))
        err = capsys.readouterr().err
        if not hook.done:
            continue
        if code not in (2, 75) or "Traceback" in err:
            last = err.strip().splitlines()[-1:] or [""]
            failed.append(f"{step} {calls[step - 1]}: exit {code}: {last[0][:200]}")
        assert not list(root.glob("tiny@*/*")), step
    assert not failed, "\n".join(failed)
