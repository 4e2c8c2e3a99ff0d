"""Every value refused or right: the chart's classes of bad values, each tested over values sets
that Hypothesis generates, rendered by the real Helm 3 and Helm 4 (alternately), and judged the
same way: either Helm refuses, naming a key the values set, or every manifest passes the strict
validation (`loader.chart.validate`: the OpenAPI schemas with int32 ranges, then the API
server's own rules) and the class's own property holds.

Each class draws its values sets in one batch (:func:`tests.chartkit.generated`) and reports every
failing one together. The counts per class are in COUNTS; a class must reach both verdicts.
"""

from __future__ import annotations

import re
import subprocess
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import strategies as st

from loader.kube import quantity
from tests import chart as rc
from tests.chartkit import Outcome, generated, get, names_a_key, render_values

# Generated cases by the dozen, each rendering or running a command: in make test, not test-fast.
pytestmark = pytest.mark.slow

HELMS = ("helm3", "helm4")
INT32 = 2**31 - 1
#: Values sets generated per class.
COUNTS = {"numbers": 40, "names": 40, "collisions": 40, "fit": 40, "features": 30}
POOL = {"gpusPerNode": 64, "nodeSelector": {"pool": "gpu"}}


def nested(path: str, value) -> dict:
    out: dict = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def merged(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out[k] = (
                merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
            )
    return out


def judge(cases: list[dict], check) -> tuple[list[str], int]:
    """Render every case (Helm 3 and 4 in turn); ``check(case, outcome)`` raises
    AssertionError for a wrong outcome. Returns the failures and how many rendered."""
    failures, rendered = [], 0
    for i, case in enumerate(cases):
        helm = HELMS[i % 2]
        base = (rc.VALUES_DIR / case["base"],) if case.get("base") else ()
        outcome = render_values(
            helm, case["values"], base=base, release=case.get("release", "codegen")
        )
        rendered += not outcome.refused
        try:
            if outcome.refused:
                assert names_a_key(outcome.error, case["keys"]), (
                    f"refused without naming {case['keys']}: {outcome.error.strip()[-600:]}"
                )
            else:
                assert outcome.problems == (), outcome.problems[:5]
                check(case, outcome)
        except AssertionError as exc:
            failures.append(f"{helm} {case}:\n    {exc}")
    return failures, rendered


def assert_class(cases: list[dict], check) -> None:
    failures, rendered = judge(cases, check)
    assert failures == [], f"{len(failures)} of {len(cases)} values sets:\n" + "\n".join(
        failures[:12]
    )
    assert 0 < rendered < len(cases), f"{rendered} of {len(cases)} rendered: one verdict only"


def docs_of(outcome: Outcome, kind: str) -> list[dict]:
    return [d for d in outcome.docs if d["kind"] == kind]


def triton_pod(outcome: Outcome) -> dict:
    return docs_of(outcome, "Deployment")[0]["spec"]["template"]["spec"]


def loader_pod(outcome: Outcome) -> dict:
    [cronjob] = docs_of(outcome, "CronJob")
    return cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]


# --------------------------------------------------------------------------- 2. numbers

INTEGER_KEYS = [
    "cluster.nodes", "cluster.replicasPerNode", "cluster.spread.maxSkew",
    "triton.startupProbe.periodSeconds", "triton.startupProbe.failureThreshold",
    "triton.livenessProbe.timeoutSeconds", "triton.readinessProbe.failureThreshold",
    "triton.waitForModel.timeoutSeconds", "triton.waitForModel.intervalSeconds",
    "triton.terminationGracePeriodSeconds", "loader.backoffLimit",
    "loader.activeDeadlineSeconds", "loader.ttlSecondsAfterFinished",
    "loader.terminationGracePeriodSeconds", "autoscaling.minReplicas", "autoscaling.maxReplicas",
    "autoscaling.keda.pollingInterval", "helmTest.requestOutputLen",
    "triton.dynamicBatching.maxQueueDelayMicroseconds",
]  # fmt: skip
SIZE_KEYS = [
    "triton.shmSize", "loader.scratchSizeLimit", "modelRepository.persistence.size",
    "triton.resources.requests.memory", "triton.resources.limits.memory",
    "loader.resources.requests.memory",
]  # fmt: skip
PERCENT_KEYS = [
    "podDisruptionBudget.maxUnavailable", "triton.updateStrategy.maxUnavailable",
    "triton.updateStrategy.maxSurge",
]  # fmt: skip
_big = st.sampled_from([2**31 - 2, 2**31 - 1, 2**31, 2**32 + 1, 2**53, 2**62, 2**63 - 1])
_integers = st.one_of(st.integers(-2, 8), _big, st.integers(0, 2**40))
_sizes = st.one_of(
    st.integers(0, 100),
    st.sampled_from(
        ["2", "0", "0Gi", "2Gi", "512Mi", "1.5Gi", "-1Gi", "2e3", "2m", "1k", "0.5", ".5Gi",
         "1Ei", "64Gi", "abc", "2GB", "00.0Mi", "7Ti"]
    ),
)  # fmt: skip
_percents = st.one_of(
    st.integers(-1, 5),
    _big,
    st.sampled_from(["", "0%", "25%", "100%", "101%", "150%", "abc", "-1%", "1.5", "50"]),
)


