"""Every failure in its class: a machine out of memory or threads is transient (75), a host
name that does not resolve is not (2, in seconds, with a hint), never a traceback."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loader import fs
from loader.sources.failures import is_transient, name_resolution_failure
from tests.runs import cli, run_argv

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "exc",
    [MemoryError(), RuntimeError("can't start new thread")],
    ids=["memory", "threads"],
)
def test_resource_exhaustion_is_transient(tiny_checkpoint_with_tokenizer, tmp_path, capsys, exc):
    raised = []

    def exhaust(op: str, path: str) -> None:
        if not raised and op == "open" and "/.staging/" in path:
            raised.append(path)
            raise exc

    with fs.inject(exhaust):
        code, _, err = cli(capsys, *run_argv(tiny_checkpoint_with_tokenizer, tmp_path / "root"))
    assert raised and code == 75, err
    assert "hint:" in err and "this is a bug" not in err, err
    code, _, err = cli(capsys, *run_argv(tiny_checkpoint_with_tokenizer, tmp_path / "root"))
    assert code == 0, err


def _wrapped_dns_failures() -> list[BaseException]:
    """A DNS failure as each HTTP stack raises it."""
    import requests
    import urllib3

    gai = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    found: list[BaseException] = [gai]
    try:
        raise urllib3.exceptions.NameResolutionError("h", None, gai) from gai
    except urllib3.exceptions.NameResolutionError as name:
        retry = urllib3.exceptions.MaxRetryError(None, "/x", name)
        found += [name, requests.exceptions.ConnectionError(retry)]
    return found


@pytest.mark.parametrize("exc", _wrapped_dns_failures(), ids=lambda e: type(e).__name__)
def test_a_name_that_does_not_resolve_is_not_transient(exc):
    assert name_resolution_failure(exc) is not None
    assert not is_transient(exc)


def test_a_connection_refused_stays_transient():
    assert is_transient(ConnectionRefusedError(111, "Connection refused"))


def _token_request_failures() -> list[BaseException]:
    """What google.auth raises when a token request (GKE's metadata server, an external
    account's token or subject URL) timed out or could not connect: its own TransportError,
    raised from the HTTP stack's error."""
    import requests
    from google.auth.exceptions import TransportError

    failures = []
    for cause in (requests.exceptions.ReadTimeout("Read timed out. (read timeout=5.0)"),
                  requests.exceptions.ConnectionError("Connection refused")):  # fmt: skip
        try:
            try:
                raise cause
            except requests.exceptions.RequestException as exc:
                raise TransportError(exc) from exc
        except TransportError as wrapped:
            failures.append(wrapped)
    return failures


@pytest.mark.parametrize("exc", _token_request_failures(), ids=["timeout", "refused"])
def test_a_token_request_that_timed_out_or_was_refused_is_transient(exc):
    """Reading gs:// under Workload Identity, the metadata server slow to hand out a token
    (a pod just started): google.auth's TransportError was a permanent source error, exit 2
    with "Check the source URI", never retried; the storage library itself retries it. Now it
    is retried to the deadline, then 75."""
    assert is_transient(exc)


def test_a_refresh_its_library_calls_retryable_is_transient_and_no_other():
    """A token endpoint that answered 429 or 5xx (google.auth's RefreshError, retryable):
    "No usable Google Cloud credentials" (2), as for credentials that cannot work. Now
    retried, then 75; a refresh refused for good stays a permission error."""
    from google.auth.exceptions import RefreshError

    from loader.sources.failures import Funnel
    from loader.sources.gcs import _specific

    assert is_transient(RefreshError("503 from the token endpoint", retryable=True))
    refused = RefreshError("invalid_grant")
    assert not is_transient(refused)
    typed = Funnel(1.0, specific=_specific).typed(refused, "gs://b/p")
    assert typed is not None and typed.exit_code == 2


@pytest.mark.server
def test_a_gcs_host_that_does_not_resolve_fails_at_once_with_a_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://no-such-host.invalid:4443")
    argv = run_argv("gs://bucket/model", tmp_path / "root", "--retry-deadline", "120")
    code, _, err = cli(capsys, *argv)
    assert code == 2 and "Cannot resolve the host" in err and "hint:" in err, err


@pytest.mark.parametrize("repo", ["org/na me", "org/a..b", "-org/x"])
def test_a_hub_id_the_hub_refuses_is_a_source_error(tmp_path, capsys, monkeypatch, repo):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # refused before any request
    argv = run_argv(f"hf://{repo}", tmp_path / "root", "--retry-deadline", "5")
    code, _, err = cli(capsys, *argv)
    assert code == 2 and "repository id" in err and "hint:" in err, err


def test_relative_paths_from_a_deleted_working_directory_are_a_typed_error(
    tmp_path, capsys, monkeypatch
):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    code, _, err = cli(capsys, *run_argv("ckpt", "root"))
    assert code == 2 and "working directory was deleted" in err and "hint:" in err, err


def _library_exception_classes() -> list[type[BaseException]]:
    """Every exception class the remote sources' libraries define (generated, not listed)."""
    import importlib
    import inspect

    modules = ["google.api_core.exceptions", "google.auth.exceptions", "requests.exceptions",
               "urllib3.exceptions", "huggingface_hub.errors", "httpx", "httpcore", "httpx2",
               "httpcore2"]  # fmt: skip
    found: dict[str, type[BaseException]] = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Exception) and cls.__module__.split(".")[0] == name.split(".")[0]:
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[k] for k in sorted(found)]


