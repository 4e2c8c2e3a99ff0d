"""The Helm chart, rendered offline by the real Helm 3 and Helm 4 CLIs (pinned in .tools/bin).

Every values file (and the defaults) is linted and rendered by both Helm versions; every
manifest is validated strictly against the Kubernetes 1.29 and 1.35 OpenAPI schemas; the GPU
arithmetic, the model key and the loader arguments are checked per values file; every bad-values
case must fail with its key named; optional resources are off by default and render when on.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from loader.cli import build_parser
from loader.cli.run import request_from_args
from loader.plan import check_placement
from tests import chart as rc

ROOT = Path(__file__).resolve().parent.parent

HELMS = ("helm3", "helm4")
HELM_VERSIONS = {"helm3": "v3.18.0", "helm4": "v4.1.4"}
#: The chart defaults (None) and every per-cluster values file.
VALUES = (None, *sorted(p.name for p in rc.VALUES_DIR.glob("*.yaml")))
INSTALL = "run `make install` (installs pinned helm 3 and 4 into .tools/bin)"


# --------------------------------------------------------------------------- helpers (cached)


def _files(values: str | None) -> tuple[Path, ...]:
    return () if values is None else (rc.VALUES_DIR / values,)


@cache
def rendered(helm: str, values: str | None, sets: tuple[str, ...] = ()) -> tuple[dict, ...]:
    text = rc.render(helm=helm, values_files=_files(values), set_values=sets)
    return tuple(rc.documents(text))


@cache
def _validated(doc_json: str) -> tuple[str, ...]:
    return tuple(rc.validate([json.loads(doc_json)]))


def validated(doc: dict) -> tuple[str, ...]:
    """rc.validate of one manifest, computed once per distinct manifest (Helm 3 and Helm 4
    render identical ones, see test_helm3_and_helm4_render_the_same_manifests)."""
    return _validated(json.dumps(doc, sort_keys=True))


def render_error(helm: str, sets: tuple[str, ...], values: str | None = None) -> str:
    with pytest.raises(rc.ChartError) as info:
        rc.render(helm=helm, values_files=_files(values), set_values=sets)
    return info.value.output


def one(docs, kind: str, *, hook: bool | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    if hook is not None:
        found = [
            d for d in found if ("helm.sh/hook" in (d["metadata"].get("annotations") or {})) == hook
        ]
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def kinds(docs) -> list[str]:
    return sorted(d["kind"] for d in docs)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@cache
def values_of(values: str | None) -> dict:
    base = yaml.safe_load((rc.CHART / "values.yaml").read_text())
    if values is None:
        return base
    return _merge(base, yaml.safe_load((rc.VALUES_DIR / values).read_text()))


def container(pod_spec: dict, name: str, *, init: bool = False) -> dict:
    group = pod_spec["initContainers" if init else "containers"]
    return next(c for c in group if c["name"] == name)


def loader_pod_spec(docs) -> dict:
    return one(docs, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def parse_loader_args(args: list[str]) -> argparse.Namespace:
    """The Job's arguments parsed by the real `model-loader` command line (strict: unknown
    flags exit)."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == "run"
    return parsed


def key_from_loader_args(args: list[str]) -> str:
    """The key `model-loader run` publishes for these arguments (the request its own flag
    handling builds), after the loader's own FasterTransformer placement check passes."""
    request = request_from_args(parse_loader_args(args))
    check_placement(request.parallelism, request.topology)
    return request.key


ALL_CASES = [(h, v) for h in HELMS for v in VALUES]
CASE_IDS = [f"{h}-{v or 'defaults'}" for h, v in ALL_CASES]


# --------------------------------------------------------------------------- tools


