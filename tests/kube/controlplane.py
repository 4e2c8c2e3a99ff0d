"""The real Kubernetes control plane, started from the binary `make kube` builds
(``tools/kube``): etcd, kube-apiserver, kube-controller-manager and kube-scheduler, each the
upstream command with its default profile, on 127.0.0.1 ports the kernel picks.

Layout of the work directory::

    pki/         the API server's serving certificate (and its CA), the service-account key
    tokens.csv   static bearer tokens: an admin (system:masters), the controller manager and
                 the scheduler (their bootstrap RBAC identities)
    kubeconfig   the admin's, for helm and kubectl; *.kubeconfig: the components'
    etcd/        etcd's data
    logs/        one log per component, kept for failures
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import socket
import subprocess
import time
import warnings
from pathlib import Path

import requests
import urllib3
import yaml

ROOT = Path(__file__).resolve().parents[2]
BINARY = ROOT / ".tools" / "bin" / "kube"
#: The Kubernetes release the binary is built from (tools/kube/go.mod).
VERSION = "v1.35.4"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
#: The components that keep no state of their own: restarted when they exit.
CONTROLLERS = ("kube-controller-manager", "kube-scheduler")
SERVICE_CIDR = "10.96.0.0/16"
BUILD_HINT = "run `make kube` (builds .tools/bin/kube from tools/kube, once)"
#: The sources scripts/tools/install-kube.sh builds the binary from (their hash: its stamp).
SOURCES = ROOT / "tools" / "kube"


def sources_stamp(sources: Path = SOURCES) -> str:
    """What scripts/tools/install-kube.sh writes to ``kube.stamp`` next to the binary it
    builds: the SHA-256 of go.mod, go.sum and the *.go files, in that order."""
    files = [sources / "go.mod", sources / "go.sum", *sorted(sources.glob("*.go"))]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def stale(binary: Path, sources: Path = SOURCES) -> bool:
    """The binary was built from other sources than ``sources`` (say, before a pull that
    changed the flags the control plane passes): its stamp says so. No stamp: not known."""
    try:
        built = (binary.parent / "kube.stamp").read_text().strip()
    except FileNotFoundError:
        return False
    return built != sources_stamp(sources)


class ControlPlaneError(RuntimeError):
    """A component did not start; the message names it and the tail of its log."""


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` started so that it receives SIGTERM when the thread that started it ends (even
    by SIGKILL of the test run): util-linux's ``setpriv --pdeathsig`` sets PR_SET_PDEATHSIG and
    then executes it, so no Python runs in the forked child (a ``preexec_fn`` does, after a
    fork of this many-threaded process, and can deadlock there on a lock another thread held:
    the parent's ``Popen`` then never returns). Without ``setpriv`` (not a Debian system),
    ``argv`` as it is: a test run killed outright may then leave processes behind."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else list(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def kubeconfig(server: str, ca: Path, token: str, user: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }


class ControlPlane:
    """Start with :meth:`start`, stop with :meth:`stop`; ``kubeconfig`` is the admin's."""

    def __init__(self, workdir: Path, binary: Path = BINARY) -> None:
        self.workdir = workdir
        self.binary = binary
        self.logs = workdir / "logs"
        self.pki = workdir / "pki"
        self.kubeconfig = workdir / "kubeconfig"
        self.ca = self.pki / "apiserver.crt"
        self.processes: dict[str, subprocess.Popen] = {}
        self.server = ""
        self.token = ""
        self.etcd_url = ""
        #: The `/healthz` port of each of :data:`CONTROLLERS`.
        self.health_ports: dict[str, int] = {}

    # -- processes

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            die_with_parent([str(self.binary), name, *args]),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        log.close()
        self.processes[name] = proc
        return proc

    def _failed(self, name: str, why: str) -> ControlPlaneError:
        tail = log_tail(self.logs / f"{name}.log")
        return ControlPlaneError(f"{name} {why}; {self.logs / name}.log ends:\n{tail}")

    def _check_alive(self) -> None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise self._failed(name, f"exited with {proc.returncode}")

    # -- start

    def start(self, timeout: float = 240.0) -> None:
        if not self.binary.exists():
            raise ControlPlaneError(f"{self.binary} is missing: {BUILD_HINT}")
        if stale(self.binary):
            raise ControlPlaneError(
                f"{self.binary} was built from other sources than {SOURCES}: {BUILD_HINT}"
            )
        for d in (self.logs, self.pki):
            d.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        try:
            self._pki()
            etcd_url = self._start_etcd(deadline)
            self._start_apiserver(etcd_url, deadline)
            self._start_controllers()
            self._wait_leaders(deadline)
        except BaseException:
            self.stop()
            raise

    def _pki(self) -> None:
        subprocess.run(
            [str(self.binary), "pki", "--dir", str(self.pki), "--host", "127.0.0.1"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        tokens = {
            "admin": (secrets.token_hex(16), "system:masters"),
            "system:kube-controller-manager": (secrets.token_hex(16), ""),
            "system:kube-scheduler": (secrets.token_hex(16), ""),
        }
        lines = [f'{tok},{user},{user},"{groups}"' for user, (tok, groups) in tokens.items()]
        tokens_file = self.workdir / "tokens.csv"
        tokens_file.write_text("\n".join(lines) + "\n")
        tokens_file.chmod(0o600)
        self.token = tokens["admin"][0]
        self._tokens = tokens

    def _start_etcd(self, deadline: float) -> str:
        url_file = self.workdir / "etcd.url"
        url_file.unlink(missing_ok=True)
        self._spawn("etcd", ["--data-dir", str(self.workdir / "etcd"), "--url-file", str(url_file)])
        while not url_file.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise self._failed("etcd", "did not serve in time")
            time.sleep(0.1)
        return url_file.read_text().strip()

    def _start_apiserver(self, etcd_url: str, deadline: float) -> None:
        for attempt in range(3):
            port = _free_port()
            self.server = f"https://127.0.0.1:{port}"
            self.etcd_url = etcd_url
            proc = self._spawn("kube-apiserver", self._apiserver_args(str(port)))
            try:
                self._wait_ready(proc, deadline)
                break
            except ControlPlaneError:
                # Another process may have taken the port between the probe and the bind.
                log = log_tail(self.logs / "kube-apiserver.log", 60)
                if attempt < 2 and "address already in use" in log:
                    proc.kill()
                    proc.wait()
                    continue
                raise
        self.kubeconfig.write_text(
            yaml.safe_dump(kubeconfig(self.server, self.ca, self.token, "admin"))
        )

    def _apiserver_args(self, port: str) -> list[str]:
        etcd_url = self.etcd_url
        return [
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--tls-cert-file={self.pki / 'apiserver.crt'}",
            f"--tls-private-key-file={self.pki / 'apiserver.key'}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.pki / 'sa.key'}",
            f"--service-account-signing-key-file={self.pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # `kubectl logs` goes to the nodes' InternalIP (127.0.0.1), where the
            # fake kubelets' log endpoint listens (tests/kube/logs.py).
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false",
            "--v=1",
        ]

    def _wait_ready(self, proc: subprocess.Popen, deadline: float) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        while True:
            if proc.poll() is not None:
                raise self._failed("kube-apiserver", f"exited with {proc.returncode}")
            try:
                r = requests.get(
                    f"{self.server}/readyz", headers=headers, verify=str(self.ca), timeout=5
                )
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise self._failed("kube-apiserver", "not ready (/readyz) in time")
            time.sleep(0.25)

    def _component_kubeconfig(self, user: str) -> Path:
        path = self.workdir / f"{user.split(':')[-1]}.kubeconfig"
        token = self._tokens[user][0]
        path.write_text(yaml.safe_dump(kubeconfig(self.server, self.ca, token, user)))
        path.chmod(0o600)
        return path

    def _controller_args(self, name: str) -> list[str]:
        """The arguments of the controller manager or the scheduler.

        Each runs as the one instance there is, without leader election
        (`--leader-elect=false`, as single-node clusters run them): with it, a component that
        cannot renew its lease within the 10 s renew deadline, as happens on two loaded cores,
        stops leading and exits. Each serves `/healthz` on a loopback port of its own (always
        allowed without credentials, `--authorization-always-allow-paths`' default), which is
        how :meth:`start` knows it runs and :meth:`healthy` knows it still answers."""
        user = f"system:{name}"
        config = self._component_kubeconfig(user)
        port = self.health_ports.setdefault(name, _free_port())
        args = [
            f"--kubeconfig={config}",
            f"--authentication-kubeconfig={config}",
            f"--authorization-kubeconfig={config}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ]
        if name == "kube-controller-manager":
            args += [
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={self.ca}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--cluster-name=model-triton-test",
                # The fake nodes' leases are renewed every 10 s by a thread of the supervisor;
                # on a loaded machine a renewal can come late. A node is marked NotReady (and
                # its pods evicted later) only after 2 minutes of silence, not 50 s.
                "--node-monitor-grace-period=2m",
                # Many tests create namespaces, Deployments and Jobs at once: the client-side
                # rate limit (20/s by default) would queue the controllers' own calls.
                "--kube-api-qps=100",
                "--kube-api-burst=200",
                # The HorizontalPodAutoscaler controller acts on a changed autoscaler no sooner
                # than one sync period after the change (its queue's rate limit is the period,
                # 15 s by default): a test that waits for it to apply new bounds waits that long
                # each time. What it does at each sync is the same.
                "--horizontal-pod-autoscaler-sync-period=2s",
                # A Job's failed pod is replaced after 1 s, then 2 s, 4 s...: upstream's 10 s,
                # 20 s... would be most of the wait of a test of retries (tools/kube's flag).
                "--job-pod-failure-backoff=1s",
            ]
        return args

    def _start_controllers(self) -> None:
        for name in CONTROLLERS:
            self._spawn(name, self._controller_args(name))

    def _wait_leaders(self, deadline: float) -> None:
        """The controller manager and the scheduler answer `/healthz`; the service-account
        controller has made `default/default`."""
        for name in CONTROLLERS:
            while not self._component_healthy(name):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise self._failed(name, "not healthy (/healthz) in time")
                time.sleep(0.25)
        headers = {"Authorization": f"Bearer {self.token}"}
        path = "/api/v1/namespaces/default/serviceaccounts/default"
        while True:
            self._check_alive()
            try:
                r = requests.get(
                    self.server + path, headers=headers, verify=str(self.ca), timeout=5
                )
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise self._failed("kube-controller-manager", f"has not made {path} in time")
            time.sleep(0.25)

    def _component_healthy(self, name: str, timeout: float = 5.0) -> bool:
        url = f"https://127.0.0.1:{self.health_ports[name]}/healthz"
        try:
            with warnings.catch_warnings():
                # The component's serving certificate is self-signed, made at its start.
                warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
                return requests.get(url, verify=False, timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    # -- supervision

    def restart(self, name: str) -> subprocess.Popen:
        """Start ``name`` again with the arguments it had: the API server on its port (etcd
        keeps the state), the controller manager or the scheduler (they keep none). etcd is not
        restarted: its port, and so the API server's `--etcd-servers`, would change."""
        if name == "kube-apiserver":
            proc = self._spawn(name, self._apiserver_args(self.server.rsplit(":", 1)[1]))
            self._wait_ready(proc, time.monotonic() + 120)
            return proc
        if name in CONTROLLERS:
            self.health_ports[name] = _free_port()  # its old port may be why it exited
            return self._spawn(name, self._controller_args(name))
        raise ControlPlaneError(f"{name} cannot be restarted: the control plane stops")

    def exited(self) -> dict[str, int]:
        """The components that have exited, with their exit codes."""
        return {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}

    # -- stop

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM in reverse start order, SIGKILL after ``timeout``."""
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.processes.clear()

    def alive(self) -> bool:
        return bool(self.processes) and all(p.poll() is None for p in self.processes.values())

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
