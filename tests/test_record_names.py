"""A name read back from what the loader wrote (a tree's record's marker, a journal's outputs
and the staging directory it names) that no file here can have: longer than ``NAME_MAX`` bytes,
or a lone surrogate a JSON document spells. It was never the loader's: it is skipped, never
looked up (a lookup failed with ENAMETOOLONG, exit 2 on every later run, or with a
UnicodeEncodeError, exit 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.convert.overlapped import MOVED, Journal
from tests.runs import published, run_argv

UNNAMEABLE = {
    "long": fs.MARKER_PREFIX + "x" * 300,
    "surrogate": fs.MARKER_PREFIX + "\ud800",
}


@pytest.mark.parametrize("marker", UNNAMEABLE.values(), ids=UNNAMEABLE)
def test_a_published_keys_record_naming_an_unnameable_marker_is_no_record(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, marker: str
):
    root = tmp_path / "models"
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root)) == 0
    record = published(root) / fs.MADE
    _, rest = record.read_bytes().split(b"\n", 1)
    record.write_bytes(json.dumps({"marker": marker}).encode() + b"\n" + rest)
    for argv in (
        run_argv(tiny_checkpoint_with_tokenizer, root),
        ["prune", "--repository", str(root)],
        run_argv(tiny_checkpoint_with_tokenizer, root, "--force"),
    ):  # processes of their own: none has entered the tree before its record was changed
        done = subprocess.run([sys.executable, "-m", "loader", *argv], capture_output=True)
        assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_journal_line_naming_an_output_or_staging_directory_too_long_is_skipped(
    tmp_path: Path,
):
    name = "a" * 300
    (tmp_path / "converted").mkdir()
    journal = Journal(tmp_path / "converted", "rev fp16 1")
    line = f"{name} 1 {'0' * 64} 1 1\n{MOVED}{name}\n"
    (tmp_path / "converted.journal").write_text(f"{journal.header}\n{line}", errors="surrogatepass")
    with fs.confined(tmp_path):
        assert journal.resume() == {}
        (tmp_path / "converted.journal").write_text(line)
        assert Journal(tmp_path / "converted", "").moved_to() is None
