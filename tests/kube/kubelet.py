"""A fake kubelet: it plays the kubelet's part for the pods bound to fake nodes in the
namespaces it owns, moving each pod through Pending -> Running -> Ready (or to Succeeded /
Failed) and reporting it in the pod's status the way the kubelet does
(kubernetes/pkg/kubelet/kubelet_pods.go, `generateAPIPodStatus`, `getPhase`;
pkg/kubelet/status/status_manager.go for the final delete).

What each container does comes from a rule the test sets (:meth:`FakeKubelet.rule`):

- :class:`Exit`: terminates with an exit code (after a delay),
- :class:`Serve`: runs until the pod is deleted, Ready while ``ready()`` holds (its probes),
- :class:`Run`: the container's own command runs as a local process: `sh -c` scripts (the
  busybox init container of the Triton pods) and the loader image's `model-loader`, with the
  pod's environment and each volume mount path mapped to a local directory (a PVC to the
  hostPath of its PV, an emptyDir to a fresh directory). Its exit code is the container's.

Without a rule: :class:`Run` for commands that run here, else :class:`Serve` for a pod that
restarts always, else ``Exit(0)``.

A local process gets what a container runtime gives a container, and nothing of the test
process's environment: the image's own environment (:data:`IMAGE_ENV`: its `PATH`, and the
loader image's `ENV` lines), `HOSTNAME` (the pod's name), then the container's `env`. Its output
goes to a log file the kubelet rotates as the kubelet's `containerLogMaxSize` /
`containerLogMaxFiles` do (10 MiB, 5 files; `kubectl logs` reads the newest file only).

Implemented: init containers in order, restart policies (Always / OnFailure / Never with a
1 s back-off), terminal phases, readiness conditions, pod IPs, graceful deletion (SIGTERM to
local processes, SIGKILL after the grace period, then the terminal status and the final delete
with grace period 0, as the status manager does), container logs (tests/kube/logs.py serves
them) and their rotation. Not implemented: images (their files: a local process sees this
machine's `/usr/bin`), probes' own timing (the rule decides readiness), preStop hooks, resource
enforcement and exec.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.kube.api import Api, ApiError
from tests.kube.controlplane import die_with_parent
from tests.kube.logs import log_file
from tests.kube.nodes import now

#: Namespaces a test kubelet owns carry this label (its id).
OWNER = "model-triton.test/kubelet"
#: Entrypoints of the images whose commands run here (loader/Dockerfile: ENTRYPOINT).
ENTRYPOINTS = {"model-triton-loader": ["model-loader"]}
#: Programs a container command may start locally.
LOCAL_PROGRAMS = {"sh", "/bin/sh", "model-loader"}
#: The `PATH` of a Debian or busybox image (Docker's default for an image that sets none).
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The loader image's virtualenv (loader/Dockerfile: `/opt/venv/bin`) is this virtualenv here.
_VENV_BIN = str(Path(sys.executable).parent)
#: Each image's environment (its Dockerfile's `ENV` lines), by image repository; other images
#: get :data:`IMAGE_PATH` alone. `HOME` names a path in the container: it is mapped like any
#: other value when a volume is mounted there, else it is the pod's own scratch directory.
IMAGE_ENV: dict[str, dict[str, str]] = {
    "model-triton-loader": {
        "PATH": f"{_VENV_BIN}:{IMAGE_PATH}",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": "/tmp",
    },
}
#: The kubelet's defaults: `containerLogMaxSize` 10Mi and `containerLogMaxFiles` 5.
LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_MAX_FILES = 5
KUBELET_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
BACKOFF_SECONDS = 1.0


@dataclass
class Exit:
    """The container terminates with ``code``, ``after`` seconds after it started."""

    code: int = 0
    after: float = 0.0


@dataclass
class Serve:
    """The container runs until the pod is deleted; Ready while ``ready()`` holds."""

    ready: Callable[[], bool] = lambda: True
    #: Exit code reported when it stops (SIGTERM handled: 0).
    stop_code: int = 0


@dataclass
class Run:
    """The container's own command as a local process."""


Behaviour = Exit | Serve | Run