def test_every_exception_class_of_the_source_libraries_has_a_class():
    """Each is transient (retried, then 75) or typed (2): none reaches the funnel as a bug."""
    from loader.sources.failures import Funnel

    funnel = Funnel(1.0)
    classes = _library_exception_classes()
    assert len(classes) > 50, len(classes)
    unmapped = []
    for cls in classes:
        try:
            exc = cls.__new__(cls)
            Exception.__init__(exc, "x")
        except Exception:
            continue  # cannot be made without its library: raised only by it, with its fields
        if not is_transient(exc) and funnel.typed(exc, "gs://b/p") is None:
            unmapped.append(f"{cls.__module__}.{cls.__qualname__}")
    assert not unmapped, unmapped


def test_a_value_a_library_refuses_is_a_source_error_not_a_bug():
    from loader.sources.failures import Funnel

    def refuse():
        import urllib3.util

        urllib3.util.parse_url("http://[bad")  # raises inside the library

    funnel = Funnel(1.0)
    with pytest.raises(Exception) as caught:
        funnel(refuse, what="gs://b/p")
    from loader.errors import SourceError

    assert isinstance(caught.value, SourceError), caught.value


@pytest.mark.parametrize(
    "body",
    [b"\x00\xffnot json{{{", b"not json", b"\xff\xfe\x00", b"[1, 2"],
    ids=["utf-16-guess", "text", "bom", "cut-short"],
)
def test_a_response_body_the_standard_library_cannot_decode_is_a_source_error(body):
    """A Hub answering ``/api/models/...`` with bytes that are no JSON: ``json`` guessed
    UTF-16 from the NULs and ``codecs`` raised UnicodeDecodeError, in the standard library on
    the library's behalf (exit 1, a bug); any such failure is the source's."""
    from loader.errors import SourceError
    from loader.sources.failures import Funnel

    namespace: dict = {"__name__": "huggingface_hub.fake"}
    exec("import json\ndef call(body):\n    return json.loads(body)\n", namespace)
    with pytest.raises(Exception) as caught:
        Funnel(1.0)(lambda: namespace["call"](body), what="hf://org/name (model info)")
    assert isinstance(caught.value, SourceError), repr(caught.value)


