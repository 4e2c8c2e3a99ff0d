"""hf:// sources against the real olah Hub mirror (offline mode, local git repositories)."""

from __future__ import annotations

import filecmp
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loader.errors import (
    CheckpointError,
    NotOursError,
    SourceNotFoundError,
    SourcePermissionError,
)
from loader.repository import manifest
from loader.sources import fetch, transfer
from tests.leftovers import left_by_a_fetch
from tests.runs import use_hub
from tests.servers import HeaderRelay, OlahServer, ThrottleProxy, git

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)


#: Files of other formats that must never be downloaded.
DECOYS = {
    "flax_model.msgpack": b"flax weights",
    "tf_model.h5": b"tensorflow weights",
    "model.onnx": b"onnx graph",
    "onnx/decoder_model.onnx": b"onnx graph",
    "pytorch_model.bin": b"a second format of the same weights",
    "README.md": b"# tiny\n",
}


@pytest.fixture(scope="module")
def hub(tiny_checkpoint_with_tokenizer, tiny_sharded_bin_checkpoint, tmp_path_factory):
    """olah serving org/tiny-gptj (main + dev), org/tiny-bin and org/no-weights."""
    srv = OlahServer(tmp_path_factory.mktemp("olah"))
    ckpt = tiny_checkpoint_with_tokenizer
    files = {p.relative_to(ckpt).as_posix(): p for p in ckpt.rglob("*") if p.is_file()}
    repo = srv.make_repo("org/tiny-gptj", {**files, **DECOYS})
    srv.revisions = {"main": git(repo, "rev-parse", "HEAD")}
    git(repo, "checkout", "-q", "-b", "dev")
    srv.revisions["dev"] = srv.commit(repo, {"added_tokens.json": b"{}\n"}, "dev: added tokens")
    git(repo, "checkout", "-q", "main")
    srv.expected = sorted(files)

    bin_ckpt = tiny_sharded_bin_checkpoint
    srv.bin_files = {p.name: p for p in bin_ckpt.iterdir() if p.is_file()}
    srv.make_repo("org/tiny-bin", {**srv.bin_files, "flax_model.msgpack": b"x"})
    srv.make_repo("org/no-weights", {"config.json": b"{}", "flax_model.msgpack": b"x"})
    links = srv.make_repo("org/links", {"model.safetensors": b"w" * 100})
    (links / "config.json").symlink_to("../../../../../../../../../../etc/hostname")
    (links / "tokenizer.json").symlink_to("model.safetensors")
    srv.commit(links, {}, "links committed as links")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def endpoint(monkeypatch, hub, tmp_path):
    use_hub(monkeypatch, hub.url, tmp_path / "hf-home")


def visible(dest: Path) -> list[str]:
    return sorted(
        p.relative_to(dest).as_posix()
        for p in dest.rglob("*")
        if p.is_file() and not p.relative_to(dest).parts[0].startswith(".")
    )


def test_pinned_commit_fetches_exactly_the_conversion_files(
    hub, tiny_checkpoint_with_tokenizer, tmp_path
):
    commit = hub.revisions["main"]
    result = fetch(f"hf://org/tiny-gptj@{commit}", tmp_path / "dest")
    assert result.revision == commit
    assert result.files == hub.expected == visible(tmp_path / "dest")
    for rel in result.files:
        assert filecmp.cmp(
            tiny_checkpoint_with_tokenizer / rel, tmp_path / "dest" / rel, shallow=False
        )
    assert result.downloaded_bytes == result.bytes > 0
    assert not (tmp_path / "dest" / transfer.PARTIAL_DIR).exists()


def test_other_formats_and_subfolders_are_not_downloaded(hub, tmp_path):
    fetch("hf://org/tiny-gptj", tmp_path / "dest")
    got = set(visible(tmp_path / "dest"))
    assert not got & set(DECOYS)
    assert "model.safetensors" in got and "tokenizer.json" in got


def test_a_branch_is_resolved_to_its_commit(hub, tmp_path):
    result = fetch("hf://org/tiny-gptj@dev", tmp_path / "dest")
    assert result.revision == hub.revisions["dev"] != hub.revisions["main"]
    assert "added_tokens.json" in result.files
    assert (tmp_path / "dest" / "added_tokens.json").read_bytes() == b"{}\n"


def test_no_revision_means_main(hub, tmp_path):
    result = fetch("hf://org/tiny-gptj", tmp_path / "dest")
    assert result.revision == hub.revisions["main"]
    assert "added_tokens.json" not in result.files


