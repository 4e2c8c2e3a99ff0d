"""hf:// sources against a hostile Hub: :class:`tests.servers.ForgedHub` answers the bits of
the Hub's API huggingface_hub calls (model info, the file list, ``resolve``) with forged
listings, commit ids, names and bodies. Whatever it answers, the loader exits with a class
(0, 2 or 75, never a traceback), writes nothing outside DEST, publishes nothing it could not
verify, and never sends or prints the token elsewhere. A canary directory beside DEST is
checksummed after every command."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import fs
from loader.errors import LoaderError, TransientSourceError
from loader.sources import fetch, transfer
from tests.leftovers import left_by_a_fetch
from tests.runs import cli, tree_digest, use_hub
from tests.servers import ForgedHub
from tests.tiers import examples

pytestmark = pytest.mark.server  # starts a server (in-process, 127.0.0.1)

CONFIG = b'{"model_type": "gptj"}'
WEIGHTS = bytes(range(256)) * 40
FILES = {"config.json": CONFIG, "model.safetensors": WEIGHTS}
TOKEN = "hf_forgedHubTokenNeverShown0123"


def blob(data: bytes) -> str:
    """The git blob id of ``data``: what the Hub lists for a file not in LFS."""
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data, usedforsecurity=False).hexdigest()


def entry(path: object, data: bytes, **forged: object) -> dict:
    """A listing entry for ``data`` at ``path`` as the Hub spells it, ``forged`` replacing
    fields."""
    return {"type": "file", "path": path, "size": len(data), "oid": blob(data), **forged}


@pytest.fixture(scope="module")
def hub():
    server = ForgedHub().start()
    yield server
    server.stop()


@pytest.fixture
def canary(tmp_path):
    """A directory outside DEST that must be the same after every command."""
    top = tmp_path / "canary"
    (top / "sub").mkdir(parents=True)
    (top / "model.safetensors").write_bytes(b"canary weights")
    (top / "sub" / "config.json").write_bytes(b"{}")
    before = tree_digest(top)
    yield top
    assert tree_digest(top) == before, "a file outside DEST was changed"


@pytest.fixture(autouse=True)
def endpoint(monkeypatch, hub, tmp_path):
    use_hub(monkeypatch, hub.url, tmp_path / "hf-home")


def _fetch(capsys, repo: str, dest: Path, *extra: str) -> tuple[int, str]:
    code, _, err = cli(capsys, "fetch", f"hf://{repo}", str(dest), "--retry-deadline", "3", *extra)
    assert code in (0, 2, 75), err
    assert "Traceback" not in err, err
    if code:
        assert "error:" in err and "hint:" in err, err
    return code, err


def published(dest: Path) -> list[str]:
    """The files in DEST, its own leftovers (``.partial``) aside."""
    if not dest.exists():
        return []
    return sorted(p.name for p in dest.iterdir() if not p.name.startswith("."))


# --- forged listings ---------------------------------------------------------------------

FORGED_LISTINGS = {
    "size null": [entry("model.safetensors", WEIGHTS, size=None)],
    "size text": [entry("model.safetensors", WEIGHTS, size="700")],
    "size negative": [entry("model.safetensors", WEIGHTS, size=-1)],
    "size fraction": [entry("model.safetensors", WEIGHTS, size=10240.5)],
    "size true": [entry("model.safetensors", b"x", size=True)],
    "path null": [entry(None, WEIGHTS), entry("model.safetensors", WEIGHTS)],
    "path number": [entry(7, WEIGHTS), entry("model.safetensors", WEIGHTS)],
    "path list": [entry(["a"], WEIGHTS), entry("model.safetensors", WEIGHTS)],
    "blob id empty": [entry("model.safetensors", WEIGHTS, oid="")],
    "blob id short": [entry("model.safetensors", WEIGHTS, oid="abc123")],
    "lfs sha256 empty": [
        entry("model.safetensors", WEIGHTS, lfs={"size": len(WEIGHTS), "oid": "", "pointerSize": 1})
    ],
    "lfs sha256 not hex": [
        entry(
            "model.safetensors",
            WEIGHTS,
            lfs={"size": len(WEIGHTS), "oid": "z" * 64, "pointerSize": 1},
        )
    ],
    "listed twice": [entry("model.safetensors", WEIGHTS), entry("model.safetensors", b"other")],
    "listed twice alike": [
        entry("model.safetensors", WEIGHTS),
        entry("model.safetensors", WEIGHTS),
    ],
}


@pytest.mark.parametrize("forged", FORGED_LISTINGS.values(), ids=FORGED_LISTINGS.keys())
def test_a_forged_listing_is_refused_before_anything_is_downloaded(
    hub, forged, capsys, tmp_path, canary
):
    """Before: a size that is no number was a TypeError or ValueError (exit 1, a traceback); an
    entry without a usable hash was taken by its size alone (published unverified); a file
    listed twice, the last entry."""
    repo = f"forged/{abs(hash(repr(forged)))}"
    hub.add(repo, FILES, listing=[entry("config.json", CONFIG), *forged])
    hub.requests.clear()
    code, err = _fetch(capsys, repo, tmp_path / "dest")
    assert code == 2, err
    assert "the Hub's file list" in err and "HF_ENDPOINT" in err, err
    assert published(tmp_path / "dest") == []
    assert not any("/resolve/" in path for path, _ in hub.requests)


def test_a_listing_without_a_hash_never_publishes_other_bytes_of_the_same_size(
    hub, capsys, tmp_path, canary
):
    """Before: an entry whose blob id was empty was checked by its size alone, and bytes of
    that size that are not the file were published (exit 0)."""
    other = bytes(reversed(WEIGHTS))
    hub.add("forged/no-hash", {**FILES, "model.safetensors": other},
            listing=[entry("config.json", CONFIG), entry("model.safetensors", WEIGHTS, oid="")])  # fmt: skip
    code, err = _fetch(capsys, "forged/no-hash", tmp_path / "dest")
    assert code == 2, err
    assert "model.safetensors" not in published(tmp_path / "dest")


def test_a_listing_whose_pages_repeat_is_refused_at_the_first_repeat(hub, capsys, tmp_path, canary):
    """Each page names the next in a ``Link`` header, and the Hub library follows them as
    long as they come: pages that repeat (here 40 times; a loop never ends) are refused at
    the second. Before, every page was asked for and its entries taken again."""
    hub.add("forged/pages", FILES, pages=40)
    hub.requests.clear()
    code, err = _fetch(capsys, "forged/pages", tmp_path / "dest")
    assert code == 2, err
    assert "twice" in err, err
    assert len([p for p, _ in hub.requests if "/tree/" in p]) == 2
    assert published(tmp_path / "dest") == []


# --- forged commit ids -------------------------------------------------------------------

PINNED = "0123456789abcdef0123456789abcdef01234567"
FORGED_COMMITS = {
    "none": ("main", {"id": "forged/c"}),
    "a number": ("main", {"id": "forged/c", "sha": 5}),
    "a path": ("main", {"id": "forged/c", "sha": "../../../../etc"}),
    "too short": ("main", {"id": "forged/c", "sha": "a" * 39}),
    "another commit for a commit id": (PINNED, {"id": "forged/c", "sha": "b" * 40}),
}


@pytest.mark.parametrize(("revision", "info"), FORGED_COMMITS.values(), ids=FORGED_COMMITS.keys())
def test_a_forged_commit_id_is_refused_before_the_listing(
    hub, revision, info, capsys, tmp_path, canary
):
    """Before: a model info without ``sha`` listed and downloaded ``main`` unpinned, then failed
    with a TypeError (exit 1); a commit that is no commit id reached the download URLs; another
    commit than the one pinned was downloaded and recorded under it."""
    hub.add("forged/c", FILES, info=info)
    hub.requests.clear()
    code, err = _fetch(capsys, f"forged/c@{revision}", tmp_path / "dest")
    assert code == 2, err
    assert "commit" in err and "HF_ENDPOINT" in err, err
    assert [path for path, _ in hub.requests if "/tree/" in path or "/resolve/" in path] == []
    assert published(tmp_path / "dest") == []


def test_a_commit_id_in_upper_case_is_the_same_commit(hub, capsys, tmp_path):
    """The Hub spells commit ids in lower case; one answered in upper case is the same commit
    (pinned and recorded in lower case), not a forgery."""
    sha = hub.add("forged/upper", FILES)
    hub.repos["forged/upper"]["info"] = {"id": "forged/upper", "sha": sha.upper()}
    code, err = _fetch(capsys, "forged/upper", tmp_path / "dest")
    assert code == 0, err
    assert published(tmp_path / "dest") == ["config.json", "model.safetensors"]


# --- names -------------------------------------------------------------------------------

#: Characters a forged shard name is made of: path separators, dots, control characters,
#: quotes, non-ASCII letters, a backslash, a space.
_CHARS = st.sampled_from([*"/.\0\n\r\t\\ '\"%?#~-_aZ9", "é", "\u202e", "\x7f"])
_MIDDLES = st.one_of(
    st.text(_CHARS, max_size=12),
    st.sampled_from(["..", "/..", "/../..", "x" * 240, "x" * 300, "a/b", "", "\x7f"]),
)


@settings(max_examples=examples(60), deadline=None, derandomize=True, database=None)
@given(middles=st.lists(_MIDDLES, min_size=1, max_size=3), bare=st.booleans())
def test_no_name_in_a_listing_reaches_a_path_outside_dest(hub, middles, bare):
    """Shard names generated from separators, ``..``, control characters and long runs:
    each fetch either places exactly the listed files, each under its own name directly in
    DEST, or is refused as bad input; nothing appears beside DEST."""
    with tempfile.TemporaryDirectory() as top:
        top = Path(top)
        canary = top / "canary"
        canary.mkdir()
        (canary / "keep").write_bytes(b"keep")
        before = tree_digest(canary)
        names = [m if bare else f"model-{m}.safetensors" for m in middles]
        files = {"config.json": CONFIG, **{n: n.encode("utf-8") for n in names}}
        repo = f"names/r{abs(hash(tuple(names)))}"
        hub.add(repo, files)
        dest = top / "dest"
        try:
            result = fetch(f"hf://{repo}", dest, retry_deadline_s=2)
        except LoaderError as exc:
            assert exc.exit_code == 2, exc
        else:
            assert result.files, names
            for rel in result.files:
                assert fs_name(rel), rel
                assert (dest / rel).read_bytes() == files[rel]
        assert {p.name for p in top.iterdir()} <= {"canary", "dest"}
        assert tree_digest(canary) == before
        if dest.exists():  # nothing but the files and the loader's own leftovers
            own = {".partial", fs.MADE, transfer.FETCH_MARKER}  # (its record of what it made)
            assert all(p.name in files or p.name in own for p in dest.iterdir())


def fs_name(rel: str) -> bool:
    return "/" not in rel and "\0" not in rel and rel.isprintable() and rel not in (".", "..")


@pytest.mark.parametrize(
    "name",
    ["model-\n.safetensors", "model-\r\nerror: forged.safetensors", "model-\x1b[2J.safetensors"],
    ids=["newline", "forged log line", "escape"],
)
def test_a_name_with_a_control_character_is_refused_and_shown_escaped(
    hub, name, capsys, tmp_path, canary
):
    """Before: a name with a line break was downloaded under it, and printed as it was in the
    log (a line of its own: a forged ``error:`` line)."""
    repo = f"names/ctl{abs(hash(name))}"
    hub.add(repo, {"config.json": CONFIG, name: b"w"})
    code, err = _fetch(capsys, repo, tmp_path / "dest")
    assert code == 2, err
    assert repr(name) in err
    assert not any(line.startswith("error: forged") for line in err.splitlines())
    assert not (tmp_path / "dest").exists() or not any(
        "\n" in p.name or "\x1b" in p.name for p in (tmp_path / "dest").rglob("*")
    )


@pytest.mark.parametrize(
    "pair",
    [("model-00001-of-00002.safetensors", "model-00001-OF-00002.safetensors"),
     ("model-\u00e9.safetensors", "model-e\u0301.safetensors"),
     ("model-\ufb01.safetensors", "model-fi.safetensors")],
    ids=["case", "composed", "ligature"],
)  # fmt: skip
def test_names_that_alias_on_some_file_systems_are_refused(hub, pair, capsys, tmp_path, canary):
    """Before: both were downloaded; on a case-insensitive or normalising volume one file
    stood for both names, and the conversion would read one shard's bytes as the other's."""
    repo = f"names/alias{abs(hash(pair))}"
    hub.add(repo, {"config.json": CONFIG, pair[0]: b"one", pair[1]: b"two"})
    code, err = _fetch(capsys, repo, tmp_path / "dest")
    assert code == 2, err
    assert "differ only in case" in err
    assert published(tmp_path / "dest") == []


def test_a_name_too_long_to_download_is_refused_naming_the_hub(hub, capsys, tmp_path, canary):
    """Before: a name that fits the file system but not with ``.incomplete`` failed at its
    download with ENAMETOOLONG, and the hint asked for a shorter --repository or --work-dir."""
    name = "model-" + "x" * 230 + ".safetensors"  # 248 bytes, 259 while it downloads
    hub.add("names/long", {"config.json": CONFIG, name: b"w"})
    code, err = _fetch(capsys, "names/long", tmp_path / "dest")
    assert code == 2, err
    assert "path component of 248 bytes" in err and "--repository" not in err, err


# --- bodies ------------------------------------------------------------------------------


def _counting(first, then):
    """A ``serve`` that answers the first request with ``first``, the others with ``then``."""
    calls = []

    def serve(handler):
        calls.append(handler.headers.get("Range"))
        (first if len(calls) == 1 else then)(handler)

    serve.calls = calls
    return serve


def _whole_or_range(handler) -> None:
    start = int((handler.headers.get("Range") or "bytes=0-")[6:-1])
    if start:
        end = len(WEIGHTS) - 1
        handler.answer(
            206, WEIGHTS[start:], {"Content-Range": f"bytes {start}-{end}/{len(WEIGHTS)}"}
        )
    else:
        handler.answer(200, WEIGHTS)


def _cut_by_close(handler) -> None:
    """A body delimited by the connection's close (HTTP/1.0), cut after 1000 bytes."""
    handler.protocol_version = "HTTP/1.0"
    handler.send_response(200)
    handler.end_headers()
    handler.wfile.write(WEIGHTS[:1000])
    handler.close_connection = True