def test_a_standard_library_failure_in_the_loaders_own_code_stays_a_bug():
    import json

    from loader.sources.failures import Funnel

    with pytest.raises(ValueError) as caught:
        Funnel(1.0)(lambda: json.loads(b"\x00\xffnot"), what="gs://b/p")
    assert not hasattr(caught.value, "remediation")


@pytest.mark.parametrize(
    "value", ["http://[bad", "http://127.0.0.1:99999", "notaurl", "ftp://host", "http://"]
)
@pytest.mark.parametrize(
    ("variable", "source"),
    [("HF_ENDPOINT", "hf://org/name"), ("STORAGE_EMULATOR_HOST", "gs://b/p")],
)
def test_an_endpoint_setting_no_library_can_use_is_named(
    tmp_path, capsys, monkeypatch, variable, source, value
):
    """Refused before any library parses it (huggingface_hub raised a ValueError at import, or
    httpx an UnsupportedProtocol that was retried until the deadline)."""
    monkeypatch.setenv(variable, value)
    code, _, err = cli(capsys, *run_argv(source, tmp_path / "root", "--retry-deadline", "30"))
    assert code == 2 and f"error: {variable}=" in err and f"hint: Set {variable} to" in err, err


@pytest.mark.parametrize("token", ["tökén", "abc\ndef", "hf_ab cd", "hf_\x07"])
def test_a_hub_token_no_header_can_carry_is_refused_without_showing_it(
    tmp_path, capsys, monkeypatch, token
):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # refused before any request
    monkeypatch.setenv("HF_TOKEN", token)
    code, _, err = cli(capsys, *run_argv("hf://org/name", tmp_path / "root"))
    assert code == 2 and "token from HF_TOKEN" in err and "hint:" in err, err
    assert token.strip() not in err


def test_a_hub_setting_the_library_cannot_parse_is_named(tmp_path):
    """huggingface_hub parses its HF_HUB_* numbers at import (a fresh process: this one has
    imported it already)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_ETAG_TIMEOUT": "abc", "HF_ENDPOINT": "http://127.0.0.1:9"}
    argv = [sys.executable, "-m", "loader", *run_argv("hf://org/name", tmp_path / "root")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "HF_HUB_ETAG_TIMEOUT" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("value", [-1, -0.5])
def test_a_negative_hub_download_timeout_is_named_before_anything_is_asked(
    value, tmp_path, capsys, monkeypatch
):
    """huggingface_hub takes a negative HF_HUB_DOWNLOAD_TIMEOUT as it is (read at its import:
    set here on the module); the HTTP library refused it only at the first file, as a
    failure of the source whose hint named no variable."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", str(value))
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", value)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    code, _, err = cli(capsys, "fetch", "hf://org/name", str(tmp_path / "dest"),
                       "--retry-deadline", "1")  # fmt: skip
    assert code == 2, err
    assert f"HF_HUB_DOWNLOAD_TIMEOUT='{value}'" in err and "more than 0" in err, err


def _settings_failures() -> list[BaseException]:
    """Failures a setting causes, as each stack raises them: no retry can help."""
    import ssl

    import httpx
    import requests
    from huggingface_hub.errors import OfflineModeIsEnabled

    found: list[BaseException] = [
        httpx.UnsupportedProtocol("Request URL is missing an 'http://' or 'https://' protocol."),
        OfflineModeIsEnabled("offline mode is enabled"),
    ]
    try:
        import httpx2

        found.append(httpx2.UnsupportedProtocol("Request URL has an unsupported protocol"))
    except ImportError:
        pass
    verify = ssl.SSLCertVerificationError(1, "certificate verify failed")
    found.append(requests.exceptions.SSLError(verify))
    return found


@pytest.mark.parametrize("exc", _settings_failures(), ids=lambda e: type(e).__name__)
def test_a_setting_that_cannot_work_is_not_retried(exc):
    from loader.errors import SourceError
    from loader.sources.failures import Funnel

    assert not is_transient(exc)
    calls = []

    def fail():
        calls.append(1)
        raise exc

    with pytest.raises(SourceError) as caught:
        Funnel(30.0)(fail, what="hf://org/name")
    assert len(calls) == 1 and caught.value.exit_code == 2, caught.value