def test_pytorch_weights_are_used_when_there_is_no_safetensors(hub, tmp_path):
    result = fetch("hf://org/tiny-bin", tmp_path / "dest")
    assert result.files == sorted(hub.bin_files)
    assert "pytorch_model.bin.index.json" in result.files
    for name, src in hub.bin_files.items():
        assert filecmp.cmp(src, tmp_path / "dest" / name, shallow=False)


def test_a_repository_without_supported_weights_is_a_checkpoint_error(hub, tmp_path):
    with pytest.raises(CheckpointError, match=r"flax_model\.msgpack"):
        fetch("hf://org/no-weights", tmp_path / "dest")
    assert visible(tmp_path / "dest") == []


def test_a_link_committed_in_the_repository_is_a_file_of_its_text_never_a_link(hub, tmp_path):
    """git keeps a symbolic link as a blob of its target's path, and the Hub lists and serves
    that blob: DEST gets a regular file holding the path, verified by its blob id; nothing
    there is a link, nothing outside DEST is read."""
    dest = tmp_path / "dest"
    fetch("hf://org/links", dest)
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert (dest / "config.json").read_bytes() == b"../../../../../../../../../../etc/hostname"
    assert (dest / "tokenizer.json").read_bytes() == b"model.safetensors"


def test_unknown_repository_is_a_not_found_error_naming_the_uri(hub, tmp_path):
    with pytest.raises(SourceNotFoundError, match="hf://org/absent") as info:
        fetch("hf://org/absent", tmp_path / "dest")
    assert "HF_TOKEN" in info.value.remediation


def test_unknown_revision_is_a_not_found_error_naming_it(hub, tmp_path):
    with pytest.raises(SourceNotFoundError, match="no-such-branch"):
        fetch("hf://org/tiny-gptj@no-such-branch", tmp_path / "dest")


def test_rerun_skips_verified_files_and_replaces_a_damaged_one(hub, tmp_path):
    dest = tmp_path / "dest"
    first = fetch("hf://org/tiny-gptj", dest)
    again = fetch("hf://org/tiny-gptj", dest)
    assert again.downloaded_bytes == 0
    damaged = dest / "model.safetensors"
    size = damaged.stat().st_size
    damaged.write_bytes(b"\0" * size)
    third = fetch("hf://org/tiny-gptj", dest)
    assert third.downloaded_bytes == size
    assert third.files == first.files
    ckpt_bytes = (hub.mirrors / "models" / "org" / "tiny-gptj" / "model.safetensors").read_bytes()
    assert damaged.read_bytes() == ckpt_bytes


@pytest.fixture
def relays(hub, monkeypatch):
    """The Hub behind a relay that records headers (HF_ENDPOINT), which sends file downloads to
    a second relay of another origin (the Hub's storage host)."""
    storage = HeaderRelay(hub.url).start()
    endpoint = HeaderRelay(hub.url, redirect_to=storage.url).start()
    monkeypatch.setenv("HF_ENDPOINT", endpoint.url)
    yield endpoint, storage
    endpoint.stop()
    storage.stop()


@pytest.mark.parametrize("variable", ["HF_TOKEN_PATH", "HF_TOKEN_FILE"])
def test_token_file_is_sent_to_the_hub_and_never_logged(
    hub, relays, tmp_path, monkeypatch, caplog, variable
):
    """huggingface_hub's HF_TOKEN_PATH, and HF_TOKEN_FILE as another name for it: every request
    to the Hub carries it (the listing, each file's download), none to the storage host."""
    endpoint, _ = relays
    secret = "hf_secretTokenValue1234567890"
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    monkeypatch.setenv(variable, str(token_file))
    with caplog.at_level(logging.DEBUG):
        result = fetch("hf://org/tiny-gptj", tmp_path / "dest")
    assert result.revision == hub.revisions["main"]
    downloads = [r for r in endpoint.requests if "/resolve/" in r[1]]
    assert len(downloads) == len(result.files)
    assert {r[2].get("authorization") for r in endpoint.requests} == {f"Bearer {secret}"}
    assert caplog.records
    assert secret not in caplog.text