def _cut_chunked(handler) -> None:
    """A chunked body that ends properly after 1000 bytes."""
    handler.send_response(200)
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    handler.wfile.write(b"3e8\r\n" + WEIGHTS[:1000] + b"\r\n0\r\n\r\n")


@pytest.mark.parametrize("cut", [_cut_by_close, _cut_chunked], ids=["close", "chunked"])
def test_a_body_that_ends_early_is_resumed_from_its_last_byte(hub, cut, capsys, tmp_path, canary):
    """Before: a body that ended cleanly before the listed size was taken as the whole file,
    failed its hash and was discarded (exit 75, the bytes downloaded again from 0)."""
    serve = _counting(cut, _whole_or_range)
    repo = f"bodies/{cut.__name__}"
    hub.add(repo, FILES, serve={"model.safetensors": serve})
    code, err = _fetch(capsys, repo, tmp_path / "dest")
    assert code == 0, err
    assert serve.calls == [None, "bytes=1000-"]
    assert (tmp_path / "dest" / "model.safetensors").read_bytes() == WEIGHTS


def test_a_part_answered_for_the_whole_file_is_written_nowhere(hub, capsys, tmp_path, canary):
    """A ``206`` for bytes 5- of a request for the whole file: transient at once (its bytes
    are not the file's start), never written as the file's start nor retried as a cut body
    until the deadline."""

    def part(handler):
        end = len(WEIGHTS) - 1
        handler.answer(206, WEIGHTS[5:], {"Content-Range": f"bytes 5-{end}/{len(WEIGHTS)}"})

    hub.add("bodies/part", FILES, serve={"model.safetensors": part})
    with pytest.raises(TransientSourceError, match="a part of the file"):
        fetch("hf://bodies/part", tmp_path / "dest", retry_deadline_s=60)
    staged = list((tmp_path / "dest").rglob("model.safetensors*"))
    assert all(p.stat().st_size == 0 for p in staged), staged


