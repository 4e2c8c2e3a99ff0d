"""One local cluster shared by every pytest process of a run (each xdist worker included), or
kept up for people by `make cluster-up`.

A supervisor process (``python -m tests.kube serve``) owns the control plane and what stands in
for the rest of a cluster:

- the storage classes the values files name (`standard-rwx`, and a default `standard`) with a
  provisioner that backs each claim by a hostPath PersistentVolume (a local directory the fake
  kubelet maps into pods), created the way an external provisioner does it and bound by the
  real PV controller;
- the upstream CRDs of ServiceMonitor, PrometheusRule (prometheus-operator) and ScaledObject
  (KEDA), that `make kube` takes from their Go modules into `.tools/crds`;
- a general pool of two large CPU nodes, where pods without a node selector run (loader Jobs,
  `helm test` pods), and the lease heartbeats of every fake node;
- for people only: node pools like the values files' and a fake kubelet for every namespace.

Processes attach to it under a file lock (the first one starts it) and register their pid; the
supervisor stops the control plane once no registered process is alive (a run killed with
SIGKILL included). Every component dies with the supervisor (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.kube.api import Api, ApiError
from tests.kube.controlplane import ROOT, ControlPlane, ControlPlaneError, log_tail
from tests.kube.logs import LogServer
from tests.kube.nodes import (
    A2_MEGAGPU_16G,
    STAGING_2GPU,
    Heartbeats,
    control_plane_node,
    cpu_pool,
    general_pool,
    gpu_pool,
    register,
)

CRDS = ROOT / ".tools" / "crds"
PROVISIONER = "model-triton.test/hostpath"
STORAGE_CLASSES = ("standard", "standard-rwx")
TOOLS_BIN = ROOT / ".tools" / "bin"
#: How often the supervisor restarts one component that exited before it gives up.
RESTARTS = 5


@dataclass(frozen=True)
class Cluster:
    """A running cluster as its clients see it."""

    root: Path
    kubeconfig: Path
    server: str
    #: Where the fake kubelets write container logs, and the port the API server reads them at.
    logs: Path
    kubelet_port: int

    @property
    def api(self) -> Api:
        return Api.from_kubeconfig(self.kubeconfig)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for helm and kubectl: this cluster's kubeconfig, the pinned tools."""
        path = f"{TOOLS_BIN}:{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": path, **extra}


# --------------------------------------------------------------------------- clients


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return ""


def _alive(record: Path) -> bool:
    try:
        pid, started = record.read_text().split()
    except (FileNotFoundError, ValueError):
        return False
    return _start_time(int(pid)) == started


