"""A checkpoint file that does not parse, by where it came from.

A file fetched from gs:// or hf:// matched the checksum its source lists before the converter
read it: fetching it again gives the same bytes, so the error names the remote object and says
to replace it there. A file of a local source may be a copy damaged on its way: the hint says
to copy it again. Against the real GCS emulator and a forged Hub (both on 127.0.0.1).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.runs import cli, run_argv, use_hub
from tests.servers import ForgedHub, GcsServer

pytestmark = pytest.mark.server  # starts real servers (see markers in pyproject.toml)

BUCKET = "corrupt"


def _broken(data: bytes) -> bytes:
    """``data`` (a safetensors file) whose header is no longer JSON, same length."""
    (length,) = struct.unpack("<Q", data[:8])
    return data[:8] + b"{" + b"\0" * (length - 1) + data[8 + length :]


def _files(checkpoint: Path, corrupt: str) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
    files[corrupt] = _broken(files[corrupt])
    return files


def _in_f8(data: bytes) -> bytes:
    """``data`` (a safetensors file) with its first tensor said to be F8_E4M3."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    first = next(name for name in header if name != "__metadata__")
    header[first]["dtype"] = "F8_E4M3"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + length :]


#: prefix -> (file, how it is changed, what the error says of it)
_CONTENT = {
    "config": ("config.json", lambda _: b"{not json", "cannot be read as JSON"),
    "dtype": ("model.safetensors", _in_f8, "in dtype 'F8_E4M3', which the loader does not read"),
}


@pytest.fixture(scope="module")
def gcs(tmp_path_factory, tiny_checkpoint_with_tokenizer, sharded_fp16_checkpoint):
    srv = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    for prefix, checkpoint, corrupt in (
        ("single", tiny_checkpoint_with_tokenizer, "model.safetensors"),
        ("sharded", sharded_fp16_checkpoint, _a_shard(sharded_fp16_checkpoint)),
    ):
        src = tmp_path_factory.mktemp(prefix)
        for name, data in _files(checkpoint, corrupt).items():
            (src / name).write_bytes(data)
        srv.upload_dir(BUCKET, prefix, src)
    for prefix, (name, change, _) in _CONTENT.items():
        src = tmp_path_factory.mktemp(prefix)
        for path in tiny_checkpoint_with_tokenizer.iterdir():
            data = path.read_bytes()
            (src / path.name).write_bytes(change(data) if path.name == name else data)
        srv.upload_dir(BUCKET, prefix, src)
    yield srv
    srv.stop()


def _a_shard(checkpoint: Path) -> str:
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))[1]


def _refused(capsys, source: str, root: Path, *extra: str) -> str:
    code, _, err = cli(capsys, *run_argv(source, root, *extra, backend=None))
    assert code == 2, err
    assert "Traceback" not in err, err
    assert not (root / "tiny").exists()
    return err


@pytest.mark.parametrize("overlap", [[], ["--no-overlap"]], ids=["overlapped", "sequential"])
@pytest.mark.parametrize("prefix", ["single", "sharded"])
def test_a_gs_object_that_matched_its_checksum_but_does_not_parse_is_blamed_on_the_bucket(
    gcs, sharded_fp16_checkpoint, capsys, monkeypatch, tmp_path, prefix, overlap
):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    name = "model.safetensors" if prefix == "single" else _a_shard(sharded_fp16_checkpoint)
    err = _refused(capsys, f"gs://{BUCKET}/{prefix}", tmp_path / "models", *overlap)
    origin = f"gs://{BUCKET}/{prefix}/{name}"
    assert f"{origin} is corrupt at its source: header is not valid JSON" in err, err
    assert f"Replace {origin} at its source" in err, err
    assert "copy that file again" not in err, err


@pytest.mark.parametrize("overlap", [[], ["--no-overlap"]], ids=["overlapped", "sequential"])
@pytest.mark.parametrize("prefix", sorted(_CONTENT))
def test_a_gs_object_whose_content_is_refused_is_named_not_only_its_download(
    gcs, capsys, monkeypatch, tmp_path, prefix, overlap
):
    """A config.json that is no JSON, a tensor in a dtype not read: what is wrong is in the
    object itself (its download matched the checksum), so the error names the object; it
    named only the download below ROOT before."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    name, _, said = _CONTENT[prefix]
    root = tmp_path / "models"
    err = _refused(capsys, f"gs://{BUCKET}/{prefix}", root, *overlap)
    assert f"gs://{BUCKET}/{prefix}/{name} (downloaded to {root}" in err, err
    assert said in err, err


@pytest.mark.parametrize("overlap", [[], ["--no-overlap"]], ids=["overlapped", "sequential"])
@pytest.mark.parametrize("repo", ["single", "sharded"])
def test_an_hf_file_that_matched_its_hash_but_does_not_parse_is_blamed_on_the_repository(
    tiny_checkpoint_with_tokenizer,
    sharded_fp16_checkpoint,
    capsys,
    monkeypatch,
    tmp_path,
    repo,
    overlap,
):
    checkpoint = tiny_checkpoint_with_tokenizer if repo == "single" else sharded_fp16_checkpoint
    name = "model.safetensors" if repo == "single" else _a_shard(sharded_fp16_checkpoint)
    hub = ForgedHub().start()
    try:
        use_hub(monkeypatch, hub.url, tmp_path / "hf-home")
        commit = hub.add(f"org/{repo}", _files(checkpoint, name))
        err = _refused(capsys, f"hf://org/{repo}", tmp_path / "models", *overlap)
    finally:
        hub.stop()
    origin = f"hf://org/{repo}@{commit}/{name}"
    assert f"{origin} is corrupt at its source: header is not valid JSON" in err, err
    assert f"Replace {origin} at its source" in err, err
    assert "copy that file again" not in err, err


def test_a_local_file_that_does_not_parse_is_to_be_copied_again(
    tiny_checkpoint_with_tokenizer, capsys, tmp_path
):
    src = tmp_path / "src"
    src.mkdir()
    for name, data in _files(tiny_checkpoint_with_tokenizer, "model.safetensors").items():
        (src / name).write_bytes(data)
    err = _refused(capsys, str(src), tmp_path / "models")
    assert f"{src / 'model.safetensors'} is truncated or corrupt" in err, err
    assert "Download or copy that file again" in err, err
    assert "at its source" not in err, err