# --- failures of the Hub -----------------------------------------------------------------

STATUSES = {
    "401": (401, {}, 2, "token"),
    "403": (403, {}, 2, "token"),
    "gated": (403, {"X-Error-Code": "GatedRepo", "X-Error-Message": "gated"}, 2, "terms"),
    "429": (429, {"Retry-After": "1"}, 75, "kept failing"),
    "503": (503, {}, 75, "kept failing"),
    "451": (451, {}, 2, "451"),
}


@pytest.mark.parametrize("where", ["model info", "file"])
@pytest.mark.parametrize(
    ("status", "headers", "exit_code", "says"), STATUSES.values(), ids=STATUSES.keys()
)
def test_each_failure_of_the_hub_exits_with_its_class_and_never_shows_the_token(
    hub, where, status, headers, exit_code, says, capsys, tmp_path, canary
):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    repo = f"status/{status}-{abs(hash(repr(headers)))}-{where.replace(' ', '-')}"
    if where == "model info":
        hub.add(repo, FILES, status=status, headers=headers)
    else:
        hub.add(repo, FILES, serve={
            "model.safetensors": lambda h: h.answer(status, b"{}", headers)})  # fmt: skip
    code, err = _fetch(
        capsys, repo, tmp_path / "dest", "--hf-token-file", str(token_file), "--retry-deadline", "1"
    )
    assert code == exit_code, err
    assert says in err, err
    assert TOKEN not in err
    assert "model.safetensors" not in published(tmp_path / "dest")


