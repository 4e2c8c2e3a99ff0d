"""A command stopped while its download stalls: a Cloud Storage stand-in that lists two
objects and never answers a download, the command started as a shell starts it, and what it
did once sent a signal (or anything else) in the middle of that wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

from loader.cli.supervise import FORWARDED
from tests.runs import run_argv

ROOT = Path(__file__).resolve().parents[1]

#: The dispositions an interactive shell gives a command it starts: the signals the tests
#: send are not ignored, whatever the test process inherited (``nohup`` ignores SIGHUP, a
#: script's background job SIGINT, and an ignored signal stays ignored across ``exec``); and a
#: child killed by SIGSEGV dumps no core. A program of its own that then executes the command
#: (same pid): no Python of the many-threaded test process runs in a forked child, where it
#: could deadlock on a lock another thread held at the fork. ``sys.argv[1]``: the signals
#: (comma-separated numbers) it starts the command with blocked, as a parent's thread that
#: blocks them leaves them across ``exec``.
_AS_A_SHELL = (
    "import os, resource, signal, sys\n"
    f"for sig in {[int(s) for s in FORWARDED]}:\n"
    "    signal.signal(sig, signal.SIG_DFL)\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, [int(s) for s in sys.argv[1].split(',') if s])\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def as_a_shell_starts(argv: list[str], *, blocked: tuple[int, ...] = ()) -> list[str]:
    """``argv`` started with the signal dispositions an interactive shell gives a command, and
    the signals ``blocked`` blocked."""
    return [sys.executable, "-c", _AS_A_SHELL, ",".join(str(int(s)) for s in blocked), *argv]


def stalled_storage() -> tuple[ThreadingHTTPServer, threading.Event, threading.Event]:
    """A Cloud Storage JSON API stand-in that lists two objects under ``gs://b/p`` and then
    never answers a download (it accepts the request and sends nothing); the event is set once
    a download was asked for, and ``release`` ends the stalled answers."""
    asked, release = threading.Event(), threading.Event()
    listed = [("p/config.json", 200), ("p/model.safetensors", 1 << 20)]

    class Stalling(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if "alt=media" in self.path:
                asked.set()
                release.wait(300)
                return
            # A checksum each: an object without one is refused before any download.
            items = [{"kind": "storage#object", "name": name, "bucket": "b", "size": str(size),
                      "generation": "1", "updated": "2024-01-01T00:00:00Z", "crc32c": "AAAAAA=="}
                     for name, size in listed]  # fmt: skip
            body = json.dumps({"kind": "storage#objects", "items": items}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, asked, release


def gcs_env(server: ThreadingHTTPServer) -> dict[str, str]:
    """The environment of a command that reads ``gs://`` from ``server``, no credentials."""
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{server.server_address[1]}"}  # fmt: skip
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    return env


def stalled_argv(command: str, tmp_path: Path) -> list[str]:
    """``fetch`` into ``tmp_path/dest`` or ``run`` into ``tmp_path/root``, from ``gs://b/p``."""
    argv = {"fetch": ["fetch", "gs://b/p", str(tmp_path / "dest")],
            "run": run_argv("gs://b/p", tmp_path / "root")}[command]  # fmt: skip
    return [sys.executable, "-m", "loader", *argv, "--retry-deadline", "600", "-q"]


class Stopped(NamedTuple):
    code: int
    out: str
    err: str
    #: Seconds from ``send`` to the command's end.
    took: float


def stopped_while_stalled(
    tmp_path: Path,
    command: str,
    send: Callable[[subprocess.Popen], None],
    *,
    env: dict[str, str] | None = None,
    blocked: tuple[int, ...] = (),
    **popen: object,
) -> Stopped:
    """Start ``command`` (with the signals ``blocked`` blocked) on a storage whose downloads
    stall, call ``send(proc)`` once a download was asked for and the main thread waits for it;
    what the command did (standard output and error as far as they are piped)."""
    server, asked, release = stalled_storage()
    try:
        proc = subprocess.Popen(
            as_a_shell_starts(stalled_argv(command, tmp_path), blocked=blocked), text=True,
            env={**gcs_env(server), **(env or {})},
            **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen},
        )  # fmt: skip
        return sent_once_asked(proc, asked, send, "no download was asked for")
    finally:
        release.set()
        server.shutdown()


def sent_once_asked(
    proc: subprocess.Popen,
    asked: threading.Event,
    send: Callable[[subprocess.Popen], None],
    never: str,
) -> Stopped:
    """Once a stalled server was ``asked`` (else the test fails with ``never``) and the
    command's main thread waits for its answer, ``send(proc)``; what the command did then
    (killed, if it had not ended, whatever failed meanwhile)."""
    try:
        assert asked.wait(120), never
        time.sleep(0.5)  # the main thread is in its wait for the answer
        send(proc)
        start = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Stopped(proc.returncode, out or "", err or "", took)