@st.composite
def number_cases(draw) -> dict:
    chosen = {}
    for keys, values in ((INTEGER_KEYS, _integers), (SIZE_KEYS, _sizes), (PERCENT_KEYS, _percents)):
        for key in draw(st.lists(st.sampled_from(keys), max_size=2, unique=True)):
            chosen[key] = draw(values)
    local = draw(st.booleans())  # the CPU backend: no GPU arithmetic bounds N
    values = merged({} if local else {"cluster": POOL}, *(nested(k, v) for k, v in chosen.items()))
    if get(values, "autoscaling.minReplicas") is not None or draw(st.booleans()):
        values = merged(values, {"autoscaling": {"enabled": draw(st.booleans())}})
    return {"values": values, "keys": list(chosen), "base": "local.yaml" if local else None}


def _number_property(case: dict, outcome: Outcome) -> None:
    for key in SIZE_KEYS:
        value = get(case["values"], key)
        if value is None:
            continue
        assert isinstance(value, str) and re.search("[A-Za-z]$", value), f"{key}={value!r}"
        assert quantity(value) > 0 and not value.endswith("m"), f"{key}={value!r}"


def test_every_number_the_chart_renders_is_one_kubernetes_accepts():
    """int32 fields stay within int32 (replicas, deadlines, probes: N x nodes, wait + period x
    threshold are compared, not wrapped); sizes carry a unit and are above 0; PDB and rollout
    values are integers or percentages within 0-100%."""
    assert_class(generated(number_cases(), COUNTS["numbers"]), _number_property)


# --------------------------------------------------------------------------- 3. names, labels

_release = st.one_of(
    st.just("codegen"),
    st.from_regex(r"[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?(\.[a-z0-9]{1,4})?", fullmatch=True),
    st.integers(40, 53).map(lambda n: ("r" + "e1" * 30)[:n]),
)
_label_keys = st.one_of(
    st.sampled_from(
        ["team", "example.com/team", "a b", "-x", "x/", "/x", "a/b/c", "A.B/c", "ok.io/x",
         "example.com/" + "n" * 64, "p" * 254 + "/y", "x" * 63, "x" * 64, "_x", "x_"]
    ),
    st.text(alphabet="aZ9._-/ ", min_size=1, max_size=8),
)  # fmt: skip
_label_values = st.one_of(
    st.sampled_from(["ml", "", "b c", "-x", "x" * 63, "x" * 64, "a_b", "a.b", "x-"]),
    st.text(alphabet="aZ9._- /", max_size=8),
)
_names = st.sampled_from(["ok", "My_SA", "a.b", "-x", "x" * 254, "a..b", "UPPER", "x-"])
_repositories = st.sampled_from(
    ["model-triton-ft", "nvcr.io/nvidia/tritonserver", "localhost:5000/x", "reg.io/a/b_c",
     "nvcr.io/nvidia/tritonserver:23.05", "Model", "x@sha256:" + "a" * 64, "a//b", "-x", "x/",
     "REG.io/x"]
)  # fmt: skip
_registries = st.sampled_from(["", "reg.io", "reg.io:5000/mirror", "Reg.IO", "reg.io/", "a..b"])
LABEL_MAPS = [
    "commonLabels", "triton.podLabels", "cluster.nodeSelector", "loader.nodeSelector",
    "metrics.serviceMonitor.labels", "service.annotations", "triton.podAnnotations",
    "serviceAccount.annotations",
]  # fmt: skip
NAME_KEYS = [
    "serviceAccount.name", "loader.serviceAccount.name", "modelRepository.persistence.existingClaim",
    "loader.hfTokenSecret.name", "triton.priorityClassName", "nameOverride", "fullnameOverride",
    "triton.security.adminSecret.name",
]  # fmt: skip
#: Keys of a Secret's data (the admin token's): YAML reads `on` and `1e3` as other types.
_secret_keys = st.sampled_from(
    ["token", "admin.key", "on", "1e3", "null", ".", "..", "..x", ".x", "a/b", "a b", "", "k" * 254]
)  # fmt: skip
#: Address ranges the loader's egress excludes: IPv4, IPv6, and what the API server refuses
#: (no prefix, a prefix of 0 or too long, a bad address, IPv4 written in IPv6).
_cidrs = st.sampled_from(
    ["10.0.0.0/8", "10.1.2.3/8", "192.168.0.0/16", "fc00::/7", "2001:db8::/32", "::1/128",
     "0.0.0.0/0", "::/0", "10.0.0.0", "10.0.0.0/33", "256.0.0.0/8", "010.0.0.0/8", "fe80::/129",
     "::ffff:10.0.0.0/104", "1:2:3:4:5:6:7:8:9/64", "1:::2/64", "gs/8", " 10.0.0.0/8"]
)  # fmt: skip


