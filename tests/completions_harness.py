"""The completions service as users run it: ``python -m completions_service`` in a process of
its own, on a free port of 127.0.0.1, in front of a real Triton."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from loader.serving import TritonServer, restricted_protocols
from tests.servers import free_port
from tests.stalled import as_a_shell_starts

ROOT = Path(__file__).resolve().parent.parent


def triton_access(triton: TritonServer, directory: Path) -> list[str]:
    """The flags the chart gives the service for a Triton that runs the chart's arguments:
    with Triton's model-config protocol restricted to the admin header (the chart's default),
    that header and a file holding its token (the chart mounts the admin Secret there)."""
    restricted = restricted_protocols(triton.pod_args)
    if "model-config" not in restricted:
        return []
    header, token = restricted["model-config"]
    token_file = directory / f"triton-token-{free_port()}"
    token_file.write_text(token)
    token_file.chmod(0o600)
    return ["--triton-protocol-header", header, "--triton-protocol-token-file", str(token_file)]


class CompletionsService:
    """``with CompletionsService(triton, log=path, extra=[...]) as svc: svc.url``

    ``triton``: a started :class:`TritonServer` (the service gets its gRPC address and the
    access the chart gives it, :func:`triton_access`), or a bare gRPC address (no header).
    ``blocked``: signals the service starts with blocked (:func:`tests.stalled.as_a_shell_starts`);
    ``as_a_shell``: started with the dispositions a shell gives it (also with ``blocked``), not
    those the test process inherited (``nohup``); ``env``: set in its environment."""

    def __init__(
        self,
        triton: TritonServer | str,
        *,
        log: Path,
        extra: list[str] | None = None,
        blocked: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
        as_a_shell: bool = False,
    ) -> None:
        access: list[str] = []
        if isinstance(triton, TritonServer):
            access = triton_access(triton, log.parent)
            triton = triton.grpc_url
        self.triton_grpc = triton
        self.log = log
        self.extra = [*access, *(extra or [])]
        self.blocked = blocked
        self.env = env or {}
        self.as_a_shell = as_a_shell or bool(blocked)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> CompletionsService:
        cmd = [
            sys.executable, "-m", "completions_service",
            "--triton-url", f"grpc://{self.triton_grpc}",
            "--listen", f"127.0.0.1:{self.port}", "--log-level", "warning", *self.extra,
        ]  # fmt: skip
        if self.as_a_shell:
            cmd = as_a_shell_starts(cmd, blocked=self.blocked)
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health/live", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        raise RuntimeError(f"the service did not answer: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> CompletionsService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as response:
            text = response.read().decode()
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0