def test_a_redirect_to_a_host_that_does_not_resolve_fails_at_once_with_a_hint(
    hub, capsys, tmp_path, canary
):
    location = "http://no-such-host.invalid/blob"
    try:
        socket.getaddrinfo("no-such-host.invalid", 80)
    except OSError:
        pass
    else:  # pragma: no cover - a resolver that answers for .invalid
        pytest.skip("this resolver answers for .invalid")
    hub.add("status/dns", FILES, serve={
        "model.safetensors": lambda h: h.answer(302, b"", {"Location": location})})  # fmt: skip
    code, err = _fetch(capsys, "status/dns", tmp_path / "dest", "--retry-deadline", "120")
    assert code == 2, err
    assert "Cannot resolve the host" in err and "HF_ENDPOINT" in err


def test_a_source_error_names_a_uri_as_it_is_written(hub, capsys, tmp_path):
    """Before: a 404 started the sentence with ``Hf://`` (the first letter capitalised)."""
    hub.add("status/gone", FILES, serve={"model.safetensors": lambda h: h.answer(404, b"{}")})
    code, err = _fetch(capsys, "status/gone", tmp_path / "dest")
    assert code == 2, err
    assert "error: hf://status/gone (model.safetensors) does not exist (404)." in err


@pytest.mark.parametrize("where", ["model info", "file", "redirect"])
def test_credentials_in_hf_endpoint_are_never_shown(hub, where, capsys, tmp_path, monkeypatch):
    """A mirror behind basic authentication: HF_ENDPOINT=http://USER:PASSWORD@HOST. Before,
    the HTTP library's error quoted the URL with them, and the loader printed it in its
    warnings and its error line."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url.replace("http://", "http://mirror:pa55w0rd@"))
    repo = f"creds/{where.replace(' ', '-')}"
    if where == "model info":
        hub.add(repo, FILES, status=500)
    elif where == "file":
        hub.add(repo, FILES, serve={"model.safetensors": lambda h: h.answer(503, b"{}")})
    else:
        hub.add(repo, FILES, serve={"model.safetensors": lambda h: h.answer(
            302, b"", {"Location": "http://mirror:pa55w0rd@127.0.0.1:99999/x"})})  # fmt: skip
    code, _, err = cli(capsys, "-v", "fetch", f"hf://{repo}", str(tmp_path / "dest"),
                       "--retry-deadline", "1")  # fmt: skip
    assert code in (2, 75), err
    assert "pa55w0rd" not in err, err
    assert "***@127.0.0.1" in err, err  # the URL still shows, where it went


def test_a_signed_url_the_hub_redirects_to_is_never_shown(hub, capsys, tmp_path):
    """The Hub redirects a download to a storage URL signed for the file (a gated model's, at
    that): valid on its own for an hour, it was printed whole in the warnings and the error
    line, which end up in the Job's logs."""
    signed = (f"{hub.url}/signed/store/resolve/main/blob?X-Amz-Algorithm=AWS4-HMAC-SHA256"
              "&X-Amz-Credential=AKIAEXAMPLE%2F20261202&X-Amz-Expires=3600"
              "&X-Amz-Signature=5ec12e7a11")  # fmt: skip
    hub.add("signed/redirect", FILES, serve={
        "model.safetensors": lambda h: h.answer(302, b"", {"Location": signed})})  # fmt: skip
    # The storage fails (a 500): the Hub library quotes the URL in its error.
    hub.add("signed/store", FILES, serve={"blob": lambda h: h.answer(500, b"try later")})
    code, _, err = cli(capsys, "-v", "fetch", "hf://signed/redirect", str(tmp_path / "dest"),
                       "--retry-deadline", "1")  # fmt: skip
    assert code in (2, 75), err
    assert "5ec12e7a11" not in err and "AKIAEXAMPLE" not in err, err
    assert "X-Amz-Signature=***" in err, err  # the URL still shows, where it went


