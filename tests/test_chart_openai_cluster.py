"""The OpenAI-compatible completions service of the chart (`openai.enabled`) on the local control
plane (tests/kube): the real Helm 3 and 4 install it in a namespace that enforces the
`restricted` Pod Security Standard; the real Deployment controller, scheduler and
HorizontalPodAutoscaler controller act on it; the NetworkPolicies are read back from the API
server and their selectors evaluated by it. Every values file with the service on is applied
with server-side dry-run (the ServiceMonitor against the upstream CRD's schema).

The fake kubelet plays the service's container (no image runs here; the service itself is tested
against a real Triton elsewhere): it projects the API-key Secret and Triton's admin Secret into the
pod's volumes as the kubelet does, and the container turns Ready only once the files its command
line names hold the Secret's keys and the admin token Triton is given. No CNI runs, so the policies' selectors are checked, not packets.
"""

from __future__ import annotations

import base64

import pytest
import yaml

from tests import chart as rc
from tests.kube import nodes as fake
from tests.kube.api import ApiError
from tests.kube.kubelet import Context, Serve

pytestmark = pytest.mark.server  # the local control plane (see markers in pyproject.toml)

HELMS = ("helm3", "helm4")
STAGING = rc.VALUES_DIR / "staging.yaml"
VALUES = (None, *sorted(p.name for p in rc.VALUES_DIR.glob("*.yaml")))
OPENAI = "codegen-model-triton-openai"
TRITON = "codegen-model-triton"
ADMIN = "codegen-model-triton-admin"
KEYS = "sk-editor-one\nsk-editor-two\n"
SERVICE_PODS = {"app.kubernetes.io/component": "openai"}
TRITON_PODS = {"app.kubernetes.io/component": "triton"}
ON = (
    "openai.enabled=true",
    "openai.autoscaling.enabled=true",
    "openai.apiKeys.existingSecret=editor-keys",
    "networkPolicy.tritonFrom=openai",
)


def staging_nodes(sandbox) -> None:
    labels = yaml.safe_load(STAGING.read_text())["cluster"]["nodeSelector"]
    sandbox.register(fake.gpu_pool("gpu", 1, fake.STAGING_2GPU, labels))


def chart(sandbox, *sets: str) -> list[str]:
    return [str(rc.CHART), *sandbox.chart_args((STAGING,), sets)]


def keys_secret(sandbox) -> None:
    sandbox.api.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "editor-keys", "namespace": sandbox.namespace},
            "data": {"keys": base64.b64encode(KEYS.encode()).decode()},
        }
    )


class PlayedService:
    """Plays the `completions` container: the kubelet fakes it (no process runs). It serves,
    Ready while the files its command line names, found through the container's volume mounts
    in the pod's volumes, hold what the service needs: the Secret's API keys
    (`--api-keys-file`) and the token of Triton's admin header, the one the chart generated
    for Triton (`--triton-protocol-token-file`: the service reads `model-config`, which is
    restricted)."""

    def __init__(self, sandbox) -> None:
        self.sandbox = sandbox
        self.files: dict[str, list] = {"--api-keys-file": [], "--triton-protocol-token-file": []}

    def _local(self, ctx: Context, flag: str):
        [path] = [a.split("=", 1)[1] for a in ctx.container["command"] if a.startswith(flag + "=")]
        [mount] = [
            m for m in ctx.container["volumeMounts"] if path.startswith(m["mountPath"] + "/")
        ]
        assert mount.get("readOnly") is True
        local = ctx.volume(mount["name"]) / path.removeprefix(mount["mountPath"] + "/")
        self.files[flag].append(local)
        return local

    def __call__(self, ctx: Context):
        if ctx.name != "completions":
            return None
        keys = self._local(ctx, "--api-keys-file")
        token = self._local(ctx, "--triton-protocol-token-file")
        secret = self.sandbox.api.get("v1", "Secret", self.sandbox.namespace, ADMIN)
        expected = base64.b64decode(secret["data"]["token"]).decode()
        return Serve(ready=lambda: keys.read_text() == KEYS and token.read_text() == expected)


