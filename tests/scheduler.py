"""A model of the kube-scheduler decisions that place the chart's Triton pods, and of the
Deployment controller's rolling update, for tests that have no control plane.

Modelled, following the upstream plugins (kubernetes/pkg/scheduler/framework/plugins):

- NodeResourcesFit (filter) on the GPU extended resource only: a node fits when its free GPUs
  cover the pod's request.
- NodeAffinity (filter): ``nodeSelector`` and required node-affinity terms (In, NotIn, Exists,
  DoesNotExist).
- TaintToleration (filter): every NoSchedule / NoExecute taint must be tolerated.
- PodTopologySpread: DoNotSchedule constraints filter (skew = matching pods in the node's domain
  + 1 - the global minimum over eligible domains, with ``minDomains``, ``nodeAffinityPolicy``
  Honor, ``nodeTaintsPolicy`` and ``matchLabelKeys``); ScheduleAnyway constraints score (fewer
  matching pods in the domain is better).
- Choice among feasible nodes: the ScheduleAnyway spread first, then the resource scoring
  strategy (LeastAllocated, the default profile, or MostAllocated), then the node name.

Not modelled: CPU, memory and other resources, inter-pod (anti-)affinity, preemption and
priorities, the real weighted sum of all score plugins, volume binding and zones, kubelet
admission, the scheduler's parallelism and caches. The scheduler places one pod at a time, as the
real one does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HOSTNAME = "kubernetes.io/hostname"


@dataclass
class Node:
    name: str
    gpus: int
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict] = field(default_factory=list)
    #: GPUs taken by pods this model does not own (another release, a batch job).
    busy_gpus: int = 0

    def __post_init__(self) -> None:
        self.labels = {HOSTNAME: self.name, **self.labels}


@dataclass
class Pod:
    name: str
    labels: dict[str, str]
    spec: dict
    gpus: int
    node: str | None = None


def gpu_pool(
    count: int, gpus: int, labels: dict[str, str] | None = None, prefix: str = "gpu"
) -> list[Node]:
    """``count`` GPU nodes of ``gpus`` GPUs, tainted ``nvidia.com/gpu`` like GKE's GPU pools."""
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    return [Node(f"{prefix}-{i}", gpus, dict(labels or {}), [taint]) for i in range(count)]


def pod_gpus(spec: dict, resource: str) -> int:
    total = 0
    for c in spec["containers"]:
        requests = (c.get("resources") or {}).get("requests") or {}
        total += int(requests.get(resource, 0))
    return total


# --------------------------------------------------------------------------- filters


def _term_matches(term: dict, labels: dict[str, str]) -> bool:
    for expr in term.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def matches_node_affinity(spec: dict, node: Node) -> bool:
    selector = spec.get("nodeSelector") or {}
    if any(node.labels.get(k) != v for k, v in selector.items()):
        return False
    required = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms")
    if required:
        return any(_term_matches(term, node.labels) for term in required)
    return True


def _tolerates(toleration: dict, taint: dict) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint["key"]
    return toleration.get("key") == taint["key"] and toleration.get("value") == taint.get("value")


def tolerates_taints(spec: dict, node: Node) -> bool:
    tolerations = spec.get("tolerations") or []
    return all(
        any(_tolerates(t, taint) for t in tolerations)
        for taint in node.taints
        if taint["effect"] in ("NoSchedule", "NoExecute")
    )


def _selects(constraint: dict, incoming: Pod, other: Pod) -> bool:
    wanted = dict(constraint["labelSelector"].get("matchLabels") or {})
    for key in constraint.get("matchLabelKeys") or []:
        if key in incoming.labels:
            wanted[key] = incoming.labels[key]
    return all(other.labels.get(k) == v for k, v in wanted.items())


