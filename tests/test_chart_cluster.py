"""The chart against the local control plane (tests/kube): the real Helm 3 and 4 install,
test, upgrade and roll back a release; the loader hook with and without `--wait`;
`kubectl create job --from=cronjob/...` by the real kubectl; the Job controller's
`podFailurePolicy` on the loader's exit codes; every values file applied with server-side
dry-run against the real API server, the upstream CRDs of ServiceMonitor, PrometheusRule and
ScaledObject installed.

The fake kubelet plays the containers: the Triton pods' init container runs its own `sh`
script against the claim's directory (so a pod turns Ready only once its key's `.ready`
exists), Triton is Ready once started, and the loader is played by a rule (it publishes its
key and exits 0, or exits with the code the test gives). tests/test_staging_deploy.py runs the
real loader.
"""

from __future__ import annotations

import time

import pytest
import yaml

from tests import chart as rc
from tests.kube import nodes as fake
from tests.kube.api import ApiError
from tests.kube.kubelet import Context, Exit

pytestmark = pytest.mark.server  # the local control plane (see markers in pyproject.toml)

HELMS = ("helm3", "helm4")
STAGING = rc.VALUES_DIR / "staging.yaml"
VALUES = (None, *sorted(p.name for p in rc.VALUES_DIR.glob("*.yaml")))
DEPLOYMENT = "codegen-model-triton"
CRONJOB = "codegen-model-loader"
CLAIM = "codegen-model-triton-models"
TRITON = {"app.kubernetes.io/component": "triton"}
KEY = "model-triton/model-key"
HOOK = ("loader.hook.enabled=true",)


def staging_nodes(sandbox, count: int = 1) -> None:
    labels = yaml.safe_load(STAGING.read_text())["cluster"]["nodeSelector"]
    sandbox.register(fake.gpu_pool("gpu", count, fake.STAGING_2GPU, labels))


def chart(sandbox, *sets: str, values=(STAGING,)) -> list[str]:
    return [str(rc.CHART), *sandbox.chart_args(values, sets)]


def key_of(sandbox) -> str:
    return sandbox.deployment(DEPLOYMENT)["metadata"]["annotations"][KEY]


def rolled_out(sandbox, timeout: float = 180) -> dict:
    def complete():
        d = sandbox.deployment(DEPLOYMENT)
        s, want = d.get("status", {}), d["spec"]["replicas"]
        return (
            s.get("observedGeneration", 0) >= d["metadata"]["generation"]
            and s.get("updatedReplicas") == s.get("availableReplicas") == s.get("replicas") == want
            and d
        )

    return sandbox.wait("rollout complete", complete, timeout=timeout)


def ready_pods(sandbox) -> list[dict]:
    return [
        p
        for p in sandbox.pods(TRITON)
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p.get("status", {}).get("conditions", [])
        )
    ]


class PlayedLoader:
    """Plays the `loader` container: exit code ``codes[attempt]`` (the last one repeats); an
    exit 0 first publishes the pod's key on the claim (`.ready` last, as the loader does).
    Records what the namespace held at each publication."""

    def __init__(self, sandbox, codes=(0,)) -> None:
        self.sandbox = sandbox
        self.codes = codes
        self.published: list[tuple[str, list[dict]]] = []

    def __call__(self, ctx: Context):
        if ctx.name != "loader":
            return None
        code = self.codes[min(ctx.attempt, len(self.codes) - 1)]
        if code == 0:
            key = ctx.pod["metadata"]["annotations"][KEY]
            self.published.append((key, self.sandbox.pods(TRITON)))
            directory = ctx.volume("models") / key
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "config.pbtxt").write_text("")
            (directory / ".ready").write_text("")
        return Exit(code)


def helm_test_pod_exits(outcome: int):
    def rule(ctx: Context):
        if ctx.labels.get("app.kubernetes.io/component") == "test":
            return Exit(outcome)
        return None

    return rule


# --------------------------------------------------------------------------- helm lifecycle