def _os_errors() -> list[OSError]:
    """An OSError for every errno this platform defines, each as the built-in subclass Python
    raises for it (FileNotFoundError, ConnectionResetError, ...): generated, not listed."""
    import errno
    import os

    return [OSError(code, os.strerror(code), "/volume/a name") for code in sorted(errno.errorcode)]


def test_every_errno_has_exactly_one_class():
    """Mapped to a typed error (2 or 75) or declared a bug: a code in neither (a new one, or
    one dropped from a class) fails here."""
    import errno

    from loader.errors import BUG_ERRNOS, typed_os_error

    unmapped, both = [], []
    for exc in _os_errors():
        typed = typed_os_error(exc)
        if typed is None and exc.errno not in BUG_ERRNOS:
            unmapped.append(errno.errorcode[exc.errno])
        if typed is not None and exc.errno in BUG_ERRNOS:
            both.append(errno.errorcode[exc.errno])
    assert not unmapped and not both, (unmapped, both)


@pytest.mark.parametrize("exc", _os_errors(), ids=lambda e: __import__("errno").errorcode[e.errno])
def test_an_os_error_reaching_the_command_line_gets_its_class(capsys, exc):
    """Through the one funnel of every command: an error line and a hint (2 or 75), or, for a
    code declared a bug, exit 1 with the traceback; never anything else."""
    import argparse

    from loader.cli import EXIT_BUG, run_command
    from loader.errors import BUG_ERRNOS

    def command(args):
        raise exc

    code = run_command(command, argparse.Namespace())
    err = capsys.readouterr().err
    if exc.errno in BUG_ERRNOS:
        assert code == EXIT_BUG
    else:
        assert code in (2, 75) and "hint:" in err and "a name" in err, (code, err)


@pytest.mark.parametrize(
    "raised",
    ["MemoryError()", 'RuntimeError("can\'t start new thread")'],
    ids=["memory", "threads"],
)
def test_resource_exhaustion_inside_a_library_call_stays_transient(raised):
    """Raised from a library's own code (here: a function whose module is requests'), it was a
    permanent SourceError (2) naming the library, where running again may well succeed."""
    from loader.errors import EXIT_TRANSIENT
    from loader.sources.failures import Funnel

    namespace: dict = {"__name__": "requests.fake"}
    exec(f"def call():\n    raise {raised}\n", namespace)
    calls = []

    def fail():
        calls.append(1)
        namespace["call"]()

    with pytest.raises(Exception) as caught:
        Funnel(30.0)(fail, what="gs://b/p")
    assert getattr(caught.value, "exit_code", None) == EXIT_TRANSIENT, caught.value
    assert len(calls) == 1  # not retried in place: the process may need more room


@pytest.mark.parametrize(
    ("what", "starts"),
    [("hf://org/name (config.json)", "hf://org/name"), ("gs://bucket/x", "gs://bucket/x"),
     ("bucket gs://b", "Bucket gs://b"), ("object gs://b/o", "Object gs://b/o")],
)  # fmt: skip
def test_a_404_names_what_was_read_with_a_uri_spelled_as_written(what, starts):
    """A URI starting the sentence kept its scheme's spelling (``Hf://``, ``Gs://`` before)."""
    from loader.errors import SourceNotFoundError
    from loader.sources.failures import by_status

    class NotFound(Exception):
        class response:  # what an HTTP library's error carries
            status_code = 404

    error = by_status(NotFound(), what, permission_hint="")
    assert isinstance(error, SourceNotFoundError)
    assert error.message == f"{starts}{what[len(starts) :]} does not exist (404)."