@pytest.mark.parametrize("helm", HELMS)
def test_pinned_helm_is_installed_under_tools(helm):
    path = rc.TOOLS_BIN / helm
    assert path.exists(), f"{path} is missing: {INSTALL}"
    out = subprocess.run(
        [str(path), "version", "--template", "{{.Version}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == HELM_VERSIONS[helm]


def test_default_helm_is_one_of_the_pinned_versions():
    out = subprocess.run(
        [str(rc.tool("helm")), "version", "--template", "{{.Version}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out in HELM_VERSIONS.values()


# --------------------------------------------------------------------------- lint + validation


@pytest.mark.parametrize(("helm", "values"), ALL_CASES, ids=CASE_IDS)
def test_chart_lints_strictly(helm, values):
    out = rc.lint(helm=helm, values_files=_files(values))
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize(("helm", "values"), ALL_CASES, ids=CASE_IDS)
def test_every_manifest_validates_strictly_on_kubernetes_1_29_and_1_35(helm, values):
    docs = rendered(helm, values)
    assert [p for doc in docs for p in validated(doc)] == []
    expected = {
        "Deployment",
        "Service",
        "CronJob",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "ServiceAccount",
        "Pod",
        "NetworkPolicy",
        "Secret",
    }
    assert expected <= set(kinds(docs))
    assert {d["kind"] for d in docs} - expected <= rc.CRD_KINDS


def test_kubernetes_validate_knows_the_target_versions():
    from kubernetes_validate.utils import all_versions

    assert set(rc.KUBERNETES_VERSIONS) <= set(all_versions())


def test_every_cluster_has_a_values_file():
    assert {"staging.yaml", "production.yaml", "local.yaml"} <= set(VALUES)


def test_validation_catches_an_unknown_field():
    doc = copy.deepcopy(one(rendered("helm4", None), "Deployment"))
    doc["spec"]["template"]["spec"]["containers"][0]["gpus"] = 2
    problems = rc.validate([doc])
    assert len(problems) == 2 and all("gpus" in p for p in problems)


def without_admin_token(docs) -> list[dict]:
    """The rendering with the generated admin token (random at every render) masked, after
    checking it is one: 40 letters and digits."""
    out = []
    for doc in copy.deepcopy(list(docs)):
        if doc["kind"] == "Secret" and doc["metadata"]["name"].endswith("-admin"):
            [token] = doc["data"].values()
            assert re.fullmatch(r"[A-Za-z0-9]{40}", base64.b64decode(token).decode())
            doc["data"] = {key: "<token>" for key in doc["data"]}
        out.append(doc)
    return out


@pytest.mark.parametrize("values", VALUES, ids=[v or "defaults" for v in VALUES])
def test_helm3_and_helm4_render_the_same_manifests(values):
    assert without_admin_token(rendered("helm3", values)) == without_admin_token(
        rendered("helm4", values)
    )


# --------------------------------------------------------------------------- GPU arithmetic


@pytest.mark.parametrize(("helm", "values"), ALL_CASES, ids=CASE_IDS)
def test_gpu_arithmetic_of_the_deployment(helm, values):
    v = values_of(values)
    t, p = v["model"]["tensorParallelSize"], v["model"]["pipelineParallelSize"]
    n, g, nodes = (v["cluster"][k] for k in ("replicasPerNode", "gpusPerNode", "nodes"))
    deployment = one(rendered(helm, values), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    res = container(pod, "triton")["resources"]

    assert deployment["spec"]["replicas"] == nodes * n
    if v["triton"]["backend"] == "fastertransformer":
        assert res["limits"]["nvidia.com/gpu"] == t * p
        assert res["requests"]["nvidia.com/gpu"] == t * p
        assert n * t * p <= g
    else:
        assert "nvidia.com/gpu" not in res.get("limits", {})
        assert "nvidia.com/gpu" not in res.get("requests", {})
    # no other container (the init container waiting for the model) holds a GPU
    for c in pod["initContainers"]:
        assert "nvidia.com/gpu" not in str(c.get("resources"))
    [spread] = pod["topologySpreadConstraints"]
    assert spread["maxSkew"] == 1
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    # GPU fit packs; the spread is a preference that a busy matching node cannot turn into
    # Pending pods (tests/test_chart_scheduling.py), counted per ReplicaSet on tolerated nodes.
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert "minDomains" not in spread
    assert spread["matchLabelKeys"] == ["pod-template-hash"]
    assert spread["nodeTaintsPolicy"] == "Honor"
    assert spread["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_production_fills_every_gpu_of_an_a2_megagpu_16g_node():
    v = values_of("production.yaml")
    c, m = v["cluster"], v["model"]
    assert c["gpusPerNode"] == 16
    assert c["replicasPerNode"] * m["tensorParallelSize"] * m["pipelineParallelSize"] == 16


def test_staging_runs_one_replica_of_two_gpus_per_two_gpu_node():
    v = values_of("staging.yaml")
    assert v["cluster"]["gpusPerNode"] == 2 and v["cluster"]["replicasPerNode"] == 1
    assert v["model"]["tensorParallelSize"] * v["model"]["pipelineParallelSize"] == 2


# --------------------------------------------------------------------------- model key + loader


@pytest.mark.parametrize(("helm", "values"), ALL_CASES, ids=CASE_IDS)
def test_loader_job_publishes_the_key_the_deployment_waits_for(helm, values):
    docs = rendered(helm, values)
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    args = container(loader_pod_spec(docs), "loader")["args"]

    key = key_from_loader_args(args)  # what `model-loader run` publishes for these arguments
    assert deployment["metadata"]["annotations"]["model-triton/model-key"] == key
    wait = container(pod, "wait-for-model", init=True)
    env = {e["name"]: e["value"] for e in wait["env"]}
    assert env["MODEL_PATH"] == f"/models/{key}"
    assert int(env["WAIT_TIMEOUT_SECONDS"]) > 0
    assert f"--model-repository=/models/{key}" in container(pod, "triton")["command"]


@pytest.mark.parametrize(("helm", "values"), ALL_CASES, ids=CASE_IDS)
def test_loader_args_carry_the_values(helm, values):
    v = values_of(values)
    a = parse_loader_args(container(loader_pod_spec(rendered(helm, values)), "loader")["args"])
    t = v["triton"]
    assert (a.source, str(a.repository), a.model_name) == (
        v["model"]["source"],
        "/models",
        v["model"]["name"],
    )
    assert (a.tp_size, a.pp_size) == (
        v["model"]["tensorParallelSize"],
        v["model"]["pipelineParallelSize"],
    )
    assert a.instance_count == t["instanceCount"]
    assert a.backend == t["backend"]
    assert a.dtype == (v["model"]["dtype"] or None)
    assert a.max_batch_size == t["maxBatchSize"]
    assert a.dynamic_batching == t["dynamicBatching"]["enabled"]
    if a.dynamic_batching:
        assert a.preferred_batch_size == t["dynamicBatching"]["preferredBatchSize"]
        assert a.max_queue_delay_us == t["dynamicBatching"]["maxQueueDelayMicroseconds"]
    assert a.gpu_memory_gib == v["cluster"]["gpuMemoryGiB"]
    assert (
        a.gpus_per_replica == v["model"]["tensorParallelSize"] * v["model"]["pipelineParallelSize"]
    )
    assert a.streaming == t["streaming"]


@pytest.mark.parametrize(
    ("sets", "expected_args"),
    [
        (("triton.dynamicBatching.enabled=false",), ["--no-dynamic-batching"]),
        (("triton.streaming=true",), ["--streaming"]),
        (
            ("model.revision=abc123", "model.dtype=fp16"),
            ["--revision abc123", "--dtype fp16"],
        ),
        (
            ("triton.instanceCount=3", "triton.maxBatchSize=16"),
            ["--instance-count 3", "--max-batch-size 16"],
        ),
    ],
    ids=["no-batching", "streaming", "revision-dtype", "instances"],
)
def test_changed_settings_reach_the_job_and_the_key_together(sets, expected_args):
    base = rendered("helm4", None)
    docs = rendered("helm4", None, sets)
    args = container(loader_pod_spec(docs), "loader")["args"]
    joined = " ".join(args)
    for fragment in expected_args:
        assert fragment in joined
    key = one(docs, "Deployment")["metadata"]["annotations"]["model-triton/model-key"]
    assert key == key_from_loader_args(args)
    assert key != one(base, "Deployment")["metadata"]["annotations"]["model-triton/model-key"]


def test_key_revision_comes_from_the_hf_uri_then_a_hash_of_the_source():
    def key(*sets):
        return one(rendered("helm4", None, sets), "Deployment")["metadata"]["annotations"][
            "model-triton/model-key"
        ]

    assert key("model.source=hf://Salesforce/codegen-2B-multi@v1.0").startswith("codegen@v1.0/")
    assert key("model.source=hf://a/b@v1", "model.revision=r2").startswith("codegen@r2/")
    gs = key("model.source=gs://bucket/models/codegen")
    assert gs.startswith("codegen@src-") and gs == key_from_loader_args(
        container(
            loader_pod_spec(rendered("helm4", None, ("model.source=gs://bucket/models/codegen",))),
            "loader",
        )["args"]
    )


@pytest.mark.parametrize(
    "spellings",
    [
        ["gs://bucket/models/codegen", "gs://bucket/models/codegen/", "gs://bucket//models/codegen"],
        ["file:///data/ckpt", "file:///data/ckpt/", "file://localhost/data//ckpt/",
         "file:///data/x/../ckpt"],
    ],
    ids=["gs", "local"],
)  # fmt: skip
def test_every_spelling_of_a_source_gives_the_loader_s_one_key(spellings):
    keys = set()
    for source in spellings:
        docs = rendered("helm4", None, (f"model.source={source}",))
        key = one(docs, "Deployment")["metadata"]["annotations"]["model-triton/model-key"]
        assert key == key_from_loader_args(container(loader_pod_spec(docs), "loader")["args"])
        keys.add(key)
    assert len(keys) == 1, keys


# --------------------------------------------------------------------------- Deployment shape


@pytest.mark.parametrize("values", VALUES, ids=[v or "defaults" for v in VALUES])
def test_deployment_rolls_without_surge_and_probes_triton_health(values):
    v = values_of(values)
    deployment = one(rendered("helm4", values), "Deployment")
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    pod = deployment["spec"]["template"]["spec"]
    triton = container(pod, "triton")
    # Kubernetes' gRPC probes: Triton's grpc.health.v1 service (HTTP is not on the network).
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert triton[probe]["grpc"] == {"port": 8001}
        assert "httpGet" not in triton[probe]
    startup = triton["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    assert {p["name"]: p["containerPort"] for p in triton["ports"]} == {
        "grpc": 8001,
        "metrics": 8002,
    }
    volumes = {vol["name"]: vol for vol in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": v["triton"]["shmSize"]}
    mounts = {m["name"]: m for m in triton["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True
    assert "checksum/config" in deployment["spec"]["template"]["metadata"]["annotations"]
    if v["cluster"]["tolerations"]:
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]


def test_loader_mounts_the_model_volume_read_write_at_the_same_path():
    pod = loader_pod_spec(rendered("helm4", None))
    mounts = {m["name"]: m for m in container(pod, "loader")["volumeMounts"]}
    assert mounts["models"]["mountPath"] == "/models"
    assert not mounts["models"].get("readOnly", False)
    deployment_pod = one(rendered("helm4", None), "Deployment")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["models"]["persistentVolumeClaim"][
        "claimName"
    ] == {v["name"]: v for v in deployment_pod["volumes"]}["models"]["persistentVolumeClaim"][
        "claimName"
    ]


def test_loader_is_a_suspended_cronjob_with_job_limits():
    cronjob = one(rendered("helm4", None), "CronJob")
    assert cronjob["metadata"]["name"] == "codegen-model-loader"
    assert cronjob["spec"]["suspend"] is True
    job = cronjob["spec"]["jobTemplate"]["spec"]
    v = values_of(None)["loader"]
    assert job["backoffLimit"] == v["backoffLimit"]
    assert job["activeDeadlineSeconds"] == v["activeDeadlineSeconds"]
    assert job["ttlSecondsAfterFinished"] == v["ttlSecondsAfterFinished"]
    assert "nvidia.com/gpu" not in str(job["template"]["spec"]["containers"][0]["resources"])


def test_checksum_annotation_changes_when_the_server_config_changes():
    def checksum(*sets):
        return one(rendered("helm4", None, sets), "Deployment")["spec"]["template"]["metadata"][
            "annotations"
        ]["checksum/config"]

    assert checksum() != checksum("triton.extraArgs={--log-verbose=1}")
    assert checksum() == checksum("helmTest.requestOutputLen=7")


@pytest.mark.parametrize("values", VALUES, ids=[v or "defaults" for v in VALUES])
def test_every_pod_runs_restricted(values):
    for doc in rendered("helm4", values):
        pod = rc._pod_spec(doc)
        if pod is None:
            continue
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True


def test_selector_labels_exclude_version_and_chart():
    deployment = one(rendered("helm4", None, ("commonLabels.team=ml",)), "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert set(selector) == {
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/component",
    }
    assert deployment["metadata"]["labels"]["team"] == "ml"
    assert "helm.sh/chart" in deployment["metadata"]["labels"]


def test_services_select_the_triton_pods_and_the_headless_one_has_no_cluster_ip():
    docs = rendered("helm4", None)
    selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    main, headless = services["codegen-model-triton"], services["codegen-model-triton-headless"]
    assert main["spec"]["type"] == "ClusterIP" and main["spec"]["selector"] == selector
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == selector
    assert {p["port"] for p in main["spec"]["ports"]} == {8001, 8002}
    assert {p["port"] for p in headless["spec"]["ports"]} == {8001}


def test_helm_test_pod_runs_model_loader_complete_against_the_ensemble():
    pod = one(rendered("helm4", None), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    assert c["command"][:3] == ["model-loader", "complete", "--check-ready"]
    # every flag the Pod passes is one `model-loader complete` has (values as Kubernetes
    # expands the $(VAR) references from the Pod's environment)
    env = {e["name"]: e["value"] for e in c["env"]}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in c["command"][2:]]
    args = build_parser().parse_args(["complete", *argv])
    assert args.check_ready and args.model == "codegen" and not args.stream
    assert args.protocol == "grpc"
    assert args.url == "codegen-model-triton.model-triton.svc:8001"
    assert args.prompt == env["PROMPT"] and args.max_tokens == int(env["REQUEST_OUTPUT_LEN"])
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["MODEL_NAME"] == "codegen"
    assert "TRITON_HTTP_URL" not in env
    assert env["TRITON_GRPC_URL"] == "codegen-model-triton.model-triton.svc:8001"
    assert env["PROMPT"] == "<python>def is_even(na: int) ->"


# --------------------------------------------------------------------------- bad values


BAD_VALUES = [
    pytest.param(
        ("cluster.replicasPerNode=2",), "model-triton: cluster.replicasPerNode", id="NxTxP-over-G"
    ),
    pytest.param(
        ("model.tensorParallelSize=4",),
        "model-triton: model.tensorParallelSize x model.pipelineParallelSize = 4 exceeds "
        "cluster.gpusPerNode = 2",
        id="TxP-over-G",
    ),
    pytest.param(("model.source=s3://bucket/codegen",), "model-triton: model.source", id="scheme"),
    pytest.param(("model.source=data/codegen",), "model-triton: model.source", id="relative-path"),
    pytest.param(("triton.instanceCount=0",), "model-triton: triton.instanceCount", id="I<1"),
    pytest.param(
        ("model.tensorParallelSize=0",), "model-triton: model.tensorParallelSize", id="T<1"
    ),
    pytest.param(
        ("model.pipelineParallelSize=0",), "model-triton: model.pipelineParallelSize", id="P<1"
    ),
    pytest.param(
        ("triton.dynamicBatching.preferredBatchSize={4,16}",),
        "model-triton: triton.dynamicBatching.preferredBatchSize",
        id="preferred>max",
    ),
    pytest.param(
        ("cluster.replicasPerNode=2", "cluster.gpusPerNode=4"),
        "model-triton: cluster.replicasPerNode is 2 but neither cluster.nodeSelector nor a "
        "required node affinity",
        id="N>1-without-a-dedicated-pool",
    ),
    pytest.param(
        ("triton.updateStrategy.maxUnavailable=0",),
        "model-triton: triton.updateStrategy.maxSurge and triton.updateStrategy.maxUnavailable",
        id="rollout-that-cannot-move",
    ),
    pytest.param(
        ("modelRepository.persistence.accessMode=ReadOnlyMany",),
        "model-triton: modelRepository.persistence.accessMode is ReadOnlyMany",
        id="read-only-volume",
    ),
    pytest.param(
        ("modelRepository.persistence.accessMode=ReadWriteOncePod",),
        "model-triton: modelRepository.persistence.accessMode is ReadWriteOncePod",
        id="one-pod-volume",
    ),
    pytest.param(
        ("modelRepository.persistence.accessMode=ReadWriteOnce", "cluster.nodes=2"),
        "model-triton: modelRepository.persistence.accessMode is ReadWriteOnce, but "
        "cluster.nodes = 2",
        id="one-node-volume-on-two-nodes",
    ),
    pytest.param(("triton.image.tag=",), "model-triton: triton.image.tag", id="empty-triton-tag"),
    pytest.param(
        ("triton.waitForModel.image.tag=",),
        "model-triton: triton.waitForModel.image.tag",
        id="empty-wait-tag",
    ),
    pytest.param(
        ("model.revision=", "model.source=hf://org/name@"),
        'model-triton: model.source "hf://org/name@" has an empty revision',
        id="empty-uri-revision",
    ),
]


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(("sets", "message"), BAD_VALUES)
def test_bad_values_fail_naming_the_key(helm, sets, message):
    assert message in render_error(helm, sets)


@pytest.mark.parametrize("helm", HELMS)
def test_every_cross_field_problem_is_listed_in_one_failure(helm):
    err = render_error(
        helm, ("model.tensorParallelSize=0", "triton.instanceCount=0", "model.source=s3://x/y")
    )
    problems = [line for line in err.splitlines() if line.startswith("model-triton: ")]
    assert len(problems) == 3
    for key in ("model.tensorParallelSize", "triton.instanceCount", "model.source"):
        assert any(key in p for p in problems)


@pytest.mark.parametrize("helm", HELMS)
def test_lint_fails_on_schema_errors(helm):
    # `helm lint` reports a template `fail` only as information, so the cross-field rules are
    # enforced by `helm template`/`install` (and scripts/staging-deploy.sh renders before linting).
    with pytest.raises(rc.ChartError) as info:
        rc.lint(helm=helm, set_values=("cluster.nodes=two",))
    assert "nodes" in info.value.output


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("image", ["triton.image", "triton.waitForModel.image", "loader.image"])
def test_a_tag_yaml_reads_as_a_number_is_refused_naming_the_key(helm, image, tmp_path):
    values = tmp_path / "values.yaml"
    first, *rest = image.split(".")
    nested = {"tag": 24.10}
    for part in reversed(rest):
        nested = {part: nested}
    values.write_text(yaml.safe_dump({first: nested}))
    with pytest.raises(rc.ChartError) as info:
        rc.render(helm=helm, values_files=[values])
    assert "tag" in info.value.output and "schema" in info.value.output


def test_a_digest_stands_in_for_an_empty_tag():
    digest = "sha256:" + "a" * 64
    docs = rendered("helm4", None, ("triton.image.tag=", f"triton.image.digest={digest}"))
    triton = container(one(docs, "Deployment")["spec"]["template"]["spec"], "triton")
    assert triton["image"] == f"model-triton-ft@{digest}"


@pytest.mark.parametrize("helm", HELMS)
def test_pipeline_parallel_replicas_take_t_x_p_gpus_and_fill_the_node(helm):
    sets = (
        "model.tensorParallelSize=2",
        "model.pipelineParallelSize=2",
        "cluster.replicasPerNode=4",
        "cluster.gpusPerNode=16",
        "cluster.nodes=2",
        "cluster.nodeSelector.pool=a100",
    )
    docs = rendered(helm, None, sets)
    assert [p for doc in docs for p in validated(doc)] == []
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    resources = container(pod, "triton")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 4
    assert deployment["spec"]["replicas"] == 8
    assert 4 * resources["limits"]["nvidia.com/gpu"] == 16  # N x T x P = G exactly
    args = container(loader_pod_spec(docs), "loader")["args"]
    parsed = parse_loader_args(args)
    assert (parsed.tp_size, parsed.pp_size, parsed.gpus_per_replica) == (2, 2, 4)
    key = deployment["metadata"]["annotations"]["model-triton/model-key"]
    assert "/tp2-pp2-" in key and key == key_from_loader_args(args)
    assert "WARNING" not in rc.notes(set_values=sets)


LONG_RELEASE = "a" * 53  # the longest release name Helm accepts


@pytest.mark.parametrize("helm", HELMS)
def test_every_name_fits_after_its_suffix_for_the_longest_release_name(helm):
    text = rc.render(
        helm=helm,
        release=LONG_RELEASE,
        set_values=(*HOOK, "metrics.serviceMonitor.enabled=true", "networkPolicy.enabled=true"),
    )
    docs = rc.documents(text)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert all(len(name) <= 63 for _, name in names), names
    assert all(len(name) <= 52 for kind, name in names if kind == "CronJob")
    assert len(set(names)) == len(names)
    services = [n for k, n in names if k == "Service"]
    assert len(services) == 2 and all(n[0].isalpha() and not n.endswith("-") for n in services)
    assert one(docs, "PersistentVolumeClaim")["metadata"]["name"].endswith("-models")
    assert [p for doc in docs for p in validated(doc)] == []


@pytest.mark.parametrize("helm", HELMS)
def test_user_labels_may_not_name_the_standard_labels(helm):
    sets = (
        "commonLabels.app\\.kubernetes\\.io/name=other",
        "triton.podLabels.app\\.kubernetes\\.io/component=other",
        "metrics.serviceMonitor.labels.helm\\.sh/chart=other",
        "commonLabels.team=ml",
    )
    err = render_error(helm, sets)
    for key, label in (
        ("commonLabels", "app.kubernetes.io/name"),
        ("triton.podLabels", "app.kubernetes.io/component"),
        ("metrics.serviceMonitor.labels", "helm.sh/chart"),
    ):
        assert f'model-triton: {key} sets "{label}", a label the chart writes itself' in err
    docs = rendered(helm, None, ("commonLabels.team=ml", "triton.podLabels.team=serving"))
    deployment = one(docs, "Deployment")
    assert deployment["metadata"]["labels"]["team"] == "ml"
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "serving"


def test_n_above_one_with_a_node_affinity_is_a_dedicated_pool():
    sets = (
        "cluster.replicasPerNode=2",
        "cluster.gpusPerNode=4",
        "cluster.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key=pool",
        "cluster.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
    )
    assert one(rendered("helm4", None, sets), "Deployment")["spec"]["replicas"] == 2


def test_python_backend_skips_the_gpu_rules():
    docs = rendered("helm4", "local.yaml", ("cluster.replicasPerNode=3",))
    assert one(docs, "Deployment")["spec"]["replicas"] == 3


SCHEMA_ERRORS = [
    # (sets, key named, Helm 3 wording, Helm 4 wording)
    pytest.param(
        ("cluster.gpuPerNode=2",),
        "gpuPerNode",
        "Additional property gpuPerNode is not allowed",
        "additional properties 'gpuPerNode' not allowed",
        id="unknown-key",
    ),
    pytest.param(
        ("surprise=1",),
        "surprise",
        "Additional property surprise is not allowed",
        "additional properties 'surprise' not allowed",
        id="unknown-top-level-key",
    ),
    pytest.param(
        ("cluster.nodes=two",),
        "nodes",
        "Invalid type. Expected: integer",
        "got string, want integer",
        id="wrong-type",
    ),
    pytest.param(
        ("triton.backend=onnx",),
        "backend",
        "must be one of the following",
        "value must be one of",
        id="enum",
    ),
    pytest.param(
        ("cluster.nodes=0",), "nodes", "Must be greater than or equal to 1", "minimum", id="range"
    ),
]


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(("sets", "key", "helm3_words", "helm4_words"), SCHEMA_ERRORS)
def test_schema_rejects_malformed_values(helm, sets, key, helm3_words, helm4_words):
    err = render_error(helm, sets)
    assert "schema" in err
    assert key in err
    assert (helm3_words if helm == "helm3" else helm4_words) in err


def _has_doc_comment(lines: list[str], i: int) -> bool:
    """A `# --` comment in the comment block directly above line i."""
    j = i - 1
    while j >= 0 and lines[j].strip().startswith("#"):
        if lines[j].strip().startswith("# --"):
            return True
        j -= 1
    return False


def _ancestors(lines: list[str], i: int):
    indent = len(lines[i]) - len(lines[i].lstrip())
    for j in range(i - 1, -1, -1):
        stripped = lines[j].strip()
        if not stripped or stripped.startswith("#"):
            continue
        k = len(lines[j]) - len(lines[j].lstrip())
        if k < indent:
            yield j
            indent = k


def test_values_yaml_documents_every_key():
    lines = (rc.CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        if stripped.split(":", 1)[1].strip() == "":  # a parent object: its children carry docs
            continue
        if not (
            _has_doc_comment(lines, i)
            or any(_has_doc_comment(lines, a) for a in _ancestors(lines, i))
        ):
            undocumented.append(stripped)
    assert undocumented == []


def test_schema_is_strict_on_every_own_object():
    import json

    schema = json.loads((rc.CHART / "values.schema.json").read_text())
    free = {
        "nodeSelector",
        "tolerations",
        "affinity",
        "extraEnv",
        "requests",
        "limits",
        "allowedFrom",
        "podSecurityContext",
        "containerSecurityContext",
        "commonLabels",
        "annotations",
        "podAnnotations",
        "podLabels",
        "lifecycle",
        "labels",
        "global",
        "claims",
    }
    loose = []

    def walk(node, path):
        own = node.get("type") == "object" and path and path[-1] not in free
        if own and node.get("additionalProperties") is not False:
            loose.append(".".join(path))
        for name, child in (node.get("properties") or {}).items():
            walk(child, [*path, name])

    walk(schema, [])
    assert loose == []
    assert schema["additionalProperties"] is False


# --------------------------------------------------------------------------- NOTES (Helm 4)
# NOTES.txt is printed by `helm install`; offline only Helm 4 can (`--dry-run=client`): Helm 3's
# dry run needs a cluster and `helm template` never renders NOTES.


def test_leftover_gpus_are_a_warning_in_notes():
    notes = rc.notes(set_values=("cluster.gpusPerNode=4",))
    assert "WARNING: model-triton: cluster.replicasPerNode" in notes
    assert "2 GPU(s) per node stay idle" in notes


@pytest.mark.parametrize("values", ["staging.yaml", "production.yaml", "local.yaml"])
def test_values_files_leave_no_gpu_idle(values):
    notes = rc.notes(values_files=_files(values))
    assert "WARNING" not in notes
    assert "kubectl -n model-triton create job" in notes
    assert "--from=cronjob/codegen-model-loader" in notes


@pytest.mark.parametrize(
    ("values", "follows", "needle"),
    [
        ("staging.yaml", True, "followed (model.followSource)"),
        ("production.yaml", False, "not pinned, not followed"),
    ],
)
def test_staging_and_production_say_whether_they_follow_their_source(values, follows, needle):
    """Each either opts in to following its branch or pins the key's revision; NOTES says which."""
    args = container(loader_pod_spec(rendered("helm4", values)), "loader")["args"]
    request = request_from_args(parse_loader_args(args))
    assert request.follow_source is follows
    assert follows or request.revision  # not followed: a pinned revision
    assert needle in rc.notes(values_files=_files(values))


def test_a_source_pinned_to_a_commit_is_reported_as_pinned():
    commit = "0123456789abcdef0123456789abcdef01234567"
    notes = rc.notes(set_values=(f"model.source=hf://org/name@{commit}",))
    assert "pinned to a commit" in notes


def test_the_loader_job_fails_fast_on_bad_input_and_retries_transient_failures():
    docs = rendered("helm4", None, ("loader.prune.enabled=true", "loader.prune.keep=3"))
    job = one(docs, "CronJob")["spec"]["jobTemplate"]["spec"]
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }  # fmt: skip
    assert rules[1]["action"] == "FailJob"
    assert rules[1]["onExitCodes"] == {
        "containerName": "loader", "operator": "NotIn", "values": [75, 143],
    }  # fmt: skip
    from loader.cli import EXIT_TERMINATED
    from loader.errors import EXIT_TRANSIENT

    assert {EXIT_TRANSIENT, EXIT_TERMINATED} == set(rules[1]["onExitCodes"]["values"])
    assert job["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    args = container(job["template"]["spec"], "loader")["args"]
    assert parse_loader_args(args).prune_keep == 3
    assert (
        "--prune-keep" not in container(loader_pod_spec(rendered("helm4", None)), "loader")["args"]
    )


# --------------------------------------------------------------------------- optional resources


OPTIONAL = [
    pytest.param("ServiceMonitor", ("metrics.serviceMonitor.enabled=true",), id="servicemonitor"),
    pytest.param(
        "Job",
        (
            "loader.hook.enabled=true",
            "modelRepository.persistence.existingClaim=models",
            "loader.serviceAccount.create=false",
            "loader.serviceAccount.name=loader",
        ),
        id="hook-job",
    ),
]


@pytest.mark.parametrize(("kind", "sets"), OPTIONAL)
def test_optional_resource_is_not_rendered_by_default(kind, sets):
    assert kind not in kinds(rendered("helm4", None))


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(("kind", "sets"), OPTIONAL)
def test_optional_resource_is_rendered_when_enabled(helm, kind, sets):
    docs = rendered(helm, None, sets)
    assert kind in kinds(docs)
    non_crd = [d for d in docs if d["kind"] not in rc.CRD_KINDS]
    assert rc.validate(non_crd) == []


def test_service_monitor_scrapes_the_metrics_port_of_the_triton_service():
    docs = rendered(
        "helm4",
        None,
        ("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom"),
    )
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    service = next(
        d for d in docs if d["kind"] == "Service" and "headless" not in d["metadata"]["name"]
    )
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_network_policies_are_not_rendered_when_disabled():
    docs = rendered("helm4", None, ("networkPolicy.enabled=false",))
    assert "NetworkPolicy" not in kinds(docs)


def test_network_policy_admits_the_serving_port_from_the_given_peers_and_metrics_from_prometheus():
    docs = rendered("helm4", None, ("networkPolicy.allowedFrom[0].podSelector.matchLabels.app=gw",))
    policy = one(
        [d for d in docs if d["metadata"]["name"] == "codegen-model-triton"], "NetworkPolicy"
    )
    assert (
        policy["spec"]["podSelector"]["matchLabels"]
        == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    )
    serving, metrics = policy["spec"]["ingress"]
    assert serving["from"][-1] == {"podSelector": {"matchLabels": {"app": "gw"}}}
    assert sorted(p["port"] for p in serving["ports"]) == [8001]  # HTTP is on the pod's loopback
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert [p["port"] for p in metrics["ports"]] == [8002]


HOOK = ("loader.hook.enabled=true",)
HOOK_ON_EXISTING = OPTIONAL[1].values[1]


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(
    ("sets", "phases"),
    [
        (HOOK, "post-install,pre-upgrade,pre-rollback"),
        (HOOK_ON_EXISTING, "pre-install,pre-upgrade,pre-rollback"),
    ],
    ids=["chart-creates-claim", "existing-claim-and-account"],
)
def test_hook_job_loads_before_an_upgrade_and_when_the_claim_exists_at_install(helm, sets, phases):
    docs = rendered(helm, None, sets)
    job = one(docs, "Job")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == phases
    assert "hook-succeeded" in annotations["helm.sh/hook-delete-policy"]
    hook = job["spec"]["template"]["spec"]["containers"][0]
    assert hook["args"] == container(loader_pod_spec(docs), "loader")["args"]
    assert key_from_loader_args(hook["args"]) == annotations["model-triton/model-key"]
    assert {"name": "MODEL_PATH", "value": f"/models/{annotations['model-triton/model-key']}"} in (
        hook["env"]
    )
    assert (
        job["spec"]["activeDeadlineSeconds"] == values_of(None)["loader"]["activeDeadlineSeconds"]
    )
    account = job["spec"]["template"]["spec"]["serviceAccountName"]
    assert account == ("loader" if "pre-install" in phases else "codegen-model-triton-loader")
    assert validated(job) == ()
    # The loader's NetworkPolicy, as a hook of the same events just before the Job (a
    # pre-install hook runs before the release's own policy exists).
    [fence] = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and "helm.sh/hook" in d["metadata"].get("annotations", {})
    ]
    assert fence["metadata"]["annotations"]["helm.sh/hook"] == phases
    assert int(fence["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        annotations["helm.sh/hook-weight"]
    )
    [own] = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "codegen-model-loader"
    ]
    assert fence["spec"] == own["spec"]


def _run_hook_script(hook: dict, model_path: Path, args: list[str]):
    command = hook["command"]
    assert command[:2] == ["sh", "-c"] and command[3] == "model-loader"
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "MODEL_PATH": str(model_path)}
    return subprocess.run(
        [*command, *args], env=env, capture_output=True, text=True, check=False, timeout=120
    )


def test_hook_skips_a_published_key_and_runs_the_loader_otherwise(tmp_path):
    hook = one(rendered("helm4", None, HOOK), "Job")["spec"]["template"]["spec"]["containers"][0]
    published = tmp_path / "published"
    published.mkdir()
    (published / ".ready").write_text("")
    done = _run_hook_script(hook, published, hook["args"])
    assert done.returncode == 0 and "is published; nothing to load" in done.stdout
    # Not published: the real model-loader runs with the Job's arguments (here --help, to run
    # nothing heavy; the full argument list is checked against the loader's parser above).
    fresh = _run_hook_script(hook, tmp_path / "absent", ["run", "--help"])
    assert fresh.returncode == 0, fresh.stderr
    assert "--tp-size" in fresh.stdout


def test_pvc_is_rendered_by_default_and_kept_on_uninstall():
    pvc = one(rendered("helm4", None), "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "storageClassName" not in pvc["spec"]
    pvc = one(
        rendered("helm4", None, ("modelRepository.persistence.storageClass=-",)),
        "PersistentVolumeClaim",
    )
    assert pvc["spec"]["storageClassName"] == ""


def test_existing_claim_replaces_the_pvc_everywhere():
    docs = rendered("helm4", None, ("modelRepository.persistence.existingClaim=shared-models",))
    assert "PersistentVolumeClaim" not in kinds(docs)
    for pod in (one(docs, "Deployment")["spec"]["template"]["spec"], loader_pod_spec(docs)):
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims == ["shared-models"]


def test_secrets_are_referenced_not_embedded_and_a_missing_key_fails_the_mount():
    docs = rendered(
        "helm4",
        None,
        (
            "loader.hfTokenSecret.name=hf",
            "loader.hfTokenSecret.key=hf-token",
            "loader.gcsCredentialsSecret.name=gcs",
        ),
    )
    # The only Secret the chart renders is the admin token it generates (_security.tpl).
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [
        "codegen-model-triton-admin"
    ]
    pod = loader_pod_spec(docs)
    env = {e["name"]: e for e in container(pod, "loader")["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container(pod, "loader")["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["hf-token"]["secret"] == {
        "secretName": "hf",
        "items": [{"key": "hf-token", "path": "token"}],
    }
    assert env["HF_TOKEN_FILE"]["value"] == f"{mounts['hf-token']}/token"
    assert volumes["gcs-credentials"]["secret"] == {
        "secretName": "gcs",
        "items": [{"key": "key.json", "path": "key.json"}],
    }
    assert env["GOOGLE_APPLICATION_CREDENTIALS"]["value"] == f"{mounts['gcs-credentials']}/key.json"


def test_the_loader_reads_the_token_file_the_chart_points_it_to(tmp_path, monkeypatch):
    from loader.sources import FetchOptions
    from loader.sources.hf import resolve_token

    pod = loader_pod_spec(rendered("helm4", None, ("loader.hfTokenSecret.name=hf",)))
    [variable] = [e["name"] for e in container(pod, "loader")["env"] if "HF_TOKEN" in e["name"]]
    token = tmp_path / "token"
    token.write_text("hf_secret\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_TOKEN_FILE", raising=False)
    monkeypatch.setenv(variable, str(token))
    assert resolve_token(FetchOptions()) == "hf_secret"


def test_only_the_loader_has_a_storage_identity():
    docs = rendered(
        "helm4",
        None,
        (
            "loader.serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account="
            "loader@p.iam.gserviceaccount.com",
        ),
    )
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    loader = accounts["codegen-model-triton-loader"]
    assert loader["metadata"]["annotations"] == {
        "iam.gke.io/gcp-service-account": "loader@p.iam.gserviceaccount.com"
    }
    assert "annotations" not in accounts["codegen-model-triton"]["metadata"]
    assert loader_pod_spec(docs)["serviceAccountName"] == "codegen-model-triton-loader"
    for kind in ("Deployment", "Pod"):
        assert rc._pod_spec(one(docs, kind))["serviceAccountName"] == "codegen-model-triton"
    assert all(a["automountServiceAccountToken"] is False for a in accounts.values())


# --------------------------------------------------------------------------- the render script


def test_render_script_prints_the_local_resources_and_validates(capsys):
    assert rc.main(["-f", str(rc.VALUES_DIR / "local.yaml"), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "Deployment" in out and "image=model-triton-cpu:24.08 gpus=0" in out
    assert "--backend python" in out
    assert "every manifest valid (strict) on Kubernetes 1.29.0, 1.35.0" in out


def test_render_script_exits_2_on_bad_values(capsys):
    assert rc.main(["--set", "triton.instanceCount=0"]) == 2
    assert "model-triton: triton.instanceCount" in capsys.readouterr().err


# --------------------------------------------------------------------------- make staging-deploy


def _staging_deploy(**env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "staging-deploy.sh")],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


@pytest.mark.slow
def test_staging_deploy_dry_run_renders_and_validates_without_a_cluster():
    proc = _staging_deploy(DRY_RUN="1", KUBECTL="/nonexistent/kubectl")
    assert proc.returncode == 0, proc.stderr
    key = one(rendered("helm4", "staging.yaml"), "Deployment")["metadata"]["annotations"][
        "model-triton/model-key"
    ]
    assert f"==> model key: {key}" in proc.stdout
    assert "every manifest valid (strict) on Kubernetes 1.29.0, 1.35.0" in proc.stdout
    assert "nothing was sent to a cluster" in proc.stdout


@pytest.mark.slow
def test_staging_deploy_dry_run_fails_on_bad_values():
    proc = _staging_deploy(DRY_RUN="1", HELM_ARGS="--set cluster.replicasPerNode=2")
    assert proc.returncode != 0
    assert "model-triton: cluster.replicasPerNode" in proc.stderr


@pytest.mark.slow
def test_staging_deploy_refuses_without_kubectl_before_touching_anything():
    proc = _staging_deploy(YES="1", KUBECTL="/nonexistent/kubectl")
    assert proc.returncode == 1
    assert "/nonexistent/kubectl not found" in proc.stderr


def test_image_pull_secrets_reach_every_pod():
    docs = rendered(
        "helm4",
        None,
        (
            "imagePullSecrets={reg-a,reg-b}",
            "loader.hook.enabled=true",
            "modelRepository.persistence.existingClaim=models",
            "serviceAccount.create=false",
            "serviceAccount.name=loader",
        ),
    )
    pods = [rc._pod_spec(d) for d in docs if rc._pod_spec(d) is not None]
    assert {d["kind"] for d in docs if rc._pod_spec(d) is not None} == {
        "Deployment",
        "CronJob",
        "Job",
        "Pod",
    }
    for pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "reg-a"}, {"name": "reg-b"}]
    assert all(
        "imagePullSecrets" not in rc._pod_spec(d)
        for d in rendered("helm4", None)
        if rc._pod_spec(d) is not None
    )