@pytest.mark.parametrize("helm", HELMS)
def test_install_test_upgrade_and_rollback_with_the_real_helm(sandbox, helm):
    staging_nodes(sandbox)
    sandbox.helm(helm, "install", "codegen", *chart(sandbox))
    first = key_of(sandbox)
    assert not ready_pods(sandbox)
    sandbox.publish(CLAIM, first)
    rolled_out(sandbox)

    sandbox.rule(helm_test_pod_exits(0))
    passed = sandbox.helm(helm, "test", "codegen")
    assert "codegen-model-triton-test-inference" in passed.stdout
    assert "Succeeded" in passed.stdout

    sandbox.helm(helm, "upgrade", "codegen", *chart(sandbox, "model.revision=v2"))
    second = key_of(sandbox)
    assert second != first and second.startswith("codegen@v2/")
    sandbox.publish(CLAIM, second)
    rolled_out(sandbox)
    assert {p["metadata"]["annotations"][KEY] for p in ready_pods(sandbox)} == {second}

    sandbox.helm(helm, "rollback", "codegen", "1")
    assert key_of(sandbox) == first
    rolled_out(sandbox)
    assert {p["metadata"]["annotations"][KEY] for p in ready_pods(sandbox)} == {first}
    history = sandbox.helm(helm, "history", "codegen", "-o", "yaml").stdout
    assert [r["revision"] for r in yaml.safe_load(history)] == [1, 2, 3]

    sandbox.rule(helm_test_pod_exits(1))
    failed = sandbox.helm(helm, "test", "codegen", check=False)
    assert failed.returncode != 0


@pytest.mark.parametrize("helm", HELMS)
def test_turning_autoscaling_on_keeps_the_live_replicas(sandbox, helm):
    """On `helm upgrade` the Deployment keeps its live replicas instead of losing the field,
    which would drop it to one replica: Helm 3 (a patch) gets the live count as it is, not
    clamped (the autoscaler applies its bounds); Helm 4 (server-side apply) none once another
    manager (here `kubectl scale`, as the autoscaler does) owns the field, so it never
    conflicts. The chart reads them with `lookup` (`helm template --dry-run=server` against the
    API server); offline it cannot."""
    sets = ("cluster.nodes=2", "cluster.replicasPerNode=8", "cluster.gpusPerNode=16",
            "cluster.nodeSelector.pool=a100")  # fmt: skip
    sandbox.helm(helm, "install", "codegen", *chart(sandbox, *sets, values=()))
    for live, low, high in ((16, 1, 16), (16, 1, 6), (1, 4, 8)):
        sandbox.kubectl("scale", f"deployment/{DEPLOYMENT}", f"--replicas={live}")
        scaling = (*sets, "autoscaling.enabled=true", f"autoscaling.minReplicas={low}",
                   f"autoscaling.maxReplicas={high}")  # fmt: skip
        text = sandbox.helm(
            helm, "template", "codegen", *chart(sandbox, *scaling, values=()), "--dry-run=server"
        ).stdout
        [rendered] = [d for d in rc.documents(text) if d["kind"] == "Deployment"]
        if helm == "helm3" or live == 16 == low * 16:
            # Helm 3; or Helm 4 still the field's only owner (scaling 16 to 16 changed nothing)
            assert rendered["spec"]["replicas"] == live, (live, low, high)
        else:
            assert "replicas" not in rendered["spec"], (live, low, high)
    offline = rc.documents(rc.render(set_values=scaling))
    assert "replicas" not in next(d for d in offline if d["kind"] == "Deployment")["spec"]


def test_helm4_lowers_max_replicas_under_an_autoscaler_without_a_conflict(sandbox):
    """Once the autoscaler changed `.spec.replicas` (its manager owns the field), a Helm 4
    upgrade that lowers maxReplicas below the live count applies without a conflict (the chart
    renders no count) and leaves the count to the autoscaler. While Helm is still the field's
    only owner it re-applies the live count: an autoscaler acting between Helm's read and its
    apply then conflicts, and the upgrade is run again (docs/operations.md)."""
    staging_nodes(sandbox, 3)
    scaling = ("cluster.nodes=3", "autoscaling.enabled=true", "autoscaling.minReplicas=1")
    sandbox.helm("helm4", "install", "codegen", *chart(sandbox, *scaling))
    raised = (*scaling, "autoscaling.minReplicas=3")
    sandbox.helm("helm4", "upgrade", "codegen", *chart(sandbox, *raised))

    def replicas(n):
        return lambda: sandbox.deployment(DEPLOYMENT)["spec"].get("replicas") == n

    sandbox.wait("the autoscaler applies the minimum", replicas(3))
    lowered = (*scaling, "autoscaling.maxReplicas=2")
    sandbox.helm("helm4", "upgrade", "codegen", *chart(sandbox, *lowered))
    sandbox.wait("the autoscaler applies the maximum", replicas(2))
    owners = [
        (m["manager"], m["operation"], m.get("subresource"))
        for m in sandbox.deployment(DEPLOYMENT)["metadata"]["managedFields"]
        if "f:replicas" in m.get("fieldsV1", {}).get("f:spec", {})
    ]
    assert owners == [("kube-controller-manager", "Update", "scale")], owners