@contextlib.contextmanager
def _locked(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with (root / "lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_state(root: Path) -> dict | None:
    try:
        return json.loads((root / "state.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def attach(root: Path, *, timeout: float = 300.0) -> Cluster:
    """The cluster under ``root``, started if none runs; this process is registered as a
    client until :func:`detach`."""
    with _locked(root):
        state = _read_state(root)
        if state and state.get("failed"):
            raise ControlPlaneError(state["failed"])
        if not (state and _alive(root / "supervisor.pid")):
            state = _spawn_supervisor(root, timeout)
        clients = root / "clients"
        clients.mkdir(exist_ok=True)
        pid = os.getpid()
        (clients / str(pid)).write_text(f"{pid} {_start_time(pid)}")
    return _cluster(root, state)


def _cluster(root: Path, state: dict) -> Cluster:
    return Cluster(
        root, Path(state["kubeconfig"]), state["server"], Path(state["logs"]), state["kubelet_port"]
    )


def check(root: Path) -> None:
    """Raise :class:`ControlPlaneError` with the reason when the cluster under ``root`` has
    stopped (a component exited for good, or the supervisor died), so that a test fails with
    why, not with `connection refused`."""
    state = _read_state(root)
    if state and state.get("failed"):
        raise ControlPlaneError(state["failed"])
    if not _alive(root / "supervisor.pid"):
        tail = log_tail(root / "supervisor.log")
        raise ControlPlaneError(
            f"the cluster's supervisor is gone; {root}/supervisor.log ends:\n{tail}"
        )


def detach(root: Path) -> None:
    with _locked(root):
        (root / "clients" / str(os.getpid())).unlink(missing_ok=True)


def _spawn_supervisor(root: Path, timeout: float, *, people: bool = False) -> dict:
    (root / "state.json").unlink(missing_ok=True)
    args = [sys.executable, "-m", "tests.kube", "serve", str(root)]
    if people:
        args.append("--people")
    log = (root / "supervisor.log").open("ab")
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + timeout
    while True:
        state = _read_state(root)
        if state and state.get("failed"):
            raise ControlPlaneError(state["failed"])
        if state:
            return state
        if proc.poll() is not None:
            tail = log_tail(root / "supervisor.log")
            raise ControlPlaneError(f"the cluster supervisor exited ({proc.returncode}):\n{tail}")
        if time.monotonic() > deadline:
            proc.kill()
            raise ControlPlaneError(f"no cluster after {timeout:.0f}s: see {root}/supervisor.log")
        time.sleep(0.2)


def up(root: Path, timeout: float = 300.0) -> Cluster:
    """`make cluster-up`: a cluster for people, kept until :func:`down`."""
    with _locked(root):
        state = _read_state(root)
        if state and not state.get("failed") and _alive(root / "supervisor.pid"):
            return _cluster(root, state)
        for old in root.glob("cluster-*"):  # stopped clusters: their data and logs go
            shutil.rmtree(old, ignore_errors=True)
        state = _spawn_supervisor(root, timeout, people=True)
    return _cluster(root, state)


def down(root: Path, timeout: float = 60.0) -> bool:
    """Stop the supervisor under ``root``; False when none ran."""
    record = root / "supervisor.pid"
    if not _alive(record):
        return False
    pid = int(record.read_text().split()[0])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(record) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(record):
        os.kill(pid, signal.SIGKILL)
    return True


# --------------------------------------------------------------------------- the supervisor


class Supervisor:
    def __init__(self, root: Path, *, people: bool) -> None:
        self.root = root
        self.people = people
        self.instance = root / f"cluster-{uuid.uuid4().hex[:8]}"
        self.plane = ControlPlane(self.instance)
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.kubelet = None
        self.heartbeats: Heartbeats | None = None
        self.log_server: LogServer | None = None
        self.restarts: dict[str, int] = {}

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        pid = os.getpid()
        (self.root / "supervisor.pid").write_text(f"{pid} {_start_time(pid)}")
        try:
            self.plane.start()
            self.log_server = LogServer(
                self.instance / "pod-logs", self.plane.ca, self.plane.pki / "apiserver.key"
            ).start()
            api = Api.from_kubeconfig(self.plane.kubeconfig)
            self._storage(api)
            self._crds(api)
            register(api, general_pool(), kubelet_port=self.log_server.port)
            self.heartbeats = Heartbeats(api).start()
            self._thread(self._provision, api)
            if self.people:
                self._people(api)
        except Exception as exc:
            traceback.print_exc()
            where = f"(traceback in {self.root / 'supervisor.log'}, logs in {self.plane.logs})"
            self._write_state({"failed": f"{type(exc).__name__}: {exc} {where}"})
            self._shutdown()
            return 1
        stable = self.root / "kubeconfig"  # one path for people: `.cluster/kubeconfig`
        stable.unlink(missing_ok=True)
        stable.symlink_to(self.plane.kubeconfig)
        self._write_state(
            {
                "kubeconfig": str(self.plane.kubeconfig),
                "server": self.plane.server,
                "logs": str(self.log_server.directory),
                "kubelet_port": self.log_server.port,
            }
        )
        print(f"cluster up: {self.plane.server} (kubeconfig {self.plane.kubeconfig})", flush=True)
        while not self.stopping.wait(1.0):
            failure = self._supervise()
            if failure:
                # Every client learns why at its next test (tests/kube/fixtures.py: `check`).
                self._write_state({"failed": failure})
                print(failure, flush=True)
                break
            if not self.people and self._no_clients():
                break
        self._shutdown()
        return 0

    def _supervise(self) -> str:
        """Restart a component that exited, as a kubelet restarts a static pod, at most
        :data:`RESTARTS` times each; the reason the cluster cannot go on, or ""."""
        for name, code in self.plane.exited().items():
            tail = log_tail(self.plane.logs / f"{name}.log", 20)
            count = self.restarts.get(name, 0) + 1
            self.restarts[name] = count
            if count > RESTARTS:
                return f"the control plane stopped: {name} exited ({code}) {count} times; its log ends:\n{tail}"
            print(
                f"{name} exited ({code}); restart {count} of {RESTARTS}. Its log ended:\n{tail}",
                flush=True,
            )
            try:
                self.plane.restart(name)
            except ControlPlaneError as exc:
                return f"the control plane stopped: {name} exited ({code}) and {exc}; its log ended:\n{tail}"
        return ""

    def _write_state(self, state: dict) -> None:
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.root / "state.json")

    def _no_clients(self) -> bool:
        with _locked(self.root):
            clients = list((self.root / "clients").glob("*"))
            for record in clients:
                if not _alive(record):
                    record.unlink(missing_ok=True)
            if any(_alive(r) for r in clients):
                return False
            (self.root / "state.json").unlink(missing_ok=True)
            return True

    def _shutdown(self) -> None:
        self.stopping.set()
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.heartbeats is not None:
            self.heartbeats.stop()
        for thread in self.threads:
            thread.join(timeout=10)
        if self.log_server is not None:
            self.log_server.stop()
        self.plane.stop()
        own = resource.getrusage(resource.RUSAGE_SELF)
        components = resource.getrusage(resource.RUSAGE_CHILDREN)  # the stopped processes
        print(
            f"cluster stopped; CPU seconds: components {components.ru_utime + components.ru_stime:.0f},"
            f" supervisor {own.ru_utime + own.ru_stime:.0f}",
            flush=True,
        )

    def _thread(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    # -- what a cluster provides

    def _storage(self, api: Api) -> None:
        for name in STORAGE_CLASSES:
            annotations = {}
            if name == "standard":
                annotations["storageclass.kubernetes.io/is-default-class"] = "true"
            api.apply(
                {
                    "apiVersion": "storage.k8s.io/v1",
                    "kind": "StorageClass",
                    "metadata": {"name": name, "annotations": annotations},
                    "provisioner": PROVISIONER,
                    "reclaimPolicy": "Delete",
                    "volumeBindingMode": "Immediate",
                }
            )

    def _crds(self, api: Api) -> None:
        files = sorted(CRDS.glob("*.yaml"))
        if not files:
            raise ControlPlaneError(f"no CRDs in {CRDS}: run `make kube`")
        names = []
        for path in files:
            crd = yaml.safe_load(path.read_text())
            api.apply(crd)
            names.append(crd["metadata"]["name"])
        for name in names:
            api.wait_for(
                f"CRD {name} established",
                lambda name=name: any(
                    c["type"] == "Established" and c["status"] == "True"
                    for c in api.get(
                        "apiextensions.k8s.io/v1", "CustomResourceDefinition", None, name
                    )
                    .get("status", {})
                    .get("conditions")
                    or []
                ),
                timeout=60,
            )

    def _provision(self, api: Api) -> None:
        """An external provisioner for the storage classes above: a hostPath PV per claim,
        its directory removed when the released PV is deleted."""
        volumes = self.instance / "volumes"
        volumes.mkdir(exist_ok=True)
        while not self.stopping.wait(0.3):
            try:
                for claim in api.list("v1", "PersistentVolumeClaim"):
                    annotations = claim["metadata"].get("annotations") or {}
                    wanted = annotations.get("volume.kubernetes.io/storage-provisioner")
                    if wanted == PROVISIONER and not claim["spec"].get("volumeName"):
                        self._provision_one(api, claim, volumes)
                for pv in api.list("v1", "PersistentVolume"):
                    ours = (pv["metadata"].get("annotations") or {}).get(
                        "pv.kubernetes.io/provisioned-by"
                    ) == PROVISIONER
                    if ours and pv.get("status", {}).get("phase") == "Released":
                        api.delete(f"/api/v1/persistentvolumes/{pv['metadata']['name']}")
                        shutil.rmtree(pv["spec"]["hostPath"]["path"], ignore_errors=True)
            except Exception as exc:
                print(f"provisioner: {exc}", flush=True)

    @staticmethod
    def _provision_one(api: Api, claim: dict, volumes: Path) -> None:
        meta = claim["metadata"]
        name = f"pvc-{meta['uid']}"
        directory = volumes / name
        directory.mkdir(exist_ok=True)
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": name,
                "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
            },
            "spec": {
                "capacity": {"storage": claim["spec"]["resources"]["requests"]["storage"]},
                "accessModes": claim["spec"]["accessModes"],
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": claim["spec"].get("storageClassName", ""),
                "claimRef": {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
                "hostPath": {"path": str(directory), "type": "Directory"},
            },
        }
        try:
            api.create(pv)
        except ApiError as exc:
            if exc.status != 409:
                raise

    def _people(self, api: Api) -> None:
        """The node pools of the values files, and a kubelet for every namespace."""
        from tests.kube.kubelet import FakeKubelet

        accelerator = {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"}
        production = {**accelerator, "node.kubernetes.io/instance-type": "a2-megagpu-16g"}
        register(
            api,
            [
                control_plane_node("control-plane"),
                *cpu_pool("cpu", 2),
                *gpu_pool("staging-gpu", 1, STAGING_2GPU, accelerator),
                *gpu_pool("a2-megagpu-16g", 2, A2_MEGAGPU_16G, production),
            ],
            kubelet_port=self.log_server.port,
        )
        self.kubelet = FakeKubelet(
            api, self.instance / "kubelet", owner=None, logs=self.log_server.directory
        ).start()