@st.composite
def name_cases(draw) -> dict:
    chosen: dict = {}
    for key in draw(st.lists(st.sampled_from(LABEL_MAPS), max_size=2, unique=True)):
        chosen[key] = draw(st.dictionaries(_label_keys, _label_values, min_size=1, max_size=2))
    for key in draw(st.lists(st.sampled_from(NAME_KEYS), max_size=1)):
        chosen[key] = draw(_names)
    for image in draw(st.lists(st.sampled_from(["triton.image", "loader.image"]), max_size=1)):
        chosen[f"{image}.repository"] = draw(_repositories)
    if draw(st.booleans()):
        chosen["global.imageRegistry"] = draw(_registries)
    if draw(st.booleans()):
        chosen["triton.security.adminSecret.key"] = draw(_secret_keys)
    if draw(st.booleans()):
        chosen["networkPolicy.loader.exceptCIDRs"] = draw(st.lists(_cidrs, min_size=1, max_size=2))
    values = merged({"cluster": POOL}, *(nested(k, v) for k, v in chosen.items()))
    if "metrics.serviceMonitor.labels" in chosen:
        values = merged(values, {"metrics": {"serviceMonitor": {"enabled": True}}})
    keys = [*chosen, "release name"]
    return {"values": values, "keys": keys, "release": draw(_release)}


def test_every_name_and_label_the_chart_renders_is_one_kubernetes_accepts():
    """Release names that make invalid Service names (a leading digit, a dot), label and
    annotation keys and values outside Kubernetes' syntax, object names, image repositories
    with a tag or capitals, Secret keys, NetworkPolicy address ranges: refused, naming the key;
    or the manifests are valid."""
    assert_class(generated(name_cases(), COUNTS["names"]), lambda case, outcome: None)


def test_release_names_and_name_overrides_yaml_reads_as_other_types_stay_strings():
    """A release name or nameOverride such as ``y``, ``on`` or ``null`` is a valid Kubernetes
    name; in a label it must stay a string (YAML 1.1 reads it as a boolean or null)."""
    words = ["y", "yes", "on", "off", "true", "n", "null", "1e3"]
    cases = [{"values": {"cluster": POOL}, "keys": ["release name"], "release": w} for w in words]
    cases += [
        {"values": {"cluster": POOL, "nameOverride": w}, "keys": ["nameOverride"]} for w in words
    ]
    failures, rendered = judge(cases, lambda case, outcome: None)
    assert failures == [], "\n".join(failures[:6])
    assert rendered > len(words)  # most render (a leading digit is refused)


# --------------------------------------------------------------------------- 4. collisions

#: Long options of `tritonserver` r23.05 (src/command_line_parser.cc, TritonParser's option
#: tables), for resolving what getopt_long makes of an argument (it takes unambiguous prefixes).
TRITON_OPTIONS = [
    "help",
    "id",
    "exit-timeout-secs",
    "model-store",
    "model-repository",
    "exit-on-error",
    "disable-auto-complete-config",
    "strict-readiness",
    "model-control-mode",
    "repository-poll-secs",
    "load-model",
    "model-load-thread-count",
    "model-namespacing",
    "allow-http",
    "http-address",
    "http-port",
    "reuse-http-port",
    "http-header-forward-pattern",
    "http-thread-count",
    "allow-grpc",
    "grpc-address",
    "grpc-port",
    "reuse-grpc-port",
    "grpc-header-forward-pattern",
    "grpc-use-ssl",
    "grpc-use-ssl-mutual",
    "grpc-server-cert",
    "grpc-server-key",
    "grpc-root-cert",
    "grpc-keepalive-time",
    "grpc-keepalive-timeout",
    "grpc-restricted-protocol",
    "log-verbose",
    "log-info",
    "log-warning",
    "log-error",
    "log-format",
    "log-file",
    "allow-sagemaker",
    "sagemaker-port",
    "sagemaker-safe-port-range",
    "sagemaker-thread-count",
    "allow-vertex-ai",
    "vertex-ai-port",
    "vertex-ai-thread-count",
    "vertex-ai-default-model",
    "allow-metrics",
    "allow-gpu-metrics",
    "allow-cpu-metrics",
    "metrics-address",
    "metrics-port",
    "metrics-interval-ms",
    "metrics-config",
    "trace-config",
    "cache-config",
    "cache-directory",
    "rate-limit",
    "rate-limit-resource",
    "pinned-memory-pool-byte-size",
    "cuda-memory-pool-byte-size",
    "buffer-manager-thread-count",
    "host-policy",
    "model-load-gpu-limit",
    "backend-directory",
    "backend-config",
    "repoagent-directory",
    "strict-model-config",
    "response-cache-byte-size",
    "trace-file",
    "trace-level",
    "trace-rate",
    "trace-count",
    "trace-log-frequency",
]
SYNONYMS = {"model-store": "model-repository"}