def test_an_endpoint_refused_is_named_without_its_password(monkeypatch):
    from loader.errors import SourceError
    from loader.sources import settings

    monkeypatch.setenv("HF_ENDPOINT", "http://mirror:pa55w0rd@mirror.local:99999")
    with pytest.raises(SourceError, match="HF_ENDPOINT") as info:
        settings.endpoint("HF_ENDPOINT")
    assert "pa55w0rd" not in str(info.value) and "***@mirror.local:99999" in str(info.value)


@pytest.mark.parametrize(
    ("text", "shown"),
    [("for url 'http://u:p@h:1/x'", "for url 'http://***@h:1/x'"),
     ("https://tok@h/a and gs://b/o", "https://***@h/a and gs://b/o"),
     ("no url here: a@b", "no url here: a@b"), ("http://h/p?a=b@c", "http://h/p?a=b@c"),
     # Signed storage URLs a Hub download is redirected to: S3, CloudFront, GCS, Azure.
     ("for url: https://cdn/x?X-Amz-Credential=AK%2F1&X-Amz-Expires=60&X-Amz-Signature=f0e",
      "for url: https://cdn/x?X-Amz-Credential=***&X-Amz-Expires=60&X-Amz-Signature=***"),
     ("https://d/x?Expires=1&Policy=eyJ9&Signature=a~b&Key-Pair-Id=K2 (403)",
      "https://d/x?Expires=1&Policy=***&Signature=***&Key-Pair-Id=*** (403)"),
     ("'https://s/b?X-Goog-Signature=ab12&X-Goog-Date=1'",
      "'https://s/b?X-Goog-Signature=***&X-Goog-Date=1'"),
     ("https://a/c/b?sv=2020&sig=Zz%3D&se=2", "https://a/c/b?sv=2020&sig=***&se=2"),
     ("http://u:p@h/x?access_token=t0k", "http://***@h/x?access_token=***"),
     ("a signature=none outside a URL", "a signature=none outside a URL")],
)  # fmt: skip
def test_credentials_of_a_url_in_a_failure_are_redacted(text, shown):
    from loader.errors import redacted

    assert redacted(text) == shown


def _import_failed_by(cause: BaseException) -> ImportError:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise ImportError(
                "Error importing numpy: you should not try to import numpy"
            ) from inner
    except ImportError as outer:
        return outer


@pytest.mark.parametrize(
    "exc",
    [
        _import_failed_by(MemoryError()),
        _import_failed_by(RuntimeError("can't start new thread")),
        ImportError("/x/_generator.so: failed to map segment from shared object"),
        ImportError("libgomp.so.1: cannot allocate memory in static TLS block"),
    ],
    ids=["memory", "threads", "map-segment", "tls"],
)
def test_a_library_import_that_ran_out_of_memory_is_transient(exc):
    """An extension module imported once memory ran out (``ulimit -v``): numpy wraps the
    MemoryError in an ImportError of its own, the dynamic loader says it could not map a
    segment; it was exit 1, a bug."""
    from loader.errors import EXIT_TRANSIENT, resource_exhaustion

    typed = resource_exhaustion(exc)
    assert typed is not None and typed.exit_code == EXIT_TRANSIENT


def test_an_import_error_with_memory_to_spare_is_not_taken_for_exhaustion():
    from loader.errors import resource_exhaustion

    assert resource_exhaustion(ImportError("No module named 'nothing_here'")) is None
    assert resource_exhaustion(SystemError("error return without exception set")) is None


def test_a_failed_import_while_memory_is_short_is_transient(monkeypatch):
    """numpy imported under ``ulimit -v``: "PyCapsule_Import could not import module
    datetime", or a C extension's SystemError, with the MemoryError that caused it lost."""
    from loader import errors

    monkeypatch.setattr(errors, "_MEMORY_PROBE", 1 << 62)  # no process can have that much
    for exc in (ImportError('PyCapsule_Import could not import module "datetime"'),
                SystemError("error return without exception set")):  # fmt: skip
        typed = errors.resource_exhaustion(exc)
        assert typed is not None and typed.exit_code == errors.EXIT_TRANSIENT
        assert len(typed.message) < 400


