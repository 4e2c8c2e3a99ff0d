"""Where the scheduler puts the chart's Triton pods, without a cluster.

The Deployment is rendered by the real Helm (3 and 4) and validated against the strict
Kubernetes schemas; tests/scheduler.py then applies the scheduler filters that decide placement
(GPU fit, node selector and affinity, taints, topology spread) and the Deployment controller's
rolling update to node pools built here. What that model leaves out is listed in its docstring
and in the chart README.
"""

from __future__ import annotations

import copy
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests import chart as rc
from tests.kubeapi import kube_api
from tests.scheduler import Cluster, Node, Rollout, gpu_pool

ROOT = Path(__file__).resolve().parent.parent


HELMS = ("helm3", "helm4")
POOL = {"cloud.google.com/gke-nodepool": "a100"}
POOL_SET = ("cluster.nodeSelector.cloud\\.google\\.com/gke-nodepool=a100",)


@cache
def deployment(helm: str, values: str | None, sets: tuple[str, ...] = ()) -> dict:
    files = () if values is None else (rc.VALUES_DIR / values,)
    docs = rc.documents(rc.render(helm=helm, values_files=files, set_values=sets))
    [doc] = [d for d in docs if d["kind"] == "Deployment"]
    assert rc.validate([doc]) == []
    return doc


def shape(t: int, p: int, n: int, g: int, nodes: int, *extra: str) -> tuple[str, ...]:
    return (
        f"model.tensorParallelSize={t}",
        f"model.pipelineParallelSize={p}",
        f"cluster.replicasPerNode={n}",
        f"cluster.gpusPerNode={g}",
        f"cluster.nodes={nodes}",
        *POOL_SET,
        *extra,
    )


def place(doc: dict, nodes: list[Node], **kw) -> tuple[Cluster, Rollout]:
    cluster = Cluster(nodes, **kw)
    return cluster, Rollout(cluster, doc)


def triton_labels(doc: dict) -> dict:
    return doc["spec"]["selector"]["matchLabels"]


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize("helm", HELMS)
def test_production_fills_its_exact_pool_eight_per_node(helm):
    doc = deployment(helm, "production.yaml")
    labels = doc["spec"]["template"]["spec"]["nodeSelector"]
    cluster, _ = place(doc, gpu_pool(2, 16, labels))
    assert cluster.pending() == []
    assert sorted(cluster.per_node().values()) == [8, 8]
    assert all(cluster.free(n) == 0 for n in cluster.nodes.values())


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(
    ("t", "p", "n"),
    [(2, 1, 8), (2, 2, 4), (4, 2, 2), (1, 4, 4), (8, 2, 1)],
    ids=["T2P1N8", "T2P2N4", "T4P2N2", "T1P4N4", "T8P2N1"],
)
def test_n_x_t_x_p_equal_to_the_node_gpus_packs_exactly_n_per_node(helm, t, p, n):
    doc = deployment(helm, None, shape(t, p, n, 16, 3))
    gpus = doc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpus["nvidia.com/gpu"] == t * p
    cluster, _ = place(doc, gpu_pool(3, 16, POOL))
    assert cluster.pending() == []
    assert list(cluster.per_node().values()) == [n, n, n]
    # One replica more would not fit anywhere: the GPU request is T x P, not less.
    cluster.schedule(
        type(cluster.pods[0])(
            "extra", cluster.pods[0].labels, doc["spec"]["template"]["spec"], t * p
        )
    )
    assert len(cluster.pending()) == 1


@pytest.mark.parametrize("helm", HELMS)
def test_a_busy_matching_node_does_not_hold_the_pool_to_one_pod_per_node(helm):
    doc = deployment(helm, "production.yaml")
    labels = doc["spec"]["template"]["spec"]["nodeSelector"]
    busy = Node("other-release", 16, dict(labels), gpu_pool(1, 16)[0].taints, busy_gpus=16)
    cluster, _ = place(doc, [*gpu_pool(2, 16, labels), busy])
    assert cluster.pending() == []
    per_node = cluster.per_node(triton_labels(doc))
    assert per_node == {"gpu-0": 8, "gpu-1": 8, "other-release": 0}