@dataclass(frozen=True)
class Context:
    """What a rule sees: the pod, the container, whether it is an init container, and the
    attempt: how many pods of the same owner (a Job's retries) this kubelet started before."""

    pod: dict
    container: dict
    init: bool
    attempt: int
    volumes: dict[str, Path]

    @property
    def name(self) -> str:
        return self.container["name"]

    @property
    def labels(self) -> dict[str, str]:
        return self.pod["metadata"].get("labels") or {}

    def volume(self, name: str) -> Path:
        return self.volumes[name]

    def env(self) -> dict[str, str]:
        return {e["name"]: e.get("value", "") for e in self.container.get("env") or []}


Rule = Callable[[Context], Behaviour | None]


def image_repository(image: str) -> str:
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def command_of(container: dict) -> list[str]:
    """The command the runtime starts: `command` + `args`, the image's entrypoint standing in
    for a missing `command`."""
    command = container.get("command") or ENTRYPOINTS.get(image_repository(container["image"]))
    return [*(command or []), *(container.get("args") or [])]


def runs_here(container: dict) -> bool:
    command = command_of(container)
    return bool(command) and command[0] in LOCAL_PROGRAMS


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined VAR is replaced, `$$` escapes, the rest stays."""

    def one(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


def map_paths(text: str, mounts: list[tuple[str, Path]]) -> str:
    """Every mount path in ``text`` (at a path boundary) replaced by its local directory."""
    if not mounts:
        return text
    ordered = sorted(mounts, key=lambda m: -len(m[0]))
    pattern = "|".join(re.escape(path.rstrip("/")) for path, _ in ordered)
    local = {path.rstrip("/"): str(directory) for path, directory in ordered}
    # A mount path starts a path: at the start, after a separator such as `=` or `:`, or right
    # after `file://`; never inside another path or URI (`/data/models`, `gs://models/x`).
    start = r"(?:(?<=file://)|(?<![\w.\-/]))"
    return re.sub(rf"{start}({pattern})(?=/|$|[^\w.-])", lambda m: local[m[1]], text)


def container_environment(
    image: str,
    pod_name: str,
    env: dict[str, str],
    mounts: list[tuple[str, Path]],
    scratch_home: Path,
) -> dict[str, str]:
    """What a runtime starts a container with: the image's environment, `HOSTNAME`, then the
    container's own `env` (already expanded and mapped); nothing of this process's."""
    image_env = {"PATH": IMAGE_PATH, **IMAGE_ENV.get(image_repository(image), {})}
    home = image_env.pop("HOME", None)
    mapped = map_paths(home, mounts) if home else None
    if mapped is None or mapped == home:  # not on a mounted volume: the pod's scratch space
        scratch_home.mkdir(parents=True, exist_ok=True)
        mapped = str(scratch_home)
    return {**image_env, "HOME": mapped, "HOSTNAME": pod_name, **env}


def rotate_log(path: Path, max_bytes: int, max_files: int) -> bool:
    """Rotate ``path`` once it holds more than ``max_bytes``, keeping ``max_files`` files in
    all (``path`` and ``path.1`` .. ``path.<max_files - 1>``), as the kubelet's container log
    manager does. The writer keeps its descriptor (opened with O_APPEND): the newest lines are
    copied aside and the file truncated, so its next write lands at the new start."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    for n in range(max_files - 1, 1, -1):
        older = path.with_name(f"{path.name}.{n - 1}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{n}"))
    if max_files > 1:
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    with path.open("r+b") as f:
        f.truncate(0)
    return True


@dataclass
class _Container:
    spec: dict
    init: bool
    behaviour: Behaviour | None = None
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "PodInitializing"
    started: float = 0.0
    started_at: str = ""
    finished_at: str = ""
    exit_code: int | None = None
    restarts: int = 0
    restart_at: float = 0.0
    last: dict | None = None
    process: subprocess.Popen | None = None
    stop_by: float | None = None
    log_checked: float = 0.0

    @property
    def name(self) -> str:
        return self.spec["name"]

    def ready(self) -> bool:
        if self.state != "running":
            return False
        if isinstance(self.behaviour, Serve):
            try:
                return bool(self.behaviour.ready())
            except Exception:
                return False
        return True


@dataclass
class _Pod:
    uid: str
    namespace: str
    name: str
    ip: str
    attempt: int
    workdir: Path
    start_time: str = field(default_factory=now)
    volumes: dict[str, Path] = field(default_factory=dict)
    containers: list[_Container] = field(default_factory=list)
    written: dict | None = None
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)
    deleted: bool = False