#: The start of a script that limits its own address space to what it has mapped and
#: ``room`` bytes more (``ulimit -v``, a container's limit), once what it tests is imported.
_ROOM_ONLY = """
import re, resource, sys
import torch
from loader.checkpoint import TorchFile, _check_records
from loader.errors import LoaderError

def leave_room(room):
    status = open("/proc/self/status").read()
    size = int(re.search(r"VmSize:\\s+(\\d+)", status).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + room, resource.RLIM_INFINITY))
"""


def _room_only(script: str, *args: Path) -> subprocess.CompletedProcess:
    """``script`` (:data:`_ROOM_ONLY` and its own lines) run in a process of its own, which
    must end well: what it prints is what it was told."""
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


_MAP_A_BIN_WITHOUT_ROOM = (
    _ROOM_ONLY
    + """
path = sys.argv[1]
torch.save({"w": torch.zeros(50 * 2**20)}, path)
_check_records(path)  # what the check imports and builds, before the limit
leave_room(120 * 2**20)
try:
    TorchFile(path)
except LoaderError as exc:
    print(exc.exit_code, exc.message)
"""
)


@pytest.mark.slow  # a process of its own, under a limit of its own
def test_a_bin_the_process_has_no_address_space_to_map_is_transient(tmp_path):
    """``torch.load(mmap=True)`` maps the whole file: under ``ulimit -v`` (or a container's
    limit) that leaves no room for it, it fails with "Cannot allocate memory". That was
    called a truncated or corrupt file, to be downloaded again (2); it is memory running out
    (75), and the same file maps where there is room."""
    done = _room_only(_MAP_A_BIN_WITHOUT_ROOM, tmp_path / "pytorch_model.bin")
    assert done.stdout.startswith("75 The loader ran out of memory mapping"), done.stdout
    assert "corrupt" not in done.stdout, done.stdout
    from loader.checkpoint import TorchFile

    assert TorchFile(tmp_path / "pytorch_model.bin").infos()["w"].shape == (50 * 2**20,)


_SCAN_A_BIN_WITHOUT_ROOM = (
    _ROOM_ONLY
    + """
path, small = sys.argv[1], sys.argv[2]
torch.save({"w": torch.zeros(1), "sets": [set() for _ in range(180000)]}, path)  # 3.6 MB
torch.save({"w": torch.zeros(1)}, small)
_check_records(small)  # what the check imports and builds, before the limit
leave_room(16 * 2**20)
try:
    _check_records(path)
except LoaderError as exc:
    print(exc.exit_code, exc.message)
"""
)


@pytest.mark.slow  # a process of its own, under a limit of its own
def test_a_bin_whose_tensor_list_the_process_has_no_memory_to_read_is_transient(tmp_path):
    """The tensor list of a ``.bin`` within its size limits (a pickle under 4 MiB, read into
    about 40 MB of objects) that the process has no memory left to read (``ulimit -v``, a
    container's limit) is memory running out (75); it was called a corrupt file (2). The same
    file reads where there is room."""
    path = tmp_path / "pytorch_model.bin"
    done = _room_only(_SCAN_A_BIN_WITHOUT_ROOM, path, tmp_path / "small.bin")
    assert done.stdout.startswith("75 The loader ran out of memory reading the tensor list"), (
        done.stdout
    )
    from loader.checkpoint import _check_records

    _check_records(path)


