"""A server whose answer to a listing or a description never ends, or trickles a byte at a
time (each read within the read timeout), against ``fetch`` from ``gs://`` and ``hf://``: the
client libraries read such answers whole, so the first grew until the kernel killed the loader
for its memory and the second held it for ever. Now an answer past
:data:`loader.sources.answers.MAX_ANSWER_BYTES` is refused (2) and one that slows below a
download's pace is retried as a cut connection until the retry deadline (75).

The bound and the pace are lowered for the test (1 MiB, 1 s) so that it takes seconds; the
code that checks them is the code that ships.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loader.sources import answers, transfer
from tests.runs import cli

URIS = {"gs": "gs://b/p", "hf": "hf://org/name"}
SETTINGS = {"gs": "STORAGE_EMULATOR_HOST", "hf": "HF_ENDPOINT"}


class _Misbehaving(BaseHTTPRequestHandler):
    """Answers every request with a JSON body that never ends (``endless``) or that arrives
    a byte every 50 ms (``trickle``); no Content-Length: the body ends when the server closes."""

    how = "endless"
    stop = threading.Event()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        try:
            self.wfile.write(b'{"items": [')
            while not self.stop.is_set():
                if self.how == "endless":
                    self.wfile.write(b'{"name": "p/x", "bucket": "b"}, ' * 2048)
                else:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.05)
        except OSError:  # the client gave up
            pass


@pytest.fixture
def server(request) -> Iterator[str]:
    handler = type("Handler", (_Misbehaving,), {"how": request.param, "stop": threading.Event()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    handler.stop.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def bounds(monkeypatch) -> None:
    monkeypatch.setattr(answers, "MAX_ANSWER_BYTES", 2**20)
    monkeypatch.setattr(transfer, "STALL_S", 1.0)


def _fetch(capsys, monkeypatch, tmp_path, scheme: str, url: str) -> tuple[int, str, float]:
    monkeypatch.setenv(SETTINGS[scheme], url)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    for name in ("HF_TOKEN", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    start = time.monotonic()
    code, _, err = cli(capsys, "fetch", URIS[scheme], str(tmp_path / "dest"),
                       "--retry-deadline", "3")  # fmt: skip
    return code, err, time.monotonic() - start


@pytest.mark.parametrize("scheme", ["gs", "hf"])
@pytest.mark.parametrize("server", ["endless"], indirect=True)
def test_an_answer_that_never_ends_is_refused_at_its_bound(
    server, bounds, scheme, capsys, monkeypatch, tmp_path
):
    code, err, _ = _fetch(capsys, monkeypatch, tmp_path, scheme, server)
    assert code == 2, err
    assert "answered with more than 1 MiB" in err and SETTINGS[scheme] in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())


@pytest.mark.parametrize("scheme", ["gs", "hf"])
@pytest.mark.parametrize("server", ["trickle"], indirect=True)
def test_an_answer_that_trickles_is_transient_at_the_retry_deadline(
    server, bounds, scheme, capsys, monkeypatch, tmp_path
):
    code, err, took = _fetch(capsys, monkeypatch, tmp_path, scheme, server)
    assert code == 75, err
    assert "Traceback" not in err and "hint:" in err, err
    assert took < 30, took  # the deadline (3 s), a stalled span (1 s) and the retries' waits
