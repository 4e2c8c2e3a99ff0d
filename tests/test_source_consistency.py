"""A source is read once and consistently: a local source replaced while it is converted is
never published under its new fingerprint; ``gs://`` names that would alias one local file are
refused; a FIFO, device or socket is never read; a link loop is a typed error."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loader import fs
from loader.errors import ReplacedDownloadError, SourceError, SpecialFileError
from loader.repository import manifest
from loader.sources import fetch, parse_uri
from tests.at_step import AtStep
from tests.runs import cli, published, run_argv, weights

ROOT = Path(__file__).resolve().parents[1]


def _copy(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    return to


def _refused_as_changed(code: int, err: str, root: Path) -> None:
    """The run stopped as for a source changed while it was read (75), publishing nothing."""
    assert code == 75 and "changed while it was loading" in err and "hint:" in err, err
    assert not list(root.glob("tiny@*/*"))


def _rerun_publishes_the_source_as_it_is(capsys, source: Path, root: Path, out: Path) -> None:
    """The next run publishes a key that verifies and holds the weights ``convert`` makes of
    the source as it is now."""
    code, _, err = cli(capsys, *run_argv(source, root))
    assert code == 0, err
    repo = published(root)
    assert manifest.verify(repo) == []
    code, lines, err = cli(capsys, "convert", str(source), str(out), "--tp-size", "1")
    assert code == 0, err
    assert weights(repo) == {p.name: p.read_bytes() for p in sorted(Path(lines[-1]).iterdir())}


def test_a_local_source_replaced_while_converting_is_not_published(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    source = _copy(tiny_checkpoint_with_tokenizer, tmp_path / "ckpt")
    (weights_file,) = source.glob("*.safetensors")
    replacement = tmp_path / "new.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-8:] = bytes(8)  # other weights, same layout
    replacement.write_bytes(bytes(data))
    replaced = []

    def replace_once(op: str, path: str) -> None:
        if (
            not replaced
            and op == "open"
            and "/fastertransformer/1/" in path
            and "/.staging/" in path
        ):
            replaced.append(path)
            os.replace(replacement, weights_file)  # the user's upload lands meanwhile

    root = tmp_path / "root"
    with fs.inject(replace_once):
        code, _, err = cli(capsys, *run_argv(source, root))
    assert replaced, "the conversion never opened an output"
    _refused_as_changed(code, err, root)
    _rerun_publishes_the_source_as_it_is(capsys, source, root, tmp_path / "out")


def test_bytes_written_through_a_mapping_while_converting_are_not_published(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """A writer holding the weights file mapped shared changes its bytes while the conversion
    reads it: a page already dirty takes the write without a fault, so the file's mtime, ctime,
    inode and size stay what the run's first look saw. The run hashes the source again after
    converting, never trusting those stamps within the run, so nothing is published under the
    fingerprint of bytes the source no longer holds."""
    source = _copy(tiny_checkpoint_with_tokenizer, tmp_path / "ckpt")
    path = source / "model.safetensors"
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    mapped = mmap.mmap(fd, size)
    os.close(fd)
    mapped[size - 1] = mapped[size - 1]  # the last page dirty and writable before the run
    written = []

    def write_through_the_mapping(op: str, where: str) -> None:
        if not written and op == "open" and "/fastertransformer/1/" in where:
            old = mapped[size - 8 : size]
            mapped[size - 8 : size] = bytes(8) if old != bytes(8) else b"\x01" * 8
            written.append(where)

    root = tmp_path / "root"
    try:
        with fs.inject(write_through_the_mapping):
            code, _, err = cli(capsys, *run_argv(source, root))
    finally:
        mapped.close()
    assert written, "the conversion never opened an output"
    _refused_as_changed(code, err, root)
    _rerun_publishes_the_source_as_it_is(capsys, source, root, tmp_path / "out")


def test_a_full_verification_hashes_a_local_source_whatever_its_stat_stamps_say(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """Bytes written through a shared mapping after a key was published leave the weights
    file's mtime, ctime, inode and size as the manifest recorded them: a quick rerun trusts
    those stamps (it reads only files whose stamps moved), a ``--verify full`` rerun hashes
    every file of the source again and refuses the changed source."""
    source = _copy(tiny_checkpoint_with_tokenizer, tmp_path / "ckpt")
    path = source / "model.safetensors"
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    mapped = mmap.mmap(fd, size)
    os.close(fd)
    try:
        mapped[size - 1] = mapped[size - 1]  # the last page dirty and writable before the run
        root = tmp_path / "root"
        assert cli(capsys, *run_argv(source, root))[0] == 0
        old = mapped[size - 8 : size]
        mapped[size - 8 : size] = bytes(8) if old != bytes(8) else b"\x01" * 8
    finally:
        mapped.close()
    code, _, err = cli(capsys, *run_argv(source, root, "--verify", "full"))
    assert code == 2 and "model.safetensors changed" in err and "hint:" in err, err


def test_a_tokenizer_replaced_after_converting_is_not_published(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """The tokenizer files are copied into the repository after the weights are converted: a
    tokenizer.json replaced between the conversion and that copy (one no check has read) is
    never published under the fingerprint of the one that was checked."""
    source = _copy(tiny_checkpoint_with_tokenizer, tmp_path / "ckpt")
    tokenizer = source / "tokenizer.json"
    broken = tmp_path / "broken.json"
    broken.write_text("{not a tokenizer")
    converted, replaced = [], []

    def replace_after_converting(op: str, where: str) -> None:
        if op == "open" and where.endswith("/preprocessing/1/tokenizer"):
            converted.append(where)  # the weights are written: the repository is being built
        elif converted and not replaced and op == "open" and where == str(tokenizer):
            replaced.append(where)
            os.replace(broken, tokenizer)  # the user's upload lands meanwhile

    root = tmp_path / "root"
    with fs.inject(replace_after_converting):
        code, _, err = cli(capsys, *run_argv(source, root))
    assert replaced, "the tokenizer was never read after the conversion"
    _refused_as_changed(code, err, root)
    code, _, err = cli(capsys, *run_argv(source, root))
    assert code == 2 and "tokenizer" in err and "hint:" in err, err  # refused, as a first look


def test_a_link_out_of_the_source_put_in_before_the_tokenizer_copy_is_not_published(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """A tokenizer file replaced, once the weights are converted, by a link to a file outside
    the source (one the loader's user can read) is never copied into a published repository,
    whose files every uid reads."""
    source = _copy(tiny_checkpoint_with_tokenizer, tmp_path / "ckpt")
    outside = tmp_path / "secret.json"
    outside.write_text('{"secret": "key"}')
    building, replaced = [], []

    def link_out_while_building(op: str, where: str) -> None:
        if op == "open" and where.endswith("/preprocessing/1/tokenizer"):
            building.append(where)
        elif building and not replaced and op == "open" and where.startswith(str(source)):
            replaced.append(where)
            os.unlink(where)
            os.symlink(outside, where)

    root = tmp_path / "root"
    with fs.inject(link_out_while_building):
        code, _, err = cli(capsys, *run_argv(source, root))
    assert replaced, "no tokenizer file was read after the conversion"
    assert code == 2 and "outside the source directory" in err and "hint:" in err, err
    assert not list(root.glob("tiny@*/*"))
    assert not [p for p in root.rglob("*") if p.is_file() and b"secret" in p.read_bytes()]


@pytest.mark.parametrize("where", ["config.json", "model.safetensors", "extra.bin"])
def test_a_fifo_in_a_local_source_is_refused_never_read(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, where
):
    source = _copy(tiny_checkpoint_with_tokenizer, tmp_path / "ckpt")
    if (source / where).exists():
        (source / where).unlink()
    os.mkfifo(source / where)
    code, _, err = cli(capsys, *run_argv(source, tmp_path / "root"))
    assert code == 2 and "FIFO" in err and "hint:" in err, err


def test_a_fifo_is_never_opened_for_reading(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SpecialFileError):
        fs.read_file(fifo, limit=10)
    with pytest.raises(SpecialFileError):
        fs.open_read(fifo)


def test_a_link_loop_in_a_local_source_is_a_typed_error(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    source = _copy(tiny_checkpoint_with_tokenizer, tmp_path / "ckpt")
    (source / "a").symlink_to(source / "b")
    (source / "b").symlink_to(source / "a")
    code, _, err = cli(capsys, *run_argv(source, tmp_path / "root"))
    assert code == 2 and "leads nowhere" in err and "hint:" in err, err


@pytest.mark.parametrize("name", ["p//x", "p/a//x", "p/./x", "p/../x", "p/x\0y", "p/"])
def test_gcs_names_that_would_alias_a_local_file_are_refused(name):
    from loader.sources.gcs import _relpath

    with pytest.raises(SourceError):
        _relpath(parse_uri("gs://bucket/p"), name)


@pytest.mark.parametrize("name", ["q/x", "px", "pp/x", ""])
def test_a_gcs_name_outside_the_prefix_listed_is_refused(name):
    """Before: the prefix's length was cut off whatever the name: a forged listing naming
    ``q/x`` beside ``p/x`` gave two objects the one local file ``x``."""
    from loader.sources.gcs import _relpath

    with pytest.raises(SourceError, match="not below that prefix"):
        _relpath(parse_uri("gs://bucket/p"), name)


def test_gcs_names_map_one_to_one():
    from loader.sources.gcs import _relpath

    uri = parse_uri("gs://bucket/p")
    assert _relpath(uri, "p/x") == "x"
    assert _relpath(uri, "p/a/x") == "a/x"
    assert _relpath(parse_uri("gs://bucket"), "a/x") == "a/x"


def test_a_fifo_as_the_hub_token_file_is_refused(tmp_path):
    from loader.sources.hf import _read_token_file

    os.mkfifo(tmp_path / "token")
    with pytest.raises(SourceError):
        _read_token_file(str(tmp_path / "token"), "--hf-token-file")


@pytest.mark.parametrize("kind", ["dir", "device", "dangling link", "link to a fifo", "socket"])
@pytest.mark.parametrize("variable", ["--hf-token-file", "HF_TOKEN_PATH", "HF_TOKEN_FILE"])
def test_a_token_file_that_is_no_regular_file_is_refused_never_read(
    tmp_path, monkeypatch, kind, variable
):
    """Whichever way it is named. A link to a regular file is read (a mounted Kubernetes
    Secret is one: ``token -> ..data/token``); a link to anything else is refused like it."""
    import socket

    from loader.sources import FetchOptions
    from loader.sources.hf import resolve_token

    path = tmp_path / "token"
    if kind == "dir":
        path.mkdir()
    elif kind == "device":
        path = Path("/dev/null")
    elif kind == "dangling link":
        path.symlink_to(tmp_path / "missing")
    elif kind == "link to a fifo":
        os.mkfifo(tmp_path / "fifo")
        path.symlink_to(tmp_path / "fifo")
    else:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))  # the socket file stays
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    options = FetchOptions()
    if variable.startswith("--"):
        options = FetchOptions(hf_token_file=str(path))
    else:
        monkeypatch.setenv(variable, str(path))
    with pytest.raises(SourceError) as info:
        resolve_token(options)
    assert str(path) in info.value.message and info.value.exit_code == 2


@pytest.mark.parametrize("variable", ["HF_HOME", "XDG_CACHE_HOME", "HOME"])
def test_a_stored_login_below_a_file_names_the_setting_that_put_it_there(tmp_path, variable):
    """``HF_HOME`` (or what it defaults from) naming a file, the token's file mistaken for the
    Hub's directory: the Hub library's read of ``$HF_HOME/token`` failed with NotADirectoryError,
    reported as the source's failure with a hint to check the source URI. Now the setting is
    named, with what to set it to (exit 2, before any request)."""
    token = tmp_path / "hf-token"
    token.write_text("hf_x\n")
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("HF_", "HUGGINGFACE_")) and k not in ("XDG_CACHE_HOME", "HOME")}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "loader", "fetch", "hf://org/name", str(tmp_path / "dest"),
         "--retry-deadline", "2", "-q"],
        env={**clean, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": "http://127.0.0.1:9",
             variable: str(token)},
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: The stored Hugging Face login"), done.stderr
    assert f"from {variable})" in done.stderr and f"hint: Set {variable} to" in done.stderr
    assert "source URI" not in done.stderr and "Traceback" not in done.stderr


def test_a_token_file_behind_a_link_is_read_as_a_mounted_secret_is(tmp_path):
    from loader.sources import FetchOptions
    from loader.sources.hf import resolve_token

    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "token").write_text("hf_fromTheSecret\n")
    (tmp_path / "token").symlink_to("..data/token")
    assert resolve_token(FetchOptions(hf_token_file=str(tmp_path / "token"))) == "hf_fromTheSecret"


@pytest.mark.parametrize("kind", ["fifo", "dir", "link to a fifo", "file", "none"])
def test_the_stored_login_is_looked_at_before_the_hub_library_opens_it(tmp_path, monkeypatch, kind):
    """With no token named, huggingface_hub opens ``$HF_HOME/token`` as it is: a FIFO there
    held the fetch forever. Anything there but a regular file is refused first; a file (or
    none) is left to the library, which reads it itself."""
    from huggingface_hub import constants

    from loader.sources import FetchOptions
    from loader.sources.hf import resolve_token

    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    stored = tmp_path / "token"
    if kind == "fifo":
        os.mkfifo(stored)
    elif kind == "dir":
        stored.mkdir()
    elif kind == "link to a fifo":
        os.mkfifo(tmp_path / "fifo")
        stored.symlink_to(tmp_path / "fifo")
    elif kind == "file":
        stored.write_text("hf_stored\n")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(stored))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", False)
    if kind in ("file", "none"):
        assert resolve_token(FetchOptions()) is None  # the library's own
        return
    with pytest.raises(SourceError, match="stored Hugging Face login") as info:
        resolve_token(FetchOptions())
    assert str(stored) in info.value.message and info.value.exit_code == 2
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)
    assert resolve_token(FetchOptions()) is None  # the library never looks


def test_a_local_source_changed_and_changed_back_while_converting_is_not_published(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """The weights file is rewritten in place (same inode) once the conversion writes its first
    output, and its first bytes are written back before the repository is built: the source
    holds what it held at the run's first look, but the conversion read other bytes. Its
    ctime moved while it was read: nothing is published under the fingerprint of bytes the
    conversion may not have read."""
    source = _copy(tiny_checkpoint_with_tokenizer, tmp_path / "ckpt")
    path = source / "model.safetensors"
    size = path.stat().st_size
    first = path.read_bytes()[size - 8 :]
    other = bytes(8) if first != bytes(8) else b"\x01" * 8
    steps = []

    def rewrite(data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, size - 8)
        finally:
            os.close(fd)

    def change_and_change_back(op: str, where: str) -> None:
        if not steps and op == "open" and "/fastertransformer/1/" in where:
            rewrite(other)  # the user's edit lands meanwhile
            steps.append(where)
        elif len(steps) == 1 and op == "open" and where.endswith("/preprocessing/1/tokenizer"):
            rewrite(first)  # and is undone
            steps.append(where)

    root = tmp_path / "root"
    with fs.inject(change_and_change_back):
        code, _, err = cli(capsys, *run_argv(source, root))
    assert len(steps) == 2, steps
    assert path.read_bytes()[size - 8 :] == first
    _refused_as_changed(code, err, root)
    _rerun_publishes_the_source_as_it_is(capsys, source, root, tmp_path / "out")


# --- a downloaded file is converted only as it was verified ----------------------------------

BUCKET = "models"


@pytest.fixture(scope="module")
def gcs_sharded(tmp_path_factory):
    """The GCS emulator serving a three-shard checkpoint at gs://models/org/sharded; yields
    (the server, another checkpoint of the same layout and other weights)."""
    from tests.servers import GcsServer
    from tests.tinymodels import make_sharded_checkpoint

    base = tmp_path_factory.mktemp("sharded")
    served = make_sharded_checkpoint(base / "served", seed=5)
    other = make_sharded_checkpoint(base / "other", seed=6)
    server = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    server.upload_dir(BUCKET, "org/sharded", served)
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", server.url)
    yield server, other, served
    mp.undo()
    server.stop()


@pytest.mark.server
@pytest.mark.parametrize("planted", ["a shard", "no safetensors file"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "sequential"])
def test_a_shard_renamed_over_its_download_after_it_was_verified_is_not_converted(
    gcs_sharded, tmp_path, capsys, overlap, planted
):
    """Another process renames a file (of the same layout, or one that is no safetensors file
    at all) over a verified shard in WORK/<key>/source just before the conversion opens it: the
    run refuses it as not the file verified (75, the file named; never as a corrupt file at
    the source, 2), reads nothing of it and publishes nothing."""
    _, other, _ = gcs_sharded
    (shard, *_) = sorted(p.name for p in other.glob("model-*.safetensors"))
    planted_at = tmp_path / "planted.safetensors"
    if planted == "a shard":
        shutil.copy(other / shard, planted_at)
    else:
        planted_at.write_bytes(b"\xff" * 64)

    def downloaded_shard(op: str, path: str) -> str | None:
        is_it = op == "open" and "/.work/" in path and path.endswith(f"/source/{shard}")
        return path if is_it else None

    swap = AtStep(1, downloaded_shard, lambda path: os.rename(planted_at, path))
    root = tmp_path / "root"
    argv = run_argv(f"gs://{BUCKET}/org/sharded", root, "--retry-deadline", "10")
    with fs.inject(swap):
        code, _, err = cli(capsys, *argv, *([] if overlap else ["--no-overlap"]))
    assert swap.done, "the conversion never opened the shard"
    assert code == 75, err
    assert "is not the file the loader downloaded and verified" in err and shard in err, err
    assert not list(root.glob("tiny@*/*"))


@pytest.fixture(scope="module")
def hf_sharded(tmp_path_factory):
    """The olah Hub mirror serving a sharded checkpoint at hf://org/sharded; yields
    (another checkpoint of the same layout and other weights, the one served)."""
    from tests.runs import use_hub
    from tests.servers import OlahServer
    from tests.tinymodels import make_sharded_checkpoint

    base = tmp_path_factory.mktemp("hf-sharded")
    served = make_sharded_checkpoint(base / "served", seed=5)
    other = make_sharded_checkpoint(base / "other", seed=6)
    server = OlahServer(base / "olah")
    server.make_repo("org/sharded", {p.name: p for p in served.iterdir() if p.is_file()})
    server.start()
    mp = pytest.MonkeyPatch()
    use_hub(mp, server.url, base / "hf-home")
    yield other, served
    mp.undo()
    server.stop()


def _written_in_place(path: Path, data: bytes) -> None:
    """``data`` written over the file at ``path`` (the same inode), its modification time moved
    on as a write a moment later moves it."""
    before = os.stat(path)
    with open(path, "r+b") as fh:
        fh.write(data)
        fh.truncate(len(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


@pytest.mark.parametrize("how", ["written in place", "renamed over"])
@pytest.mark.parametrize("reader", ["read_file", "copy_in"])
def test_a_file_changed_since_its_download_was_verified_is_never_read_as_that_file(
    tmp_path, how, reader
):
    """``fs.read_file`` (config.json, the index) and ``Dir.copy_in`` (the tokenizer files)
    given the stamp of the file a download verified: the very file, unchanged, is read; one
    written in place since (the same inode and size, its modification time moved on) or
    renamed over it (another inode, the same size and time) is refused, a
    :class:`ReplacedDownloadError`, and nothing is copied."""
    from loader.errors import ReplacedDownloadError

    path = tmp_path / "source" / "config.json"
    path.parent.mkdir()
    path.write_bytes(b'{"n_layer": 1}')
    checked = fs.stamp(os.lstat(path))

    def read() -> bytes:
        if reader == "read_file":
            return fs.read_file(path, limit=1024, checked=checked)
        with fs.Dir.open(tmp_path / "repo", create=True) as d:
            d.copy_in("config.json", path, checked=checked)
        copied = tmp_path / "repo" / "config.json"
        data = copied.read_bytes()
        copied.unlink()
        return data

    assert read() == b'{"n_layer": 1}'
    if how == "written in place":
        _written_in_place(path, b'{"n_layer": 9}')
    else:
        other = tmp_path / "other.json"
        other.write_bytes(b'{"n_layer": 9}')
        os.utime(other, ns=(checked[3], checked[3]))
        os.rename(other, path)
    with pytest.raises(ReplacedDownloadError, match=r"config\.json"):
        read()
    assert not (tmp_path / "repo" / "config.json").exists()


def test_a_gs_partial_file_is_the_one_written_only_at_its_size_and_last_slices_time():
    """A gs:// partial file is taken as the file this run's slices were written through only
    while its size is the object's and its modification time the latest the slices saw after
    their writes: bytes appended or cut in place in the same clock tick as the last write
    (the time unchanged), or a time an earlier slice saw, are another file's."""
    import types

    from loader.sources.gcs import _as_written

    obj = types.SimpleNamespace(size=10, written=[(1, 2, 10, 7), (1, 2, 4, 5)], read_back=None)
    assert _as_written(obj, (1, 2, 10, 7))
    assert not _as_written(obj, (1, 2, 11, 7)) and not _as_written(obj, (1, 2, 9, 7))
    assert not _as_written(obj, (1, 2, 10, 5)) and not _as_written(obj, (1, 2, 10, 8))


@pytest.mark.server
@pytest.mark.parametrize("how", ["written", "renamed"])
@pytest.mark.parametrize("scheme", ["gs", "hf"])
def test_a_partial_download_changed_after_its_last_write_is_not_published(
    request, tmp_path, capsys, scheme, how
):
    """Another process writes another shard of the same layout into a shard's partial download
    (in place, or renamed over it) at the first look at it once all its bytes arrived, before
    it is moved into place: the run refuses it, naming it, and publishes nothing (written in
    place: 75, the file is not the one verified; renamed over: 2, the file is not the loader's,
    left where it is, for the user to move away)."""
    gs = scheme == "gs"
    _, other, served = (
        request.getfixturevalue("gcs_sharded")
        if gs
        else (None, *request.getfixturevalue("hf_sharded"))
    )
    (shard, *_) = sorted(p.name for p in other.glob("model-*.safetensors"))
    planted = tmp_path / "planted.safetensors"
    shutil.copy(other / shard, planted)
    planted_bytes, served_bytes = planted.read_bytes(), (served / shard).read_bytes()
    assert len(planted_bytes) == len(served_bytes) and planted_bytes != served_bytes
    partial = "/.partial/" if gs else ".incomplete"

    def arrived_partial(op: str, path: str) -> str | None:
        """A look at the shard's partial download holding all of its bytes."""
        if op != "stat" or partial not in path or f"/{shard}." not in path:
            return None
        if path.endswith(".slices") or not os.path.isfile(path):
            return None
        return path if Path(path).read_bytes() == served_bytes else None

    deed = (
        (lambda path: _written_in_place(Path(path), planted_bytes))
        if how == "written"
        else (lambda path: os.rename(planted, path))
    )
    swap = AtStep(1, arrived_partial, deed)
    root = tmp_path / "root"
    uri = f"gs://{BUCKET}/org/sharded" if gs else "hf://org/sharded"
    with fs.inject(swap):
        code, _, err = cli(capsys, *run_argv(uri, root, "--retry-deadline", "10"))
    assert swap.done, "the partial download was never looked at complete"
    assert not list(root.glob("tiny@*/*")), err
    if how == "written":
        assert code == 75, err
        assert "is not the file the loader downloaded and verified" in err and shard in err, err
        code, _, err = cli(capsys, *run_argv(uri, root, "--retry-deadline", "10"))
        assert code == 0, err  # run again, as the message says: the source published
    else:
        assert code == 2, err
        assert "the loader did not create it and leaves it alone" in err and shard in err, err
        left = [p for p in root.rglob(f"*{shard}*") if p.read_bytes() == planted_bytes]
        assert len(left) == 1 and partial in str(left[0]), left


@pytest.mark.server
@pytest.mark.parametrize(
    ("name", "looked_at", "written"),
    [
        ("config.json", ("open", "/source/config.json"), "json"),  # read again by verify
        ("model.safetensors.index.json", ("open", "/source/model.safetensors.index.json"), "json"),
        ("tokenizer.json", ("mkdir", "/1/tokenizer"), "json"),  # copied by the build
        # opened, found the file verified, then written over before its bytes are read
        ("config.json", ("read", "/source/config.json"), "json"),
        ("model.safetensors.index.json", ("read", "/source/model.safetensors.index.json"), "json"),
        # (its last copy: each of the three tokenizing models holds one, read in two reads)
        ("tokenizer.json", ("read", "/source/tokenizer.json", 5), "json"),
        # the tokenizer check: a file that does not load is not the source's fault
        ("tokenizer.json", ("open", "/source/tokenizer.json"), "no tokenizer"),
    ],
    ids=[
        "config",
        "index",
        "tokenizer",
        "config-opened",
        "index-opened",
        "tokenizer-opened",
        "tokenizer-checked",
    ],
)
def test_a_small_file_written_over_after_its_download_was_verified_is_not_published(
    gcs_sharded, tmp_path, capsys, name, looked_at, written
):
    """Another process writes over a downloaded config.json, index or tokenizer.json in
    WORK/<key>/source (in place: still valid JSON, or no tokenizer at all) after its download
    was verified, before the run reads it again (verify, the tokenizer check) or copies it
    into the repository (the build), or once it opened it, before its bytes are read: the run
    refuses it (75, the file named), never as a file of the source that does not load (2),
    and publishes nothing."""
    op, ending, *nth = looked_at

    def the_moment(seen_op: str, path: str) -> str | None:
        return path if seen_op == op and path.endswith(ending) else None

    def written_over(_: str) -> None:  # valid JSON and another file, or no tokenizer
        target = next((tmp_path / "root" / ".work").glob(f"*/source/{name}"))
        data = target.read_bytes() + b" " if written == "json" else b"{}" + b" " * 100
        _written_in_place(target, data)

    swap = AtStep(nth[0] if nth else 1, the_moment, written_over)
    root = tmp_path / "root"
    argv = run_argv(f"gs://{BUCKET}/org/sharded", root, "--retry-deadline", "10")
    with fs.inject(swap):
        code, _, err = cli(capsys, *argv, "--no-overlap")
    assert swap.done, "the moment never came"
    assert code == 75, err
    assert "is not the file the loader downloaded and verified" in err and name in err, err
    assert not list(root.glob("tiny@*/*"))


@pytest.mark.server
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "sequential"])
def test_a_shard_written_over_after_it_was_opened_and_checked_is_not_published(
    gcs_sharded, tmp_path, capsys, overlap
):
    """Another process writes another checkpoint's bytes (same layout, same sizes) in place
    over the verified shards in WORK/<key>/source once the conversion opened them and found
    them the files verified, as it starts writing its first output from them: the run refuses
    them (75, a shard named), keeps no output made of them (overlapped: none journaled) and
    publishes nothing; the next run publishes the source as it is."""
    _, other, served = gcs_sharded

    def first_output(op: str, path: str) -> str | None:
        name = Path(path).name
        is_it = op == "open" and "/source/" not in path and name.startswith("model.")
        return path if is_it and name.endswith(".bin") else None

    def written_over(_: str) -> None:
        for shard in (tmp_path / "root" / ".work").glob("*/source/model-*.safetensors"):
            _written_in_place(shard, (other / shard.name).read_bytes())

    swap = AtStep(1, first_output, written_over)
    root = tmp_path / "root"
    argv = run_argv(f"gs://{BUCKET}/org/sharded", root, "--retry-deadline", "10")
    argv += [] if overlap else ["--no-overlap"]
    with fs.inject(swap):
        code, _, err = cli(capsys, *argv)
    assert swap.done, "the conversion never wrote an output"
    assert code == 75, err
    assert "is not the file the loader downloaded and verified" in err, err
    assert not list(root.glob("tiny@*/*"))
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    repo = published(root)
    assert manifest.verify(repo) == []
    as_downloaded = _copy(served, tmp_path / "source")  # config.ini names the directory
    code, lines, err = cli(
        capsys, "convert", str(as_downloaded), str(tmp_path / "out"), "--tp-size", "1"
    )
    assert code == 0, err
    assert weights(repo) == {p.name: p.read_bytes() for p in sorted(Path(lines[-1]).iterdir())}


