"""The fake kubelet's container-command handling, without a cluster: Kubernetes' `$(VAR)`
expansion and the mapping of volume mount paths to local directories (tests/kube/kubelet.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kube.kubelet import command_of, expand, map_paths, runs_here

MOUNTS = [("/models", Path("/local/pv")), ("/tmp", Path("/local/scratch"))]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "1"),
        ("x$(A)y$(B)", "x1y2"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(A)", "$(A)"),
        ("$$$(A)", "$1"),
        ("$A", "$A"),
        ("--model=$(A)", "--model=1"),
    ],
)
def test_expansion_follows_kubernetes(text, expected):
    assert expand(text, {"A": "1", "B": "2"}) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/models", "/local/pv"),
        ("/models/", "/local/pv/"),
        ("/models/codegen@v1/.ready", "/local/pv/codegen@v1/.ready"),
        ("--repository=/models", "--repository=/local/pv"),
        ("file:///models/ckpt", "file:///local/pv/ckpt"),
        ("HF_HOME=/tmp/huggingface", "HF_HOME=/local/scratch/huggingface"),
        ("a:/tmp:/models", "a:/local/scratch:/local/pv"),
        # Not a mount path: inside another path or URI, or a longer name.
        ("gs://models/codegen", "gs://models/codegen"),
        ("hf://org/models", "hf://org/models"),
        ("/data/models", "/data/models"),
        ("/modelsx", "/modelsx"),
        ("/models.bak", "/models.bak"),
        ("models", "models"),
    ],
)
def test_mount_paths_are_mapped_only_where_they_start_a_path(text, expected):
    assert map_paths(text, MOUNTS) == expected


def test_the_longest_mount_path_wins():
    mounts = [("/models", Path("/a")), ("/models/cache", Path("/b"))]
    assert map_paths("/models/cache/x /models/y", mounts) == "/b/x /a/y"


def test_the_loader_image_entrypoint_stands_in_for_a_missing_command():
    loader = {"image": "registry.example/model-triton-loader:0.1.0@sha256:ab", "args": ["run"]}
    assert command_of(loader) == ["model-loader", "run"]
    assert runs_here(loader)
    triton = {"image": "model-triton-ft:23.05", "command": ["tritonserver", "--x"]}
    assert not runs_here(triton)
    assert not runs_here({"image": "unknown:1", "args": ["x"]})


# --------------------------------------------------------------------------- the supervisor


def test_a_cluster_that_cannot_go_on_fails_the_next_test_with_its_reason(tmp_path):
    from tests.kube.cluster import check
    from tests.kube.controlplane import ControlPlaneError

    (tmp_path / "state.json").write_text(
        '{"failed": "the control plane stopped: etcd exited (1) 6 times; its log ends: disk full"}'
    )
    with pytest.raises(ControlPlaneError, match=r"etcd exited .* disk full"):
        check(tmp_path)
    (tmp_path / "state.json").write_text('{"server": "https://127.0.0.1:1"}')
    (tmp_path / "supervisor.log").write_text("Traceback ...\nMemoryError\n")
    with pytest.raises(ControlPlaneError, match=r"supervisor is gone(.|\n)*MemoryError"):
        check(tmp_path)


class _Plane:
    """What the supervisor reads of a control plane: which components exited, and restarts."""

    def __init__(self, logs: Path, exits: list[dict[str, int]], fails: set[str] = frozenset()):
        self.logs = logs
        self.exits = exits
        self.fails = fails
        self.restarted: list[str] = []

    def exited(self) -> dict[str, int]:
        return self.exits.pop(0) if self.exits else {}

    def restart(self, name: str) -> None:
        from tests.kube.controlplane import ControlPlaneError

        if name in self.fails:
            raise ControlPlaneError(f"{name} cannot be restarted")
        self.restarted.append(name)


def _supervisor(tmp_path: Path, plane: _Plane):
    from tests.kube.cluster import Supervisor

    supervisor = Supervisor(tmp_path, people=False)
    supervisor.plane = plane
    return supervisor


def test_the_supervisor_restarts_a_component_that_exits_and_gives_up_with_its_log(tmp_path):
    from tests.kube.cluster import RESTARTS

    (tmp_path / "kube-controller-manager.log").write_text("leaderelection lost\n")
    exits = [{"kube-controller-manager": 1}] * (RESTARTS + 1)
    plane = _Plane(tmp_path, list(exits))
    supervisor = _supervisor(tmp_path, plane)
    for _ in range(RESTARTS):
        assert supervisor._supervise() == ""
    assert plane.restarted == ["kube-controller-manager"] * RESTARTS
    reason = supervisor._supervise()
    assert f"kube-controller-manager exited (1) {RESTARTS + 1} times" in reason
    assert "leaderelection lost" in reason


def test_a_binary_built_from_other_sources_is_refused_with_the_build_hint(tmp_path):
    """A binary older than tools/kube (the flags the control plane passes changed since) is
    named with what to run, before a component fails on a flag it does not know."""
    from tests.kube.controlplane import ControlPlane, ControlPlaneError, sources_stamp, stale

    binary = tmp_path / "bin" / "kube"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    stamp = binary.parent / "kube.stamp"
    stamp.write_text("0" * 64 + "\n")
    with pytest.raises(ControlPlaneError, match=r"built from other sources .*`make kube`"):
        ControlPlane(tmp_path / "plane", binary).start()
    assert not (tmp_path / "plane" / "logs").exists()  # refused before anything started
    stamp.write_text(sources_stamp() + "\n")
    assert not stale(binary)
    stamp.unlink()  # built some other way: not known, not refused
    assert not stale(binary)


def test_the_supervisor_stops_with_the_reason_when_etcd_exits(tmp_path):
    (tmp_path / "etcd.log").write_text("no space left on device\n")
    plane = _Plane(tmp_path, [{"etcd": 2}], fails={"etcd"})
    reason = _supervisor(tmp_path, plane)._supervise()
    assert "etcd exited (2)" in reason and "no space left on device" in reason
    assert plane.restarted == []


@pytest.mark.server
def test_a_killed_scheduler_is_restarted_and_schedules_again(sandbox):
    """Fault injection on the shared cluster: SIGKILL the scheduler; the supervisor restarts it
    and a new pod is bound to a node."""
    import os
    import signal

    from tests import procs
    from tests.kube import nodes as fake

    instance = sandbox.cluster.kubeconfig.parent
    marker = f"--kubeconfig={instance / 'kube-scheduler.kubeconfig'}"
    [pid] = [
        pid
        for pid, argv in procs.command_lines()
        if marker.encode() in argv and b"kube-scheduler" in argv
    ]
    os.kill(pid, signal.SIGKILL)
    [node] = sandbox.register([fake.FakeNode("cpu", fake.CPU_NODE)])
    sandbox.api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "after-restart", "namespace": sandbox.namespace},
            "spec": {
                "nodeSelector": {fake.FENCE: sandbox.fence},
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": 1000,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "containers": [
                    {
                        "name": "c",
                        "image": "busybox:1.37.0",
                        "command": ["sleep", "3600"],
                        "securityContext": {
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                        },
                    }
                ],
            },
        }
    )
    sandbox.wait(
        "the pod is bound after the scheduler's restart",
        lambda: (
            sandbox.api.get("v1", "Pod", sandbox.namespace, "after-restart")["spec"].get("nodeName")
            == node
        ),
    )
    log = (sandbox.cluster.root / "supervisor.log").read_text()
    assert "kube-scheduler exited (-9); restart" in log


# --------------------------------------------------------------------------- its own health


def test_a_stuck_or_ended_kubelet_thread_is_reported_with_where_it_stands(tmp_path):
    """A sync thread that never comes back (a container start that hangs) leaves every later
    pod of the worker Pending; the failure message says so first, with the thread's stack."""
    import threading
    import time

    from tests.kube.kubelet import FakeKubelet

    kubelet = FakeKubelet(None, tmp_path / "work", owner="test", logs=tmp_path / "logs")
    release = threading.Event()

    def a_start_that_hangs():
        kubelet._beat()
        release.wait(30)

    stuck = threading.Thread(target=a_start_that_hangs, name="kubelet-sync", daemon=True)
    ended = threading.Thread(target=lambda: None, name="kubelet-watch", daemon=True)
    kubelet._threads += [stuck, ended]
    stuck.start()
    ended.start()
    ended.join()
    try:
        while "kubelet-sync" not in kubelet._beats:
            time.sleep(0.01)
        assert kubelet.health() == ["kubelet thread kubelet-watch has ended"]
        kubelet._beats["kubelet-sync"] -= 61
        [stuck_line, ended_line] = kubelet.health()
        assert ended_line == "kubelet thread kubelet-watch has ended"
        assert stuck_line.startswith("kubelet thread kubelet-sync stuck for 61s at:")
        assert "a_start_that_hangs" in stuck_line
    finally:
        release.set()
        stuck.join()
