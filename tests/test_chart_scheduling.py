"""Where the real kube-scheduler puts the chart's Triton pods, and how the real Deployment
controller rolls them, on the local control plane (tests/kube) with fake GPU nodes.

The chart is installed and upgraded by the real Helm into a namespace of the test's own; the
nodes carry the labels and taints of the values files' pools (and a fence label the release
selects, so tests sharing the cluster never see each other's nodes). The scheduler runs its
default profile: what it does here is what the chart README promises.
"""

from __future__ import annotations

import time
from functools import cache

import pytest
import yaml

from tests import chart as rc
from tests.kube import nodes as fake
from tests.kube.kubelet import Serve

pytestmark = pytest.mark.server  # the local control plane (see markers in pyproject.toml)

PRODUCTION = rc.VALUES_DIR / "production.yaml"
GPU = "nvidia.com/gpu"
TRITON = {"app.kubernetes.io/component": "triton"}
DEPLOYMENT = "codegen-model-triton"
CLAIM = "codegen-model-triton-models"


@cache
def production_labels() -> dict[str, str]:
    return yaml.safe_load(PRODUCTION.read_text())["cluster"]["nodeSelector"]


def shape(t: int, p: int, n: int, g: int, nodes: int, *extra: str) -> tuple[str, ...]:
    return (
        f"model.tensorParallelSize={t}",
        f"model.pipelineParallelSize={p}",
        f"cluster.replicasPerNode={n}",
        f"cluster.gpusPerNode={g}",
        f"cluster.nodes={nodes}",
        *extra,
    )


def a100_pool(count: int, prefix: str = "gpu") -> list[fake.FakeNode]:
    return fake.gpu_pool(prefix, count, fake.A2_MEGAGPU_16G, production_labels())


def install(sandbox, *, values=(PRODUCTION,), sets=(), helm="helm4", wait_for_model=False):
    """`helm install`; unless ``wait_for_model``, the Triton pods' init container is held
    running (placement only: no `sh` loop per pod), else it runs its own script."""
    if not wait_for_model:
        sandbox.rule(
            lambda ctx: Serve(ready=lambda: False) if ctx.name == "wait-for-model" else None
        )
    sandbox.helm(helm, "install", "codegen", str(rc.CHART), *sandbox.chart_args(values, sets))


def upgrade(sandbox, *, values=(PRODUCTION,), sets=(), helm="helm4", check=True):
    return sandbox.helm(
        helm,
        "upgrade",
        "codegen",
        str(rc.CHART),
        *sandbox.chart_args(values, sets),
        check=check,
    )


def placed(sandbox, count: int, *, unschedulable: int = 0, labels=TRITON) -> dict[str, int]:
    """Wait until ``count`` Triton pods are bound and ``unschedulable`` more were found no node;
    the pods per node."""

    def settled():
        bound = sum(sandbox.per_node(labels).values())
        stuck = len(sandbox.unschedulable(labels))
        return (bound, stuck) == (count, unschedulable)

    sandbox.wait(f"{count} bound, {unschedulable} unschedulable", settled)
    return sandbox.per_node(labels)


def key_of(sandbox) -> str:
    return sandbox.deployment(DEPLOYMENT)["metadata"]["annotations"]["model-triton/model-key"]


def gpus_requested(pod: dict) -> int:
    return sum(
        int(c["resources"].get("requests", {}).get(GPU, 0)) for c in pod["spec"]["containers"]
    )


def busy_pod(sandbox, node: str, gpus: int) -> None:
    """A pod of something else holding ``gpus`` GPUs of ``node`` (restricted, like the chart's)."""
    sandbox.api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"other-{node}", "namespace": sandbox.namespace},
            "spec": {
                "nodeName": sandbox.node_name(node),
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": 1000,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "containers": [
                    {
                        "name": "batch",
                        "image": "batch:1",
                        "resources": {"limits": {GPU: str(gpus)}},
                        "securityContext": {
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                        },
                    }
                ],
            },
        }
    )


# --------------------------------------------------------------------------- placement