class FakeKubelet:
    """Plays the kubelet for the pods in the namespaces it owns (:meth:`own`), or, with
    ``owner=None``, in every namespace no test kubelet owns (`make cluster-up`)."""

    def __init__(
        self,
        api: Api,
        workdir: Path,
        *,
        owner: str | None,
        logs: Path,
        log_max_bytes: int = LOG_MAX_BYTES,
        log_max_files: int = LOG_MAX_FILES,
    ) -> None:
        self.api = api
        self.log_max_bytes = log_max_bytes
        self.log_max_files = log_max_files
        self.workdir = workdir
        #: Container logs (`kubectl logs` reads them through tests/kube/logs.py).
        self.logs = logs
        self.owner = owner
        self.rules: list[Rule] = []
        self._namespaces: dict[str, bool] = {}
        self._pods: dict[str, dict] = {}
        self._state: dict[str, _Pod] = {}
        self._attempts: dict[str, int] = {}
        self._ips = itertools.count(2)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        #: When each thread last went round its loop (time.monotonic()).
        self._beats: dict[str, float] = {}
        self.errors: list[str] = []

    # -- set-up

    def own(self, namespace: str) -> None:
        """Create ``namespace`` (restricted Pod Security, as the chart's pods must pass) owned
        by this kubelet, or label an existing one."""
        labels = {
            OWNER: self.owner or "",
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        }
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        try:
            self.api.create({**body, "metadata": {"name": namespace, "labels": labels}})
        except ApiError as exc:
            if exc.status != 409:
                raise
            self.api.patch(f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": labels}})
        with self._lock:
            self._namespaces[namespace] = True

    def rule(self, rule: Rule) -> Rule:
        """Add a rule (usable as a decorator); later rules are asked first."""
        self.rules.insert(0, rule)
        return rule

    def remove_rule(self, rule: Rule) -> None:
        if rule in self.rules:
            self.rules.remove(rule)

    def processes(self, namespace: str) -> dict[tuple[str, str], subprocess.Popen]:
        """The running local processes of ``namespace``'s containers, by (pod, container)."""
        with self._lock:
            states = [s for s in self._state.values() if s.namespace == namespace]
        return {
            (s.name, c.name): c.process
            for s in states
            for c in s.containers
            if c.process is not None and c.process.poll() is None
        }

    def start(self) -> FakeKubelet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        for target, name in ((self._watch, "kubelet-watch"), (self._loop, "kubelet-sync")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def health(self) -> list[str]:
        """What keeps this kubelet from working, for a failure message: a thread that ended,
        or one that has not gone round its loop for longer than it ever should (the watch
        waits up to its stream's 90 s read timeout, a sync round makes a few API calls), with
        where it is stuck."""
        frames = sys._current_frames()
        problems = []
        for thread in self._threads:
            if not thread.is_alive():
                problems.append(f"kubelet thread {thread.name} has ended")
                continue
            idle = time.monotonic() - self._beats.get(thread.name, time.monotonic())
            if idle > (150 if thread.name == "kubelet-watch" else 60):
                frame = frames.get(thread.ident)
                where = "".join(traceback.format_stack(frame)[-6:]) if frame else "(no frame)"
                problems.append(f"kubelet thread {thread.name} stuck for {idle:.0f}s at:\n{where}")
        return problems

    def _beat(self) -> None:
        self._beats[threading.current_thread().name] = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            # The watch thread may sit in a stream read until the server ends it (a daemon).
            thread.join(timeout=1 if thread.name == "kubelet-watch" else 10)
        with self._lock:
            states = list(self._state.values())
        for state in states:
            for c in state.containers:
                if c.process and c.process.poll() is None:
                    c.process.kill()
                    c.process.wait()

    # -- which pods

    def _mine(self, namespace: str) -> bool:
        with self._lock:
            known = self._namespaces.get(namespace)
        if known is not None:
            return known
        if self.owner is not None:
            return False
        found = self.api.find("v1", "Namespace", None, namespace)
        mine = found is not None and OWNER not in (found["metadata"].get("labels") or {})
        with self._lock:
            self._namespaces[namespace] = mine
        return mine

    def _watch(self) -> None:
        path = "/api/v1/pods"
        params = {"fieldSelector": "spec.nodeName!="}
        while not self._stop.is_set():
            self._beat()
            try:
                listed = self.api.request("GET", path, params=params)
                seen = set()
                for pod in listed["items"]:
                    self._store("MODIFIED", pod)
                    seen.add(pod["metadata"]["uid"])
                with self._lock:
                    for uid in set(self._pods) - seen:
                        self._pods.pop(uid)
                version = listed["metadata"]["resourceVersion"]
                for event in self.api.watch(path, resource_version=version, params=params):
                    self._beat()
                    if self._stop.is_set():
                        return
                    if event["type"] == "ERROR":
                        break
                    if event["type"] != "BOOKMARK":
                        self._store(event["type"], event["object"])
            except Exception as exc:  # reconnect, relist
                if self._stop.is_set():
                    return
                self.errors.append(f"watch: {exc}")
                time.sleep(0.5)

    def _store(self, kind: str, pod: dict) -> None:
        if not self._mine(pod["metadata"]["namespace"]):
            return
        uid = pod["metadata"]["uid"]
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = pod

    # -- the sync loop

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._beat()
            with self._lock:
                pods = list(self._pods.values())
                gone = set(self._state) - set(self._pods)
            for uid in gone:
                self._forget(uid)
            for pod in pods:
                try:
                    self._sync(pod)
                except ApiError as exc:
                    if exc.status not in (404, 409):
                        self.errors.append(f"{pod['metadata']['name']}: {exc}")
                except Exception as exc:
                    self.errors.append(f"{pod['metadata']['name']}: {exc!r}")

    def _forget(self, uid: str) -> None:
        with self._lock:
            state = self._state.pop(uid, None)
        if state:
            for c in state.containers:
                if c.process and c.process.poll() is None:
                    c.process.kill()
                    c.process.wait()
            shutil.rmtree(state.workdir, ignore_errors=True)

    def _new_state(self, pod: dict) -> _Pod:
        meta, spec = pod["metadata"], pod["spec"]
        owner = next((o["uid"] for o in meta.get("ownerReferences") or []), meta["uid"])
        attempt = self._attempts.get(owner, 0)
        self._attempts[owner] = attempt + 1
        n = next(self._ips)
        workdir = Path(tempfile.mkdtemp(prefix=f"{meta['name'][:40]}-", dir=self.workdir))
        state = _Pod(
            meta["uid"],
            meta["namespace"],
            meta["name"],
            f"10.244.{n // 250}.{n % 250 + 2}",
            attempt,
            workdir,
        )
        state.volumes = self._volumes(pod, workdir)
        state.containers = [_Container(c, True) for c in spec.get("initContainers") or []]
        state.containers += [_Container(c, False) for c in spec["containers"]]
        return state

    def _volumes(self, pod: dict, workdir: Path) -> dict[str, Path]:
        """Each volume of the pod as a local directory."""
        namespace = pod["metadata"]["namespace"]
        volumes: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                claim = self.api.get(
                    "v1",
                    "PersistentVolumeClaim",
                    namespace,
                    volume["persistentVolumeClaim"]["claimName"],
                )
                pv = self.api.get("v1", "PersistentVolume", None, claim["spec"]["volumeName"])
                volumes[name] = Path(pv["spec"]["hostPath"]["path"])
                continue
            directory = workdir / "volumes" / name
            directory.mkdir(parents=True, exist_ok=True)
            source = volume.get("secret") or volume.get("configMap")
            if source is not None:
                kind = "Secret" if "secret" in volume else "ConfigMap"
                ref = source.get("secretName") or source.get("name")
                found = self.api.find("v1", kind, namespace, ref) or {}
                data = found.get("data") or {}
                for item in source.get("items") or [{"key": k, "path": k} for k in data]:
                    if item["key"] in data:
                        value = data[item["key"]]
                        if kind == "Secret":
                            import base64

                            value = base64.b64decode(value).decode()
                        (directory / item["path"]).write_text(value)
            volumes[name] = directory
        return volumes

    def _sync(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        with self._lock:
            state = self._state.get(uid)
        if state is None:
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                # Finished before this kubelet knew it: nothing to run; a deleted one goes.
                if meta.get("deletionTimestamp"):
                    self.api.delete(
                        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                        {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                    )
                return
            state = self._new_state(pod)
            with self._lock:
                self._state[uid] = state
        if meta.get("deletionTimestamp"):
            self._terminate(pod, state)
            return
        policy = spec.get("restartPolicy", "Always")
        inits = [c for c in state.containers if c.init]
        mains = [c for c in state.containers if not c.init]
        failed_init = False
        for c in inits:
            self._advance(pod, state, c, policy)
            if c.state == "terminated" and c.exit_code != 0 and policy == "Never":
                failed_init = True
                break
            if not (c.state == "terminated" and c.exit_code == 0):
                break
        else:
            for c in mains:
                self._advance(pod, state, c, policy)
        self._report(pod, state, policy, failed_init)

    def _behaviour(self, pod: dict, state: _Pod, c: _Container) -> Behaviour:
        context = Context(pod, c.spec, c.init, state.attempt, state.volumes)
        for rule in list(self.rules):
            found = rule(context)
            if found is not None:
                return found
        if runs_here(c.spec):
            return Run()
        if pod["spec"].get("restartPolicy", "Always") == "Always" and not c.init:
            return Serve()
        return Exit(0)

    def _advance(self, pod: dict, state: _Pod, c: _Container, policy: str) -> None:
        clock = time.monotonic()
        if c.state == "terminated":
            restart = policy == "Always" or (policy == "OnFailure" and c.exit_code != 0)
            if c.init and c.exit_code == 0:
                restart = False
            if not restart or clock < c.restart_at:
                return
            c.last = {"terminated": self._terminated(c)}
            c.restarts += 1
            c.state = "waiting"
        if c.state == "waiting":
            c.behaviour = self._behaviour(pod, state, c)
            c.state, c.reason = "running", ""
            c.started, c.started_at = clock, now()
            if isinstance(c.behaviour, Run):
                try:
                    c.process = self._spawn(pod, state, c)
                except OSError as exc:  # the runtime's "executable not found"
                    self.errors.append(f"{state.name}/{c.name}: {exc}")
                    self._finish(state, c, 127)
                    return
        if c.state == "running":
            code = None
            if isinstance(c.behaviour, Exit) and clock - c.started >= c.behaviour.after:
                code = c.behaviour.code
            elif isinstance(c.behaviour, Run) and c.process.poll() is not None:
                code = _exit_code(c.process.returncode)
            elif isinstance(c.behaviour, Run) and clock >= c.log_checked + 1.0:
                c.log_checked = clock
                rotate_log(
                    log_file(self.logs, state.namespace, state.name, c.name),
                    self.log_max_bytes,
                    self.log_max_files,
                )
            if code is not None:
                self._finish(state, c, code)

    def _finish(self, state: _Pod, c: _Container, code: int) -> None:
        c.state, c.exit_code, c.finished_at = "terminated", code, now()
        log_file(self.logs, state.namespace, state.name, c.name).with_suffix(".done").touch()
        c.restart_at = time.monotonic() + BACKOFF_SECONDS * (2 ** min(c.restarts, 4))

    @staticmethod
    def _terminated(c: _Container) -> dict:
        return {
            "exitCode": c.exit_code,
            "reason": "Completed" if c.exit_code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": c.finished_at,
            "containerID": f"fake://{c.name}/{c.restarts}",
        }

    # -- local processes

    def _environment(self, pod: dict, state: _Pod, c: _Container) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in c.spec.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "fieldRef" in (e.get("valueFrom") or {}):
                field_path = e["valueFrom"]["fieldRef"]["fieldPath"]
                values = {
                    "metadata.name": state.name,
                    "metadata.namespace": state.namespace,
                    "metadata.uid": state.uid,
                    "spec.nodeName": pod["spec"]["nodeName"],
                    "status.podIP": state.ip,
                    "status.hostIP": "127.0.0.1",
                }
                env[e["name"]] = values.get(field_path, "")
        return env

    def _spawn(self, pod: dict, state: _Pod, c: _Container) -> subprocess.Popen:
        mounts = [
            (m["mountPath"], state.volumes[m["name"]])
            for m in c.spec.get("volumeMounts") or []
            if m["name"] in state.volumes
        ]
        env = self._environment(pod, state, c)
        argv = [map_paths(expand(a, env), mounts) for a in command_of(c.spec)]
        local_env = {k: map_paths(v, mounts) for k, v in env.items()}
        environment = container_environment(
            c.spec["image"], state.name, local_env, mounts, state.workdir / "home"
        )
        program = shutil.which(argv[0], path=environment["PATH"])
        if program is None:
            raise FileNotFoundError(f"{argv[0]} (container {c.name}) is not on PATH")
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = log_file(self.logs, state.namespace, state.name, c.name)
        log_path.with_suffix(".done").unlink(missing_ok=True)
        log = log_path.open("ab")
        try:
            return subprocess.Popen(
                # A test run killed outright leaves no container process behind.
                die_with_parent([program, *argv[1:]]),
                env=environment,
                cwd=state.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()

    # -- deletion

    def _terminate(self, pod: dict, state: _Pod) -> None:
        grace = pod["metadata"].get("deletionGracePeriodSeconds") or 0
        clock = time.monotonic()
        for c in state.containers:
            if c.state != "running":
                continue
            if isinstance(c.behaviour, Run) and c.process is not None:
                if c.stop_by is None:
                    c.stop_by = clock + grace
                    _signal(c.process, signal.SIGTERM)
                if c.process.poll() is None and clock >= c.stop_by:
                    _signal(c.process, signal.SIGKILL)
                if c.process.poll() is None:
                    continue
                self._finish(state, c, _exit_code(c.process.returncode))
            else:
                stop_code = c.behaviour.stop_code if isinstance(c.behaviour, Serve) else 143
                self._finish(state, c, stop_code)
        if any(c.state == "running" for c in state.containers):
            return
        if state.deleted:
            return
        self._report(pod, state, pod["spec"].get("restartPolicy", "Always"), False, terminal=True)
        self.api.delete(
            f"/api/v1/namespaces/{state.namespace}/pods/{state.name}",
            {"gracePeriodSeconds": 0, "preconditions": {"uid": state.uid}},
        )
        state.deleted = True

    # -- status

    def _container_status(self, c: _Container) -> dict:
        if c.state == "running":
            current = {"running": {"startedAt": c.started_at}}
        elif c.state == "terminated":
            current = {"terminated": self._terminated(c)}
        else:
            current = {"waiting": {"reason": c.reason or "ContainerCreating"}}
        status = {
            "name": c.name,
            "image": c.spec["image"],
            "imageID": f"fake://{c.spec['image']}",
            "ready": c.ready(),
            "started": c.state == "running",
            "restartCount": c.restarts,
            "state": current,
            "lastState": c.last or {},
        }
        if c.state != "waiting":
            status["containerID"] = f"fake://{c.name}/{c.restarts}"
        return status

    def _report(
        self, pod: dict, state: _Pod, policy: str, failed_init: bool, *, terminal: bool = False
    ) -> None:
        inits = [c for c in state.containers if c.init]
        mains = [c for c in state.containers if not c.init]
        initialized = all(c.state == "terminated" and c.exit_code == 0 for c in inits)
        running = [c for c in mains if c.state == "running"]
        done = [c for c in mains if c.state == "terminated"]
        restarting = [
            c for c in done if policy == "Always" or (policy == "OnFailure" and c.exit_code)
        ]
        if failed_init:
            phase = "Failed"
        elif not initialized:
            phase = "Pending"
        elif running or (restarting and not terminal):
            phase = "Running"
        elif len(done) == len(mains):
            phase = "Succeeded" if all(c.exit_code == 0 for c in done) else "Failed"
        else:
            phase = "Pending"
        if terminal and phase not in ("Succeeded", "Failed"):
            phase = "Failed"
        ready = initialized and all(c.ready() for c in mains) and phase == "Running"
        wanted = {
            "PodReadyToStartContainers": "True",
            "Initialized": "True" if initialized else "False",
            "ContainersReady": "True" if ready else "False",
            "Ready": "True" if ready else "False",
        }
        stamp = now()
        ours = []
        for kind in KUBELET_CONDITIONS:
            status = wanted[kind]
            before = state.transitions.get(kind)
            when = before[1] if before and before[0] == status else stamp
            state.transitions[kind] = (status, when)
            ours.append(
                {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": when}
            )
        others = [
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c["type"] not in KUBELET_CONDITIONS
        ]
        status = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": state.ip,
            "podIPs": [{"ip": state.ip}],
            "startTime": state.start_time,
            "conditions": others + ours,
            "containerStatuses": [self._container_status(c) for c in mains],
        }
        if inits:
            status["initContainerStatuses"] = [self._container_status(c) for c in inits]
        if status == state.written:
            return
        self.api.patch(
            f"/api/v1/namespaces/{state.namespace}/pods/{state.name}",
            {"status": status},
            subresource="status",
        )
        state.written = status


def _exit_code(returncode: int) -> int:
    """A process killed by signal N exits 128 + N, as a container runtime reports it."""
    return 128 - returncode if returncode < 0 else returncode


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