# --------------------------------------------------------------------------- the loader hook


def _wait_flag(helm: str) -> str:
    """Helm 3's `--wait`; Helm 4's equivalent (its `--wait` alone means `watcher` too)."""
    return "--wait" if helm == "helm3" else "--wait=watcher"


@pytest.mark.parametrize("helm", HELMS)
def test_wait_with_the_post_install_hook_deadlocks_until_the_timeout(sandbox, helm):
    """Helm runs post-install hooks only after `--wait` saw the resources ready, and the
    Triton pods turn ready only once the hook has loaded the model: with 2 replicas the
    install fails at `--timeout`, the hook never started (the README says what to do)."""
    staging_nodes(sandbox, 2)
    sandbox.rule(PlayedLoader(sandbox))
    proc = sandbox.helm(
        helm,
        "install",
        "codegen",
        *chart(sandbox, *HOOK, "cluster.nodes=2"),
        _wait_flag(helm),
        "--timeout",
        "10s",
        check=False,
    )
    assert proc.returncode != 0
    assert "deadline" in proc.stderr or "timed out" in proc.stderr, proc.stderr
    assert sandbox.api.list("batch/v1", "Job", sandbox.namespace) == []
    assert ready_pods(sandbox) == []


def test_helm3_wait_needs_no_ready_pod_of_a_single_replica_so_the_hook_runs(sandbox):
    """Helm 3 waits for replicas - maxUnavailable ready pods (helm pkg/kube/ready.go,
    `deploymentReady`): staging's one replica with maxUnavailable 1 needs none, so `--wait`
    returns, the post-install hook loads, and the pod turns ready after Helm is done. (Helm 4's
    watcher waits for every replica: it deadlocks here too, see above.)"""
    staging_nodes(sandbox)
    loader = PlayedLoader(sandbox)
    sandbox.rule(loader)
    sandbox.helm(
        "helm3", "install", "codegen", *chart(sandbox, *HOOK), "--wait", "--timeout", "60s"
    )
    [(key, pods_then)] = loader.published
    assert key == key_of(sandbox)
    assert [p["metadata"]["annotations"][KEY] for p in pods_then] == [key]  # it waited, unready
    rolled_out(sandbox)


@pytest.mark.parametrize("helm", HELMS)  # Helm 4 without --wait: its default hookOnly
def test_without_wait_the_post_install_hook_loads_and_the_pods_start(sandbox, helm):
    staging_nodes(sandbox)
    loader = PlayedLoader(sandbox)
    sandbox.rule(loader)
    sandbox.helm(helm, "install", "codegen", *chart(sandbox, *HOOK))
    # Helm waited for the hook Job itself: the key is published when install returns.
    [(key, _)] = loader.published
    assert key == key_of(sandbox)
    rolled_out(sandbox)
    # hook-succeeded: the hook Job is gone once it completed.
    assert sandbox.api.list("batch/v1", "Job", sandbox.namespace) == []


def _existing_claim_and_account(sandbox) -> tuple[str, ...]:
    sandbox.api.create(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "shared-models", "namespace": sandbox.namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "standard-rwx",
                "resources": {"requests": {"storage": "100Gi"}},
            },
        }
    )
    sandbox.api.create(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "loader", "namespace": sandbox.namespace},
        }
    )
    return (
        *HOOK,
        "modelRepository.persistence.existingClaim=shared-models",
        "loader.serviceAccount.create=false",
        "loader.serviceAccount.name=loader",
    )


@pytest.mark.parametrize("helm", HELMS)
def test_pre_install_hook_loads_before_any_triton_pod_exists_and_wait_succeeds(sandbox, helm):
    staging_nodes(sandbox, 2)
    loader = PlayedLoader(sandbox)
    sandbox.rule(loader)
    sets = (*_existing_claim_and_account(sandbox), "cluster.nodes=2")
    sandbox.helm(
        helm, "install", "codegen", *chart(sandbox, *sets), _wait_flag(helm), "--timeout", "180s"
    )
    [(key, pods_then)] = loader.published
    assert pods_then == []  # no GPU pod waited through the load
    assert key == key_of(sandbox)
    # --wait returned on a ready Deployment: Helm 3 once replicas - maxUnavailable = 1 pod is
    # ready, Helm 4's watcher once both are.
    assert len(ready_pods(sandbox)) >= (1 if helm == "helm3" else 2)


