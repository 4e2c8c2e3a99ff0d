"""The chart's security defaults, rendered by the real Helm 3 and Helm 4 (SECURITY.md).

Under the defaults and every values file: model control `none`, every admin gRPC protocol behind
the header whose token a Secret holds, HTTP on the pod's loopback only, gRPC probes, and the
NetworkPolicies of Triton, the loader and the `helm test` pod, selecting the pods they are meant
for. A values set that loosens one of them says so in NOTES; one that would undo one silently
(an `extraArgs` flag, however abbreviated, an `extraEnv` variable, an unknown protocol name) is
refused. The restricted flag is read back with Triton 23.05's own parsing rules
(:func:`loader.serving.restricted_protocols`).
"""

from __future__ import annotations

import base64
import copy
import json
import re
import string
import tempfile
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import podspec
from loader.serving import restricted_protocols
from tests import chart as rc
from tests.tiers import examples

HELMS = ("helm3", "helm4")
VALUES = (None, *sorted(p.name for p in rc.VALUES_DIR.glob("*.yaml")))
#: Every 23.05 gRPC protocol but inference and health (src/grpc/grpc_server.cc).
ADMIN_PROTOCOLS = (
    "logging",
    "trace",
    "shared-memory",
    "model-repository",
    "statistics",
    "model-config",
    "metadata",
)
#: The flags the security defaults own (templates/_security.tpl), refused in triton.extraArgs.
OWNED_FLAGS = (
    "allow-http",
    "http-address",
    "http-port",
    "reuse-http-port",
    "http-restricted-api",
    "allow-grpc",
    "grpc-address",
    "grpc-port",
    "reuse-grpc-port",
    "grpc-restricted-protocol",
    "model-control-mode",
    "load-model",
    "repository-poll-secs",
    "allow-sagemaker",
    "sagemaker-port",
    "allow-vertex-ai",
    "vertex-ai-port",
)
#: tritonserver 23.05 flags a user may add: none is an abbreviation of an owned one.
ALLOWED_FLAGS = (
    "--log-verbose=1",
    "--log-format=ISO8601",
    "--grpc-keepalive-time=10000",
    "--grpc-use-ssl=false",
    "--grpc-infer-allocation-pool-size=16",
    "--http-thread-count=4",
    "--pinned-memory-pool-byte-size=268435456",
    "--strict-readiness=true",
    "--rate-limit=execution_count",
)


def _files(values: str | None) -> tuple[Path, ...]:
    """A values file of values/, or (a YAML text) an overrides file written for it."""
    if values is None:
        return ()
    if "\n" not in values:
        return (rc.VALUES_DIR / values,)
    path = Path(tempfile.mkdtemp(prefix="values-")) / "overrides.yaml"
    path.write_text(values)
    return (path,)


@cache
def rendered(helm: str, values: str | None, sets: tuple[str, ...] = ()) -> tuple[dict, ...]:
    text = rc.render(helm=helm, values_files=_files(values), set_values=sets)
    return tuple(rc.documents(text))


@cache
def notes(sets: tuple[str, ...] = (), values: str | None = None) -> str:
    return rc.notes(values_files=_files(values), set_values=sets)


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def triton_container(docs) -> dict:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "triton")


def refused(sets: tuple[str, ...]) -> str:
    with pytest.raises(rc.ChartError) as info:
        rc.render(set_values=sets)
    return info.value.output


def matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# --------------------------------------------------------------------------- the defaults hold


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("values", VALUES, ids=[v or "defaults" for v in VALUES])
def test_every_values_file_serves_with_the_security_defaults(helm, values):
    docs = rendered(helm, values)
    command = rc.triton_command(docs)  # the Secret's token substituted, as the kubelet does
    assert "--model-control-mode=none" in command
    assert {"--allow-http=true", "--http-address=127.0.0.1", "--allow-grpc=true"} <= set(command)
    # gRPC and metrics on the pod's address (Services, probes and Prometheus reach it there).
    assert {"--grpc-address=0.0.0.0", "--metrics-address=0.0.0.0"} <= set(command)
    assert not any(a.startswith(("--allow-sagemaker", "--allow-vertex")) for a in command)
    restricted = restricted_protocols(command)
    assert set(restricted) == set(ADMIN_PROTOCOLS)
    [(header, token)] = set(restricted.values())
    assert header == "triton-grpc-protocol-admin-key"
    secret = one(docs, "Secret", "codegen-model-triton-admin")
    assert base64.b64decode(secret["data"]["token"]).decode() == token
    assert re.fullmatch(r"[A-Za-z0-9]{40}", token)
    # probes over gRPC health; nothing on the network speaks HTTP
    container = triton_container(docs)
    assert all(
        container[p]["grpc"] == {"port": 8001}
        for p in ("startupProbe", "livenessProbe", "readinessProbe")
    )
    assert "http" not in {p["name"] for p in container["ports"]}
    for service in (d for d in docs if d["kind"] == "Service"):
        assert 8000 not in {p["port"] for p in service["spec"]["ports"]}
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"} == {
        "codegen-model-triton",
        "codegen-model-loader",
        "codegen-model-triton-test",
    }