def test_a_download_redirected_to_another_host_carries_no_token(
    hub, relays, tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch
):
    """The Hub sends large files to its storage host: the redirect is followed, the token stays
    with the Hub's origin."""
    endpoint, storage = relays
    monkeypatch.setenv("HF_TOKEN", "hf_secretTokenValue1234567890")
    result = fetch("hf://org/tiny-gptj", tmp_path / "dest")
    redirected = sorted(r[1] for r in endpoint.requests if "/resolve/" in r[1])
    assert sorted(r[1] for r in storage.requests) == redirected
    assert len(storage.requests) == len(result.files)
    assert all("authorization" not in r[2] for r in storage.requests)
    assert all("authorization" in r[2] for r in endpoint.requests)
    for rel in result.files:
        assert filecmp.cmp(
            tiny_checkpoint_with_tokenizer / rel, tmp_path / "dest" / rel, shallow=False
        )


def test_token_sources_in_order_and_a_missing_file_named_with_its_variable(tmp_path, monkeypatch):
    from loader.sources import FetchOptions
    from loader.sources.hf import resolve_token

    path_file, alias_file = tmp_path / "path-token", tmp_path / "alias-token"
    path_file.write_text("hf_path\n")
    alias_file.write_text("hf_alias")
    assert resolve_token(FetchOptions()) is None  # huggingface_hub's own login, if any
    monkeypatch.setenv("HF_TOKEN_FILE", str(alias_file))
    assert resolve_token(FetchOptions()) == "hf_alias"
    monkeypatch.setenv("HF_TOKEN_PATH", str(path_file))
    assert resolve_token(FetchOptions()) == "hf_path"  # the library's variable first
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert resolve_token(FetchOptions()) == "hf_env"
    assert resolve_token(FetchOptions(hf_token_file=str(alias_file))) == "hf_alias"
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "unmounted"))
    with pytest.raises(SourcePermissionError, match="HF_TOKEN_PATH") as info:
        resolve_token(FetchOptions())
    assert "unmounted" in info.value.message and "HF_TOKEN_PATH" in info.value.remediation


def test_a_token_path_under_home_or_a_variable_is_read_where_the_library_reads_it(
    tmp_path, monkeypatch
):
    """huggingface_hub expands ``~`` and ``$NAME`` in HF_TOKEN_PATH (``~/.hf-token`` works with
    the library alone); the loader opened the name as it was: 2, "no such file"."""
    from loader.sources import FetchOptions
    from loader.sources.hf import resolve_token

    (tmp_path / "path-token").write_text("hf_path\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TOKENS", str(tmp_path))
    for value in ("~/path-token", "$TOKENS/path-token"):
        monkeypatch.setenv("HF_TOKEN_PATH", value)
        assert resolve_token(FetchOptions()) == "hf_path"


def test_missing_token_file_is_a_permission_error_naming_it(hub, tmp_path):
    with pytest.raises(SourcePermissionError, match="no-such-token"):
        fetch(
            "hf://org/tiny-gptj", tmp_path / "dest", hf_token_file=str(tmp_path / "no-such-token")
        )


