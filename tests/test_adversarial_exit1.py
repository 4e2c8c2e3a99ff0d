"""Generated hostile input for every command: what a user, a script or the environment hands
``model-loader`` ends in a typed error (exit 2 with ``error:`` and ``hint:`` lines, 75 for
what may pass), never exit 1 with a traceback ("unexpected failure (this is a bug)")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.runs import cli


def _typed(code: int, err: str, *needles: str) -> None:
    """Exit 2 with an error and a hint, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err and "this is a bug" not in err, err
    assert err.startswith("error: ") and "\nhint: " in err, err
    for needle in needles:
        assert needle in err, err


@pytest.fixture
def source(tiny_checkpoint_with_tokenizer, tmp_path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_with_tokenizer, path)
    return path


# --- a '..' below a level that does not exist ----------------------------------------------


def _creating(command: str, source: Path, target: Path) -> list[str]:
    """``command`` creating the directory ``target`` it writes to."""
    return {
        "convert OUTPUT_DIR": ["convert", str(source), str(target), "--tp-size", "1"],
        "fetch DEST": ["fetch", str(source), str(target), "--copy"],
    }[command]


@pytest.mark.parametrize("command", ["convert OUTPUT_DIR", "fetch DEST"])
@pytest.mark.parametrize("tail", [("a", "..", "b"), ("a", "b", "..", "..", "c"), ("a", "..")])
def test_a_dotdot_below_a_missing_level_is_refused_naming_it(
    source, tmp_path, capsys, command, tail
):
    """``OUT/a/../b`` with no ``OUT/a``: which directory it names is decided only once ``a``
    exists. Before, the loader made ``a`` and then tried to create a directory named ``..``
    (a ValueError: exit 1, a bug); now exit 2 naming the path, and nothing is created."""
    target = tmp_path.joinpath("out", *tail)
    code, out, err = cli(capsys, *_creating(command, source, target))
    _typed(code, err, "'..'", str(target))
    assert not (tmp_path / "out").exists()
    assert out == []


def test_a_dotdot_below_an_existing_level_is_followed(source, tmp_path, capsys):
    """A ``..`` the file system can resolve is the path it names, as before."""
    (tmp_path / "a").mkdir()
    target = tmp_path / "a" / ".." / "b"
    code, out, err = cli(capsys, "fetch", str(source), str(target), "--copy")
    assert code == 0, err
    assert out[-1] == str(target)
    assert (tmp_path / "b" / "config.json").is_file()