@pytest.mark.parametrize("values", VALUES, ids=[v or "defaults" for v in VALUES])
def test_notes_of_every_values_file_show_the_defaults_and_warn_of_nothing(values):
    text = notes(values=values)
    assert "WARNING: model-triton: the gRPC protocol" not in text
    assert "WARNING: model-triton: HTTP" not in text
    assert "networkPolicy.enabled is false" not in text
    assert "triton-grpc-protocol-admin-key: <token>" in text
    assert "get secret codegen-model-triton-admin -o jsonpath='{.data.token}'" in text
    assert (
        "networkPolicy.allowedFrom" in text and "model-triton/client=codegen-model-triton" in text
    )


def test_the_generated_token_differs_between_releases():
    tokens = {
        base64.b64decode(one(rc.documents(rc.render()), "Secret")["data"]["token"])
        for _ in range(3)
    }
    assert len(tokens) == 3


def test_an_existing_secret_replaces_the_generated_one():
    docs = rendered(
        "helm4",
        None,
        ("triton.security.adminSecret.name=ops-triton", "triton.security.adminSecret.key=admin"),
    )
    assert "Secret" not in {d["kind"] for d in docs}
    [env] = [e for e in triton_container(docs)["env"] if e["name"] == "TRITON_ADMIN_TOKEN"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "ops-triton", "key": "admin"}
    command = rc.triton_command(
        [
            *docs,
            {
                "kind": "Secret",
                "metadata": {"name": "ops-triton"},
                "stringData": {"admin": "t0k3n"},
            },
        ]
    )
    assert set(restricted_protocols(command).values()) == {
        ("triton-grpc-protocol-admin-key", "t0k3n")
    }
    # A Secret the cluster lacks stops the container, as the kubelet would.
    with pytest.raises(podspec.PodSpecError, match="ops-triton"):
        rc.triton_command(docs)


@settings(max_examples=examples(12), deadline=None)
@given(
    # `--set` reads digits, true, false and null as non-strings: a leading letter keeps the name one.
    header=st.text(string.ascii_lowercase + string.digits + "-_.", max_size=30)
    .map(lambda h: "x" + h)
    .filter(lambda h: not h.endswith("-bin")),
    protocols=st.lists(st.sampled_from(ADMIN_PROTOCOLS), min_size=1, unique=True),
)
def test_the_restricted_flag_reads_back_as_the_values_say_under_23_05_parsing(header, protocols):
    sets = (
        f"triton.security.adminHeader={header}",
        "triton.security.restrictedGrpcProtocols={" + ",".join(protocols) + "}",
    )
    command = rc.triton_command(rendered("helm4", None, sets))
    restricted = restricted_protocols(command)
    assert list(restricted) == protocols
    assert {h for h, _ in restricted.values()} == {f"triton-grpc-protocol-{header}"}


# --------------------------------------------------------------------------- loosening, said


@pytest.mark.parametrize("protocol", ADMIN_PROTOCOLS)
def test_leaving_a_protocol_open_is_said_in_notes(protocol):
    kept = [p for p in ADMIN_PROTOCOLS if p != protocol]
    text = notes(("triton.security.restrictedGrpcProtocols={" + ",".join(kept) + "}",))
    [line] = [
        row
        for row in text.splitlines()
        if row.startswith("WARNING: model-triton: the gRPC protocol")
    ]
    assert f"protocol(s) {protocol} answer without the admin header" in line
    assert ("CVE-2024-0087" in line) == (protocol == "logging")
    command = rc.triton_command(
        rendered(
            "helm4", None, ("triton.security.restrictedGrpcProtocols={" + ",".join(kept) + "}",)
        )
    )
    assert protocol not in restricted_protocols(command)