def test_the_former_hard_spread_left_most_replicas_pending_next_to_a_busy_node():
    """The constraint the chart rendered before (DoNotSchedule, minDomains = nodes): with one
    more matching node that is busy the minimum stays 0 and each node takes one pod."""
    doc = deployment("helm4", "production.yaml")
    spec = doc["spec"]["template"]["spec"]
    former = {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "minDomains": 2,
        "labelSelector": {"matchLabels": triton_labels(doc)},
    }
    legacy = {**doc, "spec": {**doc["spec"], "template": {**doc["spec"]["template"]}}}
    legacy["spec"]["template"]["spec"] = {**spec, "topologySpreadConstraints": [former]}
    busy = Node("other-release", 16, dict(spec["nodeSelector"]), busy_gpus=16)
    cluster, _ = place(legacy, [*gpu_pool(2, 16, spec["nodeSelector"]), busy])
    assert len(cluster.pending()) == 14
    # The same pool without the busy node: the former rule packed fine (so the model bites only
    # where the real scheduler would).
    cluster, _ = place(legacy, gpu_pool(2, 16, spec["nodeSelector"]))
    assert cluster.pending() == []


@pytest.mark.parametrize("helm", HELMS)
def test_hard_spread_is_for_a_pool_of_its_own(helm):
    doc = deployment(helm, "production.yaml", ("cluster.spread.whenUnsatisfiable=DoNotSchedule",))
    labels = doc["spec"]["template"]["spec"]["nodeSelector"]
    cluster, _ = place(doc, gpu_pool(2, 16, labels))
    assert cluster.pending() == [] and sorted(cluster.per_node().values()) == [8, 8]
    busy = Node("other-release", 16, dict(labels), busy_gpus=16)
    cluster, _ = place(doc, [*gpu_pool(2, 16, labels), busy])
    assert cluster.pending(), "DoNotSchedule counts the busy node: documented as such"


@pytest.mark.parametrize("helm", HELMS)
def test_mixed_cpu_and_gpu_nodes_without_a_selector(helm):
    doc = deployment(helm, None, ("cluster.nodes=3",))
    control_plane = Node(
        "control-plane",
        0,
        {"node-role.kubernetes.io/control-plane": ""},
        [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}],
    )
    cpu = [Node(f"cpu-{i}", 0) for i in range(3)]
    cluster, _ = place(doc, [control_plane, *cpu, *gpu_pool(3, 2)])
    assert cluster.pending() == []
    per_node = cluster.per_node()
    assert per_node == {
        "control-plane": 0,
        "cpu-0": 0,
        "cpu-1": 0,
        "cpu-2": 0,
        "gpu-0": 1,
        "gpu-1": 1,
        "gpu-2": 1,
    }


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("scoring", ["LeastAllocated", "MostAllocated"])
def test_fewer_gpus_used_than_the_node_has_still_spreads_n_per_node(helm, scoring):
    # N x T x P = 4 x 2 x 1 = 8 < G = 16: GPU fit alone would allow 8 per node.
    doc = deployment(helm, None, shape(2, 1, 4, 16, 2))
    cluster, _ = place(doc, gpu_pool(2, 16, POOL), scoring=scoring)
    assert cluster.pending() == []
    assert sorted(cluster.per_node().values()) == [4, 4]


@pytest.mark.parametrize("helm", HELMS)
def test_a_smaller_pool_than_asked_places_what_fits_and_no_more_than_n_per_node(helm):
    doc = deployment(helm, "production.yaml")
    labels = doc["spec"]["template"]["spec"]["nodeSelector"]
    cluster, _ = place(doc, gpu_pool(1, 16, labels))
    assert cluster.per_node() == {"gpu-0": 8}
    assert len(cluster.pending()) == 8


# --------------------------------------------------------------------------- rollouts