def test_production_fills_its_exact_pool_eight_per_node(sandbox):
    sandbox.register(a100_pool(2))
    install(sandbox)
    assert placed(sandbox, 16) == {"gpu-0": 8, "gpu-1": 8}
    for pod in sandbox.pods(TRITON):
        assert gpus_requested(pod) == 2
    # One replica more fits nowhere: each pod takes T x P GPUs, the pool has no more.
    sandbox.kubectl("scale", f"deployment/{DEPLOYMENT}", "--replicas=17")
    [stuck] = placed(sandbox, 16, unschedulable=1) and sandbox.unschedulable(TRITON)
    [condition] = [c for c in stuck["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert f"Insufficient {GPU}" in condition["message"]
    # The pods are also admitted by the namespace's restricted Pod Security level.
    assert (
        sandbox.api.get("v1", "Namespace", None, sandbox.namespace)["metadata"]["labels"][
            "pod-security.kubernetes.io/enforce"
        ]
        == "restricted"
    )


@pytest.mark.parametrize(
    ("t", "p", "n"), [(2, 2, 4), (4, 2, 2), (8, 2, 1)], ids=["T2P2N4", "T4P2N2", "T8P2N1"]
)
def test_n_x_t_x_p_equal_to_the_node_gpus_packs_exactly_n_per_node(sandbox, t, p, n):
    sandbox.register(a100_pool(2))
    install(sandbox, sets=shape(t, p, n, 16, 2))
    assert placed(sandbox, 2 * n) == {"gpu-0": n, "gpu-1": n}
    assert {gpus_requested(pod) for pod in sandbox.pods(TRITON)} == {t * p}


def test_mig_slices_pack_like_gpus(sandbox):
    # 4 A100 40GB per node, 2 slices each; T x P = 1 on MIG: the default 2B model (the
    # production 16B one does not fit in a 19 GiB slice) with the default resources.
    mig = "nvidia.com/mig-3g.20gb"
    shape_ = fake.NodeShape(gpus=8, cpu="48", memory="340Gi", gpu_resource=mig)
    sandbox.register(fake.gpu_pool("mig", 2, shape_, {}))
    sets = (f"cluster.gpuResourceName={mig}", "cluster.gpuMemoryGiB=19", *shape(1, 1, 8, 8, 2))
    install(sandbox, values=(), sets=sets)
    assert placed(sandbox, 16) == {"mig-0": 8, "mig-1": 8}
    pod = sandbox.pods(TRITON)[0]
    assert pod["spec"]["containers"][0]["resources"]["requests"][mig] == "1"


def test_a_busy_matching_node_does_not_hold_the_pool_to_one_pod_per_node(sandbox):
    sandbox.register(a100_pool(3))
    busy_pod(sandbox, "gpu-2", 16)
    install(sandbox)
    assert placed(sandbox, 16) == {"gpu-0": 8, "gpu-1": 8, "gpu-2": 0}


def test_more_matching_nodes_than_cluster_nodes_spreads_over_all_of_them(sandbox):
    """N x T x P = G is exact only on a pool of `cluster.nodes` nodes: with a third free
    matching node the default scoring (PodTopologySpread's ScheduleAnyway preference, the
    least-allocated CPU and memory) spreads the 16 pods over all three nodes, so no node is
    full. GPU fit still caps a node at N."""
    sandbox.register(a100_pool(3))
    install(sandbox)
    per_node = placed(sandbox, 16)
    assert max(per_node.values()) <= 8
    assert min(per_node.values()) >= 1, per_node
    assert max(per_node.values()) - min(per_node.values()) <= 1, per_node


def test_fewer_gpus_used_than_the_node_has_still_spreads_n_per_node(sandbox):
    # N x T x P = 4 x 2 x 1 = 8 < G = 16: GPU fit alone would allow 8 per node; the scores
    # (spread preference, least-allocated CPU and memory) put 4 on each.
    sandbox.register(a100_pool(2))
    install(sandbox, sets=shape(2, 1, 4, 16, 2))
    assert placed(sandbox, 8) == {"gpu-0": 4, "gpu-1": 4}


def test_a_smaller_pool_than_asked_places_what_fits_and_no_more_than_n_per_node(sandbox):
    sandbox.register(a100_pool(1))
    install(sandbox)
    assert placed(sandbox, 8, unschedulable=8) == {"gpu-0": 8}


def test_hard_spread_is_for_a_pool_of_its_own(sandbox):
    sets = ("cluster.spread.whenUnsatisfiable=DoNotSchedule",)
    sandbox.register(a100_pool(2))
    install(sandbox, sets=sets)
    assert placed(sandbox, 16) == {"gpu-0": 8, "gpu-1": 8}


def test_hard_spread_next_to_a_busy_matching_node_leaves_pods_pending(sandbox):
    """DoNotSchedule counts the busy node as a domain with 0 pods: each other node may hold
    at most maxSkew = 1 pod more than it, so 2 of 16 are placed (documented in the README)."""
    sandbox.register(a100_pool(3))
    busy_pod(sandbox, "gpu-2", 16)
    install(sandbox, sets=("cluster.spread.whenUnsatisfiable=DoNotSchedule",))
    assert placed(sandbox, 2, unschedulable=14) == {"gpu-0": 1, "gpu-1": 1, "gpu-2": 0}


def test_mixed_cpu_gpu_and_control_plane_nodes_get_triton_only_on_gpu_nodes(sandbox):
    sandbox.register(
        [
            fake.control_plane_node("control-plane"),
            *fake.cpu_pool("cpu", 3),
            *fake.gpu_pool("gpu", 3, fake.STAGING_2GPU),
        ]
    )
    install(sandbox, values=(), sets=("cluster.nodes=3",))
    assert placed(sandbox, 3) == {
        "control-plane": 0,
        "cpu-0": 0,
        "cpu-1": 0,
        "cpu-2": 0,
        "gpu-0": 1,
        "gpu-1": 1,
        "gpu-2": 1,
    }


def test_a_tainted_dedicated_pool_needs_its_toleration(sandbox):
    dedicated = {"key": "dedicated", "value": "triton", "effect": "NoSchedule"}
    sandbox.register(
        fake.gpu_pool(
            "gpu", 2, fake.A2_MEGAGPU_16G, production_labels(), (fake.GPU_TAINT, dedicated)
        )
    )
    install(sandbox, wait_for_model=True)
    # The model is published: once placed, the pods turn available and the rollout below runs
    # (pods that never turn available would let it replace only maxUnavailable of them).
    sandbox.publish(CLAIM, key_of(sandbox))
    placed(sandbox, 0, unschedulable=16)

    def for_the_taint():
        # The scheduler's first attempt may find the claim not bound yet ("unbound immediate
        # PersistentVolumeClaims"); it tries again once the claim is bound, and the taint is
        # then what keeps the pods off both nodes (none was placed: above).
        messages = [
            c.get("message", "")
            for p in sandbox.unschedulable(TRITON)
            for c in p["status"]["conditions"]
            if c["type"] == "PodScheduled"
        ]
        return any("untolerated taint" in m for m in messages)

    sandbox.wait("a pod unschedulable for the taint", for_the_taint, timeout=120)
    tolerations = (
        "cluster.tolerations[0].key=nvidia.com/gpu",
        "cluster.tolerations[0].operator=Exists",
        "cluster.tolerations[0].effect=NoSchedule",
        "cluster.tolerations[1].key=dedicated",
        "cluster.tolerations[1].value=triton",
        "cluster.tolerations[1].effect=NoSchedule",
    )
    upgrade(sandbox, sets=tolerations)
    assert placed(sandbox, 16) == {"gpu-0": 8, "gpu-1": 8}


# --------------------------------------------------------------------------- rollouts


def rolled_out(sandbox, replicas: int) -> dict:
    """Wait until the Deployment's rollout is complete (what `kubectl rollout status` waits
    for); its status."""

    def complete():
        d = sandbox.deployment(DEPLOYMENT)
        s = d.get("status", {})
        return (
            s.get("observedGeneration", 0) >= d["metadata"]["generation"]
            and s.get("updatedReplicas") == replicas
            and s.get("replicas") == replicas
            and s.get("availableReplicas") == replicas
            and d
        )

    return sandbox.wait(f"rollout of {replicas}", complete, timeout=240)


def installed_and_ready(sandbox, sets, *, nodes: int = 2, helm="helm4") -> str:
    sandbox.register(a100_pool(nodes))
    install(sandbox, sets=sets, helm=helm, wait_for_model=True)
    key = key_of(sandbox)
    sandbox.publish(CLAIM, key)
    rolled_out(sandbox, sandbox.deployment(DEPLOYMENT)["spec"]["replicas"])
    return key


@pytest.mark.parametrize(
    ("before", "after", "helm"),
    [
        ((4, 4), (8, 2), "helm4"),
        ((8, 2), (4, 4), "helm3"),
        ((1, 16), (8, 2), "helm4"),
    ],
    ids=["N4T4-to-N8T2", "N8T2-to-N4T4", "N1T16-to-N8T2"],
)
def test_a_t_or_n_change_rolls_to_completion_on_a_full_pool(sandbox, before, after, helm):
    """The automatic maxUnavailable, replicas - nodes + 1, exceeds any growth on the pool
    (it reads nothing from the cluster); the real Deployment controller finishes."""
    (n0, t0), (n, t) = before, after
    old_key = installed_and_ready(sandbox, shape(t0, 1, n0, 16, 2), helm=helm)
    upgrade(sandbox, sets=shape(t, 1, n, 16, 2), helm=helm)
    new_key = key_of(sandbox)
    assert new_key != old_key
    strategy = sandbox.deployment(DEPLOYMENT)["spec"]["strategy"]["rollingUpdate"]
    growth = max(0, 2 * n - 2 * n0)
    assert strategy["maxUnavailable"] == max(2 * n // 4, 1, 2 * n - 2 + 1) > growth
    sandbox.publish(CLAIM, new_key)
    rolled_out(sandbox, 2 * n)
    assert sandbox.per_node(TRITON) == {"gpu-0": n, "gpu-1": n}
    assert {
        p["metadata"]["annotations"]["model-triton/model-key"] for p in sandbox.pods(TRITON)
    } == {new_key}


def test_the_former_one_at_a_time_strategy_stalls_when_replicas_grow(sandbox):
    """maxUnavailable = 1 for 8 -> 16 pods on a full pool. The replica count and the template
    change together, so the controller first handles a scaling event
    (kubernetes/pkg/controller/deployment/sync.go, `isScalingEvent`, `scale`): with one active
    ReplicaSet it scales the OLD one to 16, then the rolling update trades one old pod for one
    new and stops: 8 old pods serve, 7 more old-shape pods and 1 new pod find no GPU, and
    16 - 1 - 15 old - 1 new unavailable leaves nothing more to scale down. It never completes."""
    installed_and_ready(sandbox, shape(4, 1, 4, 16, 2))
    upgrade(sandbox, sets=shape(2, 1, 8, 16, 2, "triton.updateStrategy.maxUnavailable=1"))
    sandbox.publish(CLAIM, key_of(sandbox))
    new_hash = None

    def stalled():
        nonlocal new_hash
        s = sandbox.deployment(DEPLOYMENT)["status"]
        sizes = {
            rs["metadata"]["labels"]["pod-template-hash"]: rs["spec"]["replicas"]
            for rs in sandbox.api.list("apps/v1", "ReplicaSet", sandbox.namespace)
        }
        new = [h for h, n in sizes.items() if n == 1]
        new_hash = new[0] if new else None
        return (
            sorted(sizes.values()) == [1, 15]
            and len(sandbox.unschedulable(TRITON)) == 8
            and (s.get("updatedReplicas"), s.get("availableReplicas")) == (1, 8)
        )

    sandbox.wait("stalled", stalled)
    time.sleep(5)  # the controller's fixed point: nothing moves
    assert stalled()
    assert sandbox.per_node(TRITON) == {"gpu-0": 4, "gpu-1": 4}
    assert sandbox.pending({**TRITON, "pod-template-hash": new_hash})


def test_recreate_always_finishes(sandbox):
    installed_and_ready(sandbox, shape(4, 1, 4, 16, 2))
    upgrade(sandbox, sets=shape(2, 1, 8, 16, 2, "triton.updateStrategy.type=Recreate"))
    assert sandbox.deployment(DEPLOYMENT)["spec"]["strategy"] == {"type": "Recreate"}
    sandbox.publish(CLAIM, key_of(sandbox))
    rolled_out(sandbox, 16)
    assert sandbox.per_node(TRITON) == {"gpu-0": 8, "gpu-1": 8}


def test_an_explicit_max_unavailable_rolls_a_new_revision_a_quarter_at_a_time(sandbox):
    """The automatic value (15 of production's 16) is for any change; a release whose N never
    changes may keep more serving."""
    quarter = ("triton.updateStrategy.maxUnavailable=4",)
    installed_and_ready(sandbox, quarter)
    upgrade(sandbox, sets=("model.revision=v2", *quarter))
    strategy = sandbox.deployment(DEPLOYMENT)["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 4}
    new_key = key_of(sandbox)
    sandbox.publish(CLAIM, new_key)
    served = []

    def complete():
        s = sandbox.deployment(DEPLOYMENT).get("status", {})
        ready = [
            p
            for p in sandbox.pods(TRITON)
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p.get("status", {}).get("conditions", [])
            )
            and not p["metadata"].get("deletionTimestamp")
        ]
        served.append(len(ready))
        return s.get("updatedReplicas") == 16 and s.get("availableReplicas") == 16 and s

    sandbox.wait("revision rolled", complete, timeout=240, interval=0.05)
    assert min(served) >= 12, served  # never more than maxUnavailable = 4 of 16 down
    assert sandbox.per_node(TRITON) == {"gpu-0": 8, "gpu-1": 8}


def test_progress_deadline_covers_the_wait_and_the_startup_budget():
    docs = rc.documents(rc.render())
    [doc] = [d for d in docs if d["kind"] == "Deployment"]
    pod = doc["spec"]["template"]["spec"]
    [wait] = pod["initContainers"]
    env = {e["name"]: e["value"] for e in wait["env"]}
    probe = pod["containers"][0]["startupProbe"]
    budget = int(env["WAIT_TIMEOUT_SECONDS"]) + probe["periodSeconds"] * probe["failureThreshold"]
    assert doc["spec"]["progressDeadlineSeconds"] > budget
    assert doc["spec"]["progressDeadlineSeconds"] > 600  # the Kubernetes default