def test_run_from_hf_publishes_the_same_weights_as_from_a_local_path(
    hub, tiny_checkpoint_with_tokenizer, tmp_path
):
    """`model-loader run --source hf://...@dev` end to end; the FT weights equal a local run's."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
    paths = {}
    for name, source in (
        ("hub", "hf://org/tiny-gptj@dev"),
        ("local", str(tiny_checkpoint_with_tokenizer)),
    ):
        root = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-m", "loader", "run", "--source", source, "--repository",
             str(root), "--model-name", "tiny", "--tp-size", "2", "--pp-size", "1",
             "--instance-count", "1", "--backend", "python"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        paths[name] = Path(proc.stdout.splitlines()[-1])
    hub_path = paths["hub"]
    assert hub_path.parent.name == "tiny@dev"
    assert (hub_path / ".ready").is_file()
    assert manifest.verify(hub_path) == []
    assert manifest.read_manifest(hub_path)["source_revision"] == hub.revisions["dev"]
    ft_local = paths["local"] / "fastertransformer" / "1"
    ft_hub = hub_path / "fastertransformer" / "1"
    weights = sorted(p.relative_to(ft_local) for p in (ft_local / "2-gpu").glob("*.bin"))
    assert len(weights) > 10
    for rel in weights:
        assert filecmp.cmp(ft_local / rel, ft_hub / rel, shallow=False), rel


def test_a_hugging_face_cache_snapshot_is_a_local_source_and_links_leaving_it_are_not(
    hub, tmp_path
):
    """What `hf download` / `snapshot_download` write: files that link into ../../blobs."""
    from huggingface_hub import snapshot_download

    from loader.errors import SourceError

    cache = tmp_path / "hf-cache"
    snapshot = Path(
        snapshot_download(
            "org/tiny-gptj", cache_dir=cache, endpoint=hub.url,
            allow_patterns=["*.json", "*.safetensors", "*.txt"],
        )
    )  # fmt: skip
    weights = snapshot / "model.safetensors"
    assert weights.is_symlink() and "blobs" in os.readlink(weights)
    proc = subprocess.run(
        [sys.executable, "-m", "loader", "run", "--source", str(snapshot), "--repository",
         str(tmp_path / "models"), "--model-name", "tiny", "--tp-size", "1", "--pp-size", "1",
         "--instance-count", "1", "--backend", "python"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (Path(proc.stdout.splitlines()[-1]) / ".ready").is_file()

    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (snapshot / "stray.json").symlink_to(outside)
    with pytest.raises(SourceError, match="outside the source directory"):
        fetch(str(snapshot))
    (snapshot / "stray.json").unlink()
    # the same files in a folder that is not a cache snapshot: the blob links leave it
    lookalike = tmp_path / "copy" / "snapshot"
    lookalike.parent.mkdir()
    lookalike.mkdir()
    (lookalike / "model.safetensors").symlink_to(weights.resolve())
    with pytest.raises(SourceError, match="outside the source directory"):
        fetch(str(lookalike))


@pytest.fixture
def dead_owner() -> str:
    """The owner tag of a loader of this host that is gone."""
    from loader import fs

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return f"{pid}-{fs.host_digest()}"


def _stopped_download(dest: Path, owner: str, name: str, data: bytes) -> Path:
    """What a stopped run left: ``data`` as the first bytes of ``name`` being downloaded."""
    staging = f"{transfer.PARTIAL_DIR}/hf.{owner}"
    return left_by_a_fetch(dest, f"{staging}/{name}.incomplete", data).parent


@pytest.mark.parametrize("ignores_range", [False, True], ids=["range", "server-ignores-range"])
def test_a_stopped_runs_download_is_resumed_from_its_last_byte(
    hub, dead_owner, tmp_path, monkeypatch, ignores_range
):
    """A range request for the rest; a server that answers it with the whole file gets the file
    written from its start (a prefix of wrong bytes cannot survive: the hash is checked)."""
    weights = (hub.mirrors / "models" / "org" / "tiny-gptj" / "model.safetensors").read_bytes()
    half = len(weights) // 2
    dest = tmp_path / "dest"
    prefix = b"\0" * half if ignores_range else weights[:half]
    _stopped_download(dest, dead_owner, "model.safetensors", prefix)
    if ignores_range:
        proxy = ThrottleProxy(hub.port, strip_range=True).start()
        monkeypatch.setenv("HF_ENDPOINT", proxy.url)
    relay = HeaderRelay(proxy.url if ignores_range else hub.url).start()
    monkeypatch.setenv("HF_ENDPOINT", relay.url)
    try:
        fetch("hf://org/tiny-gptj", dest)
    finally:
        relay.stop()
        if ignores_range:
            proxy.stop()
    (request,) = [r for r in relay.requests if r[1].endswith("/model.safetensors")]
    assert request[2].get("range") == f"bytes={half}-"
    assert (dest / "model.safetensors").read_bytes() == weights
    assert not (dest / transfer.PARTIAL_DIR).exists()


def test_a_file_of_dests_that_no_fetch_wrote_is_never_replaced_by_a_hub_file(hub, tmp_path):
    """The user's own ``DEST/config.json`` differs from the Hub's: refused, kept byte for
    byte; the fetch's own files are replaced when the Hub's change (a test of ``gs://`` and
    ``--copy`` does that part)."""
    from loader.errors import NotOursError

    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "config.json").write_text("the user's\n")
    with pytest.raises(NotOursError, match=r"config\.json"):
        fetch("hf://org/tiny-gptj", dest)
    assert (dest / "config.json").read_text() == "the user's\n"


def test_a_stopped_runs_download_of_other_bytes_is_discarded(hub, dead_owner, tmp_path):
    """The stopped run's bytes fail the hash once resumed: the same run downloads the file
    again from its start (it no longer fails with a checksum mismatch for the next run to
    fetch it)."""
    weights = (hub.mirrors / "models" / "org" / "tiny-gptj" / "model.safetensors").read_bytes()
    dest = tmp_path / "dest"
    half = len(weights) // 2
    staging = _stopped_download(dest, dead_owner, "model.safetensors", b"\0" * half)
    fetch("hf://org/tiny-gptj", dest)
    assert (dest / "model.safetensors").read_bytes() == weights
    assert not list(dest.rglob("model.safetensors.incomplete"))
    assert not staging.exists()  # taken over by this run, then removed


@pytest.mark.parametrize(
    "where",
    [
        ".partial",
        ".partial/hf.OWNER",
        ".partial/hf.OWNER/model.safetensors.incomplete",
        ".partial/hf.DEAD/model.safetensors.incomplete",
        "config.json",
    ],
)
def test_a_link_planted_where_the_download_writes_is_never_followed(
    hub, dead_owner, tmp_path, where
):
    """At every name an hf:// fetch creates below DEST (this run's and a stopped run's staging
    directory, the file being downloaded, the final name): the link is refused or replaced,
    never written through."""
    from loader import fs

    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    precious = outside / "dir" / "model.safetensors.incomplete"
    precious.write_bytes(b"not the loader's")
    dest = tmp_path / "dest"
    rel = where.replace("OWNER", fs.owner()).replace("DEAD", dead_owner)
    planted = dest / rel
    planted.parent.mkdir(parents=True, exist_ok=True)
    target = precious if rel.endswith((".incomplete", ".json")) else outside / "dir"
    planted.symlink_to(target)
    before = sorted((p.relative_to(outside), p.read_bytes()) for p in outside.rglob("*.*"))
    try:
        fetch("hf://org/tiny-gptj", dest)
    except NotOursError as exc:
        assert str(tmp_path) in exc.message
    else:
        assert not planted.is_symlink() or rel.startswith(".partial/hf.")
        assert filecmp.cmp(hub.mirrors / "models/org/tiny-gptj/config.json", dest / "config.json")
    after = sorted((p.relative_to(outside), p.read_bytes()) for p in outside.rglob("*.*"))
    assert after == before
    assert sorted(p.name for p in (outside / "dir").iterdir()) == [precious.name]


@pytest.mark.parametrize("location", ["http://127.0.0.1:99999", "http://[::1"])
def test_a_redirect_to_something_that_is_not_a_url_is_a_source_error(
    hub, tmp_path, monkeypatch, location
):
    from loader.errors import SourceError

    relay = HeaderRelay(hub.url, redirect_to=location).start()
    monkeypatch.setenv("HF_ENDPOINT", relay.url)
    try:
        with pytest.raises(SourceError, match="not a URL") as info:
            fetch("hf://org/tiny-gptj", tmp_path / "dest")
    finally:
        relay.stop()
    assert "HF_ENDPOINT" in info.value.remediation


def test_too_little_free_space_is_refused_before_any_download(hub, tmp_path, monkeypatch):
    from loader.errors import InsufficientDiskSpaceError

    monkeypatch.setattr(transfer, "DISK_MARGIN", 1 << 60)
    with pytest.raises(InsufficientDiskSpaceError, match="hf://org/tiny-gptj"):
        fetch("hf://org/tiny-gptj", tmp_path / "dest")
    assert visible(tmp_path / "dest") == []
    assert not (tmp_path / "dest" / transfer.PARTIAL_DIR).exists()


def test_progress_counts_every_byte_once_a_resumed_file_included(
    hub, dead_owner, tmp_path, monkeypatch
):
    import contextlib
    import threading

    from loader.sources import hf

    reports: list[tuple[int | None, list[int]]] = []
    lock = threading.Lock()

    class Recorder:
        def __init__(self, total: int | None) -> None:
            self.updates: list[int] = []
            reports.append((total, self.updates))

        def update(self, n: int) -> None:
            with lock:
                self.updates.append(n)

    @contextlib.contextmanager
    def recording(what: str, total: int | None, **_: object):
        yield Recorder(total)

    monkeypatch.setattr(hf, "byte_progress", recording)
    weights = (hub.mirrors / "models" / "org" / "tiny-gptj" / "model.safetensors").read_bytes()
    dest = tmp_path / "dest"
    _stopped_download(dest, dead_owner, "model.safetensors", weights[: len(weights) // 3])
    result = fetch("hf://org/tiny-gptj", dest, workers=3)
    ((total, updates),) = reports
    assert total == result.downloaded_bytes == result.bytes
    assert all(n > 0 for n in updates)
    assert sum(updates) == total