@pytest.mark.server
@pytest.mark.parametrize("scheme", ["gs", "hf"])
def test_a_resumed_download_written_over_after_it_was_read_back_is_not_verified(
    request, tmp_path, scheme
):
    """A stopped fetch left a shard's partial download complete (gs://: every slice
    journaled); the next fetch reads its bytes back for the checksum, which matches, and
    another process then writes another shard's bytes (same size) in place over it, before
    it is moved into place: the fetch refuses it (75, the file named) and puts nothing of it
    in place as verified."""
    gs = scheme == "gs"
    _, other, served = (
        request.getfixturevalue("gcs_sharded")
        if gs
        else (None, *request.getfixturevalue("hf_sharded"))
    )
    shard = sorted(p.name for p in served.glob("model-*.safetensors"))[0]
    dest = tmp_path / "dest"
    uri = f"gs://{BUCKET}/org/sharded" if gs else "hf://org/sharded"

    def synced(op: str, path: str) -> str | None:
        """An fsync of the shard's partial download."""
        ours = f"/.partial/{shard}." in path if gs else path.endswith(f"/{shard}.incomplete")
        return path if op == "fsync" and ours and not path.endswith(".slices") else None

    def stopped(path: str) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    # gs://: the whole file's fsync once its checksum matched (its last slice's is the first);
    # hf://: the one once all its bytes arrived; just before it is moved into place
    stop = AtStep(2 if gs else 1, synced, stopped)
    with fs.inject(stop), pytest.raises(OSError):
        fetch(uri, dest, workers=1, retry_deadline_s=2)
    assert stop.seen == stop.step and not (dest / shard).exists()

    planted = (other / shard).read_bytes()
    swap = AtStep(1, synced, lambda path: _written_in_place(Path(path), planted))
    with fs.inject(swap), pytest.raises(ReplacedDownloadError) as refused:
        fetch(uri, dest, workers=1, retry_deadline_s=2)
    assert swap.done, "the partial download was never read back"
    assert shard in str(refused.value)
    assert not (dest / shard).exists()


