"""Adversarial failures: what a user, a checkpoint or the environment can hand the loader ends
in a typed error (exit 2 with a hint, 75 for what may pass), never a traceback, a forged line
of the log or a hang."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.runs import cli
from tests.tiers import examples

ROOT = Path(__file__).resolve().parents[1]

#: A tensor name that, printed as it is, would forge a line of its own in the error output.
FORGED = "x\nerror: forged"


def _read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _add_entry(path: Path, entry: dict, data: bytes = b"") -> None:
    """Add the header entry ``FORGED`` to the safetensors file ``path`` (``data`` appended)."""
    header, body = _read_safetensors(path)
    header[FORGED] = entry
    _write_safetensors(path, header, body + data)


def _end(path: Path) -> int:
    return len(_read_safetensors(path)[1])


def _names_quoted(code: int, err: str) -> None:
    """The error names the tensor quoted, on the error's own line: no line of its own."""
    assert code == 2, err
    assert "Traceback" not in err and "this is a bug" not in err
    assert "\nerror: forged" not in err, err
    assert repr(FORGED) in err, err
    assert "hint:" in err


ENTRIES = {
    "an unsupported dtype": lambda end: (
        {"dtype": "Q9", "shape": [0], "data_offsets": [0, 0]},
        b"",
    ),
    "an incomplete entry": lambda end: ({"dtype": "F32"}, b""),
    "a malformed entry": lambda end: (
        {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]},
        b"",
    ),
    "a span of the wrong length": lambda end: (
        {"dtype": "F32", "shape": [2], "data_offsets": [end, end + 4]},
        b"\0" * 4,
    ),
    "bytes another tensor holds": lambda end: (
        {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        b"",
    ),
    "a gap before it": lambda end: (
        {"dtype": "F32", "shape": [1], "data_offsets": [end + 4, end + 8]},
        b"\0" * 8,
    ),
    "a tensor the model does not have": lambda end: (
        {"dtype": "F32", "shape": [1], "data_offsets": [end, end + 4]},
        b"\0" * 4,
    ),
}


@pytest.mark.parametrize("what", sorted(ENTRIES))
def test_a_tensor_name_from_a_header_never_forges_a_line_of_the_error(
    source, tmp_path, capsys, what
):
    weights = source / "model.safetensors"
    entry, data = ENTRIES[what](_end(weights))
    _add_entry(weights, entry, data)
    code, _, err = cli(capsys, "convert", str(source), str(tmp_path / "out"), "--tp-size", "1")
    _names_quoted(code, err)
    assert not (tmp_path / "out" / "1-gpu").exists()


def test_a_tensor_name_a_shard_holds_but_the_index_does_not_list_is_quoted(
    sharded_fp16_checkpoint, tmp_path, capsys
):
    source = tmp_path / "ckpt"
    shutil.copytree(sharded_fp16_checkpoint, source)
    shard = sorted(source.glob("model-*.safetensors"))[0]
    end = _end(shard)
    _add_entry(shard, {"dtype": "F16", "shape": [2], "data_offsets": [end, end + 4]}, b"\0" * 4)
    code, _, err = cli(capsys, "convert", str(source), str(tmp_path / "out"), "--tp-size", "1")
    _names_quoted(code, err)


# --- MODEL_LOADER_PROFILE: the file the stage totals go to ---------------------------------


def _convert_profiled(source: Path, out: Path, profile: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loader", "-q", "convert", str(source), str(out), "--tp-size", "1"],
        cwd=ROOT, env={**os.environ, "MODEL_LOADER_PROFILE": profile},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _plant_entry(path: Path, kind: str) -> None:
    """Something other than a regular file at ``path``: a FIFO, a directory, a sparse 64 MiB
    file, a link to a device or (any other kind) a dangling symbolic link."""
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge file":
        with path.open("wb") as fh:
            fh.truncate(64 * 2**20)  # sparse: no disk used
    elif kind == "link to a device":
        path.symlink_to("/dev/zero")
    else:
        path.symlink_to(path.parent / "elsewhere.json")


@pytest.mark.parametrize("kind", ["FIFO", "directory", "symbolic link"])
def test_a_profile_path_where_something_else_stands_is_refused_before_any_work(
    tiny_checkpoint_with_tokenizer, tmp_path, kind
):
    profile = tmp_path / "profile.json"
    _plant_entry(profile, kind)
    before = os.lstat(profile)
    done = _convert_profiled(tiny_checkpoint_with_tokenizer, tmp_path / "out", str(profile))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "MODEL_LOADER_PROFILE" in done.stderr and "hint:" in done.stderr
    after = os.lstat(profile)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)  # left as it was
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]