def resolve(arg: str) -> str | None:
    """The option glibc's getopt_long reads ``arg`` as (an exact name, else the one option it
    is a prefix of), by its canonical name; None when it is no option or an ambiguous one."""
    if not arg.startswith("--") or arg == "--":
        return None
    name = arg[2:].split("=", 1)[0]
    if name in TRITON_OPTIONS:
        return SYNONYMS.get(name, name)
    matches = {SYNONYMS.get(o, o) for o in TRITON_OPTIONS if o.startswith(name)}
    return matches.pop() if len(matches) == 1 else None


OWNED_LABELS = [
    "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
    "app.kubernetes.io/version", "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of",
    "helm.sh/chart",
]  # fmt: skip
_args = st.one_of(
    st.sampled_from(
        ["--exit-timeout-secs=1", "--exit-timeout=1", "--exit-t=3", "--model-store=/x",
         "--model-repository=/y", "--model-repo=/z", "--http-port=1", "--grpc-p=2",
         "--metrics-port", "--log-verbose=1", "--allow-metrics=false", "--exit-on-error=false",
         "--id=x", "--", "--exit-timeout-s=2", "--model-s=/q", "--metrics-p=1", "--http-p=3"]
    ),
    # the security defaults' flags (templates/_security.tpl), which the chart sets or keeps off
    st.sampled_from(
        ["--allow-http=true", "--http-a=0.0.0.0", "--grpc-r=logging:k=v", "--model-control=poll",
         "--load-model=x", "--allow-s=true", "--vertex-ai-p=1", "--repository-poll-secs=1",
         "--grpc-use-ssl=true", "--grpc-use-ssl=false", "--grpc-keepalive-time=1"]
    ),
)  # fmt: skip
#: Flags the security defaults own (templates/_security.tpl), which the chart sets or keeps off.
SECURITY_OWNED = {
    "allow-http", "http-address", "http-port", "reuse-http-port", "allow-grpc", "grpc-address",
    "grpc-port", "reuse-grpc-port", "grpc-restricted-protocol", "model-control-mode",
    "load-model", "repository-poll-secs", "allow-sagemaker", "sagemaker-port",
    "sagemaker-safe-port-range", "sagemaker-thread-count", "allow-vertex-ai", "vertex-ai-port",
    "vertex-ai-thread-count", "vertex-ai-default-model", "grpc-use-ssl", "grpc-use-ssl-mutual",
}  # fmt: skip