@pytest.mark.parametrize("helm", ["helm4"])  # pre-upgrade runs alike in Helm 3 (pre-install)
def test_pre_upgrade_hook_publishes_the_new_key_while_the_old_pods_serve(sandbox, helm):
    staging_nodes(sandbox)
    sandbox.helm(helm, "install", "codegen", *chart(sandbox))
    first = key_of(sandbox)
    sandbox.publish(CLAIM, first)
    rolled_out(sandbox)
    loader = PlayedLoader(sandbox)
    sandbox.rule(loader)
    sandbox.helm(
        helm,
        "upgrade",
        "codegen",
        *chart(sandbox, *HOOK, "model.revision=v2"),
        _wait_flag(helm),
        "--timeout",
        "180s",
    )
    [(key, pods_then)] = loader.published
    assert key == key_of(sandbox) != first
    # While the hook loaded, the old pod was still the one serving.
    assert [p["metadata"]["annotations"][KEY] for p in pods_then] == [first]
    rolled_out(sandbox)
    assert {p["metadata"]["annotations"][KEY] for p in ready_pods(sandbox)} == {key}


# --------------------------------------------------------------------------- the loader Job


def _job(sandbox, name: str) -> dict:
    return sandbox.api.get("batch/v1", "Job", sandbox.namespace, name)


def _condition(job: dict, kind: str) -> dict | None:
    return next(
        (
            c
            for c in job.get("status", {}).get("conditions", [])
            if c["type"] == kind and c["status"] == "True"
        ),
        None,
    )


def test_kubectl_create_job_from_the_cronjob_loads_the_key_the_pods_wait_for(sandbox):
    staging_nodes(sandbox)
    sandbox.helm("helm4", "install", "codegen", *chart(sandbox))
    cronjob = sandbox.api.get("batch/v1", "CronJob", sandbox.namespace, CRONJOB)
    assert cronjob["spec"]["suspend"] is True
    sandbox.wait("the Triton pod waits for its model", lambda: sandbox.pods(TRITON))
    time.sleep(2)
    assert ready_pods(sandbox) == []
    loader = PlayedLoader(sandbox)
    sandbox.rule(loader)
    sandbox.kubectl("create", "job", "load-1", f"--from=cronjob/{CRONJOB}")
    sandbox.wait("job complete", lambda: _condition(_job(sandbox, "load-1"), "Complete"))
    assert [key for key, _ in loader.published] == [key_of(sandbox)]
    rolled_out(sandbox)


@pytest.mark.parametrize(
    ("codes", "condition", "reason", "failed"),
    [
        ((75, 0), "Complete", None, 1),
        ((143, 0), "Complete", None, 1),
        ((2,), "Failed", "PodFailurePolicy", 1),
        ((1,), "Failed", "PodFailurePolicy", 1),
        ((75, 75, 75), "Failed", "BackoffLimitExceeded", 3),
    ],
    ids=["75-retried", "143-retried", "2-fails-at-once", "1-fails-at-once", "75-until-backoff"],
)
def test_the_job_controller_applies_the_pod_failure_policy(
    sandbox, codes, condition, reason, failed
):
    """Exit 75 (transient) and 143 (SIGTERM) are retried up to backoffLimit (2); anything
    else fails the Job at once (the loader's exit codes, README)."""
    sandbox.helm("helm4", "install", "codegen", *chart(sandbox))
    sandbox.rule(PlayedLoader(sandbox, codes))
    sandbox.kubectl("create", "job", "load", f"--from=cronjob/{CRONJOB}")

    def finished():
        job = _job(sandbox, "load")
        return (_condition(job, "Complete") or _condition(job, "Failed")) and job

    job = sandbox.wait("job finished", finished, timeout=150)
    assert _condition(job, condition), job["status"]
    if reason:
        assert _condition(job, condition)["reason"] == reason
    assert job["status"].get("failed", 0) == failed


# --------------------------------------------------------------------------- server-side dry-run


