"""The chart's cluster features, rendered by the real Helm 3 and 4 and validated against the strict
Kubernetes 1.29 and 1.35 schemas: shutdown drain, pod placement knobs, MIG resource names, the
disruption budget, metrics and alerts, opt-in autoscaling, image registries, schema maxima
and the Triton image the chart defaults to (`make staging-deploy`: test_staging_deploy.py)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests import chart as rc

ROOT = Path(__file__).resolve().parent.parent


HELMS = ("helm3", "helm4")
POOL = ("cluster.nodeSelector.pool=a100",)


@cache
def rendered(helm: str, sets: tuple[str, ...] = (), values: str | None = None) -> tuple[dict, ...]:
    files = () if values is None else (rc.VALUES_DIR / values,)
    docs = tuple(rc.documents(rc.render(helm=helm, values_files=files, set_values=sets)))
    assert rc.validate(docs) == []
    return docs


def one(docs, kind: str) -> dict:
    found = [
        d
        for d in docs
        if d["kind"] == kind and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})
    ]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def triton_pod(docs) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def triton(docs) -> dict:
    return next(c for c in triton_pod(docs)["containers"] if c["name"] == "triton")


def error(helm: str, sets: tuple[str, ...]) -> str:
    with pytest.raises(rc.ChartError) as info:
        rc.render(helm=helm, set_values=sets)
    return info.value.output


# --------------------------------------------------------------------------- shutdown


@pytest.mark.parametrize("helm", HELMS)
def test_triton_leaves_the_endpoints_then_drains_within_the_grace_period(helm):
    docs = rendered(helm)
    pod, c = triton_pod(docs), triton(docs)
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) == 10
    [exit_timeout] = [a for a in c["command"] if a.startswith("--exit-timeout-secs=")]
    drain = int(exit_timeout.split("=")[1])
    assert drain >= 5
    assert int(sleep[1]) + drain < pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("helm", HELMS)
def test_a_lifecycle_value_replaces_the_default_pre_stop(helm):
    docs = rendered(
        helm,
        (
            "triton.lifecycle.preStop.httpGet.path=/drain",
            "triton.lifecycle.preStop.httpGet.port=http",
        ),
    )
    assert triton(docs)["lifecycle"]["preStop"]["httpGet"]["path"] == "/drain"
    assert "exec" not in triton(docs)["lifecycle"]["preStop"]


@pytest.mark.parametrize("helm", HELMS)
def test_a_grace_period_shorter_than_the_pre_stop_sleep_is_refused(helm):
    err = error(helm, ("triton.terminationGracePeriodSeconds=20", "triton.preStopSleepSeconds=10"))
    assert "model-triton: triton.terminationGracePeriodSeconds = 20" in err
    assert "triton.preStopSleepSeconds = 10" in err


# --------------------------------------------------------------------------- pod knobs


@pytest.mark.parametrize("helm", HELMS)
def test_priority_runtime_class_pod_labels_and_extra_volumes_reach_the_triton_pods(helm):
    docs = rendered(
        helm,
        (
            "triton.priorityClassName=serving-high",
            "triton.runtimeClassName=nvidia",
            "triton.podLabels.team=ml",
            "triton.extraVolumes[0].name=cache",
            "triton.extraVolumes[0].emptyDir.sizeLimit=1Gi",
            "triton.extraVolumeMounts[0].name=cache",
            "triton.extraVolumeMounts[0].mountPath=/cache",
        ),
    )
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "serving-high"
    assert pod["runtimeClassName"] == "nvidia"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "ml"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert {"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    assert {"name": "cache", "mountPath": "/cache"} in triton(docs)["volumeMounts"]
    assert "team" not in deployment["metadata"]["labels"]  # pod labels only


def test_by_default_no_priority_or_runtime_class_is_set():
    pod = triton_pod(rendered("helm4"))
    assert "priorityClassName" not in pod and "runtimeClassName" not in pod


# --------------------------------------------------------------------------- MIG


@pytest.mark.parametrize("helm", HELMS)
def test_a_mig_resource_name_is_requested_and_packs_like_whole_gpus(helm):
    mig = "nvidia.com/mig-3g.20gb"
    sets = (
        f"cluster.gpuResourceName={mig}",
        "cluster.gpusPerNode=4",  # 2 x 2 slices of an A100 40GB pair
        "cluster.replicasPerNode=4",
        "cluster.gpuMemoryGiB=19",  # one slice (nvidia-smi mig -lgip: 19968 MiB)
        "model.tensorParallelSize=1",
        "cluster.nodes=2",
        *POOL,
    )
    docs = rendered(helm, sets)
    resources = triton(docs)["resources"]
    assert resources["limits"] == {mig: 1, "memory": "64Gi"}
    assert resources["requests"][mig] == 1
    assert "nvidia.com/gpu" not in resources["requests"]
    # Placed by the real scheduler: tests/test_chart_scheduling.py (MIG slices).
    args = next(d for d in docs if d["kind"] == "CronJob")["spec"]["jobTemplate"]["spec"][
        "template"
    ]["spec"]["containers"][0]["args"]
    assert args[args.index("--gpu-memory-gib") + 1] == "19"  # the loader plans for the slice


# --------------------------------------------------------------------------- disruption budget


@pytest.mark.parametrize("helm", HELMS)
def test_pods_waiting_for_the_model_never_block_a_node_drain(helm):
    pdb = one(rendered(helm), "PodDisruptionBudget")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    pdb = one(
        rendered(helm, ("podDisruptionBudget.unhealthyPodEvictionPolicy=IfHealthyBudget",)),
        "PodDisruptionBudget",
    )
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "IfHealthyBudget"


# --------------------------------------------------------------------------- metrics and alerts


MONITORING = (
    "metrics.serviceMonitor.enabled=true",
    "metrics.serviceMonitor.namespace=monitoring",
    "metrics.serviceMonitor.relabelings[0].action=labeldrop",
    "metrics.serviceMonitor.relabelings[0].regex=container",
    "metrics.serviceMonitor.metricRelabelings[0].action=drop",
    "metrics.serviceMonitor.metricRelabelings[0].sourceLabels[0]=__name__",
    "metrics.serviceMonitor.metricRelabelings[0].regex=nv_cpu_.*",
    "metrics.prometheusRule.enabled=true",
    "metrics.prometheusRule.labels.release=prom",
)


@pytest.mark.parametrize("helm", HELMS)
def test_service_monitor_in_another_namespace_still_selects_the_release(helm):
    monitor = one(rendered(helm, MONITORING), "ServiceMonitor")
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["model-triton"]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["relabelings"] == [{"action": "labeldrop", "regex": "container"}]
    assert endpoint["metricRelabelings"][0]["regex"] == "nv_cpu_.*"


@pytest.mark.parametrize("helm", HELMS)
def test_prometheus_rule_alerts_on_queue_time_and_failed_inferences_of_this_release(helm):
    docs = rendered(helm, MONITORING)
    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"TritonQueueTimeHigh", "TritonInferenceFailures"}
    queue, failures = (
        alerts["TritonQueueTimeHigh"]["expr"],
        alerts["TritonInferenceFailures"]["expr"],
    )
    assert "nv_inference_queue_duration_us" in queue and "nv_inference_request_success" in queue
    assert queue.endswith("> 200000")
    assert "nv_inference_request_failure" in failures and failures.endswith("> 0")
    # The pod matcher selects this Deployment's pods (named <deployment>-<hash>-<suffix>).
    pattern = re.search(r'pod=~"([^"]+)"', queue).group(1)
    name = one(docs, "Deployment")["metadata"]["name"]
    assert re.fullmatch(pattern, f"{name}-6d5f7c9b8-x2x7q")
    assert not re.fullmatch(pattern, "other-release-6d5f7c9b8-x2x7q")
    for expr in (queue, failures):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")


# --------------------------------------------------------------------------- autoscaling


@pytest.mark.parametrize("helm", HELMS)
def test_hpa_scales_on_queue_time_within_the_pool_and_owns_the_replica_count(helm):
    sets = ("autoscaling.enabled=true",)
    docs = rendered(helm, sets, "production.yaml")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 16)  # 2 nodes x 8
    [metric] = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "triton_queue_time_us_per_request"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "50000"}
    assert "replicas" not in one(docs, "Deployment")["spec"]
    assert "replicas" in one(rendered(helm, (), "production.yaml"), "Deployment")["spec"]


@pytest.mark.parametrize("helm", HELMS)
def test_keda_scales_on_the_same_queue_time_query(helm):
    docs = rendered(
        helm,
        ("autoscaling.enabled=true", "autoscaling.kind=keda", "autoscaling.maxReplicas=6"),
        "production.yaml",
    )
    scaled = one(docs, "ScaledObject")
    assert "HorizontalPodAutoscaler" not in {d["kind"] for d in docs}
    assert scaled["spec"]["maxReplicaCount"] == 6
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    query = trigger["metadata"]["query"]
    assert "nv_inference_queue_duration_us" in query and 'model="fastertransformer"' in query
    assert trigger["metadata"]["threshold"] == "50000"


@pytest.mark.parametrize("helm", HELMS)
def test_autoscaling_beyond_the_pool_is_refused(helm):
    err = error(helm, ("autoscaling.enabled=true", "autoscaling.maxReplicas=3"))
    assert "model-triton: autoscaling.maxReplicas = 3 exceeds cluster.nodes x" in err
    err = error(helm, ("autoscaling.enabled=true", "autoscaling.minReplicas=2"))
    assert "model-triton: autoscaling.minReplicas = 2 exceeds the most replicas, 1" in err


# --------------------------------------------------------------------------- images


@pytest.mark.parametrize("helm", HELMS)
def test_global_image_registry_prefixes_every_image(helm):
    docs = rendered(helm, ("global.imageRegistry=registry.example.com/mirror",))
    images = []
    for doc in docs:
        pod = rc._pod_spec(doc)
        if pod:
            images += [c["image"] for c in pod["containers"] + pod.get("initContainers", [])]
    assert len(images) == 4
    assert all(i.startswith("registry.example.com/mirror/") for i in images), images


def test_the_default_triton_image_is_the_one_images_triton_builds():
    """The chart runs what images/triton/Dockerfile builds: Triton 23.05 (the newest the
    FasterTransformer backend builds with) under the image name its build command gives."""
    values = yaml.safe_load((rc.CHART / "values.yaml").read_text())["triton"]["image"]
    dockerfile = (ROOT / "images" / "triton" / "Dockerfile").read_text()
    (base,) = re.findall(r"^ARG BASE=(\S+)$", dockerfile, re.MULTILINE)
    assert re.findall(r"^FROM \$\{BASE\}$", dockerfile, re.MULTILINE)
    triton_version = base.split(":")[1].split("-")[0]
    assert values["tag"] == triton_version == "23.05"
    (built,) = re.findall(
        r"docker build -t \S+/(\S+):(\S+) -f images/triton/Dockerfile", dockerfile
    )
    assert built == (values["repository"], values["tag"])


# --------------------------------------------------------------------------- schema maxima


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (("model.tensorParallelSize=64",), "tensorParallelSize"),
        (("model.pipelineParallelSize=64",), "pipelineParallelSize"),
        (("triton.instanceCount=32",), "instanceCount"),
        (("triton.maxBatchSize=4096",), "maxBatchSize"),
        (("cluster.gpuResourceName=gpu",), "gpuResourceName"),
        (("autoscaling.kind=vpa",), "kind"),
        (("modelRepository.persistence.accessMode=ReadWriteSometimes",), "accessMode"),
    ],
    ids=["T", "P", "I", "maxBatchSize", "gpu-resource", "autoscaler", "access-mode"],
)
def test_schema_refuses_values_beyond_its_maxima_naming_the_key(helm, sets, key):
    err = error(helm, sets)
    assert "schema" in err and key in err


def test_every_new_value_is_in_the_schema():
    schema = json.loads((rc.CHART / "values.schema.json").read_text())["properties"]
    assert set(schema["autoscaling"]["properties"]) >= {"enabled", "kind", "hpa", "keda"}
    assert "prometheusRule" in schema["metrics"]["properties"]
    assert "imageRegistry" in schema["global"]["properties"]


# --------------------------------------------------------------------------- notes


def test_notes_tell_the_hook_user_to_raise_helms_timeout():
    notes = rc.notes(set_values=("loader.hook.enabled=true",))
    assert "Pass --timeout 14400s or more" in notes
    assert "--timeout" not in rc.notes()


@pytest.mark.parametrize("helm", HELMS)
def test_volumes_are_not_chowned_file_by_file_at_every_mount(helm):
    for doc in rendered(helm):
        pod = rc._pod_spec(doc)
        if pod is not None:
            assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def _render_against(helm: str, sandbox, sets: tuple[str, ...]):
    """`helm template --dry-run=server` by the real Helm against the local API server (what
    `lookup` sees during `helm install` and `helm upgrade`)."""
    args = ["template", "codegen", str(rc.CHART), "--dry-run=server"]
    for s in sets:
        args += ["--set", s]
    return sandbox.helm(helm, *args, check=False)


def _claim(*modes: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "shared-models"},
        "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": "1Ti"}}},
    }


@pytest.mark.server  # the local control plane (see markers in pyproject.toml)
@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(
    ("modes", "refused"),
    [
        (("ReadWriteOnce",), "is ReadWriteOnce, but cluster.nodes = 2"),
        (("ReadOnlyMany",), "is ReadOnlyMany, but the loader writes"),
        (("ReadWriteOncePod",), "is ReadWriteOncePod, but the loader and every Triton pod"),
        (("ReadWriteMany",), None),
        (("ReadWriteOnce", "ReadWriteMany"), None),
    ],
    ids=["rwo", "rox", "rwop", "rwx", "rwo+rwx"],
)
def test_an_existing_claim_is_checked_on_install_by_its_live_access_modes(
    helm, modes, refused, sandbox
):
    sets = ("modelRepository.persistence.existingClaim=shared-models", "cluster.nodes=2")
    claim = _claim(*modes)
    claim["metadata"]["namespace"] = sandbox.namespace
    sandbox.api.create(claim)
    proc = _render_against(helm, sandbox, sets)
    if refused is None:
        assert proc.returncode == 0, proc.stderr
        assert "kind: PersistentVolumeClaim" not in proc.stdout
    else:
        assert proc.returncode != 0
        assert "model-triton: the accessModes of modelRepository.persistence.existingClaim" in (
            proc.stderr
        )
        assert '"shared-models"' in proc.stderr and refused in proc.stderr
    # Offline (`helm template`) the claim cannot be read: nothing to refuse.
    assert rc.documents(rc.render(helm=helm, set_values=sets))