NOTHING_RESTRICTED = "triton:\n  security:\n    restrictedGrpcProtocols: []\n"


def test_no_restriction_at_all_drops_the_flag_the_secret_and_warns():
    docs = rendered("helm4", NOTHING_RESTRICTED)
    command = rc.triton_command(docs)
    assert not any(a.startswith("--grpc-restricted-protocol") for a in command)
    assert "Secret" not in {d["kind"] for d in docs}
    assert "TRITON_ADMIN_TOKEN" not in {e["name"] for e in triton_container(docs)["env"]}
    assert (
        "logging, trace, shared-memory, model-repository, statistics, model-config, metadata answer without"
        in notes(values=NOTHING_RESTRICTED)
    )


def test_http_on_the_network_is_served_fenced_and_warned_about():
    sets = ("triton.security.http=network",)
    docs = rendered("helm4", None, sets)
    command = rc.triton_command(docs)
    assert "--http-address=0.0.0.0" in command
    assert {p["name"]: p["containerPort"] for p in triton_container(docs)["ports"]}["http"] == 8000
    assert 8000 in {
        p["port"] for p in one(docs, "Service", "codegen-model-triton")["spec"]["ports"]
    }
    [inference] = [
        r
        for r in one(docs, "NetworkPolicy", "codegen-model-triton")["spec"]["ingress"]
        if {"port": 8001, "protocol": "TCP"} in r["ports"]
    ]
    assert {"port": 8000, "protocol": "TCP"} in inference["ports"]
    text = notes(sets)
    assert "WARNING: model-triton: HTTP (8000) listens on the pod's address" in text
    assert "port-forward svc/codegen-model-triton 8000:8000" in text


def test_http_off_disables_it():
    sets = ("triton.security.http=off",)
    command = rc.triton_command(rendered("helm4", None, sets))
    assert "--allow-http=false" in command
    assert not any(a.startswith("--http-") for a in command)
    assert "curl" not in notes(sets)


def test_turning_the_network_policies_off_is_said_in_notes():
    assert "WARNING: model-triton: networkPolicy.enabled is false" in notes(
        ("networkPolicy.enabled=false",)
    )


# --------------------------------------------------------------------------- undoing, refused


@settings(max_examples=examples(40), deadline=None)
@given(
    flag=st.sampled_from(OWNED_FLAGS),
    cut=st.integers(min_value=0, max_value=40),
    form=st.sampled_from(["--{}=true", "--{}", "-{}=1"]),
)
def test_an_owned_flag_in_extra_args_is_refused_however_abbreviated(flag, cut, form):
    # getopt_long takes any unambiguous prefix of a long option.
    name = flag[: max(len(flag) - cut, 1)]
    arg = form.format(name)
    output = refused((f"triton.extraArgs[0]={arg}",))
    # Refused once: by _rules.tpl when the chart sets the option itself, else by _security.tpl.
    [line] = [row for row in output.splitlines() if f'triton.extraArgs has "{arg}"' in row]
    assert "Use triton.security" in line or "a tritonserver option the chart sets itself" in line


@pytest.mark.parametrize("arg", ALLOWED_FLAGS)
def test_other_triton_flags_are_passed_through(arg):
    command = rc.triton_command(rendered("helm4", None, (f"triton.extraArgs[0]={arg}",)))
    assert command[-1] == arg


@pytest.mark.parametrize("arg", ["--grpc-use-ssl=true", "--grpc-use-ssl-mutual=1", "--grpc-use=on"])
def test_grpc_tls_is_refused_because_the_probes_speak_plaintext(arg):
    assert "turns on gRPC TLS" in refused((f"triton.extraArgs[0]={arg}",))


@pytest.mark.parametrize("name", ["TRITON_ADMIN_TOKEN", "AIP_MODE"])
def test_extra_env_cannot_replace_the_token_or_open_vertex_ai(name):
    output = refused((f"triton.extraEnv[0].name={name}", "triton.extraEnv[0].value=PREDICTION"))
    assert f"triton.extraEnv sets {name}" in output