@pytest.mark.server
@pytest.mark.parametrize("output", ["model.final_layernorm.weight.bin", "config.ini"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "sequential"])
def test_an_output_written_over_before_it_is_sealed_is_not_published(
    gcs_sharded, tmp_path, capsys, overlap, output
):
    """Another process writes other bytes (same size) in place over a converted output (in
    WORK/<key>/converted, or in the staging directory) once it was written and hashed, before
    the build seals the repository: the run refuses it (75, the file named) and publishes no
    key whose manifest lists a digest its file does not hold."""

    def built(op: str, path: str) -> str | None:  # the build starts: the outputs are in place
        return path if op == "mkdir" and path.endswith("/1/tokenizer") else None

    def written_over(_: str) -> None:
        (written, *_) = sorted((tmp_path / "root").rglob(f"*-gpu/{output}"))
        _written_in_place(written, bytes(len(written.read_bytes())))

    swap = AtStep(1, built, written_over)
    root = tmp_path / "root"
    argv = run_argv(f"gs://{BUCKET}/org/sharded", root, "--retry-deadline", "10")
    argv += [] if overlap else ["--no-overlap"]
    with fs.inject(swap):
        code, _, err = cli(capsys, *argv)
    assert swap.done, "the build never started"
    assert code == 0 or not list(root.glob("tiny@*/*")), err
    if code == 0:
        assert manifest.verify(published(root)) == []
    assert code == 75, err
    assert output in err, err