def test_a_profile_path_in_a_missing_directory_is_refused_before_any_work(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    profile = tmp_path / "missing" / "profile.json"
    done = _convert_profiled(tiny_checkpoint_with_tokenizer, tmp_path / "out", str(profile))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "MODEL_LOADER_PROFILE" in done.stderr and "hint:" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_profile_that_cannot_be_written_at_exit_is_a_warning_that_leaves_nothing(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    """The directory is there when the command starts, gone when it ends: the conversion's
    result stands, one line says the profile was not written, no temporary file is left."""
    where = tmp_path / "profiles"
    where.mkdir()
    profile = where / "profile.json"
    out = tmp_path / "out"
    code = (
        "import os, shutil, sys; from loader import stages; from loader.cli import main; "
        f"code = main(sys.argv[1:]); os.rename({str(where)!r}, {str(where)!r} + '.moved'); "
        f"os.mkdir({str(where)!r}); os.mkfifo({str(profile)!r}); sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "-q", "convert", str(tiny_checkpoint_with_tokenizer),
         str(out), "--tp-size", "1"],
        cwd=ROOT, env={**os.environ, "MODEL_LOADER_PROFILE": str(profile)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "profile" in done.stderr and str(profile) in done.stderr
    assert (out / "1-gpu" / "config.ini").is_file()
    assert stat.S_ISFIFO(os.lstat(profile).st_mode)  # someone else's, left as it was
    assert sorted(p.name for p in where.iterdir()) == ["profile.json"]


# --- GOOGLE_APPLICATION_CREDENTIALS: the key file the Cloud Storage client reads -------------


def _fetch_gs(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "STORAGE_"))}
    return subprocess.run(
        [sys.executable, "-m", "loader", "fetch", "gs://bucket/prefix", str(tmp_path / "dest"),
         "--retry-deadline", "5"],
        cwd=ROOT, env={**clean, "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["FIFO", "directory", "huge file", "link to a device"])
def test_a_credentials_setting_that_names_no_key_file_fails_at_once_naming_it(tmp_path, kind):
    """A FIFO there hung the client's read for good, /dev/zero read until memory ran out."""
    key = tmp_path / "key.json"
    _plant_entry(key, kind)
    done = _fetch_gs(tmp_path, GOOGLE_APPLICATION_CREDENTIALS=str(key))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"GOOGLE_APPLICATION_CREDENTIALS={str(key)!r}" in done.stderr
    assert "hint:" in done.stderr
    assert not (tmp_path / "dest").exists()


def _external_account(token_file: Path) -> dict:
    """An external account's configuration (workload identity federation) whose subject token
    the client reads from ``token_file``."""
    return {"type": "external_account",
            "audience": "//iam.googleapis.com/projects/1/locations/global/workloadIdentityPools/"
                        "pool/providers/provider",
            "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
            "token_url": "http://127.0.0.1:1/token",
            "credential_source": {"file": str(token_file)}}  # fmt: skip


@pytest.mark.parametrize("kind", ["FIFO", "link to a device", "directory"])
def test_a_subject_token_file_that_is_no_file_fails_at_once_naming_it(tmp_path, kind):
    """The key file may be an external account's configuration, whose subject token the
    client reads from the file it names at each token refresh, whole and with no timeout: a
    FIFO there held ``fetch`` for good whatever ``--retry-deadline`` said (a device until
    memory ran out; a directory was "Reading bucket gs://bucket failed: IsADirectoryError"
    with a hint to check the URI). Now that file is checked with the key file: 2 at once,
    naming it."""
    token = tmp_path / "token"
    _plant_entry(token, kind)
    key = tmp_path / "key.json"
    key.write_text(json.dumps(_external_account(token)))
    done = _fetch_gs(tmp_path, GOOGLE_APPLICATION_CREDENTIALS=str(key), GOOGLE_CLOUD_PROJECT="p")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"The subject token file {token}" in done.stderr, done.stderr
    assert "credential_source.file" in done.stderr and "hint:" in done.stderr
    assert not (tmp_path / "dest").exists()


def test_a_key_file_nested_too_deeply_is_a_source_error_not_a_bug(tmp_path):
    """A key file of ``[[[[...`` within the size bound: looking in it for a token file must
    not fail where the client's own reading of it is a typed error."""
    key = tmp_path / "key.json"
    key.write_text("[" * 100_000)
    done = _fetch_gs(tmp_path, GOOGLE_APPLICATION_CREDENTIALS=str(key), GOOGLE_CLOUD_PROJECT="p")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr


def test_a_fifo_where_gcloud_keeps_its_default_credentials_fails_at_once_naming_it(tmp_path):
    (tmp_path / "gcloud").mkdir()
    os.mkfifo(tmp_path / "gcloud" / "application_default_credentials.json")
    done = _fetch_gs(tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "application_default_credentials.json" in done.stderr and "FIFO" in done.stderr


@pytest.mark.parametrize("kind", ["FIFO", "link to a device", "huge file"])
@pytest.mark.parametrize("where", ["NETRC", "home", "NETRC=~/"])
def test_a_login_file_that_is_no_file_fails_at_once_naming_it(tmp_path, kind, where):
    """requests reads its login file (the one NETRC names, else ``~/.netrc``) whole, with no
    timeout, before each request: a FIFO there held ``fetch gs://`` for good, past
    ``--retry-deadline`` (a device until memory ran out). Now: 2 at once, naming it.
    ``NETRC=~/.netrc`` is the file in the home directory (requests expands the ``~``): it
    was looked for under a directory named ``~``, and a FIFO there still held the command."""
    (tmp_path / "home").mkdir()
    planted = tmp_path / "home" / ".netrc"
    _plant_entry(planted, kind)
    env = {"NETRC": str(planted)} if where == "NETRC" else {"HOME": str(tmp_path / "home")}
    if where == "NETRC=~/":
        env["NETRC"] = "~/.netrc"
    done = _fetch_gs(tmp_path, STORAGE_EMULATOR_HOST="http://127.0.0.1:1", **env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr
    assert str(planted) in done.stderr and "netrc" in done.stderr and "hint:" in done.stderr
    assert not (tmp_path / "dest").exists()


def test_a_login_file_that_is_a_directory_is_skipped_as_requests_skips_it(tmp_path):
    (tmp_path / "netrc").mkdir()
    done = _fetch_gs(
        tmp_path, STORAGE_EMULATOR_HOST="http://127.0.0.1:1", NETRC=str(tmp_path / "netrc")
    )
    assert "netrc" not in done.stderr, done.stderr
    assert done.returncode == 75, done.stderr  # the refused connection, to the deadline


@pytest.mark.parametrize("where", ["NETRC", "home"])
def test_a_login_file_at_dev_null_is_no_logins_as_requests_reads_it(tmp_path, monkeypatch, where):
    """``NETRC=/dev/null`` (or ``~/.netrc`` a link to it), the usual way to turn the login file
    off: requests reads it as holding no logins; the check refused it as a device (2), and
    ``fetch gs://`` never started."""
    from loader.errors import SourcePermissionError
    from loader.sources import settings as source_settings

    (tmp_path / "home").mkdir()
    if where == "NETRC":
        monkeypatch.setenv("NETRC", os.devnull)
    else:
        monkeypatch.delenv("NETRC", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        (tmp_path / "home" / ".netrc").symlink_to(os.devnull)
    source_settings.netrc_file()
    monkeypatch.setenv("NETRC", "/dev/zero")  # another device still fails at once
    with pytest.raises(SourcePermissionError, match="a device"):
        source_settings.netrc_file()


def test_the_login_file_read_is_the_first_of_netrc_and_underscore_netrc_there(
    tmp_path, monkeypatch
):
    """Without NETRC, requests reads ``~/.netrc``, else ``~/_netrc``: a FIFO at ``_netrc``
    alone is refused at once, naming it; behind a regular ``.netrc`` it is never read, and
    nothing is refused."""
    from loader.errors import SourcePermissionError
    from loader.sources import settings as source_settings

    home = tmp_path / "home"
    home.mkdir()
    os.mkfifo(home / "_netrc")
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(SourcePermissionError, match="_netrc"):
        source_settings.netrc_file()
    (home / ".netrc").write_text("machine example.com login a password b\n")
    source_settings.netrc_file()


def test_a_warning_python_is_told_to_raise_is_named_not_a_bug(tmp_path):
    """``PYTHONWARNINGS=error``: google-api-core's ImportWarning at its import (grpcio-status
    is not installed) became an exception, and ``fetch gs://`` ended with exit 1 and a
    traceback ("this is a bug"). Now: 2, naming the setting."""
    done = _fetch_gs(tmp_path, STORAGE_EMULATOR_HOST="http://127.0.0.1:1", PYTHONWARNINGS="error")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr
    assert "PYTHONWARNINGS" in done.stderr and "hint:" in done.stderr, done.stderr
    assert not (tmp_path / "dest").exists()


# --- the Hugging Face token's settings ----------------------------------------------------


def _fetch_hf(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return subprocess.run(
        [sys.executable, "-m", "loader", "fetch", "hf://org/name", str(tmp_path / "dest"),
         "--retry-deadline", "5"],
        cwd=tmp_path,
        env={**clean, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf"),
             "HF_ENDPOINT": "http://127.0.0.1:1", **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_an_empty_hf_token_path_is_named_not_taken_for_the_working_directory(tmp_path):
    """The Hub library reads an empty HF_TOKEN_PATH as the file ``.``; the error named ``.`` as
    "the stored login under HF_HOME", not the setting."""
    done = _fetch_hf(tmp_path, HF_TOKEN_PATH="")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "HF_TOKEN_PATH" in done.stderr and "empty" in done.stderr, done.stderr
    assert "hint:" in done.stderr


@pytest.mark.parametrize("variable", ["HF_TOKEN_PATH", "HF_TOKEN_FILE"])
def test_a_token_file_name_with_a_line_break_is_shown_quoted(tmp_path, variable):
    done = _fetch_hf(tmp_path, **{variable: str(tmp_path / "x\nerror: forged")})
    assert done.returncode == 2, done.stderr
    assert "\nerror: forged" not in done.stderr, done.stderr
    assert "error: forged" in done.stderr


# --- the certificate authorities the HTTP libraries trust ----------------------------------

#: The settings naming them: httpx (hf://) reads the first two, requests (gs://) the last two.
TRUST = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def _trusting(monkeypatch: pytest.MonkeyPatch, path: Path, kind: str) -> None:
    """Only the setting under test names certificates: ``kind`` is planted at ``path``."""
    for variable in TRUST:
        monkeypatch.delenv(variable, raising=False)
    if kind == "garbage":
        path.write_bytes(b"not a certificate\n" * 100)
    elif kind != "missing":
        _plant_entry(path, kind)


@pytest.mark.parametrize("kind", ["FIFO", "missing", "garbage", "link to a device"])
@pytest.mark.parametrize("variable", ["SSL_CERT_FILE", "SSL_CERT_DIR"])
def test_a_hub_trust_setting_naming_no_certificates_fails_at_once_naming_it(
    tmp_path, monkeypatch, variable, kind
):
    """httpx opens SSL_CERT_FILE (or SSL_CERT_DIR) as it makes the Hub's client, whatever the
    endpoint's scheme: a FIFO there held ``fetch`` for good, past --retry-deadline; a missing
    file or one without a certificate was exit 1 with a traceback. Now: 2 at once, naming
    the setting."""
    planted = tmp_path / "ca.pem"
    _trusting(monkeypatch, planted, kind)
    done = _fetch_hf(tmp_path, **{variable: str(planted)})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr
    assert f"{variable}={str(planted)!r}" in done.stderr and "hint:" in done.stderr
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("kind", ["FIFO", "missing", "garbage"])
@pytest.mark.parametrize("variable", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"])
def test_a_storage_trust_setting_naming_no_certificates_fails_at_once_naming_it(
    tmp_path, monkeypatch, variable, kind
):
    """requests opens REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) at each https request, with no
    timeout: a FIFO there held ``fetch gs://`` for good once a server took the connection.
    Now: 2 before any request, naming the setting."""
    planted = tmp_path / "ca.pem"
    _trusting(monkeypatch, planted, kind)
    done = _fetch_gs(
        tmp_path, STORAGE_EMULATOR_HOST="https://127.0.0.1:1", **{variable: str(planted)}
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr
    assert f"{variable}={str(planted)!r}" in done.stderr and "hint:" in done.stderr


def test_a_trust_setting_the_library_does_not_read_is_left_alone(tmp_path, monkeypatch):
    """Only the first setting set is read (requests: REQUESTS_CA_BUNDLE, else CURL_CA_BUNDLE):
    a stale CURL_CA_BUNDLE behind a good REQUESTS_CA_BUNDLE changes nothing."""
    import certifi

    _trusting(monkeypatch, tmp_path / "ca.pem", "missing")
    done = _fetch_gs(
        tmp_path,
        STORAGE_EMULATOR_HOST="http://127.0.0.1:1",
        REQUESTS_CA_BUNDLE=certifi.where(),
        CURL_CA_BUNDLE=str(tmp_path / "ca.pem"),
    )
    assert "CURL_CA_BUNDLE" not in done.stderr, done.stderr
    assert done.returncode == 75, done.stderr  # the refused connection, to the deadline


@pytest.mark.parametrize("variable", ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"])
def test_a_trust_file_larger_than_any_bundle_is_refused_before_it_is_read(
    tmp_path, monkeypatch, variable
):
    """A certificate file is read whole by the TLS library: one past 16 MiB (a sparse
    file: nothing is written) is refused naming its size; one of 16 MiB is read (and
    then refused for what it holds)."""
    from loader.errors import SourceError
    from loader.sources import settings

    planted = tmp_path / "ca.pem"
    _trusting(monkeypatch, planted, "missing")
    monkeypatch.setenv(variable, str(planted))
    which = settings.HUB_TRUST if variable == "SSL_CERT_FILE" else settings.STORAGE_TRUST
    for size, said in ((16 * 2**20 + 1, "too large"),
                       (16 * 2**20, "holds no certificate")):  # fmt: skip
        with planted.open("wb") as fh:
            fh.truncate(size)
        with pytest.raises(SourceError) as info:
            settings.trust_files(which)
        assert said in info.value.message and variable in info.value.message


# --- the proxy settings the HTTP libraries read ----------------------------------------------

PROXIES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def _without_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (*PROXIES, *(v.upper() for v in PROXIES)):
        monkeypatch.delenv(variable, raising=False)


#: Proxy settings no library here can use: a SOCKS proxy without its module, a scheme no
#: proxy has, a port out of range, a host that does not parse (with a password, never shown).
UNUSABLE_PROXIES = ["socks5://127.0.0.1:1", "ftp://proxy", "http://proxy:99999",
                    "http://user:s3cret@[::1", "user:s3cret@proxy:99999", ":::"]  # fmt: skip


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "https_proxy", "ALL_PROXY"])
@pytest.mark.parametrize("value", UNUSABLE_PROXIES)
def test_a_proxy_setting_the_hub_library_cannot_use_is_named(
    tmp_path, monkeypatch, variable, value
):
    """httpx reads every proxy setting as it makes the Hub's client: such a value was exit 1
    with a traceback (ImportError, ValueError, httpx's InvalidURL), whatever the endpoint."""
    _without_proxies(monkeypatch)
    done = _fetch_hf(tmp_path, **{variable: value})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr
    assert f"{variable}=" in done.stderr and "proxy" in done.stderr and "hint:" in done.stderr
    assert "s3cret" not in done.stderr


@pytest.mark.parametrize("value", ["socks5://127.0.0.1:1", "http://proxy:99999"])
def test_a_proxy_setting_the_storage_library_cannot_use_is_named(tmp_path, monkeypatch, value):
    """requests refused it as a failure of "the source", with a hint to check the URI."""
    _without_proxies(monkeypatch)
    done = _fetch_gs(tmp_path, STORAGE_EMULATOR_HOST="http://127.0.0.1:1", HTTP_PROXY=value)
    assert done.returncode == 2, done.stderr
    assert f"HTTP_PROXY={value!r} is not a proxy" in done.stderr, done.stderr


# --- resources: file descriptors ----------------------------------------------------------


def test_running_out_of_file_descriptors_says_so_and_names_the_limit(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    """EMFILE is the process's descriptor limit, not the volume: the hint said to check the
    volume's kernel log and NFS server."""
    root = tmp_path / "root"
    code = (
        "import resource, sys; from loader.cli import main; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (8, 8)); sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "run", "--source", str(tiny_checkpoint_with_tokenizer),
         "--repository", str(root), "--model-name", "m", "--tp-size", "1", "--pp-size", "1",
         "--instance-count", "1", "--backend", "python", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 75, done.stderr
    assert "Traceback" not in done.stderr
    assert "file descriptors" in done.stderr and "ulimit -n" in done.stderr, done.stderr
    assert "(8)" in done.stderr
    assert "NFS" not in done.stderr
    assert not list(root.glob("m@*"))


@pytest.mark.parametrize("limit", [6, 7])
def test_complete_with_too_few_file_descriptors_for_grpc_names_the_limit(limit):
    """``complete`` under ``ulimit -n 6``: gRPC could not open its own descriptors and killed
    the process (SIGABRT); under 7 its connection's socket failed, "Too many open files", told
    as a server that is not up (2). Each is the process's limit: 75, naming it, before any
    call."""
    code = (
        "import resource, sys; from loader.cli import main; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
        "sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "complete", "hi", "--url", "127.0.0.1:1", "--model", "m",
         "--timeout", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 75, done.stderr
    assert f"open files ({limit}: ulimit -n)" in done.stderr and "hint:" in done.stderr


@pytest.mark.slow  # a run in a subprocess of its own at each of nine limits
def test_running_out_of_file_descriptors_leaves_no_empty_directory_in_staging(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    """Descriptors running out as a staging directory is made: its create was recorded through
    a descriptor that could not be had (or its record could not be opened), and its removal
    opened the directory and its record, which failed too; the typed error left the empty
    directory in ``.staging``. Now it is removed without one, at every limit where ``run``
    fails so."""
    code = (
        "import resource, sys; from loader.cli import main; n = int(sys.argv[1]); "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); sys.exit(main(sys.argv[2:]))"
    )
    for limit in range(6, 15):
        root = tmp_path / str(limit)
        done = subprocess.run(
            [sys.executable, "-c", code, str(limit), "run", "--source",
             str(tiny_checkpoint_with_tokenizer), "--repository", str(root), "--model-name", "m",
             "--tp-size", "1", "--pp-size", "1", "--instance-count", "1", "--backend", "python",
             "-q"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode in (0, 75), done.stderr
        assert "Traceback" not in done.stderr
        staging = root / ".staging"
        made = staging.iterdir() if staging.exists() else []
        empty = [p.name for p in made if p.is_dir() and not any(p.iterdir())]
        assert empty == [], f"ulimit -n {limit}: {empty} left"


# --- complete and serve -------------------------------------------------------------------


def test_a_request_file_nested_too_deeply_is_a_user_error(tmp_path, capsys):
    request = tmp_path / "request.json"
    request.write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = cli(capsys, "complete", "--request", str(request), "--url", "127.0.0.1:1")
    assert code == 2, err
    assert "Traceback" not in err and "this is a bug" not in err
    assert str(request) in err and "hint:" in err


@pytest.mark.parametrize(
    "url",
    ["http://user:s3cret@127.0.0.1:1", "ftp://user:s3cret@127.0.0.1:1", "http://user:s3cret@"],
)
def test_an_endpoint_refused_never_shows_its_password(capsys, url):
    code, _, err = cli(capsys, "complete", "hi", "--url", url)
    assert code == 2, err
    assert "s3cret" not in err, err
    assert "***@" in err


def test_serve_refuses_a_values_file_that_is_a_fifo_without_waiting_on_it(tmp_path):
    """helm opened the FIFO and waited for a writer for good."""
    values = tmp_path / "values.yaml"
    os.mkfifo(values)
    done = subprocess.run(
        [sys.executable, "-m", "loader", "serve", str(tmp_path), "-f", str(values)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert str(values) in done.stderr and "FIFO" in done.stderr


# --- the working directory deleted --------------------------------------------------------


def test_a_relative_path_described_after_the_working_directory_was_deleted_is_a_user_error(
    tmp_path,
):
    """What stands at a relative path is described for a message (``tune --repository r``):
    with the working directory gone that was an UnboundLocalError, exit 1."""
    gone = tmp_path / "gone"
    gone.mkdir()
    code = (
        "import os, sys; from loader.cli import main; os.chdir(sys.argv[1]); "
        "os.rmdir(sys.argv[1]); sys.exit(main(sys.argv[2:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(gone), "tune", "--repository", "r"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "working directory was deleted" in done.stderr


def test_what_stands_at_a_relative_path_is_not_guessed_without_a_working_directory(tmp_path):
    from loader import fs

    gone = tmp_path / "gone"
    gone.mkdir()
    here = os.getcwd()
    os.chdir(gone)
    try:
        gone.rmdir()
        with pytest.raises(FileNotFoundError):
            fs.not_a_directory(Path("r"))
    finally:
        os.chdir(here)


# --- safetensors headers, generated -------------------------------------------------------

_NAMES = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12)
_NUMBERS = st.one_of(
    st.integers(min_value=-3, max_value=64),
    st.integers(min_value=2**62, max_value=2**70),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
_ENTRIES = st.one_of(
    st.fixed_dictionaries(
        {
            "dtype": st.one_of(
                st.sampled_from(["F32", "F16", "BF16", "I32", "F64", "Q9"]), _NUMBERS
            ),
            "shape": st.one_of(st.lists(_NUMBERS, max_size=3), _NUMBERS),
            "data_offsets": st.one_of(st.lists(_NUMBERS, max_size=3), _NUMBERS),
        }
    ),
    st.fixed_dictionaries({"dtype": st.just("F32")}),
    _NUMBERS,
    st.lists(_NUMBERS, max_size=2),
)


@settings(
    max_examples=examples(300),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    header=st.dictionaries(_NAMES, _ENTRIES, max_size=4),
    data=st.binary(max_size=64),
    length_delta=st.sampled_from([0, 0, 0, -1, 1, 2**40]),
)
def test_any_safetensors_header_opens_or_is_a_checkpoint_error_on_one_line(
    tmp_path, header, data, length_delta
):
    from loader.checkpoint import SafetensorsFile
    from loader.errors import CheckpointError, DtypeError

    path = tmp_path / "model.safetensors"
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", max(0, len(raw) + length_delta)) + raw + data)
    try:
        SafetensorsFile(path)
    except (CheckpointError, DtypeError) as exc:
        for line in (exc.message, exc.remediation):
            assert line.isprintable(), line  # a name read from the header shown escaped


def test_an_empty_hf_endpoint_is_named_not_left_to_the_library(tmp_path):
    """The Hub library takes an empty HF_ENDPOINT as its endpoint (no scheme, no host); the
    error was the HTTP library's "Request URL is missing an 'http://' or 'https://' protocol"."""
    done = _fetch_hf(tmp_path, HF_ENDPOINT="")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "HF_ENDPOINT" in done.stderr and "empty" in done.stderr, done.stderr
    assert "hint:" in done.stderr