@pytest.mark.parametrize(
    "sets",
    [
        ("triton.security.restrictedGrpcProtocols={inference}",),
        ("triton.security.restrictedGrpcProtocols={health}",),
        ("triton.security.restrictedGrpcProtocols={loging}",),
        ("triton.security.restrictedGrpcProtocols={Logging}",),
        ("triton.security.restrictedGrpcProtocols={logging,logging}",),
        ("triton.security.adminHeader=Admin",),
        ("triton.security.adminHeader=admin:key",),
        ("triton.security.adminHeader=admin=key",),
        ("triton.security.adminHeader=token-bin",),
        ("triton.security.adminHeader=",),
        ("triton.security.http=public",),
        ("triton.security.adminSecret.key=a/b",),
    ],
    ids=lambda sets: sets[0].split(".", 2)[-1],
)
def test_the_schema_refuses_what_23_05_would_ignore_or_misparse(sets):
    output = refused(sets)
    assert "values don't meet the specifications of the schema" in output
    assert "triton.security" in output.replace("/", ".")


# --------------------------------------------------------------------------- the fences


def pod_labels(docs) -> dict[str, dict]:
    """Labels of the pods each component runs: Triton, the loader (CronJob and hook Job), the
    `helm test` pod."""
    deployment = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    cronjob = one(docs, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    test = one(docs, "Pod")["metadata"]["labels"]
    return {"triton": deployment, "loader": cronjob, "test": test}


def test_each_policy_selects_its_own_pods_and_admits_only_the_named_clients():
    docs = rendered(
        "helm4",
        None,
        ("networkPolicy.allowedFrom[0].namespaceSelector.matchLabels.team=gateway",),
    )
    labels = pod_labels(docs)
    triton = one(docs, "NetworkPolicy", "codegen-model-triton")["spec"]
    loader = one(docs, "NetworkPolicy", "codegen-model-loader")["spec"]
    test = one(docs, "NetworkPolicy", "codegen-model-triton-test")["spec"]
    for spec, component in ((triton, "triton"), (loader, "loader"), (test, "test")):
        selector = spec["podSelector"]["matchLabels"]
        selected = {c for c, pod in labels.items() if matches(selector, pod)}
        assert selected == {component}
        assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    # Triton: inference (8001) from the test pod, labelled clients and allowedFrom; metrics
    # (8002) from metrics.prometheus; no egress.
    inference, metrics = triton["ingress"]
    assert inference["ports"] == [{"port": 8001, "protocol": "TCP"}]
    test_peer, client_peer, gateway = inference["from"]
    assert matches(test_peer["podSelector"]["matchLabels"], labels["test"])
    assert not matches(test_peer["podSelector"]["matchLabels"], labels["loader"])
    assert client_peer == {
        "podSelector": {"matchLabels": {"model-triton/client": "codegen-model-triton"}}
    }
    assert gateway == {"namespaceSelector": {"matchLabels": {"team": "gateway"}}}
    assert metrics["ports"] == [{"port": 8002, "protocol": "TCP"}]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }
    assert "egress" not in triton
    # the loader serves nothing; the test pod reaches Triton's gRPC port and DNS only
    assert "ingress" not in loader and "ingress" not in test
    dns, to_triton = test["egress"]
    assert {p["port"] for p in dns["ports"]} == {53} and "to" not in dns
    assert to_triton["ports"] == [{"port": 8001, "protocol": "TCP"}]
    assert matches(to_triton["to"][0]["podSelector"]["matchLabels"], labels["triton"])


def test_the_hook_job_pods_are_fenced_like_the_cronjob_ones():
    docs = rendered("helm4", None, ("loader.hook.enabled=true",))
    policy = one(docs, "NetworkPolicy", "codegen-model-loader")["spec"]["podSelector"][
        "matchLabels"
    ]
    [job] = [d for d in docs if d["kind"] == "Job"]
    assert matches(policy, job["spec"]["template"]["metadata"]["labels"])


def _loader_egress(*sets: str) -> list[dict]:
    return one(rendered("helm4", None, sets), "NetworkPolicy", "codegen-model-loader")["spec"].get(
        "egress", []
    )


def _https(rules) -> list[dict]:
    return [r for r in rules if r.get("ports") == [{"port": 443, "protocol": "TCP"}]]