@st.composite
def collision_cases(draw) -> dict:
    chosen: dict = {}
    label = st.sampled_from([*OWNED_LABELS, "team", "release"])
    picks = draw(
        st.lists(
            st.sampled_from(
                ["podAnnotations", "commonLabels", "podLabels", "metricsLabels", "pvc", "volumes",
                 "env", "args", "accounts", "gpu"]
            ),
            min_size=1, max_size=3, unique=True,
        )
    )  # fmt: skip
    values: dict = {"cluster": POOL}
    if "podAnnotations" in picks:
        key = draw(st.sampled_from(["checksum/config", "model-triton/model-key", "team"]))
        chosen["triton.podAnnotations"] = {key: "x"}
    if "commonLabels" in picks:
        chosen["commonLabels"] = {draw(label): "a"}
    if "podLabels" in picks:
        chosen["triton.podLabels"] = {draw(label): "b"}
    if "metricsLabels" in picks:
        chosen["metrics.serviceMonitor.labels"] = {draw(label): "c"}
        chosen["metrics.prometheusRule.labels"] = {draw(label): "d"}
        values = merged(values, {"metrics": {"serviceMonitor": {"enabled": True},
                                             "prometheusRule": {"enabled": True}}})  # fmt: skip
    if "pvc" in picks:
        chosen["modelRepository.persistence.annotations"] = {
            draw(st.sampled_from(["helm.sh/resource-policy", "backup/on"])): draw(
                st.sampled_from(["keep", "delete"])
            )
        }
        chosen["modelRepository.persistence.keep"] = draw(st.booleans())
    if "volumes" in picks:
        names = draw(
            st.lists(
                st.sampled_from(["models", "dshm", "tmp", "cache", "data"]), min_size=1, max_size=2
            )
        )
        chosen["triton.extraVolumes"] = [{"name": n, "emptyDir": {}} for n in names]
        chosen["triton.extraVolumeMounts"] = [
            {"name": draw(st.sampled_from([*names, "nope"])),
             "mountPath": draw(st.sampled_from(["/models", "/dev/shm", "/tmp/", "/cache", "/data"]))}
            for _ in range(draw(st.integers(1, 2)))
        ]  # fmt: skip
    if "env" in picks:
        chosen["triton.extraEnv"] = [
            {"name": draw(st.sampled_from(["HOME", "X", "X"])), "value": "1"}
            for _ in range(draw(st.integers(1, 2)))
        ]
        chosen["loader.extraEnv"] = [
            {"name": draw(st.sampled_from(["HOME", "HF_HOME", "HF_TOKEN_FILE", "Y"])), "value": "1"}
        ]
    if "args" in picks:
        chosen["triton.extraArgs"] = draw(st.lists(_args, min_size=1, max_size=2))
    if "accounts" in picks:
        name = draw(
            st.sampled_from(["shared", "codegen-model-triton", "codegen-model-triton-loader"])
        )
        chosen["serviceAccount.name"] = draw(st.sampled_from([name, ""]))
        chosen["serviceAccount.create"] = draw(st.booleans())
        chosen["loader.serviceAccount.name"] = draw(st.sampled_from([name, ""]))
        chosen["loader.serviceAccount.create"] = draw(st.booleans())
    if "gpu" in picks:
        part = draw(st.sampled_from(["requests", "limits"]))
        chosen[f"triton.resources.{part}"] = {"nvidia.com/gpu": draw(st.integers(1, 4))}
    values = merged(values, *(nested(k, v) for k, v in chosen.items()))
    return {"values": values, "keys": list(chosen)}


def _collision_property(case: dict, outcome: Outcome) -> None:
    values = case["values"]
    for pvc in docs_of(outcome, "PersistentVolumeClaim"):
        policy = (pvc["metadata"].get("annotations") or {}).get("helm.sh/resource-policy")
        assert (policy == "keep") == get(values, "modelRepository.persistence.keep", True)
    [triton] = [c for c in triton_pod(outcome)["containers"] if c["name"] == "triton"]
    command = triton["command"]
    extra = get(values, "triton.extraArgs") or []
    assert command[len(command) - len(extra) :] == extra
    owned = [resolve(a) for a in command[1 : len(command) - len(extra)]]
    assert all(owned) and len(owned) >= 5
    for option in owned:
        setters = [a for a in command[1:] if resolve(a) == option]
        assert len(setters) == 1, f"--{option} is set by {setters}"
    for arg in extra:  # TLS off is allowed; turned on, the plaintext probes would never pass
        if resolve(arg) in SECURITY_OWNED:
            assert arg.endswith("=false") and resolve(arg).startswith("grpc-use-ssl"), arg
    gpus = {k: v for k, v in triton["resources"]["limits"].items() if "nvidia.com" in k}
    assert gpus == {"nvidia.com/gpu": 2}, gpus  # T x P of the defaults, whatever was asked
    accounts = {d["metadata"]["name"] for d in docs_of(outcome, "ServiceAccount")}
    loader, serving = (
        loader_pod(outcome)["serviceAccountName"],
        triton_pod(outcome)["serviceAccountName"],
    )
    if loader in accounts or serving in accounts:
        assert loader != serving, "the loader and Triton share a ServiceAccount"


def test_user_maps_never_collide_with_what_the_chart_writes():
    """Pod annotations, labels, the PVC's resource policy, volumes and mounts, environment
    variables, tritonserver options (prefixes included), the GPU resource and ServiceAccount
    names: a collision is refused naming it, or the manifests have no repeated key and the
    chart's own settings hold."""
    assert_class(generated(collision_cases(), COUNTS["collisions"]), _collision_property)


# --------------------------------------------------------------------------- 5. what fits

_affinities = st.sampled_from(
    [
        {},
        {"nodeAffinity": {}},
        {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": []}]}}},
        {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "Exists"}]}]}}},
        {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {"matchExpressions": [{"key": "pool", "operator": "Exists"}]}}]}},
    ]
)  # fmt: skip