def test_credentials_in_hf_endpoint_are_never_logged_even_at_debug(hub, tmp_path):
    """At -vv the HTTP library logs every request with its URL; before, with the user name
    and password of HF_ENDPOINT in it (a process of its own: its logging as the CLI sets it
    up)."""
    hub.add("creds/debug", FILES, status=500)
    env = {**os.environ, "HF_ENDPOINT": hub.url.replace("http://", "http://mirror:pa55w0rd@")}
    argv = [sys.executable, "-m", "loader", "-vv", "fetch", "hf://creds/debug",
            str(tmp_path / "dest"), "--retry-deadline", "1"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 75, done.stderr
    assert "HTTP Request: GET http://***@127.0.0.1" in done.stderr, done.stderr[-3000:]
    assert "pa55w0rd" not in done.stderr + done.stdout


@pytest.fixture
def dead_owner() -> str:
    """The owner tag of a loader of this host that is gone."""
    from loader import fs

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return f"{pid}-{fs.host_digest()}"


def test_a_rerun_after_the_branch_moved_downloads_a_stopped_runs_file_again_at_once(
    hub, dead_owner, capsys, tmp_path, canary
):
    """A run stopped halfway through the old commit's file; ``main`` moved to a commit whose
    file of that name differs. Before, the rerun resumed the old bytes, failed the hash and
    discarded them (exit 75, "corrupt at its source"), and only the run after it fetched the
    file; now the same run downloads it again from its start."""
    from loader.sources import transfer

    old = bytes(range(256)) * 40
    new = bytes(reversed(old))
    hub.add("moved/resume", {**FILES, "model.safetensors": old})
    hub.move("moved/resume", {**FILES, "model.safetensors": new})
    dest = tmp_path / "dest"
    left_by_a_fetch(
        dest, f"{transfer.PARTIAL_DIR}/hf.{dead_owner}/model.safetensors.incomplete", old[:4000]
    )
    hub.requests.clear()
    code, err = _fetch(capsys, "moved/resume", dest)
    assert code == 0, err
    assert (dest / "model.safetensors").read_bytes() == new
    ranges = [h.get("range") for p, h in hub.requests if p.endswith("/model.safetensors")]
    assert ranges == ["bytes=4000-", None]
    assert not (dest / transfer.PARTIAL_DIR).exists()


def test_a_file_that_fails_its_hash_from_its_start_is_not_downloaded_twice(
    hub, capsys, tmp_path, canary
):
    """Downloaded again from its start only when the bytes a stopped run left were resumed:
    a file whose own bytes do not match is discarded at once (exit 75)."""
    hub.add("moved/corrupt", FILES, listing=[entry("config.json", CONFIG),
            entry("model.safetensors", bytes(reversed(WEIGHTS)))])  # fmt: skip
    hub.requests.clear()
    code, err = _fetch(capsys, "moved/corrupt", tmp_path / "dest")
    assert code == 75, err
    assert "do not match the Hub's hash" in err
    assert len([p for p, _ in hub.requests if p.endswith("/model.safetensors")]) == 1


@pytest.mark.parametrize("revision", ["..", ".", "main/..", "a b", "x.lock", ".hidden", "a~1"])
def test_a_revision_no_git_name_can_be_is_refused_before_the_hub_is_asked(
    hub, revision, capsys, tmp_path, canary
):
    """Before: ``@..`` made the Hub's URL for the revision ``/api/models/ORG/NAME``, the
    repository's own page, which answers main's commit: the fetch took main (exit 0) under
    a revision that names nothing. The key takes such a source (as the chart does); the
    fetch refuses it (and ``run``'s fingerprint of a published key alike)."""
    from loader.errors import SourceError
    from loader.sources import fingerprint

    hub.add("dots/repo", FILES)
    hub.requests.clear()
    code, err = _fetch(capsys, f"dots/repo@{revision}", tmp_path / "dest")
    assert code == 2, err
    assert "no branch, tag or commit" in err and "refs/pr/N" in err
    with pytest.raises(SourceError, match="no branch, tag or commit"):
        fingerprint(f"hf://dots/repo@{revision}")
    assert hub.requests == []
    assert not (tmp_path / "dest").exists()


def test_a_revision_git_names_with_slashes_reaches_the_hub_as_one(hub, capsys, tmp_path):
    """``refs/pr/1`` (a pull request's head) is one revision: quoted into one part of the
    Hub's URL, and its commit is what is fetched."""
    hub.add("dots/pr", FILES, revision=[])
    code, err = _fetch(capsys, "dots/pr@refs/pr/1", tmp_path / "dest")
    assert code == 0, err
    assert hub.repos["dots/pr"]["revision"] == ["refs/pr/1"]
    assert published(tmp_path / "dest") == ["config.json", "model.safetensors"]


def test_the_token_never_goes_to_another_origin_a_listing_page_names(hub, capsys, tmp_path):
    """The Hub library follows a ``Link: <URL>; rel="next"`` of the file list with the same
    headers, wherever URL is; before, the token went to whatever host a listing page named."""
    elsewhere = ForgedHub().start()
    try:
        elsewhere.add("pages/elsewhere", FILES)
        hub.add("pages/elsewhere", FILES, pages=2, next_url=elsewhere.url)
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        _fetch(capsys, "pages/elsewhere", tmp_path / "dest", "--hf-token-file", str(token_file))
        assert [p for p, _ in elsewhere.requests if "/tree/" in p]  # the page was asked for
        assert all("authorization" not in headers for _, headers in elsewhere.requests)
        assert all(h.get("authorization") == f"Bearer {TOKEN}" for _, h in hub.requests[-2:])
    finally:
        elsewhere.stop()


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=5), inner, max_size=2)
    ),
    max_leaves=4,
)
_fields = {
    "path": st.sampled_from(["model.safetensors", "config.json"]) | _json,
    "size": st.sampled_from([len(WEIGHTS), 0, -1, 2**64, 10**30]) | _json,
    "oid": st.just(blob(WEIGHTS)) | st.sampled_from(["", "0" * 40, "A" * 40]) | _json,
    "lfs": st.none()
    | st.just({"size": len(WEIGHTS), "oid": hashlib.sha256(WEIGHTS).hexdigest(), "pointerSize": 1})
    | _json,
    "type": st.sampled_from(["file", "directory"]) | _json,
}