FEATURES = (
    "metrics.serviceMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
    "networkPolicy.enabled=true",
    "loader.hook.enabled=true",
)


def _server_dry_run(sandbox, docs: list[dict]) -> list[str]:
    """Server-side apply of every document with `dryRun=All`: validation, defaulting and
    admission run, nothing is stored. The ServiceAccounts are applied for real first, as Helm
    creates them before the pods that name them (admission looks them up)."""
    problems = []
    for doc in sorted(docs, key=lambda d: d["kind"] != "ServiceAccount"):
        doc.setdefault("metadata", {})["namespace"] = sandbox.namespace
        try:
            sandbox.api.apply(doc, dry_run=doc["kind"] != "ServiceAccount")
        except ApiError as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc}")
    return problems


@pytest.mark.parametrize("values", VALUES, ids=[v or "defaults" for v in VALUES])
@pytest.mark.parametrize(
    "sets",
    [(), FEATURES, ("autoscaling.enabled=true", "autoscaling.kind=keda")],
    ids=["plain", "features", "keda"],
)
def test_every_values_file_is_accepted_by_the_api_server(sandbox, values, sets):
    files = () if values is None else (rc.VALUES_DIR / values,)
    text = rc.render(values_files=files, set_values=sets, namespace=sandbox.namespace)
    docs = rc.documents(text)
    kinds = {d["kind"] for d in docs}
    if "metrics.serviceMonitor.enabled=true" in sets:
        assert {"ServiceMonitor", "PrometheusRule"} <= kinds
    if "autoscaling.kind=keda" in sets:
        assert "ScaledObject" in kinds
    assert _server_dry_run(sandbox, docs) == []


def test_the_crd_schemas_are_enforced_by_the_api_server(sandbox):
    """The CRDs are the upstream ones with their schemas: a field they do not define is
    refused (server-side apply validates strictly), so the test above checks CRD fields."""
    sets = (
        "metrics.serviceMonitor.enabled=true",
        "autoscaling.enabled=true",
        "autoscaling.kind=keda",
    )
    docs = rc.documents(rc.render(set_values=sets, namespace=sandbox.namespace))
    for kind in ("ServiceMonitor", "ScaledObject"):
        [doc] = [d for d in docs if d["kind"] == kind]
        doc["spec"]["notAField"] = 1
        [problem] = _server_dry_run(sandbox, [doc])
        assert "notAField" in problem


HOSTILE = {
    "duplicate-volume": (
        ("triton.extraVolumes[0].name=models", "triton.extraVolumes[0].emptyDir.medium="),
        # server-side apply's structured merge refuses it first (create: "Duplicate value")
        "duplicate entries",
    ),
    "unknown-volume-mount": (
        ("triton.extraVolumeMounts[0].name=nope", "triton.extraVolumeMounts[0].mountPath=/x"),
        'Not found: "nope"',
    ),
    "label-syntax": (("triton.podLabels.bad key=x",), "Invalid value"),
    "negative-quantity": (
        ("triton.resources.requests.memory=-1Gi",),
        "must be greater than or equal to 0",
    ),
    "int32-overflow": (
        ("triton.startupProbe.failureThreshold=2147483648",),
        "startupProbe.failureThreshold: Invalid value",
    ),
    "replicas-overflow": (("cluster.nodes=3000000000",), "spec.replicas: Invalid value"),
    "priority-class-name": (
        ("triton.priorityClassName=Not_A_DNS_Name",),
        "RFC 1123 subdomain",
    ),
    "runtime-class-name": (("triton.runtimeClassName=UPPER",), "RFC 1123 subdomain"),
    "service-account-name": (("serviceAccount.name=Bad_SA",), "RFC 1123 subdomain"),
}


@pytest.mark.parametrize(("sets", "words"), HOSTILE.values(), ids=HOSTILE.keys())
def test_values_the_schemas_miss_are_refused_by_the_api_server(sandbox, sets, words):
    """Values that strict offline validation (kubernetes-validate) let through: the real API
    server refuses what they render. Either `helm template` refuses them first (the chart's
    schema and rules), or the server does at install: never neither."""
    try:
        docs = rc.documents(rc.render(set_values=sets, namespace=sandbox.namespace))
    except rc.ChartError:
        return  # the chart refuses it first
    problems = _server_dry_run(sandbox, docs)
    assert any(words in p for p in problems), problems