@st.composite
def fit_cases(draw) -> dict:
    t, p = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2]))
    requests = {"cpu": draw(st.sampled_from(["1", "4", "10", "12.5", "500m"])),
                "memory": draw(st.sampled_from(["8Gi", "32Gi", "96Gi", "150Gi"]))}  # fmt: skip
    limits = {}
    if draw(st.booleans()):
        limits["memory"] = draw(st.sampled_from(["16Gi", "64Gi", "150Gi", "200Gi"]))
    if draw(st.booleans()):
        limits["cpu"] = draw(st.sampled_from(["2", "16"]))
    cluster = {
        "gpusPerNode": draw(st.sampled_from([1, 2, 4, 8, 16])),
        "replicasPerNode": draw(st.integers(1, 8)),
        "nodes": draw(st.integers(1, 3)),
        "gpuResourceName": draw(
            st.sampled_from(["nvidia.com/gpu", "nvidia.com/gpu", "nvidia.com/mig-1g.5gb",
                             "nvidia.com/mig-3g.20gb", "nvidia.com/mig-7g.40gb"])
        ),
        "gpuMemoryGiB": draw(st.sampled_from([4, 5, 19, 20, 40, 80])),
        "nodeSelector": draw(st.sampled_from([{}, {"pool": "a"}])),
        "affinity": draw(_affinities),
    }  # fmt: skip
    keys = ["cluster", "triton.resources", "model.tensorParallelSize"]
    if draw(st.booleans()):
        cluster["nodeAllocatable"] = {
            "cpu": draw(st.sampled_from(["", "8", "16", "94", "95.5"])),
            "memory": draw(st.sampled_from(["", "64Gi", "100Gi", "1200Gi"])),
        }
    values = {
        "cluster": cluster,
        "model": {"tensorParallelSize": t, "pipelineParallelSize": p},
        "triton": {"resources": {"requests": requests, "limits": limits}},
    }
    return {"values": values, "keys": keys}


def _fit_property(case: dict, outcome: Outcome) -> None:
    c = case["values"]["cluster"]
    m = case["values"]["model"]
    n, gpus = c["replicasPerNode"], m["tensorParallelSize"] * m["pipelineParallelSize"]
    [triton] = [x for x in triton_pod(outcome)["containers"] if x["name"] == "triton"]
    for name in ("cpu", "memory"):
        have = (c.get("nodeAllocatable") or {}).get(name)
        if have:
            request = (
                triton["resources"]["requests"].get(name) or triton["resources"]["limits"][name]
            )
            assert n * quantity(request) <= quantity(have), f"{n} x {request} > {have}"
    if "mig-" in c["gpuResourceName"]:
        assert gpus == 1, "T x P > 1 on MIG slices"
        slice_gb = int(re.search(r"\.(\d+)gb", c["gpuResourceName"])[1])
        assert c["gpuMemoryGiB"] <= slice_gb, "the loader plans for more than a slice"
    assert n * gpus <= c["gpusPerNode"]
    if n > 1:
        terms = (
            get(
                c["affinity"],
                "nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
            )
            or []
        )
        assert c["nodeSelector"] or (terms and all(t.get("matchExpressions") for t in terms)), (
            "N > 1 without a pool"
        )


def test_what_a_node_must_hold_fits_on_it():
    """CPU and memory requests x N within the node's allocatable (when given), limits not below
    requests, T x P = 1 and a slice's memory on MIG, N > 1 only on a pool that a selector or a
    required node affinity names."""
    assert_class(generated(fit_cases(), COUNTS["fit"]), _fit_property)


def test_production_fills_in_its_node_s_allocatable_cpu_and_memory():
    values = rc.documents(rc.render(values_files=[rc.VALUES_DIR / "production.yaml"]))
    assert values  # renders: 8 replicas x the requests fit the node
    import yaml

    production = yaml.safe_load((rc.VALUES_DIR / "production.yaml").read_text())
    allocatable = production["cluster"]["nodeAllocatable"]
    # a2-megagpu-16g: 96 vCPUs, 1360 GB; GKE's reservations leave 95.69 CPU and ~1234 GiB
    assert Fraction(90) <= quantity(allocatable["cpu"]) <= Fraction("95.69")
    assert 1100 * 2**30 <= quantity(allocatable["memory"]) <= 1234 * 2**30
    requests = production["triton"]["resources"]["requests"]
    assert 8 * quantity(requests["cpu"]) <= quantity(allocatable["cpu"])
    assert 8 * quantity(requests["memory"]) <= quantity(allocatable["memory"])


# --------------------------------------------------------------------------- 6. features together


