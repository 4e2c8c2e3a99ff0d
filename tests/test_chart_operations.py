"""Generated sequences of the operations users run on a live release, on the local control plane
(tests/kube): `helm upgrade` (plain, `--reuse-values`, `--reset-then-reuse-values`), `helm
rollback` (to the previous and to older revisions), `kubectl rollout undo`, a GitOps re-render
(`helm template | kubectl apply`), `helm uninstall` and a new `helm install`, over changes of
T, P, N, the node count, the instance count, the model name and its revision.

After each operation the real Deployment controller and scheduler must converge: every replica
of the shape the operation applied bound, ready and serving the key it names, nothing Pending.
The pool (two nodes of four GPUs) is full for most shapes drawn, where a rollout that adds
replicas stops for good unless maxUnavailable exceeds the growth; the chart's automatic value
reads nothing from the cluster, so it must hold after whatever ran before.

`make test` runs OPERATION_SEQUENCES sequences (default 2) of OPERATION_STEPS operations
(default 5); set `MODEL_TRITON_OPERATION_SEQUENCES` and `MODEL_TRITON_OPERATION_STEPS` for a
longer run, and `MODEL_TRITON_OPERATION_SEED` to vary the draws (a failure names its seed).
"""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass, replace

import pytest
import yaml

from tests import chart as rc
from tests.chartkit import write_values
from tests.kube import nodes as fake
from tests.kube.cluster import TOOLS_BIN

pytestmark = pytest.mark.server  # the local control plane (see markers in pyproject.toml)

SEQUENCES = int(os.environ.get("MODEL_TRITON_OPERATION_SEQUENCES", "2"))
STEPS = int(os.environ.get("MODEL_TRITON_OPERATION_STEPS", "5"))
SEED = int(os.environ.get("MODEL_TRITON_OPERATION_SEED", "0"))
#: How long one operation may take to converge before the test fails (a stalled rollout never
#: does; a converging one here takes seconds).
CONVERGE_SECONDS = 150.0

GPUS_PER_NODE = 4
POOL = fake.NodeShape(gpus=GPUS_PER_NODE, cpu="32", memory="256Gi")
GPU = "nvidia.com/gpu"
TRITON = {"app.kubernetes.io/component": "triton"}
RELEASE = "codegen"
DEPLOYMENT = "codegen-model-triton"
CLAIM = "codegen-model-triton-models"
KEY = "model-triton/model-key"
ADMIN_SECRET = "triton-admin"
#: What every operation passes: small pods (the pool's GPUs are the only constraint) and an admin
#: Secret of the test's own (a re-render cannot look up the chart's).
BASE = {
    "triton": {
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "512Mi"},
        },
        "security": {"adminSecret": {"name": ADMIN_SECRET}},
    },
    "cluster": {"gpusPerNode": GPUS_PER_NODE},
}


@dataclass(frozen=True)
class Shape:
    """The values an operation changes."""

    t: int = 1
    p: int = 1
    n: int = 1
    nodes: int = 2
    instances: int = 1
    name: str = "codegen"
    revision: str = "v1"

    @property
    def replicas(self) -> int:
        return self.n * self.nodes

    @property
    def gpus(self) -> int:
        return self.t * self.p

    def settings(self) -> dict[str, str]:
        return {
            "model.tensorParallelSize": str(self.t),
            "model.pipelineParallelSize": str(self.p),
            "cluster.replicasPerNode": str(self.n),
            "cluster.nodes": str(self.nodes),
            "triton.instanceCount": str(self.instances),
            "model.name": self.name,
            "model.revision": self.revision,
        }

    def sets(self, since: Shape | None = None) -> tuple[str, ...]:
        """`--set` arguments: every value, or only those that differ from ``since``."""
        old = since.settings() if since else {}
        return tuple(f"{k}={v}" for k, v in self.settings().items() if old.get(k) != v)