@pytest.mark.server
@pytest.mark.parametrize(
    "written", ["fastertransformer/config.pbtxt", "preprocessing/1/tokenizer/tokenizer.json"]
)
def test_a_file_of_the_build_written_over_before_it_is_sealed_is_not_published(
    gcs_sharded, tmp_path, capsys, written
):
    """Another process writes over a file the build wrote into the staging directory (a
    model's config.pbtxt, a tokenizer copy) before the repository is sealed: the run refuses
    it (75, the file named) and publishes nothing the loader did not write."""

    def sealed(op: str, path: str) -> str | None:  # the build wrote every file: sealing starts
        return path if op == "chmod" and "/.staging/" in path else None

    def written_over(_: str) -> None:
        (there, *_) = sorted((tmp_path / "root" / ".staging").glob(f"*/{written}"))
        _written_in_place(there, there.read_bytes() + b"\n")

    swap = AtStep(1, sealed, written_over)
    root = tmp_path / "root"
    argv = run_argv(f"gs://{BUCKET}/org/sharded", root, "--retry-deadline", "10", "--no-overlap")
    with fs.inject(swap):
        code, _, err = cli(capsys, *argv)
    assert swap.done, "the repository was never sealed"
    assert code == 75, err
    assert written.rsplit("/", 1)[-1] in err, err
    assert not list(root.glob("tiny@*/*"))
