"""Adversarial DESTs of ``model-loader fetch`` and OUTPUT_DIRs of ``model-loader convert``:
what others plant at the names the loader creates there, runs killed and run again, two runs
at once. Each test checks that what is not the loader's stays byte for byte, that the command
ends with a typed error (``error:`` and ``hint:`` lines, exit 2 or 75) or the right bytes, and
never with a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.sources.transfer import PARTIAL_DIR

#: A pid no process of this host has (above the kernel's largest), tagged with this host: the
#: owner tag a stopped fetch of this host left in its partial names.
GONE = f"{2**22 + 7}-{fs.host_digest()}"


def _fetch_copy(capsys, source: Path, dest: Path) -> tuple[int, str]:
    code = main(["fetch", "--copy", str(source), str(dest)])
    return code, capsys.readouterr().err


def _same_files(source: Path, dest: Path) -> None:
    for f in source.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize("kind", ["link", "dangling link", "FIFO"])
def test_a_link_or_fifo_at_a_stopped_fetchs_partial_name_stays_and_the_fetch_finishes(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, kind
):
    """Before: a link or FIFO at the name of a gone owner's partial file (``.partial/<name>.
    <owner>``) was kept by the removal of what stopped fetches left, which then took
    ``.partial`` for empty and failed removing it (ENOTEMPTY: exit 1, "this is a bug")."""
    dest = tmp_path / "dest"
    (dest / PARTIAL_DIR).mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"a user's\n")
    planted = dest / PARTIAL_DIR / f"config.json.{GONE}"
    if kind == "FIFO":
        os.mkfifo(planted)
    else:
        planted.symlink_to(victim if kind == "link" else tmp_path / "nothing")

    code, err = _fetch_copy(capsys, tiny_checkpoint_with_tokenizer, dest)
    assert code == 0, err
    assert "Traceback" not in err
    _same_files(tiny_checkpoint_with_tokenizer, dest)
    assert os.path.lexists(planted) and victim.read_bytes() == b"a user's\n"
    code, err = _fetch_copy(capsys, tiny_checkpoint_with_tokenizer, dest)  # and again
    assert code == 0, err
    assert os.path.lexists(planted)


def test_a_partial_directory_another_fetch_fills_while_it_is_removed_stays(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """Two fetches into one DEST: one removes ``.partial`` once its own files are gone just
    as the other puts its partial file there (ENOTEMPTY), or removes it first (ENOENT). Before:
    exit 1, "this is a bug"; now the fetch ends well and the other's file stays."""
    for race in ("fills", "removes"):
        dest = tmp_path / race
        other = dest / PARTIAL_DIR / f"config.json.{os.getppid()}-{fs.host_digest()}.0badcafe"

        def hook(op: str, path: str, race: str = race, other: Path = other) -> None:
            if op != "rmdir" or not path.endswith(f"/{PARTIAL_DIR}"):
                return
            if race == "fills":
                other.write_bytes(b"the other fetch's bytes\n")
            else:
                os.rmdir(path)

        with fs.inject(hook):
            code, err = _fetch_copy(capsys, tiny_checkpoint_with_tokenizer, dest)
        assert code == 0, err
        _same_files(tiny_checkpoint_with_tokenizer, dest)
        if race == "fills":
            assert other.read_bytes() == b"the other fetch's bytes\n"
        else:
            assert not (dest / PARTIAL_DIR).exists()