@settings(max_examples=examples(50), deadline=None, derandomize=True, database=None)
@given(forged=st.fixed_dictionaries({}, optional=_fields))
def test_a_listing_entry_of_any_json_is_refused_or_verified(hub, forged):
    """One entry of the file list with every field any JSON value (or left out): the fetch
    places the weights only if they are the bytes the entry's hash names, and any other end is
    a typed error (exit 2 or 75), never another exception."""
    weights = {"type": "file", "path": "model.safetensors", "size": len(WEIGHTS),
               "oid": blob(WEIGHTS), **forged}  # fmt: skip
    repo = f"json/r{abs(hash(repr(weights)))}"
    hub.add(repo, FILES, listing=[entry("config.json", CONFIG), weights])
    with tempfile.TemporaryDirectory() as top:
        dest = Path(top) / "dest"
        try:
            fetch(f"hf://{repo}", dest, retry_deadline_s=1)
        except LoaderError as exc:
            assert exc.exit_code in (2, 75), exc
        else:
            assert (dest / "model.safetensors").read_bytes() == WEIGHTS
        assert {p.name for p in Path(top).iterdir()} <= {"dest"}


#: The commit id ForgedHub gives FILES (a hash of the content).
_FILES_SHA = hashlib.sha1(repr(sorted(FILES.items())).encode(), usedforsecurity=False).hexdigest()
_shas = st.sampled_from([_FILES_SHA, _FILES_SHA.upper(), _FILES_SHA[:39], " " + _FILES_SHA])