def available(sandbox, name: str, replicas: int):
    def check():
        d = sandbox.deployment(name)
        s = d.get("status", {})
        return (
            d["spec"].get("replicas") == replicas
            and s.get("observedGeneration", 0) >= d["metadata"]["generation"]
            and s.get("availableReplicas") == s.get("updatedReplicas") == replicas
            and d
        )

    return sandbox.wait(f"deployment {name} available with {replicas} replicas", check)


def names(pods) -> set[str]:
    return {p["metadata"]["name"] for p in pods}


def selected(sandbox, selector: dict) -> set[str]:
    """The pods of the namespace the API server selects with ``matchLabels``."""
    return names(sandbox.pods(selector))


def client_pod(sandbox) -> str:
    """A restricted pod labelled as both kinds of client (Triton's and the service's)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "editor",
            "namespace": sandbox.namespace,
            "labels": {"model-triton/client": TRITON, "model-triton/openai-client": TRITON},
        },
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "editor", "image": "busybox:1.37.0",
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }  # fmt: skip
    sandbox.api.create(pod)
    return "editor"


@pytest.mark.parametrize("helm", HELMS)
def test_the_service_becomes_available_fenced_and_autoscaled(sandbox, helm):
    staging_nodes(sandbox)
    keys_secret(sandbox)
    played = PlayedService(sandbox)
    sandbox.rule(played)
    sandbox.helm(helm, "install", "codegen", *chart(sandbox, *ON))

    # The chart renders no replica count with the HPA on: the API server defaults it to 1 and
    # the HorizontalPodAutoscaler controller raises it to minReplicas (2) through the
    # Deployment's scale subresource, which it reaches only through scaleTargetRef.
    deployment = available(sandbox, OPENAI, 2)
    assert len(played.files["--api-keys-file"]) >= 2
    assert all(f.read_text() == KEYS for f in played.files["--api-keys-file"])
    assert len(played.files["--triton-protocol-token-file"]) >= 2

    def hpa_scaled():
        hpa = sandbox.api.get(
            "autoscaling/v2", "HorizontalPodAutoscaler", sandbox.namespace, OPENAI
        )
        status = hpa.get("status", {})
        able = any(
            c["type"] == "AbleToScale" and c["status"] == "True"
            for c in status.get("conditions", [])
        )
        return able and status.get("desiredReplicas") == 2 and hpa

    hpa = sandbox.wait("the HPA read its target's scale and set it", hpa_scaled)
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # The Service's endpoints are the service's ready pods.
    service = sandbox.api.get("v1", "Service", sandbox.namespace, OPENAI)
    assert service["spec"]["ports"][0]["port"] == 8080
    service_pods = selected(sandbox, SERVICE_PODS)
    assert len(service_pods) == 2
    assert selected(sandbox, service["spec"]["selector"]) == service_pods

    # The NetworkPolicies, as the API server stored them, select what they should.
    editor = client_pod(sandbox)
    triton_pods = selected(sandbox, TRITON_PODS)
    assert triton_pods and not triton_pods & service_pods
    fence = sandbox.api.get("networking.k8s.io/v1", "NetworkPolicy", sandbox.namespace, OPENAI)
    assert selected(sandbox, fence["spec"]["podSelector"]["matchLabels"]) == service_pods
    [ingress] = fence["spec"]["ingress"]
    assert [p["port"] for p in ingress["ports"]] == [8080]
    pod_peers = [p for p in ingress["from"] if set(p) == {"podSelector"}]
    assert [selected(sandbox, p["podSelector"]["matchLabels"]) for p in pod_peers] == [{editor}]
    to_triton = fence["spec"]["egress"][1]
    assert [p["port"] for p in to_triton["ports"]] == [8001]
    assert selected(sandbox, to_triton["to"][0]["podSelector"]["matchLabels"]) == triton_pods
    # Triton's gRPC port admits the service's pods and, with tritonFrom=openai, no other client
    # of the namespace (the labelled editor is not admitted; the helm test pod is not running).
    triton = sandbox.api.get("networking.k8s.io/v1", "NetworkPolicy", sandbox.namespace, TRITON)
    inference = triton["spec"]["ingress"][0]
    assert [p["port"] for p in inference["ports"]] == [8001]
    admitted = set().union(
        *(selected(sandbox, p["podSelector"]["matchLabels"]) for p in inference["from"])
    )
    assert admitted == service_pods and editor not in admitted

    # Turned off again, every resource of the service is gone and Triton admits its clients.
    sandbox.helm(helm, "upgrade", "codegen", *chart(sandbox))
    for api_version, kind in (
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("policy/v1", "PodDisruptionBudget"),
        ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ):
        assert sandbox.api.find(api_version, kind, sandbox.namespace, OPENAI) is None, kind
    triton = sandbox.api.get("networking.k8s.io/v1", "NetworkPolicy", sandbox.namespace, TRITON)
    admitted = set().union(
        *(selected(sandbox, p["podSelector"]["matchLabels"]) for p in triton["spec"]["ingress"][0]["from"])
    )  # fmt: skip
    assert editor in admitted


@pytest.mark.parametrize("helm", HELMS)
def test_turning_the_hpa_on_keeps_the_live_replicas_within_its_bounds(sandbox, helm):
    """On `helm upgrade` the service's Deployment keeps its live replicas (within the HPA's
    bounds) instead of losing the field, which would drop it to one replica: the chart reads
    them with `lookup` (`helm template --dry-run=server` asks the API server)."""
    sets = ("openai.enabled=true",)
    sandbox.helm(helm, "install", "codegen", *chart(sandbox, *sets))
    deployment = sandbox.api.path("apps/v1", "Deployment", sandbox.namespace, OPENAI)
    for live, low, high, expected in ((5, 2, 8, 5), (1, 2, 8, 2), (9, 2, 4, 4)):
        sandbox.api.patch(deployment, {"spec": {"replicas": live}}, subresource="scale")
        scaling = (*sets, "openai.autoscaling.enabled=true",
                   f"openai.autoscaling.minReplicas={low}", f"openai.autoscaling.maxReplicas={high}")  # fmt: skip
        text = sandbox.helm(
            helm, "template", "codegen", *chart(sandbox, *scaling), "--dry-run=server"
        ).stdout
        [rendered] = [
            d for d in rc.documents(text)
            if d["kind"] == "Deployment" and d["metadata"]["name"] == OPENAI
        ]  # fmt: skip
        assert rendered["spec"]["replicas"] == expected, (live, low, high)


# --------------------------------------------------------------------------- every values file


def _server_dry_run(sandbox, docs: list[dict]) -> list[str]:
    """Server-side apply with `dryRun=All` (the ServiceAccounts for real first: admission
    looks them up)."""
    problems = []
    for doc in sorted(docs, key=lambda d: d["kind"] != "ServiceAccount"):
        doc.setdefault("metadata", {})["namespace"] = sandbox.namespace
        try:
            sandbox.api.apply(doc, dry_run=doc["kind"] != "ServiceAccount")
        except ApiError as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc}")
    return problems


@pytest.mark.parametrize("values", VALUES, ids=[v or "defaults" for v in VALUES])
def test_every_values_file_with_the_service_is_accepted_by_the_api_server(sandbox, values):
    files = () if values is None else (rc.VALUES_DIR / values,)
    sets = (*ON, "metrics.serviceMonitor.enabled=true")
    text = rc.render(values_files=files, set_values=sets, namespace=sandbox.namespace)
    docs = rc.documents(text)
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"} <= {
        d["kind"] for d in docs if d["metadata"]["name"] == OPENAI
    }
    assert _server_dry_run(sandbox, docs) == []
