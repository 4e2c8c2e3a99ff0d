"""pytest fixtures of the local cluster.

- ``kube`` (session): the cluster, shared by every process of the run (xdist workers attach to
  the one the first started; it stops when the last one detaches).
- ``kubelet`` (session): this process's fake kubelet; it plays the kubelet for the namespaces
  this process's tests create, whichever node their pods land on.
- ``sandbox`` (function): a namespace of the test's own, restricted by Pod Security, a fence
  label for the nodes it registers (selected through ``sandbox.fence_values()``), kubelet rules
  scoped to it, and ``helm`` / ``kubectl`` against the cluster. Torn down after the test.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.kube import nodes as fake_nodes
from tests.kube.api import Api
from tests.kube.cluster import TOOLS_BIN, Cluster, attach, check, detach
from tests.kube.kubelet import Context, FakeKubelet, Rule


def _shared_root(factory: pytest.TempPathFactory) -> Path:
    """A directory every xdist worker of this run shares (the run's base temp dir)."""
    base = factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "kube"


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = _shared_root(tmp_path_factory)
    cluster = attach(root)
    try:
        yield cluster
    finally:
        detach(root)


@pytest.fixture(scope="session")
def kubelet(kube: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeKubelet]:
    owner = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
    fake = FakeKubelet(
        kube.api, tmp_path_factory.mktemp("kubelet"), owner=owner, logs=kube.logs
    ).start()
    yield fake
    fake.stop()


@dataclass
class Sandbox:
    """One test's namespace on the shared cluster."""

    cluster: Cluster
    kubelet: FakeKubelet
    namespace: str
    fence: str
    api: Api
    nodes: list[str] = field(default_factory=list)
    rules: list[Rule] = field(default_factory=list)

    # -- nodes

    def node_name(self, name: str) -> str:
        return f"{self.fence}-{name}"

    def register(self, nodes: Iterable[fake_nodes.FakeNode]) -> list[str]:
        """Register ``nodes`` (names prefixed by the fence, fence label added)."""
        fenced = [
            fake_nodes.FakeNode(
                self.node_name(n.name),
                n.shape,
                {**n.labels, fake_nodes.FENCE: self.fence},
                n.taints,
            )
            for n in nodes
        ]
        names = fake_nodes.register(self.api, fenced, kubelet_port=self.cluster.kubelet_port)
        self.nodes += names
        return names

    def fence_values(self) -> tuple[str, ...]:
        """`--set` values that keep the Triton pods on this sandbox's nodes."""
        key = fake_nodes.FENCE.replace(".", "\\.")
        return (f"cluster.nodeSelector.{key}={self.fence}",)

    # -- the kubelet

    def rule(self, rule: Rule) -> Rule:
        """A kubelet rule for this namespace's pods only (usable as a decorator)."""

        def scoped(ctx: Context):
            if ctx.pod["metadata"]["namespace"] != self.namespace:
                return None
            return rule(ctx)

        self.kubelet.rule(scoped)
        self.rules.append(scoped)
        return rule

    # -- tools

    def env(self, **extra: str) -> dict[str, str]:
        return self.cluster.env(**extra)

    def run(self, *argv: str, timeout: float = 300, check: bool = True, **env: str):
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            env=self.env(**env),
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def helm(self, helm: str, *args: str, timeout: float = 300, check: bool = True):
        return self.run(
            str(TOOLS_BIN / helm),
            *args,
            "--namespace",
            self.namespace,
            timeout=timeout,
            check=check,
        )

    def kubectl(self, *args: str, timeout: float = 120, check: bool = True):
        return self.run(
            str(TOOLS_BIN / "kubectl"),
            "--namespace",
            self.namespace,
            *args,
            timeout=timeout,
            check=check,
        )

    # -- the chart

    def chart_args(
        self, values: Iterable[Path | str] = (), sets: Iterable[str] = (), *, fenced: bool = True
    ) -> list[str]:
        """`-f`/`--set` arguments; ``fenced``: the Triton pods select this sandbox's nodes, and
        the init container looks for `.ready` every second (not every 10)."""
        args: list[str] = []
        for f in values:
            args += ["-f", str(f)]
        extra = (*self.fence_values(), "triton.waitForModel.intervalSeconds=1") if fenced else ()
        for s in (*extra, *sets):
            args += ["--set", s]
        return args

    def claim_dir(self, claim: str) -> Path:
        """The local directory behind a bound claim (its PV's hostPath)."""
        found = self.wait(
            f"claim {claim} bound",
            lambda: (
                (self.api.find("v1", "PersistentVolumeClaim", self.namespace, claim) or {})
                .get("spec", {})
                .get("volumeName")
            ),
        )
        pv = self.api.get("v1", "PersistentVolume", None, found)
        return Path(pv["spec"]["hostPath"]["path"])

    def publish(self, claim: str, key: str) -> Path:
        """What a finished load leaves: `<claim>/<key>/.ready` (the loader writes it last)."""
        directory = self.claim_dir(claim) / key
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".ready").write_text("")
        return directory

    # -- reading the cluster

    def pods(self, labels: dict[str, str] | None = None) -> list[dict]:
        return self.api.list("v1", "Pod", self.namespace, labels=labels)

    def per_node(self, labels: dict[str, str] | None = None) -> dict[str, int]:
        """Bound, not terminating pods per node of this sandbox (every node listed, by the
        name it was registered with, without the fence prefix)."""
        counts = {name.removeprefix(f"{self.fence}-"): 0 for name in self.nodes}
        for pod in self.pods(labels):
            node = pod["spec"].get("nodeName")
            if node and not pod["metadata"].get("deletionTimestamp"):
                short = node.removeprefix(f"{self.fence}-")
                counts[short] = counts.get(short, 0) + 1
        return counts

    def pending(self, labels: dict[str, str] | None = None) -> list[dict]:
        return [p for p in self.pods(labels) if not p["spec"].get("nodeName")]

    def unschedulable(self, labels: dict[str, str] | None = None) -> list[dict]:
        """Pending pods the scheduler has tried and found no node for."""
        return [
            p
            for p in self.pending(labels)
            if any(
                c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                for c in p.get("status", {}).get("conditions", [])
            )
        ]

    def deployment(self, name: str) -> dict:
        return self.api.get("apps/v1", "Deployment", self.namespace, name)

    def wait(self, what: str, check, timeout: float = 180.0, interval: float = 0.25):
        try:
            return self.api.wait_for(
                f"{self.namespace}: {what}", check, timeout=timeout, interval=interval
            )
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.describe()}") from None

    def describe(self) -> str:
        """What the namespace holds, for a failure message: first what keeps the kubelet from
        working, if anything (a failure message may be cut in its middle)."""
        lines = self.kubelet.health()
        if self.kubelet.errors:
            lines.append(f"kubelet errors: {self.kubelet.errors[-10:]}")
        for d in self.api.list("apps/v1", "Deployment", self.namespace):
            lines.append(f"deployment/{d['metadata']['name']}: {d.get('status')}")
        for rs in self.api.list("apps/v1", "ReplicaSet", self.namespace):
            lines.append(f"replicaset/{rs['metadata']['name']}: {rs.get('status')}")
        for j in self.api.list("batch/v1", "Job", self.namespace):
            lines.append(f"job/{j['metadata']['name']}: {j.get('status')}")
        for pod in self.pods():
            status = pod.get("status", {})
            reasons = [
                f"{c['type']}={c['status']}{'/' + c['reason'] if c.get('reason') else ''}"
                for c in status.get("conditions") or []
            ]
            lines.append(
                f"pod/{pod['metadata']['name']} node={pod['spec'].get('nodeName')} "
                f"phase={status.get('phase')} deleting={bool(pod['metadata'].get('deletionTimestamp'))} "
                f"{' '.join(reasons)}"
            )
        return "\n".join(lines)

    def close(self) -> None:
        for rule in self.rules:
            self.kubelet.remove_rule(rule)
        self.api.delete(f"/api/v1/namespaces/{self.namespace}")
        fake_nodes.retire(self.api, self.nodes)


@pytest.fixture
def sandbox(kube: Cluster, kubelet: FakeKubelet) -> Iterator[Sandbox]:
    check(kube.root)  # a stopped cluster fails the test with its reason
    # So does a kubelet that stopped working: no pod of this worker would move again.
    if problems := kubelet.health():
        pytest.fail("this worker's fake kubelet stopped working:\n" + "\n".join(problems))
    # A letter first: `--set` would read an all-digit (or "12e3") fence as a number.
    fence = f"f{secrets.token_hex(3)}"
    namespace = f"t-{fence}"
    kubelet.own(namespace)
    box = Sandbox(kube, kubelet, namespace, fence, kube.api)
    try:
        yield box
    finally:
        box.close()
