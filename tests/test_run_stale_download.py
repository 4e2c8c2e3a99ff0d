"""A remote source whose weights changed format between a killed run and its rerun: the rerun
converts what the source holds now, never a file an earlier listing put in the download
directory.

A run killed after its download keeps ``WORK/<key>`` for the next run (it resumes). If the
source is meanwhile uploaded again in another weight format (safetensors replaced by PyTorch
``.bin``: other weights), the old files are still in that directory; the checkpoint's layout is
read from the files there, safetensors first, so without care the rerun would convert the old
weights and publish them under the new source's fingerprint, and every later run would call
the key up to date.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

import pytest

from loader.cli import main
from loader.repository import manifest
from tests.runs import weights
from tests.servers import GcsServer
from tests.test_kill_points import KILLED, _argv, forked
from tests.test_kill_removal import KillBeforeMarkedRename

pytestmark = pytest.mark.server

BUCKET, PREFIX = "models", "org/changing"
SOURCE = f"gs://{BUCKET}/{PREFIX}"


@pytest.fixture(scope="module")
def versions(tmp_path_factory, tiny_checkpoint_with_tokenizer) -> tuple[Path, Path]:
    """The tiny checkpoint (one safetensors file), and the same model with other weights as
    PyTorch ``.bin`` shards with their index, the same tokenizer."""
    from tests.tinymodels import SERVING_CONTEXT, make_tiny_checkpoint

    new = make_tiny_checkpoint(tmp_path_factory.mktemp("v1") / "ckpt", arch="gptj", fmt="bin",
                               sharded=True, seed=11, n_positions=SERVING_CONTEXT)  # fmt: skip
    for path in tiny_checkpoint_with_tokenizer.iterdir():
        if not (new / path.name).exists() and not path.name.endswith(".safetensors"):
            shutil.copyfile(path, new / path.name)
    assert {p.name for p in new.glob("*.bin*")} and not list(new.glob("*.safetensors*"))
    return tiny_checkpoint_with_tokenizer, new


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    server = GcsServer(tmp_path / "gcs").start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    yield server
    server.stop()


def _replace(server: GcsServer, checkpoint: Path) -> None:
    """The prefix holds ``checkpoint`` and nothing else."""
    bucket = server.client().bucket(BUCKET)
    if bucket.exists():
        for blob in list(bucket.list_blobs(prefix=PREFIX + "/")):
            blob.delete()
    server.upload_dir(BUCKET, PREFIX, checkpoint)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "sequential"])
def test_a_rerun_after_the_source_changed_format_converts_what_it_holds_now(
    overlap, versions, gcs, tmp_path
):
    old, new = versions
    extra = () if overlap else ("--no-overlap",)
    root = tmp_path / "root"
    _replace(gcs, old)
    # Killed once everything was downloaded: just before its staging directory got its name.
    killer = KillBeforeMarkedRename("/.staging/")
    assert forked(_argv(SOURCE, root, *extra), killer) == KILLED
    assert list((root / ".work").glob("*/source/model.safetensors"))  # kept for a rerun
    _replace(gcs, new)
    with contextlib.redirect_stdout(sys.stderr):
        assert main(_argv(SOURCE, root, *extra)) == 0
        assert main(_argv(SOURCE, tmp_path / "fresh", *extra)) == 0  # no download kept
    (published,) = root.glob("tiny@r1/*")
    (fresh,) = (tmp_path / "fresh").glob("tiny@r1/*")
    assert manifest.verify(published) == []
    recorded = manifest.read_manifest(published)[manifest.SOURCE_FINGERPRINT]["files"]
    assert "pytorch_model.bin.index.json" in recorded and "model.safetensors" not in recorded
    assert weights(published) == weights(fresh)


def test_a_rerun_after_the_source_lost_its_config_is_refused_not_run_on_the_old_one(
    versions, gcs, tmp_path, capsys
):
    old, _ = versions
    root = tmp_path / "root"
    _replace(gcs, old)
    killer = KillBeforeMarkedRename("/.staging/")
    assert forked(_argv(SOURCE, root, "--no-overlap"), killer) == KILLED
    assert list((root / ".work").glob("*/source/config.json"))  # kept for a rerun
    gcs.client().bucket(BUCKET).blob(f"{PREFIX}/config.json").delete()
    assert main(_argv(SOURCE, root, "--no-overlap")) == 2
    err = capsys.readouterr().err
    assert f"{SOURCE} holds no config.json" in err
    assert not list(root.glob("tiny@r1/*"))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "sequential"])
def test_a_shard_the_source_no_longer_holds_is_refused_not_read_from_the_last_download(
    overlap, gcs, tmp_path, capsys
):
    from tests.tinymodels import make_sharded_checkpoint

    sharded = make_sharded_checkpoint(tmp_path / "sharded", seed=5)
    extra = () if overlap else ("--no-overlap",)
    root = tmp_path / "root"
    _replace(gcs, sharded)
    killer = KillBeforeMarkedRename("/.staging/")
    assert forked(_argv(SOURCE, root, "--no-overlap"), killer) == KILLED  # all downloaded
    shard = "model-00002-of-00004.safetensors"
    assert list((root / ".work").glob(f"*/source/{shard}"))
    gcs.client().bucket(BUCKET).blob(f"{PREFIX}/{shard}").delete()
    assert main(_argv(SOURCE, root, *extra)) == 2
    assert f"{shard} listed in model.safetensors.index.json is missing" in capsys.readouterr().err
    assert not list(root.glob("tiny@r1/*"))


def test_a_tokenizer_file_the_source_no_longer_holds_is_not_published(versions, gcs, tmp_path):
    old, _ = versions
    root = tmp_path / "root"
    _replace(gcs, old)
    killer = KillBeforeMarkedRename("/.staging/")
    assert forked(_argv(SOURCE, root, "--no-overlap"), killer) == KILLED
    gone = "special_tokens_map.json"
    assert list((root / ".work").glob(f"*/source/{gone}"))
    gcs.client().bucket(BUCKET).blob(f"{PREFIX}/{gone}").delete()
    with contextlib.redirect_stdout(sys.stderr):
        assert main(_argv(SOURCE, root, "--no-overlap")) == 0
    (published,) = root.glob("tiny@r1/*")
    assert manifest.verify(published) == []
    tokenizers = list(published.glob("*/1/tokenizer"))
    assert tokenizers and all((t / "tokenizer.json").is_file() for t in tokenizers)
    assert not list(published.rglob(gone))


def test_an_hf_rerun_after_main_moved_to_another_format_converts_the_new_commit(
    versions, tmp_path, monkeypatch
):
    from tests import runs
    from tests.servers import OlahServer, git

    old, new = versions
    hub = OlahServer(tmp_path / "olah")
    repo = hub.make_repo("org/moving", {p.name: p for p in old.iterdir() if p.is_file()})
    hub.start()
    try:
        runs.use_hub(monkeypatch, hub.url, tmp_path / "hf-home")
        root, source = tmp_path / "root", "hf://org/moving"
        killer = KillBeforeMarkedRename("/.staging/")
        assert forked(_argv(source, root, "--no-overlap"), killer) == KILLED
        assert list((root / ".work").glob("*/source/model.safetensors"))  # kept for a rerun
        git(repo, "rm", "-q", "model.safetensors")
        hub.commit(repo, {p.name: p for p in new.iterdir() if p.is_file()}, "as .bin")
        with contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, root, "--no-overlap", "--follow-source")) == 0
            assert main(_argv(source, tmp_path / "fresh", "--no-overlap")) == 0
    finally:
        hub.stop()
    (published,) = root.glob("tiny@r1/*")
    (fresh,) = (tmp_path / "fresh").glob("tiny@r1/*")
    assert manifest.verify(published) == []
    assert weights(published) == weights(fresh)


def test_the_tokenizer_checked_is_the_one_published_not_one_an_earlier_listing_left(
    versions, gcs, tmp_path, capsys
):
    """A killed run left tokenizer.json in the download directory; the source then dropped it
    and holds vocab.json + merges.txt whose ids run past the model's vocabulary. What the
    repository would hold (those two files) is what is checked, never the file left behind."""
    import json

    old, _ = versions
    root = tmp_path / "root"
    _replace(gcs, old)
    killer = KillBeforeMarkedRename("/.staging/")
    assert forked(_argv(SOURCE, root, "--no-overlap"), killer) == KILLED
    assert list((root / ".work").glob("*/source/tokenizer.json"))
    bucket = gcs.client().bucket(BUCKET)
    bucket.blob(f"{PREFIX}/tokenizer.json").delete()
    vocab = json.loads((old / "vocab.json").read_text())
    vocab["<beyond>"] = 4000  # an id past vocab_size
    bucket.blob(f"{PREFIX}/vocab.json").upload_from_string(json.dumps(vocab))
    with contextlib.redirect_stdout(sys.stderr):
        assert main(_argv(SOURCE, root, "--no-overlap")) == 2
    err = capsys.readouterr().err
    assert "produces ids up to 4000" in err and "hint:" in err, err
    assert not list(root.glob("tiny@r1/*"))