def draw_shape(rng: random.Random, before: Shape | None) -> Shape:
    """A shape the pool holds; often a change of N and T x P together (the case that grows)."""
    while True:
        t = rng.choice((1, 2, 4))
        p = rng.choice((1, 1, 2))
        if t * p > GPUS_PER_NODE:
            continue
        most = GPUS_PER_NODE // (t * p)
        n = rng.choice([x for x in (1, 2, 4) if x <= most] + [most, most])
        shape = Shape(
            t=t,
            p=p,
            n=n,
            nodes=rng.choice((1, 2, 2, 2)),
            instances=rng.choice((1, 1, 2)),
            name=rng.choice(("codegen", "codegen", "coder")),
            revision=rng.choice(("v1", "v2", "v3")),
        )
        if shape != before:
            return shape


@dataclass(frozen=True)
class Step:
    kind: str  # install, upgrade, rollback, undo, gitops, reinstall
    shape: Shape | None = None
    mode: str = ""  # upgrade: "", --reuse-values, --reset-then-reuse-values
    revision: int = 0  # rollback: 0 is the previous one

    def __str__(self) -> str:
        what = [self.kind]
        if self.mode:
            what.append(self.mode)
        if self.kind == "rollback":
            what.append(str(self.revision or "previous"))
        if self.shape:
            what.append(" ".join(self.shape.sets()))
        return " ".join(what)


def draw_steps(rng: random.Random, count: int) -> list[Step]:
    """An install, then ``count`` operations; rollbacks name revisions that exist."""
    first = draw_shape(rng, None)
    steps = [Step("install", first)]
    revisions = [first]  # Helm's history of this release, index = revision - 1
    current = first
    for _ in range(count):
        kinds = ["upgrade"] * 3 + ["gitops", "reinstall", "undo"]
        if len(revisions) > 1:
            kinds += ["rollback"] * 3
        kind = rng.choice(kinds)
        if kind == "upgrade":
            shape = draw_shape(rng, current)
            mode = rng.choice(("", "--reuse-values", "--reset-then-reuse-values"))
            steps.append(Step("upgrade", shape, mode))
            revisions.append(shape)
            current = shape
        elif kind == "rollback":
            if rng.random() < 0.5 or len(revisions) < 3:
                target = 0
                shape = revisions[-2]
            else:
                target = rng.randrange(1, len(revisions) - 1)
                shape = revisions[target - 1]
            steps.append(Step("rollback", shape, revision=target))
            revisions.append(shape)
            current = shape
        elif kind == "gitops":
            shape = draw_shape(rng, current)
            steps.append(Step("gitops", shape))
            current = shape  # Helm's history does not know it
        elif kind == "reinstall":
            shape = draw_shape(rng, current)
            steps.append(Step("reinstall", shape))
            revisions = [shape]
            current = shape
        else:
            steps.append(Step("undo"))
    # Whatever the sequence left, a plain upgrade brings the release to a known shape.
    steps.append(Step("upgrade", draw_shape(rng, current)))
    return steps


# --------------------------------------------------------------------------- the cluster side