def _rollout(helm: str, before: tuple[str, ...], after: tuple[str, ...], nodes: int = 2):
    first = deployment(helm, None, before)
    cluster = Cluster(gpu_pool(nodes, 16, POOL))
    rollout = Rollout(cluster, first, "old")
    assert cluster.pending() == []
    return cluster, rollout, deployment(helm, None, after)


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(
    ("before", "after"),
    [((4, 4), (8, 2)), ((8, 2), (4, 4)), ((8, 2), (2, 8)), ((16, 1), (8, 2))],
    ids=["N4T4-to-N8T2", "N8T2-to-N4T4", "N8T2-to-N2T8", "N16T1-to-N8T2"],
)
def test_a_t_or_n_change_rolls_to_completion_with_the_live_replicas_known(helm, before, after):
    """On `helm upgrade` the chart reads the live Deployment (lookup) and raises maxUnavailable to
    the growth + 1; rendered offline the same number is what `--set` gives."""
    (n0, t0), (n, t) = before, after
    growth = max(0, 2 * n - 2 * n0)
    auto = max(1, 2 * n // 4, growth + 1)
    cluster, rollout, new = _rollout(
        helm,
        shape(t0, 1, n0, 16, 2),
        shape(t, 1, n, 16, 2, f"triton.updateStrategy.maxUnavailable={auto}"),
    )
    assert rollout.update(new, "new")
    assert cluster.pending() == []
    assert sorted(cluster.per_node().values()) == [n, n]


def upgrade_render(helm: str, live: dict, sets: tuple[str, ...], tmp_path: Path) -> dict:
    """The Deployment `helm upgrade` would apply over ``live``: the real Helm renders with
    `--dry-run=server` against a local API that serves the live Deployment to `lookup`."""
    owned = copy.deepcopy(live)
    owned["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "Helm"
    owned["metadata"]["annotations"] = {
        **owned["metadata"].get("annotations", {}),
        "meta.helm.sh/release-name": "codegen",
        "meta.helm.sh/release-namespace": "model-triton",
    }
    args = ["template", "codegen", str(rc.CHART), "--namespace", "model-triton"]
    args += ["--dry-run=server", "--disable-openapi-validation"]
    for s in sets:
        args += ["--set", s]
    with kube_api([owned], tmp_path) as kubeconfig:
        proc = subprocess.run(
            [str(rc.tool(helm)), *args, "--kubeconfig", str(kubeconfig)],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr
    [doc] = [d for d in rc.documents(proc.stdout) if d["kind"] == "Deployment"]
    assert rc.validate([doc]) == []
    return doc


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [((4, 4), (8, 2), 9), ((1, 16), (8, 2), 15), ((8, 2), (4, 4), 2), ((8, 2), (8, 2), 4)],
    ids=["N4T4-to-N8T2", "N1T16-to-N8T2", "N8T2-to-N4T4", "same-shape"],
)
def test_upgrade_reads_the_live_replicas_and_the_rollout_finishes(
    helm, before, after, expected, tmp_path
):
    (n0, t0), (n, t) = before, after
    old = deployment(helm, None, shape(t0, 1, n0, 16, 2))
    new = upgrade_render(helm, old, shape(t, 1, n, 16, 2, "model.revision=v2"), tmp_path)
    assert new["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == expected
    cluster = Cluster(gpu_pool(2, 16, POOL))
    rollout = Rollout(cluster, old, "old")
    assert rollout.update(new, "new")
    assert cluster.pending() == [] and sorted(cluster.per_node().values()) == [n, n]
    # Rendered offline (no cluster to read) the same values give the quarter only.
    offline = deployment(helm, None, shape(t, 1, n, 16, 2, "model.revision=v2"))
    assert offline["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == max(1, 2 * n // 4)


@pytest.mark.parametrize("helm", HELMS)
def test_the_former_one_at_a_time_strategy_deadlocks_when_replicas_grow(helm):
    cluster, rollout, new = _rollout(
        helm,
        shape(4, 1, 4, 16, 2),
        shape(2, 1, 8, 16, 2, "triton.updateStrategy.maxUnavailable=1"),
    )
    assert not rollout.update(new, "new")
    assert len(cluster.pending()) == 8  # the new pods wait for GPUs the old ones never free


@pytest.mark.parametrize("helm", HELMS)
def test_recreate_always_finishes(helm):
    cluster, rollout, new = _rollout(
        helm, shape(4, 1, 4, 16, 2), shape(2, 1, 8, 16, 2, "triton.updateStrategy.type=Recreate")
    )
    assert new["spec"]["strategy"] == {"type": "Recreate"}
    assert rollout.update(new, "new")
    assert sorted(cluster.per_node().values()) == [8, 8]


@pytest.mark.parametrize("helm", HELMS)
def test_a_new_model_revision_rolls_a_quarter_at_a_time(helm):
    cluster, rollout, new = _rollout(
        helm, shape(2, 1, 8, 16, 2), shape(2, 1, 8, 16, 2, "model.revision=v2")
    )
    assert new["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 4}
    served = []
    original = rollout._step

    def step():
        original()
        served.append(sum(Rollout.available(rs) for rs in (*rollout.old, rollout.new)))

    rollout._step = step
    assert rollout.update(new, "new")
    assert min(served) >= 12  # never more than maxUnavailable = 4 of 16 down
    assert sorted(cluster.per_node({"pod-template-hash": "new"}).values()) == [8, 8]


@pytest.mark.parametrize("helm", HELMS)
def test_progress_deadline_covers_the_wait_and_the_startup_budget(helm):
    doc = deployment(helm, None, ())
    pod = doc["spec"]["template"]["spec"]
    [wait] = pod["initContainers"]
    env = {e["name"]: e["value"] for e in wait["env"]}
    probe = pod["containers"][0]["startupProbe"]
    budget = int(env["WAIT_TIMEOUT_SECONDS"]) + probe["periodSeconds"] * probe["failureThreshold"]
    assert doc["spec"]["progressDeadlineSeconds"] > budget
    assert doc["spec"]["progressDeadlineSeconds"] > 600  # the Kubernetes default
