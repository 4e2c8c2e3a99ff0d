"""The OpenAI-compatible completions service in the chart (`openai.enabled`), rendered offline by
the real Helm 3 and Helm 4 and validated strictly against the Kubernetes 1.29 and 1.35 schemas.

Off by default under the defaults and every values file; when on, under each of them: its
Deployment (the `completions-service` command line of the service's contract, restricted pod
security, probes on /health/live and /health/ready, the API keys as a read-only file from an
existing Secret), Service (8080, `http`), NetworkPolicy, PodDisruptionBudget and opt-in
HorizontalPodAutoscaler; Triton's gRPC port admits its pods, or only them
(`networkPolicy.tritonFrom: openai`). Values that cannot work together are refused naming the
key. tests/test_chart_openai_cluster.py applies it on the local control plane.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from hypothesis import strategies as st

from tests import chart as rc
from tests.chartkit import generated, get, names_a_key, render_values

HELMS = ("helm3", "helm4")
VALUES = (None, *sorted(p.name for p in rc.VALUES_DIR.glob("*.yaml")))
IDS = [v or "defaults" for v in VALUES]
ON = ("openai.enabled=true",)
NAME = "codegen-model-triton-openai"
#: The flags of `completions-service`: its command-line contract, and the header (with the file
#: of its token) that admits it to Triton's restricted protocols (it reads `model-config`).
SERVICE_FLAGS = {
    "--triton-url",
    "--triton-model",
    "--listen",
    "--api-keys-file",
    "--max-concurrency",
    "--max-queue",
    "--max-body-bytes",
    "--request-timeout-s",
    "--triton-protocol-header",
    "--triton-protocol-token-file",
}


def _files(values: str | None) -> tuple[Path, ...]:
    return () if values is None else (rc.VALUES_DIR / values,)


@cache
def rendered(helm: str, values: str | None, sets: tuple[str, ...] = ()) -> tuple[dict, ...]:
    text = rc.render(helm=helm, values_files=_files(values), set_values=sets)
    return tuple(rc.documents(text))


def refused(sets: tuple[str, ...], helm: str = "helm4") -> str:
    with pytest.raises(rc.ChartError) as info:
        rc.render(helm=helm, set_values=sets)
    return info.value.output


def component(doc: dict) -> str | None:
    return (doc["metadata"].get("labels") or {}).get("app.kubernetes.io/component")


def of(docs, kind: str, comp: str = "openai") -> list[dict]:
    return [d for d in docs if d["kind"] == kind and component(d) == comp]


def one(docs, kind: str, comp: str = "openai") -> dict:
    found = of(docs, kind, comp)
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def service_container(docs) -> dict:
    [c] = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def flags(command: list[str]) -> dict[str, str]:
    """`--name=value` arguments as a map (every argument after the program is one)."""
    out = {}
    for arg in command[1:]:
        name, sep, value = arg.partition("=")
        assert arg.startswith("--") and sep, f"{arg!r} is not --flag=value"
        assert name not in out, f"{name} given twice"
        out[name] = value
    return out


def pod_labels(docs) -> dict[str, dict]:
    """The labels of every pod the rendering runs, by component."""
    labels = {}
    for doc in docs:
        pod_template = {
            "Deployment": lambda d: d["spec"]["template"],
            "CronJob": lambda d: d["spec"]["jobTemplate"]["spec"]["template"],
            "Pod": lambda d: d,
        }.get(doc["kind"])
        if pod_template is not None:
            meta = pod_template(doc)["metadata"]
            labels[meta["labels"]["app.kubernetes.io/component"]] = meta["labels"]
    return labels


def matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# --------------------------------------------------------------------------- off by default


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("values", VALUES, ids=IDS)
def test_off_by_default_under_every_values_file(helm, values):
    docs = rendered(helm, values)
    assert [d["metadata"]["name"] for d in docs if component(d) == "openai"] == []
    assert "openai" not in json.dumps(docs)
    # Triton admits the test pod and the labelled clients, as before.
    [triton_np] = [d for d in docs if d["kind"] == "NetworkPolicy" and component(d) == "triton"]
    peers = triton_np["spec"]["ingress"][0]["from"]
    assert all("openai" not in json.dumps(p) for p in peers)


def test_notes_say_nothing_of_it_by_default():
    assert "OpenAI" not in rc.notes()


# --------------------------------------------------------------------------- rendered when on


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("values", VALUES, ids=IDS)
def test_rendered_and_valid_under_every_values_file(helm, values):
    docs = rendered(helm, values, ON)
    assert rc.validate(docs) == []
    monitored = bool(of(docs, "ServiceMonitor", "triton"))  # metrics.serviceMonitor.enabled
    assert sorted(d["kind"] for d in docs if component(d) == "openai") == sorted(
        ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service"]
        + ["ServiceMonitor"] * monitored
    )
    deployment = one(docs, "Deployment")
    c = service_container(docs)
    # The command line of the service's contract, Triton's Service and the `llm` model.
    args = flags(c["command"])
    assert c["command"][0] == "completions-service"
    assert set(args) <= SERVICE_FLAGS
    [triton_service] = [
        s for s in of(docs, "Service", "triton") if s["spec"].get("clusterIP") != "None"
    ]
    grpc = next(p for p in triton_service["spec"]["ports"] if p["name"] == "grpc")
    assert args["--triton-url"] == (
        f"grpc://{triton_service['metadata']['name']}.model-triton.svc:{grpc['port']}"
    )
    assert args["--triton-model"] == "llm"
    assert args["--listen"] == "0.0.0.0:8080"
    assert "--api-keys-file" not in args  # no Secret named: no authentication
    # The Service: port 8080 named http, onto the container's port, selecting the pods.
    service = one(docs, "Service")
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(service["spec"]["selector"], template_labels)
    assert matches(deployment["spec"]["selector"]["matchLabels"], template_labels)
    # The service's selector matches none of the Triton, loader or test pods.
    others = {k: v for k, v in pod_labels(docs).items() if k != "openai"}
    assert others and not any(matches(service["spec"]["selector"], v) for v in others.values())
    # Probes on the service's health paths.
    assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    # Image and pull policy like the chart's other images.
    assert c["image"] == "model-triton-completions:0.1.0"
    assert c["imagePullPolicy"] == "IfNotPresent"
    # The PodDisruptionBudget selects the service's pods.
    pdb = one(docs, "PodDisruptionBudget")
    assert matches(pdb["spec"]["selector"]["matchLabels"], template_labels)
    assert pdb["spec"]["maxUnavailable"] == 1
    # Triton still runs the command the chart always rendered.
    assert rc.triton_command(docs)[0] == "tritonserver"


@pytest.mark.parametrize("values", VALUES, ids=IDS)
def test_the_pods_are_restricted_like_the_triton_pods(values):
    docs = rendered("helm4", values, ON)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    triton_pod = one(docs, "Deployment", "triton")["spec"]["template"]["spec"]
    triton = next(c for c in triton_pod["containers"] if c["name"] == "triton")
    c = service_container(docs)
    assert pod["securityContext"] == triton_pod["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == triton["securityContext"]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == triton_pod["serviceAccountName"]
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    # It writes only /tmp, a bounded emptyDir; it reads Triton's admin token (below).
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["tmp"] == {"name": "tmp", "mountPath": "/tmp"}
    assert all(m.get("readOnly") for name, m in mounts.items() if name != "tmp")
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}} in pod["volumes"]
    assert set(mounts) == {v["name"] for v in pod["volumes"]} == {"tmp", "triton-admin"}
    assert c["resources"]["requests"] == {"cpu": "500m", "memory": "256Mi"}
    assert c["resources"]["limits"] == {"memory": "1Gi"}


def test_the_values_reach_the_command_line_and_roll_the_pods():
    base = rendered("helm4", None, ON)
    sets = (
        *ON,
        "openai.maxConcurrency=7",
        "openai.maxQueue=0",
        "openai.maxBodyBytes=4096",
        "openai.requestTimeoutSeconds=90",
        "openai.replicas=3",
    )
    docs = rendered("helm4", None, sets)
    args = flags(service_container(docs)["command"])
    assert (
        args["--max-concurrency"],
        args["--max-queue"],
        args["--max-body-bytes"],
        args["--request-timeout-s"],
    ) == ("7", "0", "4096", "90")
    assert one(docs, "Deployment")["spec"]["replicas"] == 3

    def checksum(d):
        return one(d, "Deployment")["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"
        ]

    assert checksum(docs) != checksum(base)


def test_a_large_body_limit_is_printed_as_an_integer():
    # Helm 4 reads numbers as floats: 1073741824 must not become 1.073741824e+09.
    docs = rendered("helm4", None, (*ON, "openai.maxBodyBytes=1073741824"))
    assert flags(service_container(docs)["command"])["--max-body-bytes"] == "1073741824"


def test_the_image_follows_the_registry_tag_and_digest():
    sets = (*ON, "global.imageRegistry=registry.example.com/mirror", "openai.image.tag=1.2.3")
    c = service_container(rendered("helm4", None, sets))
    assert c["image"] == "registry.example.com/mirror/model-triton-completions:1.2.3"
    digest = "sha256:" + "ab" * 32
    c = service_container(rendered("helm4", None, (*ON, f"openai.image.digest={digest}")))
    assert c["image"] == f"model-triton-completions@{digest}"


# --------------------------------------------------------------------------- API keys


@pytest.mark.parametrize("helm", HELMS)
def test_api_keys_come_from_an_existing_secret_as_a_read_only_file(helm):
    sets = (*ON, "openai.apiKeys.existingSecret=editor-keys", "openai.apiKeys.key=lines.txt")
    docs = rendered(helm, None, sets)
    assert rc.validate(docs) == []
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = service_container(docs)
    [volume] = [v for v in pod["volumes"] if "secret" in v and v["name"] != "triton-admin"]
    assert volume["secret"] == {
        "secretName": "editor-keys",
        "items": [{"key": "lines.txt", "path": "keys"}],
    }
    [mount] = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    keys_file = flags(c["command"])["--api-keys-file"]
    assert keys_file == f"{mount['mountPath']}/keys"
    # The chart never holds a key: the only Secret it renders is Triton's admin token.
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [
        "codegen-model-triton-admin"
    ]
    assert "editor-keys" not in json.dumps([d for d in docs if component(d) != "openai"])


@pytest.mark.parametrize(
    "sets",
    [
        ("openai.apiKeys.key=..keys",),
        ("openai.apiKeys.key=a/b",),
        ("openai.apiKeys.existingSecret=Not_A_Name",),
        ("openai.apiKeys.token=sk-123",),  # a key is never a value
    ],
    ids=["dot-dot", "slash", "secret-name", "unknown-key"],
)
def test_the_schema_refuses_bad_secret_references(sets):
    err = refused((*ON, *sets))
    assert "schema" in err and "apiKeys" in err


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("values", VALUES, ids=IDS)
def test_the_service_reads_the_model_config_with_triton_s_admin_token(helm, values):
    """`model-config` is restricted by default and the service reads the `llm` model's
    configuration: it gets the admin header and the token Triton itself is given, as a file."""
    docs = rendered(helm, values, ON)
    c = service_container(docs)
    args = flags(c["command"])
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    triton_pod = one(docs, "Deployment", "triton")["spec"]["template"]["spec"]
    triton = next(x for x in triton_pod["containers"] if x["name"] == "triton")
    [token_env] = [e for e in triton["env"] if e["name"] == "TRITON_ADMIN_TOKEN"]
    reference = token_env["valueFrom"]["secretKeyRef"]
    header = args["--triton-protocol-header"]
    restricted = rc.triton_command(docs)
    assert any(a.startswith("--grpc-restricted-protocol=") for a in restricted)
    assert header == "triton-grpc-protocol-admin-key"
    [volume] = [v for v in pod["volumes"] if v["name"] == "triton-admin"]
    assert volume["secret"] == {
        "secretName": reference["name"],
        "items": [{"key": reference["key"], "path": "token"}],
    }
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "triton-admin"]
    assert mount["readOnly"] is True
    assert args["--triton-protocol-token-file"] == f"{mount['mountPath']}/token"


def test_the_admin_token_follows_the_header_and_secret_values():
    sets = (
        *ON,
        "triton.security.adminHeader=ops",
        "triton.security.adminSecret.name=triton-ops",
        "triton.security.adminSecret.key=tok",
    )
    docs = rendered("helm4", None, sets)
    args = flags(service_container(docs)["command"])
    assert args["--triton-protocol-header"] == "triton-grpc-protocol-ops"
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "triton-admin"]
    assert volume["secret"] == {
        "secretName": "triton-ops",
        "items": [{"key": "tok", "path": "token"}],
    }


@pytest.mark.parametrize(
    "protocols",
    [[], ["logging", "trace", "shared-memory", "model-repository", "statistics", "metadata"]],
    ids=["none", "all-but-model-config"],
)
def test_without_a_restricted_model_config_the_service_gets_no_admin_token(protocols):
    values = {
        "openai": {"enabled": True},
        "triton": {"security": {"restrictedGrpcProtocols": protocols}},
    }
    outcome = render_values("helm4", values)
    assert outcome.error is None and outcome.problems == ()
    c = service_container(outcome.docs)
    assert not {"--triton-protocol-header", "--triton-protocol-token-file"} & set(
        flags(c["command"])
    )
    pod = one(outcome.docs, "Deployment")["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]


# --------------------------------------------------------------------------- network


def test_the_policies_admit_the_named_clients_and_reach_only_triton():
    sets = (
        *ON,
        "openai.networkPolicy.allowedFrom[0].namespaceSelector.matchLabels.team=editors",
        "metrics.prometheus.podLabels.app=prometheus",
    )
    docs = rendered("helm4", None, sets)
    labels = pod_labels(docs)
    policy = one(docs, "NetworkPolicy")["spec"]
    selected = {
        c for c, pod in labels.items() if matches(policy["podSelector"]["matchLabels"], pod)
    }
    assert selected == {"openai"}
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    [ingress] = policy["ingress"]
    assert ingress["ports"] == [{"port": 8080, "protocol": "TCP"}]
    assert ingress["from"] == [
        {"podSelector": {"matchLabels": {"model-triton/openai-client": "codegen-model-triton"}}},
        {"namespaceSelector": {"matchLabels": {"team": "editors"}}},
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app": "prometheus"}},
        },
    ]
    dns, to_triton = policy["egress"]
    assert {p["port"] for p in dns["ports"]} == {53} and "to" not in dns
    assert to_triton["ports"] == [{"port": 8001, "protocol": "TCP"}]
    [peer] = to_triton["to"]
    assert {c for c, pod in labels.items() if matches(peer["podSelector"]["matchLabels"], pod)} == {
        "triton"
    }
    # Triton's inference port admits the service's pods besides its other clients.
    triton = one(docs, "NetworkPolicy", "triton")["spec"]
    inference = triton["ingress"][0]
    admitted = {
        c
        for c, pod in labels.items()
        for p in inference["from"]
        if "podSelector" in p
        and "namespaceSelector" not in p
        and matches(p["podSelector"]["matchLabels"], pod)
    }
    assert admitted == {"test", "openai"}
    assert {"podSelector": {"matchLabels": {"model-triton/client": "codegen-model-triton"}}} in (
        inference["from"]
    )


def test_prometheus_can_be_left_out_of_the_service_s_port():
    docs = rendered("helm4", None, (*ON, "openai.networkPolicy.prometheus=false"))
    [ingress] = one(docs, "NetworkPolicy")["spec"]["ingress"]
    assert ingress["from"] == [
        {"podSelector": {"matchLabels": {"model-triton/openai-client": "codegen-model-triton"}}}
    ]


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("values", VALUES, ids=IDS)
def test_only_the_service_may_reach_triton_when_asked(helm, values):
    docs = rendered(helm, values, (*ON, "networkPolicy.tritonFrom=openai"))
    assert rc.validate(docs) == []
    labels = pod_labels(docs)
    triton = one(docs, "NetworkPolicy", "triton")["spec"]
    inference, metrics = triton["ingress"]
    assert [p for p in inference["from"] if set(p) != {"podSelector"}] == []
    admitted = [
        {c for c, pod in labels.items() if matches(p["podSelector"]["matchLabels"], pod)}
        for p in inference["from"]
    ]
    assert admitted == [{"test"}, {"openai"}]  # no client label, no allowedFrom
    assert "model-triton/client" not in json.dumps(inference)
    assert metrics["ports"] == [{"port": 8002, "protocol": "TCP"}]


def test_only_the_service_is_said_in_notes():
    text = rc.notes(set_values=(*ON, "networkPolicy.tritonFrom=openai"))
    assert "the helm test pod and the OpenAI-compatible\n   service's pods only" in text
    assert "model-triton/client=" not in text


def test_the_service_monitor_scrapes_the_service_s_metrics_on_its_port():
    sets = (*ON, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=kp")
    docs = rendered("helm4", None, sets)
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["metadata"]["name"] == NAME
    assert monitor["metadata"]["labels"]["release"] == "kp"
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert [
        s["metadata"]["name"] for s in services if matches(selector, s["metadata"]["labels"])
    ] == [NAME]
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["model-triton"]}
    # Off without the service; Triton's own monitor is unchanged.
    alone = rendered("helm4", None, ("metrics.serviceMonitor.enabled=true",))
    assert [d["metadata"]["name"] for d in alone if d["kind"] == "ServiceMonitor"] == [
        "codegen-model-triton"
    ]


# --------------------------------------------------------------------------- autoscaling


@pytest.mark.parametrize("helm", HELMS)
def test_the_hpa_scales_the_service_deployment_on_cpu(helm):
    sets = (*ON, "openai.autoscaling.enabled=true", "openai.autoscaling.maxReplicas=5")
    docs = rendered(helm, None, sets)
    assert rc.validate(docs) == []
    hpa = one(docs, "HorizontalPodAutoscaler")
    deployment = one(docs, "Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 70},
            },
        }
    ]
    assert "replicas" not in deployment["spec"]  # the autoscaler owns the count
    # Triton's own autoscaling is a different switch.
    assert of(docs, "HorizontalPodAutoscaler", "triton") == []
    assert "replicas" in one(docs, "Deployment", "triton")["spec"]


def test_both_autoscalers_render_side_by_side():
    sets = (*ON, "openai.autoscaling.enabled=true", "autoscaling.enabled=true")
    docs = rendered("helm4", None, sets)
    names = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert names == ["codegen-model-triton", NAME]
    assert rc.validate(docs) == []


def test_no_hpa_and_no_pdb_when_asked():
    sets = (*ON, "openai.podDisruptionBudget.enabled=false")
    docs = rendered("helm4", None, sets)
    assert of(docs, "PodDisruptionBudget") == [] and of(docs, "HorizontalPodAutoscaler") == []


# --------------------------------------------------------------------------- refusals


REFUSED = {
    "triton-from-openai-without-the-service": (
        ("networkPolicy.tritonFrom=openai",),
        "model-triton: networkPolicy.tritonFrom is openai, but openai.enabled is false",
    ),
    "triton-from-openai-without-policies": (
        (*ON, "networkPolicy.tritonFrom=openai", "networkPolicy.enabled=false"),
        "model-triton: networkPolicy.tritonFrom is openai, but networkPolicy.enabled is false",
    ),
    "triton-from-openai-with-allowed-from": (
        (
            *ON,
            "networkPolicy.tritonFrom=openai",
            "networkPolicy.allowedFrom[0].namespaceSelector.matchLabels.team=gateway",
        ),
        "but networkPolicy.allowedFrom admits other peers",
    ),
    "min-above-max": (
        (*ON, "openai.autoscaling.enabled=true", "openai.autoscaling.minReplicas=9"),
        "model-triton: openai.autoscaling.minReplicas = 9 exceeds openai.autoscaling.maxReplicas = 8",
    ),
    "hpa-without-cpu-request": (
        (*ON, "openai.autoscaling.enabled=true", "openai.resources.requests.cpu=null"),
        "openai.resources.requests.cpu is not set",
    ),
    "grace-below-pre-stop": (
        (*ON, "openai.terminationGracePeriodSeconds=6", "openai.preStopSleepSeconds=5"),
        "model-triton: openai.terminationGracePeriodSeconds = 6",
    ),
    "env-of-a-chart-flag": (
        (*ON, "openai.extraEnv[0].name=COMPLETIONS_TRITON_URL", "openai.extraEnv[0].value=x"),
        "model-triton: openai.extraEnv sets COMPLETIONS_TRITON_URL",
    ),
    "env-home": (
        (*ON, "openai.extraEnv[0].name=HOME", "openai.extraEnv[0].value=/"),
        'model-triton: openai.extraEnv sets "HOME"',
    ),
    "owned-label": (
        (*ON, "openai.podLabels.app\\.kubernetes\\.io/component=x"),
        "model-triton: openai.podLabels sets",
    ),
    "request-above-limit": (
        (*ON, "openai.resources.requests.memory=2Gi"),
        "model-triton: openai.resources.requests.memory (2Gi) is above openai.resources.limits",
    ),
    "image-reference": (
        (*ON, "global.imageRegistry=-bad-"),
        "openai.image.repository",
    ),
}


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(("sets", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_values_that_cannot_work_together_are_refused_naming_the_key(helm, sets, message):
    assert message in refused(sets, helm)


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (("openai.maxConcurrency=0",), "maxConcurrency"),
        (("openai.maxQueue=-1",), "maxQueue"),
        (("openai.maxBodyBytes=10",), "maxBodyBytes"),
        (("openai.requestTimeoutSeconds=0",), "requestTimeoutSeconds"),
        (("openai.service.type=ExternalName",), "type"),
        (("openai.autoscaling.targetCPUUtilizationPercentage=0",), "targetCPUUtilization"),
        (("openai.port=9000",), "port"),
        (("networkPolicy.tritonFrom=everyone",), "tritonFrom"),
    ],
    ids=["concurrency", "queue", "body", "timeout", "service-type", "cpu", "port", "triton-from"],
)
def test_the_schema_refuses_values_out_of_range_naming_the_key(sets, key):
    err = refused((*ON, *sets))
    assert "schema" in err and key in err


def test_the_service_s_values_are_checked_even_while_it_is_off():
    # Off, its values are still checked (a later `openai.enabled=true` must not surprise).
    assert "model-triton: openai.resources.requests.memory" in refused(
        ("openai.resources.requests.memory=2Gi",)
    )


# --------------------------------------------------------------------------- notes


def test_notes_show_how_to_call_it_and_who_may():
    text = rc.notes(set_values=ON)
    assert "port-forward svc/codegen-model-triton-openai 8080:8080" in text
    assert "http://codegen-model-triton-openai.model-triton.svc:8080/v1" in text
    assert "/v1/engines/<engine>/completions" in text
    assert '"model": "codegen"' in text
    assert "No API keys" in text and "Authorization" not in text
    assert "model-triton/openai-client=codegen-model-triton" in text
    assert "mount the token of Secret codegen-model-triton-admin" in text
    assert "WARNING" not in text


def test_notes_with_keys_and_an_exposed_service():
    keyed = rc.notes(set_values=(*ON, "openai.apiKeys.existingSecret=editor-keys"))
    assert "Authorization: Bearer $KEY" in keyed
    assert 'key "keys" of Secret editor-keys' in keyed
    exposed = rc.notes(set_values=(*ON, "openai.service.type=LoadBalancer"))
    assert "WARNING: model-triton: openai.service.type is LoadBalancer" in exposed
    keyed_exposed = rc.notes(
        set_values=(*ON, "openai.service.type=LoadBalancer", "openai.apiKeys.existingSecret=k")
    )
    assert "WARNING" not in keyed_exposed


# --------------------------------------------------------------------------- generated values

_ints = st.one_of(
    st.integers(-2, 12),
    st.sampled_from([1023, 1024, 86400, 86401, 2**31 - 1, 2**31, 2**40]),
)
_NUMBERS = [
    "openai.replicas", "openai.maxConcurrency", "openai.maxQueue", "openai.maxBodyBytes",
    "openai.requestTimeoutSeconds", "openai.terminationGracePeriodSeconds",
    "openai.preStopSleepSeconds", "openai.livenessProbe.periodSeconds",
    "openai.readinessProbe.timeoutSeconds", "openai.autoscaling.minReplicas",
    "openai.autoscaling.maxReplicas", "openai.autoscaling.targetCPUUtilizationPercentage",
    "openai.podDisruptionBudget.maxUnavailable",
]  # fmt: skip
_QUANTITIES = {
    "openai.resources.requests.cpu": st.sampled_from([None, "500m", "0", "2", "-1", 0.5, "x"]),
    "openai.resources.requests.memory": st.sampled_from(["256Mi", "2Gi", "0Mi", "1e3", "64"]),
    "openai.resources.limits.memory": st.sampled_from([None, "1Gi", "128Mi", "-1Gi"]),
}
_label_key = st.sampled_from(
    ["team", "app.kubernetes.io/component", "helm.sh/chart", "bad key", "a/b/c", "x.io/ok"]
)


@st.composite
def openai_cases(draw) -> dict:
    chosen: dict = {}
    for key in draw(st.lists(st.sampled_from(_NUMBERS), max_size=3, unique=True)):
        chosen[key] = draw(_ints)
    for key in draw(st.lists(st.sampled_from(sorted(_QUANTITIES)), max_size=2, unique=True)):
        chosen[key] = draw(_QUANTITIES[key])
    picks = draw(
        st.lists(
            st.sampled_from(["labels", "env", "keys", "fence", "hpa", "service"]),
            max_size=3, unique=True,
        )
    )  # fmt: skip
    if "labels" in picks:
        chosen["openai.podLabels"] = {draw(_label_key): "v"}
        chosen["openai.podAnnotations"] = {draw(_label_key): "v"}
        chosen["openai.nodeSelector"] = {draw(_label_key): "v"}
    if "env" in picks:
        names = ["HOME", "COMPLETIONS_LISTEN", "COMPLETIONS_API_KEYS_FILE", "X", "X", "1BAD"]
        chosen["openai.extraEnv"] = [
            {"name": draw(st.sampled_from(names)), "value": "1"}
            for _ in range(draw(st.integers(1, 2)))
        ]
    if "keys" in picks:
        chosen["openai.apiKeys.existingSecret"] = draw(st.sampled_from(["", "keys", "Bad_Name"]))
        chosen["openai.apiKeys.key"] = draw(st.sampled_from(["keys", "..", "a/b", "k.txt", ""]))
    if "fence" in picks:
        chosen["networkPolicy.tritonFrom"] = draw(st.sampled_from(["clients", "openai", "all"]))
        chosen["networkPolicy.enabled"] = draw(st.booleans())
        chosen["networkPolicy.allowedFrom"] = draw(
            st.sampled_from([[], [{"namespaceSelector": {"matchLabels": {"team": "gw"}}}]])
        )
        chosen["openai.networkPolicy.prometheus"] = draw(st.booleans())
    if "hpa" in picks:
        chosen["openai.autoscaling.enabled"] = draw(st.booleans())
    if "service" in picks:
        chosen["openai.service.type"] = draw(st.sampled_from(["ClusterIP", "LoadBalancer", "None"]))
    values: dict = {"openai": {"enabled": True}}
    for key, value in chosen.items():
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    base = draw(st.sampled_from([None, *(v for v in VALUES if v)]))
    return {"values": values, "keys": list(chosen), "base": base}


def _openai_property(case: dict, outcome) -> None:
    values = case["values"]
    docs = outcome.docs
    c = service_container(docs)
    args = flags(c["command"])
    assert set(args) <= SERVICE_FLAGS and args["--triton-model"] == "llm"
    # What the chart renders, the service's own parser takes (the same bounds on both sides).
    from completions_service.cli import parser

    parser().parse_args(c["command"][1:])
    for key, flag in (
        ("openai.maxConcurrency", "--max-concurrency"),
        ("openai.maxQueue", "--max-queue"),
        ("openai.maxBodyBytes", "--max-body-bytes"),
        ("openai.requestTimeoutSeconds", "--request-timeout-s"),
    ):
        if get(values, key) is not None:
            assert args[flag] == str(get(values, key)), (flag, args[flag])
    assert ("--api-keys-file" in args) == bool(get(values, "openai.apiKeys.existingSecret"))
    owned = {"HOME"} | {"COMPLETIONS_" + f[2:].upper().replace("-", "_") for f in args}
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names)) and not set(names[1:]) & owned
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 5 + int(
        get(values, "openai.preStopSleepSeconds", 5)
    )
    hpas = of(docs, "HorizontalPodAutoscaler")
    assert len(hpas) == bool(get(values, "openai.autoscaling.enabled"))
    for hpa in hpas:
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert "replicas" not in deployment["spec"]
        assert c["resources"]["requests"]["cpu"]
    fenced = get(values, "networkPolicy.enabled", True)
    assert len(of(docs, "NetworkPolicy")) == int(fenced)
    if get(values, "networkPolicy.tritonFrom") == "openai":
        inference = one(docs, "NetworkPolicy", "triton")["spec"]["ingress"][0]
        assert "model-triton/client" not in json.dumps(inference)
        assert len(inference["from"]) == 2


@pytest.mark.slow
def test_generated_service_values_are_refused_naming_a_key_or_render_right():
    """Generated values sets of the service (numbers at and beyond their bounds, quantities,
    label and annotation keys, environment variables, Secret references, who may reach Triton,
    autoscaling), over the defaults and every values file: Helm refuses naming a key the set
    holds, or every manifest validates strictly and the command line, the autoscaler, the
    policies and the environment say what the values say."""
    failures, rendered_count = [], 0
    cases = generated(openai_cases(), 40)
    for i, case in enumerate(cases):
        helm = HELMS[i % 2]
        base = (rc.VALUES_DIR / case["base"],) if case["base"] else ()
        outcome = render_values(helm, case["values"], base=base)
        rendered_count += not outcome.refused
        try:
            if outcome.refused:
                assert names_a_key(outcome.error, case["keys"]), outcome.error.strip()[-600:]
            else:
                assert outcome.problems == (), outcome.problems[:5]
                _openai_property(case, outcome)
        except AssertionError as exc:
            failures.append(f"{helm} {case}:\n    {exc}")
    assert failures == [], f"{len(failures)} of {len(cases)}:\n" + "\n".join(failures[:8])
    assert 0 < rendered_count < len(cases), f"{rendered_count} of {len(cases)} rendered"


@pytest.mark.parametrize("values", VALUES, ids=IDS)
def test_the_rendered_command_is_accepted_by_the_services_own_parser(values):
    """The chart and the service agree: `completions-service`'s argument parser takes the
    command the chart renders, and reads the same settings from it."""
    from completions_service import cli

    command = service_container(rendered("helm4", values, ON))["command"]
    assert command[0] == "completions-service"
    args = cli.parser().parse_args(command[1:])
    settings = cli.settings_of(args)
    rendered_flags = flags(command)
    assert args.triton_model == "llm"
    assert rendered_flags["--triton-url"].startswith("grpc://")
    assert settings is not None


def test_notes_warn_that_stream_is_refused_when_triton_does_not_stream():
    warning = "triton.streaming is false"
    assert warning in rc.notes(set_values=ON)
    assert warning not in rc.notes(set_values=(*ON, "triton.streaming=true"))