class Release:
    """One release in a sandbox, driven by the real helm and kubectl."""

    def __init__(self, sandbox, helm: str, tmp_path) -> None:
        self.sandbox = sandbox
        self.helm = helm
        #: kubectl changed fields Helm applied (a re-render, an undo): Helm 4's server-side
        #: apply then conflicts until it is told to take them back (--force-conflicts); Helm
        #: 3's three-way patch overrides them.
        self.drifted = False
        #: The shapes of Helm's revisions as they happened (index = revision - 1): an undo
        #: followed by an upgrade adds one the drawn sequence does not know of.
        self.history: list[Shape] = []
        self.base = write_values(tmp_path, BASE, "base.yaml")
        self.sandbox.kubectl(
            "create", "secret", "generic", ADMIN_SECRET, "--from-literal=token=s3cret-admin"
        )

    def args(self, shape: Shape, since: Shape | None = None) -> list[str]:
        return [str(rc.CHART), *self.sandbox.chart_args((self.base,), shape.sets(since))]

    def expected_key(self, shape: Shape) -> str:
        """The key the chart renders for ``shape`` (offline: `helm template`)."""
        out = self.sandbox.run(
            str(TOOLS_BIN / self.helm),
            "template",
            RELEASE,
            *self.args(shape),
            "--namespace",
            self.sandbox.namespace,
            "--show-only",
            "templates/deployment.yaml",
        ).stdout
        return yaml.safe_load(out)["metadata"]["annotations"][KEY]

    def publish(self, shape: Shape) -> str:
        """Publish the shape's key where the pods wait for it (as a finished load leaves it)."""
        key = self.expected_key(shape)
        self.sandbox.publish(CLAIM, key)
        return key

    def run(self, step: Step, since: Shape | None) -> tuple[int | None, str | None, int | None]:
        """Apply ``step``; the replicas, key and GPUs per replica the cluster must converge
        to (None: what the Deployment holds, for `rollout undo`)."""
        box, shape = self.sandbox, step.shape
        force = ["--force-conflicts"] if self.drifted and self.helm == "helm4" else []
        if step.kind in ("gitops", "undo"):
            self.drifted = True
        if step.kind == "install":
            box.helm(self.helm, "install", RELEASE, *self.args(shape))
            self.history = [shape]
        elif step.kind == "upgrade":
            changed_only = step.mode and since is not None
            args = self.args(shape, since if changed_only else None)
            box.helm(
                self.helm, "upgrade", RELEASE, *args, *([step.mode] if step.mode else []), *force
            )
            self.history.append(shape)
        elif step.kind == "rollback":
            # The newest earlier revision of the drawn shape (what "previous" or the drawn
            # revision named in the drawn history), by its number in Helm's.
            target = max(i + 1 for i, old in enumerate(self.history[:-1]) if old == shape)
            box.helm(self.helm, "rollback", RELEASE, str(target), *force)
            self.history.append(shape)
        elif step.kind == "gitops":
            rendered = box.run(
                str(TOOLS_BIN / self.helm),
                "template",
                RELEASE,
                *self.args(shape),
                "--namespace",
                box.namespace,
                "--no-hooks",
                "--skip-tests",
            ).stdout
            proc = subprocess.run(
                [str(TOOLS_BIN / "kubectl"), "--namespace", box.namespace, "apply", "-f", "-"],
                input=rendered,
                capture_output=True,
                text=True,
                env=box.env(),
                timeout=120,
                check=False,
            )
            assert proc.returncode == 0, proc.stderr
        elif step.kind == "reinstall":
            box.helm(self.helm, "uninstall", RELEASE, "--wait")
            self.drifted = False
            box.wait("the release's pods gone", lambda: not box.pods(TRITON))
            box.helm(self.helm, "install", RELEASE, *self.args(shape))
            self.history = [shape]
        elif step.kind == "undo":
            return self.undo()
        else:  # pragma: no cover - draw_steps makes no other kind
            raise AssertionError(step.kind)
        return shape.replicas, self.expected_key(shape), shape.gpus

    def undo(self) -> tuple[int | None, str | None, int | None]:
        """`kubectl rollout undo`: the previous ReplicaSet's template at the live replica count.
        When that many replicas of its shape cannot fit the pool, nothing can converge: the
        undo only proves that a later `helm upgrade` still recovers."""
        box = self.sandbox
        sets = sorted(
            box.api.list("apps/v1", "ReplicaSet", box.namespace),
            key=lambda rs: int(rs["metadata"]["annotations"]["deployment.kubernetes.io/revision"]),
        )
        if len(sets) < 2:
            return None, None, None
        template = sets[-2]["spec"]["template"]
        gpus = int(template["spec"]["containers"][0]["resources"]["requests"][GPU])
        replicas = box.deployment(DEPLOYMENT)["spec"]["replicas"]
        box.kubectl("rollout", "undo", f"deployment/{DEPLOYMENT}")
        if replicas > 2 * (GPUS_PER_NODE // gpus):
            return None, None, None
        return replicas, template["metadata"]["annotations"][KEY], gpus

    def converged(self, replicas: int, key: str, gpus: int) -> None:
        """Wait until the Deployment is rolled out: ``replicas`` pods of ``key`` with ``gpus``
        GPUs each, bound, ready, none Pending, no other pod left."""
        box = self.sandbox

        def done():
            d = box.deployment(DEPLOYMENT)
            s = d.get("status", {})
            if d["spec"]["template"]["metadata"]["annotations"][KEY] != key:
                return False
            if not (
                s.get("observedGeneration", 0) >= d["metadata"]["generation"]
                and d["spec"]["replicas"] == replicas
                and s.get("updatedReplicas") == s.get("availableReplicas") == replicas
                and s.get("replicas") == replicas
            ):
                return False
            pods = [p for p in box.pods(TRITON) if not p["metadata"].get("deletionTimestamp")]
            return (
                len(pods) == replicas
                and all(p["spec"].get("nodeName") for p in pods)
                and all(p["metadata"]["annotations"][KEY] == key for p in pods)
                and all(
                    int(p["spec"]["containers"][0]["resources"]["requests"][GPU]) == gpus
                    for p in pods
                )
            )

        try:
            box.wait(
                f"{replicas} replicas of {key} ({gpus} GPU(s) each)",
                done,
                timeout=CONVERGE_SECONDS,
            )
        except TimeoutError as exc:
            d = box.deployment(DEPLOYMENT)
            held = d["spec"]["template"]["metadata"]["annotations"][KEY]
            raise TimeoutError(
                f"{exc}\ndeployment generation {d['metadata']['generation']}, "
                f"spec.replicas {d['spec'].get('replicas')}, template key {held}"
            ) from None


def sequence_ids() -> list[int]:
    return [SEED + i for i in range(SEQUENCES)]


@pytest.mark.parametrize("seed", sequence_ids(), ids=lambda s: f"seed{s}")
def test_generated_operations_converge(sandbox, tmp_path, seed):
    rng = random.Random(seed)
    helm = ("helm3", "helm4")[seed % 2]
    steps = draw_steps(rng, STEPS)
    sandbox.register(fake.gpu_pool("gpu", 2, POOL, {}))
    release = Release(sandbox, helm, tmp_path)
    done: list[str] = []
    helm_shape: Shape | None = None  # the values Helm's current revision holds
    for step in steps:
        label = f"seed {seed} ({helm}), after {done} at {step}"
        try:
            replicas, key, gpus = release.run(step, helm_shape)
            if step.shape:  # the load finishes after the operation (the claim may be new)
                release.publish(step.shape)
            if step.kind == "undo" and replicas is None and helm_shape is not None:
                # Nothing to converge to (one ReplicaSet, or a shape that cannot fit at this
                # count): a plain upgrade re-applies what Helm holds.
                replicas, key, gpus = release.run(Step("upgrade", helm_shape), None)
            if replicas is not None:
                release.converged(replicas, key, gpus)
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"{label}:\n{exc}") from None
        if step.kind not in ("gitops", "undo"):
            helm_shape = step.shape
        done.append(str(step))