class Cluster:
    """Nodes and the pods bound to them; ``schedule`` places one pod like kube-scheduler."""

    def __init__(
        self,
        nodes: list[Node],
        *,
        resource: str = "nvidia.com/gpu",
        scoring: str = "LeastAllocated",
    ) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.pods: list[Pod] = []
        self.resource = resource
        self.scoring = scoring

    # -- state

    def used(self, node: Node) -> int:
        return node.busy_gpus + sum(p.gpus for p in self.pods if p.node == node.name)

    def free(self, node: Node) -> int:
        return node.gpus - self.used(node)

    def per_node(self, labels: dict[str, str] | None = None) -> dict[str, int]:
        """Bound pods per node (those carrying ``labels``), every node listed."""
        counts = dict.fromkeys(self.nodes, 0)
        for p in self.pods:
            if p.node and all(p.labels.get(k) == v for k, v in (labels or {}).items()):
                counts[p.node] += 1
        return counts

    def pending(self) -> list[Pod]:
        return [p for p in self.pods if p.node is None]

    def remove(self, pod: Pod) -> None:
        self.pods.remove(pod)

    # -- the scheduler

    def _eligible(self, constraint: dict, incoming: Pod, node: Node) -> bool:
        """Whether ``node`` counts as a domain of ``constraint`` (node inclusion policies)."""
        if constraint["topologyKey"] not in node.labels:
            return False
        if constraint.get("nodeAffinityPolicy", "Honor") == "Honor" and not (
            matches_node_affinity(incoming.spec, node)
        ):
            return False
        honor_taints = constraint.get("nodeTaintsPolicy", "Ignore") == "Honor"
        return not honor_taints or tolerates_taints(incoming.spec, node)

    def _domain_counts(self, constraint: dict, incoming: Pod) -> dict[str, int]:
        key = constraint["topologyKey"]
        counts: dict[str, int] = {}
        for node in self.nodes.values():
            if self._eligible(constraint, incoming, node):
                counts.setdefault(node.labels[key], 0)
        for p in self.pods:
            if p.node is None or p is incoming:
                continue
            node = self.nodes[p.node]
            domain = node.labels.get(key)
            if domain in counts and _selects(constraint, incoming, p):
                counts[domain] += 1
        return counts

    def _spread_allows(self, constraint: dict, incoming: Pod, node: Node) -> bool:
        key = constraint["topologyKey"]
        if key not in node.labels:
            return False
        counts = self._domain_counts(constraint, incoming)
        global_min = min(counts.values(), default=0)
        if len(counts) < int(constraint.get("minDomains", 1)):
            global_min = 0
        self_match = 1 if _selects(constraint, incoming, incoming) else 0
        skew = counts.get(node.labels[key], 0) + self_match - global_min
        return skew <= int(constraint["maxSkew"])

    def feasible(self, pod: Pod) -> list[Node]:
        hard = [
            c
            for c in pod.spec.get("topologySpreadConstraints") or []
            if c["whenUnsatisfiable"] == "DoNotSchedule"
        ]
        return [
            node
            for node in self.nodes.values()
            if self.free(node) >= pod.gpus
            and matches_node_affinity(pod.spec, node)
            and tolerates_taints(pod.spec, node)
            and all(self._spread_allows(c, pod, node) for c in hard)
        ]

    def _score(self, pod: Pod, node: Node) -> tuple:
        soft = [
            c
            for c in pod.spec.get("topologySpreadConstraints") or []
            if c["whenUnsatisfiable"] == "ScheduleAnyway"
        ]
        spread = 0
        for c in soft:
            counts = self._domain_counts(c, pod)
            spread += counts.get(node.labels.get(c["topologyKey"]), 0)
        used = self.used(node) / node.gpus if node.gpus else 1.0
        resource = used if self.scoring == "LeastAllocated" else -used
        return (spread, resource, node.name)

    def schedule(self, pod: Pod) -> str | None:
        """Bind ``pod`` to the best feasible node; None (Pending) when no node passes."""
        if pod not in self.pods:
            self.pods.append(pod)
        candidates = self.feasible(pod)
        if not candidates:
            return None
        pod.node = min(candidates, key=lambda n: self._score(pod, n)).name
        return pod.node

    def schedule_pending(self) -> int:
        placed = 0
        for pod in list(self.pending()):
            if self.schedule(pod):
                placed += 1
        return placed


# --------------------------------------------------------------------------- Deployments


def _resolve(value: int | str, replicas: int, *, round_up: bool) -> int:
    """maxSurge / maxUnavailable as the Deployment controller reads them (percent of replicas:
    surge rounds up, unavailable rounds down)."""
    if isinstance(value, str) and value.endswith("%"):
        exact = int(value[:-1]) * replicas / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


@dataclass
class ReplicaSet:
    template_hash: str
    labels: dict[str, str]
    spec: dict
    gpus: int
    replicas: int = 0
    pods: list[Pod] = field(default_factory=list)


def replica_set(deployment: dict, template_hash: str, resource: str) -> ReplicaSet:
    template = deployment["spec"]["template"]
    labels = {**template["metadata"]["labels"], "pod-template-hash": template_hash}
    spec = template["spec"]
    return ReplicaSet(template_hash, labels, spec, pod_gpus(spec, resource))