@pytest.mark.parametrize(
    ("source", "key_secret", "metadata_server"),
    [
        ("gs://bucket/ckpt", False, True),
        ("gs://bucket/ckpt", True, False),
        ("hf://Salesforce/codegen-350M-mono", False, False),
    ],
)
def test_the_loader_reaches_https_outside_private_ranges_and_only_what_its_source_needs(
    source, key_secret, metadata_server
):
    sets = (
        f"model.source={source}",
        *(("loader.gcsCredentialsSecret.name=gcs",) if key_secret else ()),
    )
    rules = _loader_egress(*sets)
    [https] = _https(rules)
    v4, v6 = (peer["ipBlock"] for peer in https["to"])
    assert v4["cidr"] == "0.0.0.0/0" and {
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "169.254.0.0/16",
    } <= set(v4["except"])
    assert v6["cidr"] == "::/0" and {"fc00::/7", "fe80::/10"} <= set(v6["except"])
    metadata = [
        r
        for r in rules
        if r.get("to", [{}])[0].get("ipBlock", {}).get("cidr", "").startswith("169.254.169.25")
    ]
    assert bool(metadata) == metadata_server
    assert {p["port"] for r in rules if "to" not in r for p in r["ports"]} == {53}
    assert all(
        "podSelector" not in peer and "namespaceSelector" not in peer
        for r in rules
        for peer in r.get("to", [])
    )


def test_a_local_source_gives_the_loader_no_egress_but_what_is_added():
    assert _loader_egress("model.source=file:///models/ckpt") == []
    extra = _loader_egress(
        "model.source=file:///models/ckpt",
        "networkPolicy.loader.extraEgress[0].ports[0].port=3128",
    )
    assert extra == [{"ports": [{"port": 3128}]}]


def test_triton_egress_is_opt_in():
    spec = one(
        rendered("helm4", None, ("networkPolicy.tritonEgress[0].ports[0].port=4317",)),
        "NetworkPolicy",
        "codegen-model-triton",
    )["spec"]
    assert spec["egress"] == [{"ports": [{"port": 4317}]}]


@pytest.mark.parametrize("helm", HELMS)
def test_loosened_and_extended_values_still_validate_strictly(helm):
    docs = rendered(
        helm,
        None,
        (
            "triton.security.http=network",
            "triton.security.restrictedGrpcProtocols={logging}",
            "networkPolicy.tritonEgress[0].ports[0].port=4317",
            "model.source=gs://bucket/ckpt",
            "networkPolicy.loader.exceptCIDRs={10.0.0.0/8,fd00::/8}",
        ),
    )
    assert rc.validate([d for d in docs if d["kind"] not in rc.CRD_KINDS]) == []
    triton = one(docs, "NetworkPolicy", "codegen-model-triton")["spec"]
    assert [sorted(p["port"] for p in r["ports"]) for r in triton["ingress"]] == [
        [8000, 8001],
        [8002],
    ]


# --------------------------------------------------------------------------- what the API refuses


def _schema_pattern(*path: str) -> re.Pattern:
    node = json.loads((rc.CHART / "values.schema.json").read_text())
    for part in path:
        node = node["properties"][part] if part != "items" else node["items"]
    return re.compile(node["pattern"])


_octets = st.one_of(st.integers(0, 255).map(str), st.sampled_from(["256", "010", "00", ""]))
_groups = st.one_of(
    st.integers(0, 0xFFFF).map(lambda n: f"{n:x}"),
    st.sampled_from(["", "FE80", "0000", "12345", "g", "1.2.3.4"]),
)


@st.composite
def _cidr_texts(draw) -> str:
    """Mostly well-formed IPv4 and IPv6 ranges, with the mistakes people make."""
    if draw(st.booleans()):
        count = draw(st.sampled_from([4, 4, 4, 3, 5]))
        address = ".".join(draw(st.lists(_octets, min_size=count, max_size=count)))
        prefix = draw(st.integers(1, 32))
    else:
        groups = draw(st.lists(_groups, min_size=1, max_size=9))
        cut = draw(st.integers(0, len(groups)))
        if len(groups) < 8 or draw(st.booleans()):
            address = ":".join(groups[:cut]) + "::" + ":".join(groups[cut:])
        else:
            address = ":".join(groups)
        prefix = draw(st.integers(1, 128))
    suffix = draw(st.sampled_from([f"/{prefix}"] * 6 + ["", "/0", "/08", "/x", "/129", "/33"]))
    return address + suffix