@settings(max_examples=examples(30), deadline=None, derandomize=True, database=None)
@given(
    info=_json
    | st.fixed_dictionaries({"id": st.just("x/y") | _json}, optional={"sha": _shas | _json})
)
def test_a_model_info_of_any_json_is_refused_or_pins_a_commit(hub, info):
    """The Hub's answer for the revision, any JSON: either a commit id that every later
    request names, or a typed error before the file list is asked for."""
    repo = f"json/info{abs(hash(repr(info)))}"
    hub.add(repo, FILES, info=info)
    hub.requests.clear()
    with tempfile.TemporaryDirectory() as top:
        try:
            result = fetch(f"hf://{repo}", Path(top) / "dest", retry_deadline_s=1)
        except LoaderError as exc:
            assert exc.exit_code in (2, 75), exc
            assert not [p for p, _ in hub.requests if "/tree/" in p or "/resolve/" in p]
        else:
            assert result.revision == info["sha"].lower() == _FILES_SHA
            assert all(result.revision in p for p, _ in hub.requests if "/revision/" not in p)


def test_a_fifo_as_the_stored_login_ends_the_fetch_at_once(hub, tmp_path):
    """``$HF_HOME/token``, the token ``hf auth login`` stores, as a FIFO: before, the Hub
    library opened it to read the token and the fetch waited forever (a process of its own:
    the library reads HF_HOME at import)."""
    hub.add("login/fifo", FILES)
    home = tmp_path / "hf-home"
    home.mkdir()
    os.mkfifo(home / "token")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_TOKEN")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home))
    argv = [sys.executable, "-m", "loader", "fetch", "hf://login/fifo", str(tmp_path / "dest")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"{home / 'token'}" in done.stderr and "is a FIFO" in done.stderr
    assert "Traceback" not in done.stderr


def _answer_with(status: int, body: bytes, headers: dict[str, str]):
    def serve(handler) -> None:
        handler.answer(status, body, headers)

    return serve


@pytest.mark.parametrize(
    ("status", "headers"),
    [(404, {"X-Error-Code": "EntryNotFound"}), (500, {}), (403, {})],
)
def test_what_the_hub_answers_in_a_failure_never_forges_a_line_of_the_error(
    hub, tmp_path, capsys, status, headers
):
    """The Hub library puts the server's message on lines of its own in its exception; quoted
    in the error, a Hub (or mirror) could print a line of the loader's."""
    body = b'{"error": "gone\\nerror: forged by the hub\\nhint: forged"}'
    hub.add(
        f"org/answers-{status}",
        FILES,
        serve={"model.safetensors": _answer_with(status, body, {
            **headers, "X-Error-Message": "gone", "Content-Type": "application/json"})},
    )  # fmt: skip
    code, err = _fetch(capsys, f"org/answers-{status}", tmp_path / "dest")
    assert code in (2, 75), err
    lines = err.splitlines()
    assert [line for line in lines if line.startswith("error:")][1:] == [], err
    assert not any(line.startswith("error: forged") or line == "hint: forged" for line in lines)
    assert len([line for line in lines if line.startswith("hint:")]) == 1, err


def test_a_body_that_trickles_is_dropped_and_retried_until_the_deadline(
    hub, capsys, tmp_path, monkeypatch
):
    """A server (or proxy) that sends a byte now and then, each within the read timeout, held
    the download for good: the library's timeout is per read. Below the pace the answer is
    dropped and the file retried from its last byte, within the retry deadline."""
    from loader.sources import transfer

    monkeypatch.setattr(transfer, "STALL_S", 0.5)
    monkeypatch.setattr(transfer, "STALL_BYTES", 1024)
    answers = []

    def trickle(handler) -> None:
        answers.append(1)
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(WEIGHTS)))
        handler.end_headers()
        try:
            for byte in WEIGHTS[:200]:  # 10 bytes a second: far below the pace, never idle
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(0.1)
        except OSError:  # the loader dropped the answer
            pass

    hub.add("slow/trickle", FILES, serve={"model.safetensors": trickle})
    code, err = _fetch(capsys, "slow/trickle", tmp_path / "dest")  # --retry-deadline 3
    assert code == 75, err
    assert "slowed to" in err and "model.safetensors" in err, err
    assert len(answers) >= 2  # retried, not given up at the first stall
    assert "model.safetensors" not in published(tmp_path / "dest")