def admits(policy: dict, namespace_labels: dict, pod_labels: dict, port: int) -> bool:
    """Whether a NetworkPolicy's ingress admits a pod (its labels, its namespace's labels) to a
    port (matchLabels and matchExpressions with In/Exists; peers as Kubernetes reads them)."""

    def selects(selector: dict | None, labels: dict) -> bool:
        if selector is None:
            return True
        for key, value in (selector.get("matchLabels") or {}).items():
            if labels.get(key) != value:
                return False
        for e in selector.get("matchExpressions") or []:
            if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
                return False
            if e["operator"] == "Exists" and e["key"] not in labels:
                return False
        return True

    same_namespace = (
        namespace_labels.get("kubernetes.io/metadata.name") == policy["metadata"]["namespace"]
    )
    for rule in policy["spec"].get("ingress") or []:
        if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
            continue
        for peer in rule.get("from") or [{}]:
            if "namespaceSelector" in peer:
                ok = selects(peer["namespaceSelector"], namespace_labels)
            else:
                ok = same_namespace
            if ok and selects(peer.get("podSelector"), pod_labels):
                return True
    return False


def pod_names(deployment: str, count: int, seed: int) -> list[str]:
    """Names Kubernetes gives a Deployment's pods: ReplicaSet <deployment>-<hash>, then
    generateName <replicaset>- cut to 58 characters + 5 random (both from its safe alphabet)."""
    import random

    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    rng = random.Random(seed)
    names = []
    for _ in range(count):
        digest = "".join(rng.choice(alphabet) for _ in range(rng.choice([9, 10])))
        base = f"{deployment}-{digest}-"[:58]
        names.append(base + "".join(rng.choice(alphabet) for _ in range(5)))
    return names


