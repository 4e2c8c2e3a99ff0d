"""A published key whose files a user changed afterwards is never "already published and
verified": without checksums (``--no-verify-checksums``) nothing is hashed, but a file written
since its seal was taken is found by the seal alone, and the key is published again."""

from __future__ import annotations

from pathlib import Path

from loader.cli import main
from loader.repository import manifest
from tests.runs import published, run_argv, weights


def test_a_weight_changed_in_place_is_published_again_without_checksums(
    tiny_checkpoint_with_tokenizer: Path, tmp_path: Path, capsys, caplog
):
    root = tmp_path / "models"
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root)) == 0
    key = published(root)
    before = weights(key)
    (target,) = (key / "fastertransformer" / "1").glob("*-gpu")
    name = sorted(before)[-1]
    data = bytearray(before[name])
    data[0] ^= 1
    with open(target / name, "r+b") as fh:  # same file, same size
        fh.write(bytes(data))
    with caplog.at_level("INFO", logger="loader"):
        assert main(run_argv(tiny_checkpoint_with_tokenizer, root, "--no-verify-checksums")) == 0
    assert "already published" not in caplog.text
    assert f"{name} was changed since it was written" in caplog.text
    assert weights(published(root)) == before
    assert manifest.verify(published(root)) == []
    caplog.clear()
    with caplog.at_level("INFO", logger="loader"):
        assert main(run_argv(tiny_checkpoint_with_tokenizer, root, "--no-verify-checksums")) == 0
    assert "already published" in caplog.text
    capsys.readouterr()
