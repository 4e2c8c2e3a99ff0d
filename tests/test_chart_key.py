"""One model key: the chart's `_modelkey.tpl` and the loader's `loader.repository.key` agree on
every generated input, or both refuse it.

The chart states the key at render time (the Deployment's annotation, the init container's
`MODEL_PATH`, Triton's `--model-repository`, NOTES, `make staging-deploy`), so it keeps its own
implementation, and this module proves the two equal:

* thousands of generated sources, names, revisions and settings are rendered through the real
  Helm 3 and Helm 4 in a few runs (the chart's own helper files in a scratch chart, one loop
  around them); for each case the chart's key must equal the key `model-loader run` computes
  from the arguments the chart renders for it (its real argument parser), or both must refuse;
* the same kind of generated values go through the whole chart with its schema;
* the schema's limits on the key's parts are the loader's constants, read from both.

The one deliberate difference: a relative path, which the loader resolves against its working
directory, is refused by the chart (a pod's working directory is not a place a user chooses).
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loader.cli import build_parser
from loader.cli.run import request_from_args
from loader.errors import LoaderError
from loader.parallel import Parallelism
from loader.repository import key as loader_key
from tests import chart as rc
from tests.chartkit import generated, render_helpers, render_values
from tests.tiers import examples

# Generated cases by the dozen, each rendering or running a command: in make test, not test-fast.
pytestmark = pytest.mark.slow

HELMS = ("helm3", "helm4")
#: Generated cases per Helm version in the batched comparison.
CASES = 2000

HARNESS = """
{{- $out := list -}}
{{- range $case := .Values.cases -}}
{{- $ctx := dict "Values" $case "Chart" $.Chart "Release" $.Release "Capabilities" $.Capabilities -}}
{{- $problems := include "model-triton.keyProblems" $ctx | fromJsonArray -}}
{{- $m := $case.model -}}
{{- $entry := dict "problems" $problems "echo" (list $m.name $m.source $m.revision) -}}
{{- if not $problems -}}
{{- $_ := set $entry "key" (include "model-triton.modelKey" $ctx) -}}
{{- $_ := set $entry "args" (include "model-triton.loaderArgs" $ctx | fromYamlArray) -}}
{{- end -}}
{{- $out = append $out $entry -}}
{{- end -}}
kind: HelperResult
result: {{ toJson $out | b64enc }}
"""

# --------------------------------------------------------------------------- generated inputs

#: Characters the key's parts are built from: the legal ones, separators, what URL parsers
#: decode or cut, whitespace, controls, YAML line breaks, and letters that case-fold oddly.
_HOSTILE = "aZ09._-/@:%?#~ \t\n\x00\x7f\x85\u2028\u0130\u212a\u017f\u00e9\U0001f600"
_hostile_text = st.text(alphabet=_HOSTILE, max_size=12)
_legal = st.text(alphabet="abcXYZ0189._-", min_size=1, max_size=12).filter(lambda s: s[0].isalnum())


def _long(min_size: int, max_size: int):
    return st.integers(min_size, max_size).map(lambda n: ("a1" * n)[:n])


_part = st.one_of(_legal, _legal, _hostile_text, st.sampled_from(["", ".", "..", "localhost"]))
_scheme = st.one_of(
    st.sampled_from(["gs", "hf", "file"]),
    st.sampled_from(
        ["GS", "Gs", "HF", "hF", "FILE", "File", "s3", "http", "", "h f", "f\u0130le", "\u0130f",
         "g\u017f", "gs ", " hf"]
    ),
)  # fmt: skip


@st.composite
def sources(draw) -> str:
    kind = draw(st.sampled_from(["uri", "uri", "uri", "hf", "hf-rev", "path", "file-host"]))
    if kind == "path":
        parts = draw(st.lists(_part, max_size=4))
        return draw(st.sampled_from(["/", "/", "", "//", "~/"])) + "/".join(parts)
    scheme = draw(_scheme)
    if kind == "file-host":
        host = draw(st.sampled_from(["", "localhost", "LOCALHOST", "localhostx", "host"]))
        return f"{scheme}://{host}/" + "/".join(draw(st.lists(_part, max_size=3)))
    lead = draw(st.sampled_from(["", "", "/", "//"]))
    if kind in ("hf", "hf-rev"):
        scheme = draw(st.sampled_from(["hf", "hf", "HF"]))
        body = "/".join(draw(st.lists(st.one_of(_legal, _legal, _part), min_size=1, max_size=3)))
        if kind == "hf-rev":
            body += "@" + draw(st.one_of(_legal, _legal, _hostile_text, _long(60, 70)))
        return f"{scheme}://{lead}{body}"
    return f"{scheme}://{lead}" + "/".join(draw(st.lists(_part, min_size=0, max_size=4)))


@st.composite
def legal_sources(draw) -> str:
    """Sources both sides take, in every spelling: scheme case, slashes, localhost, `@rev`."""
    kind = draw(st.sampled_from(["gs", "hf", "file", "path"]))
    parts = draw(st.lists(_legal, min_size=1, max_size=3))
    slashes = draw(st.sampled_from(["", "/", "//"]))
    if kind == "path":
        return "/" + slashes + "/".join(parts) + draw(st.sampled_from(["", "/", "/.", "/.."]))
    scheme = "".join(draw(st.sampled_from([c, c.upper()])) for c in kind)
    if kind == "hf":
        rev = draw(st.one_of(st.just(""), _legal.map(lambda r: "@" + r)))
        return (
            f"{scheme}://{slashes}" + "/".join(parts[:2]) + draw(st.sampled_from(["", "/"])) + rev
        )
    if kind == "file":
        host = draw(st.sampled_from(["", "localhost"]))
        return f"{scheme}://{host}/{slashes}" + "/".join(parts)
    return f"{scheme}://" + "/".join(parts) + slashes


_names = st.one_of(
    _hostile_text,
    _long(60, 70),
    st.sampled_from([*sorted(loader_key.RESERVED_MODEL_NAMES), "codegen", "Preprocessing"]),
)
_revisions = st.one_of(_hostile_text, _long(60, 70))
#: The dimensions a case may make hostile (at most two at once; the rest is legal).
DIMENSIONS = ("name", "source", "revision", "parallel", "batching")


@st.composite
def key_cases(draw) -> dict:
    """The values a key depends on, in the chart's shape: legal, except for up to two
    dimensions drawn from everything that can go wrong there."""
    hostile = draw(st.sets(st.sampled_from(DIMENSIONS), max_size=2))
    max_batch = draw(st.integers(1, 1024))
    legal_sizes = st.lists(st.integers(1, max_batch), max_size=3, unique=True)
    count = st.integers(0, 32) if "parallel" in hostile else st.integers(1, 8)
    return {
        "model": {
            "name": draw(_names if "name" in hostile else _legal),
            "source": draw(sources() if "source" in hostile else legal_sources()),
            "revision": draw(
                _revisions if "revision" in hostile else st.one_of(st.just(""), _legal)
            ),
            "followSource": False,
            "tensorParallelSize": draw(count),
            "pipelineParallelSize": draw(count),
            "dtype": draw(st.sampled_from(["", "fp16", "fp32"])),
        },
        "triton": {
            "backend": draw(st.sampled_from(["fastertransformer", "python"])),
            "instanceCount": draw(st.integers(0, 16) if "parallel" in hostile else count),
            "maxBatchSize": max_batch,
            "dynamicBatching": {
                "enabled": draw(st.booleans()),
                "preferredBatchSize": draw(
                    st.lists(st.integers(1, 1100), max_size=3, unique=True)
                    if "batching" in hostile
                    else legal_sizes
                ),
                "maxQueueDelayMicroseconds": draw(st.integers(0, 2**31 - 1)),
            },
            "streaming": draw(st.booleans()),
        },
        "cluster": {"gpuMemoryGiB": 40},
        "loader": {"prune": {"enabled": False, "keep": 2}},
    }


# --------------------------------------------------------------------------- the loader's side


def loader_verdict(case: dict) -> str | None:
    """The key `model-loader run` computes for these values, or None when it refuses them
    (a typed LoaderError; anything else is a bug and propagates). The batching flags reach the
    loader only with dynamic batching on, as the chart passes them."""
    m, t = case["model"], case["triton"]
    batching = t["dynamicBatching"]
    on = batching["enabled"]
    try:
        return loader_key.model_key(
            m["name"],
            m["source"],
            Parallelism(m["tensorParallelSize"], m["pipelineParallelSize"], t["instanceCount"]),
            loader_key.ServingSettings(
                backend=t["backend"],
                dtype=m["dtype"] or "auto",
                max_batch_size=t["maxBatchSize"],
                dynamic_batching=batching["enabled"],
                preferred_batch_sizes=tuple(batching["preferredBatchSize"]) if on else (),
                max_queue_delay_us=batching["maxQueueDelayMicroseconds"] if on else 100,
                streaming=t["streaming"],
            ),
            revision=m["revision"] or None,
        )
    except LoaderError:
        return None


def key_of_args(args: list[str]) -> str:
    """The key `model-loader run` publishes for the arguments the chart renders."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == "run"
    return request_from_args(parsed).key