@settings(max_examples=examples(300), deadline=None)
@given(_cidr_texts())
def test_an_excepted_range_the_schema_takes_is_one_the_api_server_takes(text):
    """Differential: networkPolicy.loader.exceptCIDRs' schema pattern against the API server's
    rule as loader.kube reads it (a CIDR strictly inside 0.0.0.0/0 or ::/0)."""
    if _schema_pattern("networkPolicy", "loader", "exceptCIDRs", "items").fullmatch(text):
        block = {"cidr": "::/0" if ":" in text else "0.0.0.0/0", "except": [text]}
        assert _kube_problems(_policy_with(block)) == []


def _kube_problems(doc: dict) -> list[str]:
    from loader import kube

    return kube.problems([doc])


def _policy_with(block: dict) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "p", "namespace": "n"},
        "spec": {"podSelector": {}, "egress": [{"to": [{"ipBlock": block}]}]},
    }


@pytest.mark.parametrize(
    ("cidr", "excepted"),
    [
        ("0.0.0.0/0", "0.0.0.0/0"),
        ("0.0.0.0/0", "fc00::/7"),
        ("::/0", "::ffff:10.0.0.0/104"),
        ("10.0.0.0/8", "192.168.0.0/16"),
        ("0.0.0.0/0", "10.0.0.0/33"),
        ("0.0.0.0/0", "10.0.0.0"),
        ("10.0.0/8", "10.1.0.0/16"),
    ],
)
def test_validation_refuses_an_address_block_the_api_server_refuses(cidr, excepted):
    assert _kube_problems(_policy_with({"cidr": cidr, "except": [excepted]})) != []


def test_validation_refuses_secret_references_and_keys_the_api_server_refuses():
    docs = rendered("helm4", None)
    deployment = one(docs, "Deployment")
    secret = one(docs, "Secret")
    assert _kube_problems(deployment) == [] and _kube_problems(secret) == []
    for name, key in (("a..b", "token"), ("ok", "..x"), ("ok", "."), ("UP", "token")):
        broken = copy.deepcopy(deployment)
        [triton] = [
            c for c in broken["spec"]["template"]["spec"]["containers"] if c["name"] == "triton"
        ]
        [env] = [e for e in triton["env"] if "valueFrom" in e]
        env["valueFrom"]["secretKeyRef"] = {"name": name, "key": key}
        assert len(_kube_problems(broken)) == 1, (name, key)
    for key in (".", "..", "..x", "a/b", ""):
        assert len(_kube_problems({**secret, "data": {key: "eA=="}})) == 1, key


@pytest.mark.server  # the local control plane (see markers in pyproject.toml)
@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("live_key", ["token", "other"])
def test_an_upgrade_keeps_the_live_admin_token(helm, live_key, sandbox):
    """`helm upgrade` reads the live Secret (`lookup`, here `helm template --dry-run=server`
    against the API server) and keeps its token, so running pods and admin clients keep
    working; a Secret without the key gets a new random token."""
    kept = base64.b64encode(b"kept-token-0123456789").decode()
    sandbox.api.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "codegen-model-triton-admin",
                "namespace": sandbox.namespace,
                "labels": {"app.kubernetes.io/managed-by": "Helm"},
                "annotations": {
                    "meta.helm.sh/release-name": "codegen",
                    "meta.helm.sh/release-namespace": sandbox.namespace,
                },
            },
            "data": {live_key: kept},
        }
    )
    proc = sandbox.helm(helm, "template", "codegen", str(rc.CHART), "--dry-run=server", check=False)
    assert proc.returncode == 0, proc.stderr
    docs = rc.documents(proc.stdout)
    token = one(docs, "Secret", "codegen-model-triton-admin")["data"]["token"]
    if live_key == "token":
        assert token == kept
    else:
        assert token != kept
        assert re.fullmatch(r"[A-Za-z0-9]{40}", base64.b64decode(token).decode())
    [env] = [e for e in triton_container(docs)["env"] if e["name"] == "TRITON_ADMIN_TOKEN"]
    assert env["valueFrom"]["secretKeyRef"] == {
        "name": "codegen-model-triton-admin",
        "key": "token",
    }
