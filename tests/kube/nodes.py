"""Fake nodes: Node objects with the capacity, labels and taints of the node pools the values
files target, registered the way a kubelet registers itself (the object, then its status), and
kept Ready by lease heartbeats in `kube-node-lease` as kubelets do.

No kubelet runs on them; tests/kube/kubelet.py plays the kubelet's part for the pods bound to
them.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from tests.kube.api import Api, ApiError

#: Every fake node carries this label (the heartbeats renew the leases of these nodes).
FAKE = "model-triton.test/fake"
#: A node a finished test no longer needs: cordoned, deleted once no pod is bound to it.
RETIRED = "model-triton.test/retired"
#: Tests give their nodes a fence label of their own and select it, so that tests running at
#: the same time on one cluster never place pods on each other's nodes.
FENCE = "model-triton.test/fence"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
CONTROL_PLANE_TAINT = {"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}
LEASE_SECONDS = 40
#: The kubelet renews its lease every 10 s (`nodeLeaseDurationSeconds` / 4).
RENEW_SECONDS = 10.0


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class NodeShape:
    """One machine type: what a node of a pool reports as capacity."""

    gpus: int = 0
    cpu: str = "8"
    memory: str = "32Gi"
    pods: int = 110
    gpu_resource: str = "nvidia.com/gpu"


#: GKE a2-megagpu-16g: 16 x A100 40GB, 96 vCPUs, 1360 GB (values/production.yaml).
A2_MEGAGPU_16G = NodeShape(gpus=16, cpu="96", memory="1360Gi")
#: The staging pool: 2 A100s per node (values/staging.yaml).
STAGING_2GPU = NodeShape(gpus=2, cpu="24", memory="170Gi")
CPU_NODE = NodeShape(cpu="16", memory="64Gi")
#: The cluster's general pool: where pods without a node selector (loader Jobs, `helm test`
#: pods) run, sized for many tests at once.
GENERAL_NODE = NodeShape(cpu="256", memory="2Ti", pods=250)


@dataclass(frozen=True)
class FakeNode:
    name: str
    shape: NodeShape
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict, ...] = ()

    def manifest(self) -> dict:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            FAKE: "true",
            **self.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels},
            "spec": {"taints": list(self.taints)} if self.taints else {},
        }

    def status(self, kubelet_port: int = 0) -> dict:
        capacity = {
            "cpu": self.shape.cpu,
            "memory": self.shape.memory,
            "pods": str(self.shape.pods),
            "ephemeral-storage": "500Gi",
        }
        if self.shape.gpus:
            capacity[self.shape.gpu_resource] = str(self.shape.gpus)
        stamp = now()

        def condition(kind: str, status: str, reason: str) -> dict:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": reason,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }

        return {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": [
                    condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                    condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                    condition("PIDPressure", "False", "KubeletHasSufficientPID"),
                    condition("Ready", "True", "KubeletReady"),
                ],
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
                "nodeInfo": {
                    "machineID": self.name,
                    "systemUUID": self.name,
                    "bootID": self.name,
                    "kernelVersion": "6.1.0",
                    "osImage": "fake",
                    "containerRuntimeVersion": "fake://1.0",
                    "kubeletVersion": "v1.35.4",
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            }
        }


def gpu_pool(
    prefix: str,
    count: int,
    shape: NodeShape,
    labels: dict[str, str] | None = None,
    taints: Iterable[dict] = (GPU_TAINT,),
) -> list[FakeNode]:
    """``count`` GPU nodes, tainted ``nvidia.com/gpu`` like GKE's GPU pools."""
    return [
        FakeNode(f"{prefix}-{i}", shape, dict(labels or {}), tuple(taints)) for i in range(count)
    ]


def cpu_pool(prefix: str, count: int, labels: dict[str, str] | None = None) -> list[FakeNode]:
    return [FakeNode(f"{prefix}-{i}", CPU_NODE, dict(labels or {})) for i in range(count)]


def general_pool(count: int = 2) -> list[FakeNode]:
    return [FakeNode(f"general-{i}", GENERAL_NODE) for i in range(count)]


def control_plane_node(name: str, labels: dict[str, str] | None = None) -> FakeNode:
    role = {"node-role.kubernetes.io/control-plane": "", **(labels or {})}
    return FakeNode(name, CPU_NODE, role, (CONTROL_PLANE_TAINT,))


def register(
    api: Api, nodes: Iterable[FakeNode], *, kubelet_port: int, wait: bool = True
) -> list[str]:
    """Create the nodes, report them Ready (their kubelet endpoint: ``kubelet_port``, the
    cluster's log server), take their leases; with ``wait``, return once the node lifecycle
    controller has lifted the `not-ready` taint that admission put on them."""
    names = []
    for node in nodes:
        try:
            api.create(node.manifest())
        except ApiError as exc:
            if exc.status != 409:
                raise
        api.patch(f"/api/v1/nodes/{node.name}", node.status(kubelet_port), subresource="status")
        renew_lease(api, node.name)
        names.append(node.name)
    if wait:
        for name in names:
            api.wait_for(
                f"node {name} schedulable",
                lambda name=name: (
                    not any(
                        t["key"] == "node.kubernetes.io/not-ready"
                        for t in api.get("v1", "Node", None, name)["spec"].get("taints", [])
                    )
                ),
                timeout=120,
            )
    return names


def retire(api: Api, names: Iterable[str]) -> None:
    """Cordon the nodes and mark them retired: :class:`Heartbeats` deletes each once no pod is
    bound to it (a pod of another test may still run there; deleting its node now would make
    it an orphan for the pod garbage collector)."""
    for name in names:
        api.patch(
            f"/api/v1/nodes/{name}",
            {"metadata": {"labels": {RETIRED: "true"}}, "spec": {"unschedulable": True}},
        )


def _delete(api: Api, name: str) -> None:
    api.delete(f"/api/v1/nodes/{name}")
    api.delete(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}")


def renew_lease(api: Api, name: str) -> None:
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": "kube-node-lease"},
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": now_micro(),
        },
    }
    api.apply(body, manager="fake-kubelet")


class Heartbeats:
    """Renews the lease of every fake node every 10 s, as each node's kubelet would."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-heartbeats", daemon=True)

    def start(self) -> Heartbeats:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            # A missed beat is retried at the next round; the controller manager marks a node
            # NotReady after 2 minutes without one (tests/kube/controlplane.py). One node's
            # failed call does not cost the others their beat.
            try:
                nodes = self.api.list("v1", "Node", labels={FAKE: "true"})
            except Exception:
                continue
            live = [n for n in nodes if RETIRED not in n["metadata"].get("labels", {})]
            retired = [n for n in nodes if RETIRED in n["metadata"].get("labels", {})]
            for node in live + retired:  # the leases first, the clean-up after
                name = node["metadata"]["name"]
                try:
                    if node in retired and not self.api.list(
                        "v1", "Pod", fields=f"spec.nodeName={name}"
                    ):
                        _delete(self.api, name)
                    else:  # live, or retired with a pod still bound
                        renew_lease(self.api, name)
                except Exception:
                    continue