@pytest.mark.parametrize(
    ("failure", "transient"),
    [
        (f"unable to mmap 64 bytes from file </proc/self/fd/5>: {os.strerror(errno.ENOMEM)} "
         f"({errno.ENOMEM})", True),
        (f"unable to mmap 64 bytes from file </proc/self/fd/5>: {os.strerror(errno.EACCES)} "
         f"({errno.EACCES})", False),
        ("MemoryError", True),
    ],
    ids=["ENOMEM", "EACCES", "MemoryError"],
)  # fmt: skip
def test_a_bin_torch_could_not_map_for_memory_is_transient_for_another_reason_not(
    tmp_path, monkeypatch, failure, transient
):
    """``torch.load(mmap=True)`` failing with torch's own words for a map refused for memory
    (ENOMEM), or a MemoryError, is the machine's (75); refused for another reason it stays
    the file's (2). A tensor list the process has no memory to read is 75 too (the slow tests
    do both under a real address-space limit)."""
    import torch

    from loader import checkpoint
    from loader.errors import CheckpointError, ResourceExhaustedError

    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(4)}, path)

    def load(*args, **kwargs):
        raise MemoryError if failure == "MemoryError" else RuntimeError(failure)

    monkeypatch.setattr(torch, "load", load)
    expected = ResourceExhaustedError if transient else CheckpointError
    with pytest.raises(expected) as raised:
        checkpoint.TorchFile(path)
    assert transient or not isinstance(raised.value, ResourceExhaustedError)
    monkeypatch.undo()

    def no_memory(self):
        raise MemoryError

    monkeypatch.setattr(checkpoint._Storages, "load", no_memory)
    with pytest.raises(ResourceExhaustedError, match="ran out of memory reading the tensor list"):
        checkpoint.TorchFile(path)


def test_a_tokenizer_the_process_has_no_memory_to_load_is_transient(
    tiny_checkpoint_with_tokenizer, monkeypatch
):
    """Memory running out while the tokenizer is checked (its files within their limits) is
    the machine's (75), not the files' (2: "does not load"); the library's own refusal of a
    file stays the file's."""
    from loader.errors import CheckpointError, ResourceExhaustedError
    from loader.repository import layout, validate

    files = layout.tokenizer_files(tiny_checkpoint_with_tokenizer)

    def no_memory(tokenizer):
        raise MemoryError

    monkeypatch.setattr(validate, "_ids", no_memory)
    with pytest.raises(ResourceExhaustedError, match="ran out of memory loading the tokenizer"):
        validate.check_tokenizer(tiny_checkpoint_with_tokenizer, files, 10**6)
    monkeypatch.setattr(validate, "_ids", lambda tokenizer: 1 / 0)
    with pytest.raises(CheckpointError, match="does not load"):
        validate.check_tokenizer(tiny_checkpoint_with_tokenizer, files, 10**6)


@pytest.mark.parametrize(
    "code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM], ids=["EMFILE", "ENFILE", "ENOMEM"]
)
def test_a_tokenizer_the_library_has_no_descriptor_or_memory_to_open_is_transient(
    tiny_checkpoint_with_tokenizer, monkeypatch, code
):
    """The tokenizers library out of descriptors or memory raises a plain Exception whose
    message ends with the errno (``Too many open files (os error 24)``): the process's or the
    machine's limit (75, naming it), not a tokenizer that does not load (2). Another errno in
    such a message stays the file's."""
    from loader.errors import CheckpointError, LoaderError
    from loader.repository import layout, validate

    files = layout.tokenizer_files(tiny_checkpoint_with_tokenizer)

    def failing(errno_: int):
        def tokenizer_from(paths, directory):
            raise Exception(f"{os.strerror(errno_)} (os error {errno_})")  # as the library's

        return tokenizer_from

    from loader.repository.models import tokenization

    monkeypatch.setattr(tokenization, "tokenizer_from", failing(code))
    with pytest.raises(LoaderError) as raised:
        validate.check_tokenizer(tiny_checkpoint_with_tokenizer, files, 10**6)
    assert raised.value.exit_code == 75 and os.strerror(code) in raised.value.message
    monkeypatch.setattr(tokenization, "tokenizer_from", failing(errno.EACCES))
    with pytest.raises(CheckpointError, match="does not load"):
        validate.check_tokenizer(tiny_checkpoint_with_tokenizer, files, 10**6)
