"""The kubelet's log endpoint for every fake node: the API server proxies `kubectl logs` (the
`pods/log` subresource) to `https://<node InternalIP>:<daemonEndpoints port>/containerLogs/
<namespace>/<pod>/<container>`, and this server answers from the files the fake kubelets write
(`<namespace>_<pod>_<container>.log` in one directory; a `.done` file beside one marks the
container finished, so `follow` ends). `tailLines` and `follow` are honoured.
"""

from __future__ import annotations

import ssl
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def log_file(directory: Path, namespace: str, pod: str, container: str) -> Path:
    return directory / f"{namespace}_{pod}_{container}.log"


class LogServer:
    def __init__(self, directory: Path, cert: Path, key: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        handler = type("Handler", (_Handler,), {"directory": directory})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> LogServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    directory: Path
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            self.send_error(404)
            return
        query = urllib.parse.parse_qs(url.query)
        path = log_file(self.directory, *parts[1:])
        done = path.with_suffix(".done")
        text = path.read_text(errors="replace") if path.exists() else ""
        if "tailLines" in query:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(query["tailLines"][0]) :]) if lines else ""
        follow = query.get("follow", ["false"])[0] == "true"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = path.stat().st_size if path.exists() else 0
        if text:
            self._chunk(text.encode())
        while follow and not done.exists():
            time.sleep(0.2)
            if path.exists() and path.stat().st_size > sent:
                with path.open("rb") as f:
                    f.seek(sent)
                    more = f.read()
                sent += len(more)
                try:
                    self._chunk(more)
                except OSError:
                    return
        self.wfile.write(b"0\r\n\r\n")  # the last chunk

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