def _relative(source: str) -> bool:
    return "://" not in source and not source.startswith("/")


def _holds_the_volume(problems: list[str] | str) -> bool:
    """The chart refuses a local source holding /models from its path alone; the loader
    refuses it where /models exists (in the pod), which this machine need not have."""
    return "holds the model volume" in (
        problems if isinstance(problems, str) else " ".join(problems)
    )


def _unused_sizes_out_of_range(case: dict) -> bool:
    """The schema checks ``preferredBatchSize`` against its own range even with dynamic
    batching off, when the loader never receives the sizes (a typo is caught either way)."""
    batching = case["triton"]["dynamicBatching"]
    schema = json.loads((rc.CHART / "values.schema.json").read_text())
    items = schema["properties"]["triton"]["properties"]["dynamicBatching"]["properties"][
        "preferredBatchSize"
    ]["items"]
    return not batching["enabled"] and any(
        not items["minimum"] <= size <= items["maximum"] for size in batching["preferredBatchSize"]
    )


def disagreements(cases: list[dict], results: list[dict]) -> list[str]:
    found = []
    for case, result in zip(cases, results, strict=True):
        m = case["model"]
        # Helm read every generated string back unchanged.
        assert result["echo"] == [m["name"], m["source"], m["revision"]], result["echo"]
        expected = loader_verdict(case)
        if result["problems"]:
            if expected is None:
                continue
            if _relative(m["source"]) and any("relative path" in p for p in result["problems"]):
                continue
            if _holds_the_volume(result["problems"]):
                continue
            found.append(f"chart refuses, loader publishes {expected!r}: {case['model']}")
            continue
        if expected is None:
            found.append(f"chart renders {result['key']!r}, loader refuses: {case}")
        elif result["key"] != expected or key_of_args(result["args"]) != expected:
            found.append(f"chart {result['key']!r} != loader {expected!r}: {case}")
    return found


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    # ten cases per Hypothesis example: drawing is what costs here, not Helm
    batches = generated(st.lists(key_cases(), min_size=10, max_size=10), CASES // 10)
    return [case for batch in batches for case in batch]


@pytest.mark.parametrize("helm", HELMS)
def test_chart_and_loader_compute_the_same_key_or_both_refuse(helm, cases):
    results = render_helpers(helm, HARNESS, {"cases": cases})
    assert len(results) == len(cases)
    bad = disagreements(cases, results)
    assert bad == [], f"{len(bad)} of {len(cases)} cases disagree:\n" + "\n".join(bad[:20])
    # the generated cases reach both verdicts, on every kind of source
    accepted = [c for c, r in zip(cases, results, strict=True) if not r["problems"]]
    assert 0.1 * len(cases) < len(accepted) < 0.9 * len(cases)
    schemes = {c["model"]["source"].split("://")[0].lower() for c in accepted}
    assert {"gs", "hf", "file"} <= schemes


def test_the_comparison_catches_a_chart_that_drifts(cases):
    """The harness is not blind: a chart key that ignores the scheme's case is found."""
    drifted = HARNESS.replace(
        '(include "model-triton.modelKey" $ctx)',
        '(include "model-triton.modelKey" $ctx | replace "@v" "@V")',
    )
    probe = [c for c in cases if not _relative(c["model"]["source"])][:200]
    probe.append(
        {**cases[0], "model": {**cases[0]["model"], "name": "m", "revision": "v1"}}
    )  # one case whose key has "@v"
    assert disagreements(probe, render_helpers("helm4", drifted, {"cases": probe}))


# --------------------------------------------------------------------------- the whole chart


def _values_of(case: dict) -> dict:
    values = {k: v for k, v in case.items() if k != "loader"}
    values["model"] = {**case["model"]}
    values["cluster"] = {"gpusPerNode": 64, "nodeSelector": {"pool": "gpu"}}
    return values


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=key_cases(), helm=st.sampled_from(HELMS))
@example(  # sizes the schema refuses while dynamic batching is off (found by Hypothesis)
    case={
        "model": {"name": "0", "source": "gs://0", "revision": "", "followSource": False,
                  "tensorParallelSize": 1, "pipelineParallelSize": 1, "dtype": ""},
        "triton": {"backend": "fastertransformer", "instanceCount": 1, "maxBatchSize": 1,
                   "dynamicBatching": {"enabled": False, "preferredBatchSize": [1025],
                                       "maxQueueDelayMicroseconds": 0},
                   "streaming": False},
        "cluster": {"gpuMemoryGiB": 40},
        "loader": {"prune": {"enabled": False, "keep": 2}},
    },
    helm="helm3",
)  # fmt: skip
def test_the_whole_chart_renders_the_loader_s_key_or_refuses_naming_the_key(case, helm):
    """Through the real chart with its schema: the Deployment waits for the key the loader Job
    publishes, and it is the loader's own key; or the chart refuses, naming a model key."""
    outcome = render_values(helm, _values_of(case))
    expected = loader_verdict(case)
    assert outcome.problems == ()
    m = case["model"]
    if outcome.refused:
        # beyond the key, the chart places the replica: T x P GPUs on a node of at most 64
        too_big = m["tensorParallelSize"] * m["pipelineParallelSize"] > 64
        assert (
            expected is None
            or _relative(m["source"])
            or too_big
            or _holds_the_volume(outcome.error)
            or _unused_sizes_out_of_range(case)
        ), outcome.error
        # Helm 3 cannot even read a value holding DEL or a C1 control (its schema step re-reads
        # the values as YAML, which forbids them raw); the loader refuses those sources too.
        helm3_unreadable = "yaml: control characters are not allowed" in outcome.error
        assert helm3_unreadable or re.search(
            r"model[./](source|name|revision|\w+ParallelSize)|triton[./]", outcome.error
        )
        return
    assert expected is not None, f"the chart renders a key the loader refuses: {case}"
    deployment = next(d for d in outcome.docs if d["kind"] == "Deployment")
    key = deployment["metadata"]["annotations"]["model-triton/model-key"]
    cronjob = next(d for d in outcome.docs if d["kind"] == "CronJob")
    args = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert key == expected == key_of_args(args)