@st.composite
def feature_cases(draw) -> dict:
    values: dict = {"cluster": {**POOL, "nodes": draw(st.integers(1, 3)), "replicasPerNode": draw(st.integers(1, 8))},
                    "model": {"tensorParallelSize": 1}}  # fmt: skip
    keys = ["metrics", "networkPolicy", "autoscaling", "loader.prune", "release name"]
    if draw(st.booleans()):
        values["metrics"] = {"prometheus": {
            "namespace": draw(st.sampled_from(["monitoring", "prom", "model-triton"])),
            "podLabels": draw(st.sampled_from([{}, {"app": "prom"}, {"app.kubernetes.io/name": "prometheus"}])),
        }}  # fmt: skip
    values = merged(values, {
        "metrics": {"serviceMonitor": {"enabled": draw(st.booleans())},
                    "prometheusRule": {"enabled": draw(st.booleans())}},
        "networkPolicy": {"enabled": draw(st.booleans()),
                          "allowedFrom": draw(st.sampled_from([[], [{"podSelector": {"matchLabels": {"app": "gw"}}}]]))},
    })  # fmt: skip
    replicas = values["cluster"]["nodes"] * values["cluster"]["replicasPerNode"]
    if draw(st.booleans()):
        low = draw(st.integers(1, replicas))
        values["autoscaling"] = {"enabled": True, "kind": draw(st.sampled_from(["hpa", "keda"])),
                                 "minReplicas": low, "maxReplicas": draw(st.integers(low, replicas))}  # fmt: skip
    if draw(st.booleans()):
        values["loader"] = {"prune": {"enabled": True}}
        if draw(st.booleans()):
            values["modelRepository"] = {"persistence": {"existingClaim": "shared-models"}}
    elif draw(st.booleans()):
        values = merged(values, {
            "cluster": {"nodes": 1, "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
            "modelRepository": {"persistence": {"accessMode": "ReadWriteOnce"}},
        })  # fmt: skip
        if values.get("autoscaling"):
            values["autoscaling"]["minReplicas"] = values["autoscaling"]["maxReplicas"] = 1
    release = draw(st.sampled_from(["codegen", "a", "serving-codegen", "x" * 34]))
    return {"values": values, "keys": keys, "release": release}


def _feature_property(case: dict, outcome: Outcome) -> None:
    values = case["values"]
    deployment = docs_of(outcome, "Deployment")[0]
    prometheus = get(values, "metrics.prometheus") or {}
    name = deployment["metadata"]["name"]
    policies = {p["metadata"]["name"]: p for p in docs_of(outcome, "NetworkPolicy")}
    enabled = get(values, "networkPolicy.enabled")
    assert len(policies) == (3 if enabled else 0), sorted(policies)
    policy = policies.get(name)
    if policy:
        namespace = {"kubernetes.io/metadata.name": "model-triton"}
        [test_pod] = docs_of(outcome, "Pod")
        assert admits(policy, namespace, test_pod["metadata"]["labels"], 8001), "helm test"
        assert admits(policy, namespace, {"model-triton/client": name}, 8001)
        assert not admits(policy, namespace, {"model-triton/client": name + "-b"}, 8001)
        assert not admits(policy, namespace, {"app": "other"}, 8001)
        assert admits(policy, namespace, {"app": "gw"}, 8001) == bool(
            get(values, "networkPolicy.allowedFrom")
        )
        assert not admits(policy, namespace, {"app": "gw"}, 8000), "HTTP is the pod's own"
    if policy and get(values, "metrics.serviceMonitor.enabled"):
        namespace = prometheus.get("namespace", "monitoring")
        labels = prometheus.get("podLabels") or {}
        assert admits(policy, {"kubernetes.io/metadata.name": namespace}, labels, 8002), (
            "the ServiceMonitor's Prometheus cannot reach port 8002"
        )
    if get(values, "autoscaling.enabled"):
        low, high = values["autoscaling"]["minReplicas"], values["autoscaling"]["maxReplicas"]
        bound = high - values["cluster"]["nodes"] + 1  # the autoscaler may add pods mid-rollout
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == max(
            1, low // 4, bound
        )
    selectors = [
        rule["expr"]
        for d in docs_of(outcome, "PrometheusRule")
        for g in d["spec"]["groups"]
        for rule in g["rules"]
    ] + [
        t["metadata"]["query"]
        for d in docs_of(outcome, "ScaledObject")
        for t in d["spec"]["triggers"]
    ]
    for expr in selectors:
        pattern = re.search(r'pod=~"([^"]+)"', expr)[1]
        assert all(re.fullmatch(pattern, p) for p in pod_names(name, 20, 1)), pattern
        for other in (f"{name}-v2", f"{name}-b", f"{name}-canary-2"):
            assert not any(re.fullmatch(pattern, p) for p in pod_names(other, 20, 2)), (
                f"{pattern} matches the pods of {other}"
            )
    if get(values, "loader.prune.enabled") and get(
        values, "modelRepository.persistence.existingClaim"
    ):
        assert get(values, "modelRepository.persistence.shared") is False, "prune on a shared claim"
    if get(values, "modelRepository.persistence.accessMode") == "ReadWriteOnce":
        loader, triton = loader_pod(outcome), triton_pod(outcome)
        for toleration in triton.get("tolerations") or []:
            assert toleration in (loader.get("tolerations") or []), "the loader cannot follow"
        assert (triton.get("nodeSelector") or {}).items() <= (
            loader.get("nodeSelector") or {}
        ).items()
        [term] = loader["affinity"]["podAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert (
            term["podAffinityTerm"]["labelSelector"]["matchLabels"]
            == deployment["spec"]["selector"]["matchLabels"]
        )


def test_features_work_together():
    """With the ServiceMonitor and the NetworkPolicy on, the scraper reaches 8002; the policies
    (Triton's, the loader's, the helm test pod's) come together, and Triton's admits the helm
    test pod, the labelled clients and allowedFrom to gRPC, no other pod, nobody to HTTP; with
    autoscaling, maxUnavailable comes from its bounds; alerts and KEDA select this release's
    pods only; prune never runs on a shared claim; on a one-node volume the loader may run
    where the Triton pods (and the volume) are."""
    assert_class(generated(feature_cases(), COUNTS["features"]), _feature_property)


# --------------------------------------------------------------------------- staging-deploy


def test_staging_deploy_keeps_its_job_whatever_its_ttl(tmp_path):
    """`ttlSecondsAfterFinished: 0` deletes a finished Job at once; the Job the script creates
    keeps its record for an hour, so the script reads how it ended."""
    script = (Path(rc.ROOT) / "scripts" / "staging-deploy.sh").read_text()
    [create] = [
        line
        for line in script.splitlines()
        if "create job" in line and not line.lstrip().startswith("#")
    ]
    assert "--dry-run=client -o json" in create
    block = script[script.index(create) :]
    code = block[
        block.index("python -c '") + len("python -c '") : block.index('\' \\\n  | "$kubectl"')
    ]
    for ttl in (0, 1, 600, 86400, None):
        job = {"spec": {} if ttl is None else {"ttlSecondsAfterFinished": ttl}}
        import json

        out = subprocess.run(["python3", "-c", code], input=json.dumps(job), capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        assert json.loads(out)["spec"]["ttlSecondsAfterFinished"] == max(3600, ttl or 0)


@pytest.mark.parametrize("helm", HELMS)
def test_large_int_or_percent_values_from_a_file_render_as_integers(helm):
    """A values file's numbers reach the templates as floats (Helm 4) or json.Number (Helm 3):
    the int-or-percent fields still render 2147483647, not 2.147483647e+09 or 0."""
    big = 2**31 - 1
    outcome = render_values(
        helm,
        {
            "triton": {"updateStrategy": {"maxUnavailable": big, "maxSurge": big}},
            "podDisruptionBudget": {"maxUnavailable": big},
        },
    )
    assert outcome.problems == ()
    [deployment] = docs_of(outcome, "Deployment")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": big,
        "maxUnavailable": big,
    }
    assert docs_of(outcome, "PodDisruptionBudget")[0]["spec"]["maxUnavailable"] == big
