"""`model-loader run` against changing sources: the fingerprint rule, one key per spelling,
and the download directory (real fake-gcs-server and olah on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import pytest

from loader.repository import manifest
from loader.repository.key import key_filename
from tests.runs import cli, run_argv, use_hub
from tests.servers import GcsServer, OlahServer

BUCKET = "models"


def _flip_last_bytes(path: Path) -> None:
    """Change a weight's value (the file's last bytes) and keep the file valid and its size."""
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(b ^ 0x55 for b in data[-4:])
    path.write_bytes(bytes(data))


@pytest.fixture
def local_source(tiny_checkpoint_with_tokenizer, tmp_path) -> Path:
    source = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_with_tokenizer, source)
    return source


# --- local sources --------------------------------------------------------------------------


def test_an_overwritten_local_source_is_never_nothing_to_do(local_source, tmp_path, capsys):
    root = tmp_path / "root"
    code, out, _ = cli(capsys, *run_argv(str(local_source), root))
    assert code == 0
    published = Path(out[-1])
    before = (published / manifest.MANIFEST).read_bytes()
    recorded = manifest.read_manifest(published)[manifest.SOURCE_FINGERPRINT]
    assert recorded["uri"] == f"file://{local_source}"
    assert len(recorded["files"]["model.safetensors"]["blake3"]) == 64

    _flip_last_bytes(local_source / "model.safetensors")
    code, out, err = cli(capsys, *run_argv(str(local_source), root))
    assert code == 2
    assert out == []
    assert "model.safetensors changed" in err
    assert "keeps serving the old weights" in err
    assert "hint: Pin the new content under a new key (--revision NEW" in err
    assert "Traceback" not in err
    assert (published / manifest.MANIFEST).read_bytes() == before  # left as it was

    # Following the source publishes it again under the same key; then it is up to date.
    code, out, _ = cli(capsys, *run_argv(str(local_source), root, "--follow-source"))
    assert code == 0 and out[-1] == str(published)
    assert manifest.verify(published) == []
    assert (published / manifest.MANIFEST).read_bytes() != before
    code, out, _ = cli(capsys, *run_argv(str(local_source), root))
    assert code == 0 and out[-1] == str(published)


def test_a_touched_but_identical_local_file_is_not_a_change(local_source, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="loader")
    root = tmp_path / "root"
    assert cli(capsys, *run_argv(str(local_source), root))[0] == 0
    os.utime(local_source / "model.safetensors", (1, 1))
    shutil.copy(local_source / "config.json", local_source / "config.json.tmp")
    os.replace(local_source / "config.json.tmp", local_source / "config.json")  # a new inode
    caplog.clear()
    code, _, _ = cli(capsys, *run_argv(str(local_source), root))
    assert code == 0
    assert "already published and verified; nothing to do" in caplog.text
    assert "hashing 2 file(s)" in caplog.text  # only the two whose stat changed were read


def _as_an_earlier_loader_recorded_it(published: Path, source: Path) -> None:
    """Rewrite the key's source fingerprint with sha256 digests and no stat stamps (every
    file is read again): what loaders before BLAKE3 recorded."""
    data = manifest.read_manifest(published)
    recorded = data[manifest.SOURCE_FINGERPRINT]
    for rel, info in recorded["files"].items():
        del info["blake3"]
        info["sha256"] = hashlib.sha256((source / rel).read_bytes()).hexdigest()
    recorded.pop("stamps", None)
    (published / manifest.MANIFEST).chmod(0o644)
    manifest.write_manifest(published, data)


def test_a_sha256_fingerprint_of_an_earlier_loader_is_compared_as_sha256(
    local_source, tmp_path, capsys, caplog
):
    caplog.set_level(logging.INFO, logger="loader")
    root = tmp_path / "root"
    code, out, _ = cli(capsys, *run_argv(str(local_source), root))
    assert code == 0
    published = Path(out[-1])
    _as_an_earlier_loader_recorded_it(published, local_source)
    caplog.clear()
    code, out, _ = cli(capsys, *run_argv(str(local_source), root))
    assert code == 0 and out[-1] == str(published)
    assert "already published and verified; nothing to do" in caplog.text
    _flip_last_bytes(local_source / "model.safetensors")
    code, _, err = cli(capsys, *run_argv(str(local_source), root))
    assert code == 2
    assert "model.safetensors changed" in err


def test_a_file_added_to_a_local_source_is_a_change(local_source, tmp_path, capsys):
    root = tmp_path / "root"
    assert cli(capsys, *run_argv(str(local_source), root))[0] == 0
    (local_source / "README.md").write_text("# notes\n")
    code, _, err = cli(capsys, *run_argv(str(local_source), root))
    assert code == 2
    assert "README.md was added" in err


def test_every_spelling_of_a_local_path_publishes_one_key(
    local_source, tmp_path, capsys, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="loader")
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "root"
    paths = []
    for spelling in ("ckpt", f"{local_source}/", f"file://{local_source}", "./x/../ckpt"):
        code, out, err = cli(capsys, *run_argv(spelling, root))
        assert code == 0, err
        paths.append(out[-1])
    assert len(set(paths)) == 1
    assert caplog.text.count("nothing to do") == 3
    assert len([p for p in root.glob("tiny@*/*") if p.is_dir()]) == 1


# --- gs:// sources ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    srv = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    yield srv
    srv.stop()


@pytest.fixture
def gs_source(gcs, local_source, monkeypatch, request) -> str:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    prefix = f"ckpt-{request.node.name[:40]}"
    gcs.upload_dir(BUCKET, prefix, local_source)
    return f"gs://{BUCKET}/{prefix}"


@pytest.mark.server
def test_a_re_uploaded_gcs_prefix_is_a_change(gs_source, gcs, local_source, tmp_path, capsys):
    root = tmp_path / "root"
    code, out, _ = cli(capsys, *run_argv(gs_source, root))
    assert code == 0
    recorded = manifest.read_manifest(Path(out[-1]))[manifest.SOURCE_FINGERPRINT]
    entry = recorded["files"]["model.safetensors"]
    assert entry["crc32c"] and entry["generation"]

    _flip_last_bytes(local_source / "model.safetensors")
    gcs.upload_dir(BUCKET, gs_source.split("/", 3)[3], local_source)
    code, out, err = cli(capsys, *run_argv(gs_source + "/", root))  # another spelling: same key
    assert code == 2
    assert "model.safetensors changed" in err and "config.json changed" in err


@pytest.mark.server
def test_a_scratch_work_dir_keeps_everything_the_loader_did_not_create(gs_source, tmp_path, capsys):
    root, scratch = tmp_path / "root", tmp_path / "scratch"
    (scratch / "mine").mkdir(parents=True)
    (scratch / "notes.txt").write_text("not the loader's")
    code, out, _ = cli(capsys, *run_argv(gs_source, root, "--work-dir", str(scratch)))
    assert code == 0
    assert manifest.verify(Path(out[-1])) == []
    assert sorted(p.name for p in scratch.iterdir()) == ["mine", "notes.txt"]
    assert (scratch / "notes.txt").read_text() == "not the loader's"


@pytest.mark.server
def test_the_repository_root_as_work_dir_keeps_the_published_model(gs_source, tmp_path, capsys):
    root = tmp_path / "root"
    root.mkdir()
    (root / "other-model").mkdir()
    code, out, _ = cli(capsys, *run_argv(gs_source, root, "--work-dir", str(root)))
    assert code == 0
    published = Path(out[-1])
    assert manifest.verify(published) == []  # the printed path exists and is complete
    assert (root / "other-model").is_dir()
    assert not (root / key_filename(str(published.relative_to(root)))).exists()


@pytest.mark.server
def test_a_download_directory_the_loader_did_not_create_is_refused_and_kept(
    gs_source, tmp_path, capsys
):
    from loader.cli import build_parser
    from loader.cli.run import request_from_args

    root, scratch = tmp_path / "root", tmp_path / "scratch"
    argv = run_argv(gs_source, root, "--work-dir", str(scratch))
    key = request_from_args(build_parser().parse_args(argv)).key
    from loader.run.strategies import download_name

    theirs = scratch / download_name(request_from_args(build_parser().parse_args(argv)), root, key)
    theirs.mkdir(parents=True)
    (theirs / "theirs.txt").write_text("x")
    code, _, err = cli(capsys, *argv)
    assert code == 2, err
    assert f"{theirs} is a directory without the loader's marker for {key}" in err
    assert [p.name for p in theirs.iterdir()] == ["theirs.txt"]  # nothing written into it
    assert (theirs / "theirs.txt").read_text() == "x"


# --- hf:// sources ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tiny_checkpoint_with_tokenizer, tmp_path_factory):
    srv = OlahServer(tmp_path_factory.mktemp("olah"))
    ckpt = tiny_checkpoint_with_tokenizer
    files = {p.relative_to(ckpt).as_posix(): p for p in ckpt.rglob("*") if p.is_file()}
    srv.repo = srv.make_repo("org/moving", files)
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.server
def test_a_moved_hf_branch_is_a_change_naming_both_commits(hub, tmp_path, capsys, monkeypatch):
    use_hub(monkeypatch, hub.url, tmp_path / "hf-home")
    root = tmp_path / "root"
    code, out, err = cli(capsys, *run_argv("hf://org/moving@main", root))
    assert code == 0, err
    published = Path(out[-1])
    first = manifest.read_manifest(published)[manifest.SOURCE_FINGERPRINT]["commit"]
    assert len(first) == 40

    moved = hub.commit(hub.repo, {"generation_config.json": b"{}\n"}, "main moves")
    code, out, err = cli(capsys, *run_argv("hf://org/moving@main", root))
    assert code == 2
    assert f"commit {first} is now {moved}" in err
    # Pinning the new commit publishes it under its own key; the old key stays as it was.
    code, out, err = cli(capsys, *run_argv(f"hf://org/moving@{moved}", root))
    assert code == 0, err
    assert Path(out[-1]) != published and manifest.verify(published) == []


@pytest.mark.server
def test_a_run_that_finds_its_key_published_removes_an_interrupted_runs_download(
    gs_source, tmp_path, capsys
):
    from loader.cli import build_parser
    from loader.cli.run import request_from_args
    from loader.repository.publish import DOWNLOAD_MARKER

    root = tmp_path / "root"
    argv = run_argv(gs_source, root)
    assert cli(capsys, *argv)[0] == 0
    key = request_from_args(build_parser().parse_args(argv)).key
    left = root / ".work" / key_filename(key)  # what a run killed while downloading leaves
    (left / "source").mkdir(parents=True)
    (left / DOWNLOAD_MARKER).write_text(f"{key}\n")
    (left / "source" / "model.safetensors").write_bytes(b"x" * 1000)
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    assert not left.exists()