# --------------------------------------------------------------------------- one set of limits


def test_the_schema_s_limits_on_the_key_are_the_loader_s():
    schema = json.loads((rc.CHART / "values.schema.json").read_text())["properties"]
    name, revision = (
        schema["model"]["properties"]["name"],
        schema["model"]["properties"]["revision"],
    )
    assert name["pattern"] == f"^{loader_key.NAME_PATTERN}$"
    assert name["maxLength"] == loader_key.MAX_PART_BYTES
    assert set(name["not"]["enum"]) == loader_key.RESERVED_MODEL_NAMES
    assert revision["pattern"] == f"^({loader_key.REVISION_PATTERN})?$"
    assert revision["maxLength"] == loader_key.MAX_PART_BYTES
    backends = schema["triton"]["properties"]["backend"]["enum"]
    assert set(backends) == set(loader_key.BACKENDS)
    dtypes = schema["model"]["properties"]["dtype"]["enum"]
    assert {d or "auto" for d in dtypes} == set(loader_key.DTYPES)
    # the templates check the same patterns and length (the key's refusals name the key)
    template = (rc.CHART / "templates" / "_modelkey.tpl").read_text()
    assert f'regexMatch "^{loader_key.NAME_PATTERN}$" $name' in template
    assert f'regexMatch "^{loader_key.REVISION_PATTERN}$" $revision' in template
    assert f"$maxPart := {loader_key.MAX_PART_BYTES}" in template
    reserved = re.search(r"has \$name \(list ([^)]*)\)", template)[1]
    assert set(re.findall(r'"([^"]+)"', reserved)) == loader_key.RESERVED_MODEL_NAMES


@pytest.mark.parametrize(
    ("source", "refused"),
    [("/", True), ("/models", True), ("file:///models/", True), ("//", True),
     ("/models2/ckpt", False), ("/models/ckpt", False), ("/data/ckpt", False)],
)  # fmt: skip
def test_a_local_source_holding_the_model_volume_is_refused(source, refused):
    """What the loader refuses in the pod (its repository inside its local source), the chart
    refuses from the path: ``/models`` and every directory above it."""
    values = {
        "model": {"name": "m", "source": source},
        "cluster": {"gpusPerNode": 8, "nodeSelector": {"pool": "gpu"}},
    }
    outcome = render_values("helm4", values)
    assert outcome.refused == refused, outcome.error
    if refused:
        assert "holds the model volume (/models)" in outcome.error