class Rollout:
    """The Deployment controller's RollingUpdate / Recreate over a Cluster, pods available as
    soon as they are bound (model load and probes take no time here)."""

    def __init__(self, cluster: Cluster, deployment: dict, template_hash: str = "v1") -> None:
        self.cluster = cluster
        self.new = replica_set(deployment, template_hash, cluster.resource)
        self.old: list[ReplicaSet] = []
        self.deployment = deployment
        self._scale(self.new, deployment["spec"]["replicas"])
        cluster.schedule_pending()

    def _scale(self, rs: ReplicaSet, replicas: int) -> None:
        while len(rs.pods) < replicas:
            pod = Pod(f"{rs.template_hash}-{len(rs.pods)}", rs.labels, rs.spec, rs.gpus)
            rs.pods.append(pod)
            self.cluster.pods.append(pod)
        while len(rs.pods) > replicas:
            # The controller deletes unscheduled pods first, then those sharing a node with
            # more pods of their ReplicaSet, then the newest.
            on_node = {p.node: sum(q.node == p.node for q in rs.pods) for p in rs.pods}
            victim = max(
                reversed(rs.pods),
                key=lambda p: (p.node is None, on_node[p.node] if p.node else 0),
            )
            rs.pods.remove(victim)
            self.cluster.remove(victim)
        rs.replicas = replicas

    @staticmethod
    def available(rs: ReplicaSet) -> int:
        return sum(1 for p in rs.pods if p.node is not None)

    def update(self, deployment: dict, template_hash: str, *, max_steps: int = 500) -> bool:
        """Roll to ``deployment``; True when it completes, False when it stops progressing."""
        self.old = [rs for rs in (*self.old, self.new) if rs.replicas]
        self.new = replica_set(deployment, template_hash, self.cluster.resource)
        self.deployment = deployment
        for _ in range(max_steps):
            before = self._state()
            self._step()
            self.cluster.schedule_pending()
            if self.done():
                return True
            if self._state() == before:
                return False
        return False

    def done(self) -> bool:
        replicas = self.deployment["spec"]["replicas"]
        return (
            not any(rs.replicas for rs in self.old)
            and self.new.replicas == replicas
            and self.available(self.new) == replicas
        )

    def _state(self) -> tuple:
        return tuple(
            (rs.template_hash, rs.replicas, self.available(rs)) for rs in (*self.old, self.new)
        )

    def _step(self) -> None:
        spec = self.deployment["spec"]
        replicas = spec["replicas"]
        strategy = spec.get("strategy") or {"type": "RollingUpdate"}
        if strategy["type"] == "Recreate":
            for rs in self.old:
                self._scale(rs, 0)
            if not any(rs.pods for rs in self.old):
                self._scale(self.new, replicas)
            return
        rolling = strategy.get("rollingUpdate") or {}
        surge = _resolve(rolling.get("maxSurge", "25%"), replicas, round_up=True)
        unavailable = _resolve(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
        if surge == 0 and unavailable == 0:
            unavailable = 1  # the API forbids both 0; the controller treats it so
        # reconcileNewReplicaSet
        total = sum(rs.replicas for rs in (*self.old, self.new))
        if self.new.replicas < replicas:
            grow = min(replicas + surge - total, replicas - self.new.replicas)
            if grow > 0:
                self._scale(self.new, self.new.replicas + grow)
        elif self.new.replicas > replicas:
            self._scale(self.new, replicas)
        self.cluster.schedule_pending()
        # reconcileOldReplicaSets
        total = sum(rs.replicas for rs in (*self.old, self.new))
        min_available = replicas - unavailable
        new_unavailable = self.new.replicas - self.available(self.new)
        budget = total - min_available - new_unavailable
        if budget <= 0:
            return
        # cleanupUnhealthyReplicas: old pods that are not available go first
        for rs in self.old:
            unhealthy = rs.replicas - self.available(rs)
            cut = min(unhealthy, budget)
            if cut > 0:
                self._scale(rs, rs.replicas - cut)
                budget -= cut
        # scaleDownOldReplicaSetsForRollingUpdate
        available = sum(self.available(rs) for rs in (*self.old, self.new))
        cut = available - min_available
        for rs in self.old:
            if cut <= 0:
                break
            step = min(rs.replicas, cut)
            self._scale(rs, rs.replicas - step)
            cut -= step
        self.old = [rs for rs in self.old if rs.replicas]