# --------------------------------------------------------------------------- the rule itself


def rendered_max_unavailable(*sets: str) -> int:
    docs = rc.documents(rc.render(set_values=sets))
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    return deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"]


@pytest.mark.parametrize(
    ("nodes", "n", "expected"),
    [(1, 1, 1), (8, 1, 2), (2, 8, 15), (2, 2, 3), (1, 4, 4)],
)
def test_the_automatic_max_unavailable_depends_on_the_values_alone(nodes, n, expected):
    sets = (
        f"cluster.nodes={nodes}",
        f"cluster.replicasPerNode={n}",
        "cluster.gpusPerNode=16",
        "model.tensorParallelSize=1",
        "cluster.nodeSelector.pool=gpu",
    )
    assert rendered_max_unavailable(*sets) == expected


def test_an_explicit_max_unavailable_below_the_bound_is_warned_about():
    sets = ("cluster.nodes=2", "cluster.replicasPerNode=8", "cluster.gpusPerNode=16")
    sets += ("model.tensorParallelSize=2", "cluster.nodeSelector.pool=gpu")
    warning = "triton.updateStrategy.maxUnavailable = 4 is below 15"
    assert warning in rc.notes(set_values=(*sets, "triton.updateStrategy.maxUnavailable=4"))
    assert "maxUnavailable =" not in rc.notes(set_values=sets)
    assert "maxUnavailable =" not in rc.notes(
        set_values=(*sets, "triton.updateStrategy.maxUnavailable=15")
    )


def test_shapes_drawn_are_valid_and_replace_is_a_change():
    rng = random.Random(1)
    for _ in range(200):
        shape = draw_shape(rng, None)
        assert shape.n * shape.gpus <= GPUS_PER_NODE
    assert replace(Shape(), n=2).sets(Shape()) == ("cluster.replicasPerNode=2",)
