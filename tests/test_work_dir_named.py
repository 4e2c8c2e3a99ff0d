"""The directory a user names with ``--work-dir`` is theirs, whatever its name: the loader
removes its own download directory in it, never the directory itself (only ``ROOT/.work``, the
loader's own, goes once it is empty)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loader.repository import manifest
from tests.runs import cli, run_argv
from tests.test_run_sources import gcs, gs_source, local_source  # noqa: F401 (fixtures)


@pytest.mark.server
@pytest.mark.parametrize("name", [".work", "scratch"])
def test_an_empty_work_dir_stays_after_the_run_whatever_its_name(
    gs_source,  # noqa: F811
    tmp_path,
    capsys,
    name,
):
    root, scratch = tmp_path / "root", tmp_path / "data" / name
    scratch.mkdir(parents=True)
    code, out, err = cli(capsys, *run_argv(gs_source, root, "--work-dir", str(scratch)))
    assert code == 0, err
    assert manifest.verify(Path(out[-1])) == []
    assert scratch.is_dir() and not list(scratch.iterdir())
    code, out, err = cli(capsys, *run_argv(gs_source, root, "--force"))  # ROOT/.work: removed
    assert code == 0, err
    assert not (root / ".work").exists()
