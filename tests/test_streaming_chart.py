"""The chart with ``triton.streaming``: the loader publishes with ``--streaming`` under its own
key, the ``helm test`` Pod streams, and NOTES tell users to call the model over gRPC streaming
(HTTP cannot stream). The Deployment and Services need nothing else: gRPC is already served."""

from __future__ import annotations

from pathlib import Path

from tests import chart as rc

ROOT = Path(__file__).resolve().parent.parent


def _by_kind(*sets: str) -> dict[str, list[dict]]:
    docs = rc.documents(rc.render(helm="helm4", set_values=sets))
    kinds: dict[str, list[dict]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def _loader_args(kinds: dict[str, list[dict]]) -> list[str]:
    (cronjob,) = kinds["CronJob"]
    (container,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return [*container.get("command", []), *container.get("args", [])]


def _test_pod_env(kinds: dict[str, list[dict]]) -> dict[str, str]:
    (pod,) = [p for p in kinds["Pod"] if p["metadata"]["name"].endswith("-test-inference")]
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def _model_path(kinds: dict[str, list[dict]]) -> str:
    (deployment,) = kinds["Deployment"]
    (wait,) = deployment["spec"]["template"]["spec"]["initContainers"]
    return next(e["value"] for e in wait["env"] if e["name"] == "MODEL_PATH")


def test_streaming_publishes_its_own_key_and_the_helm_test_streams():
    plain, streaming = _by_kind(), _by_kind("triton.streaming=true")
    assert "--streaming" not in _loader_args(plain)
    assert "--streaming" in _loader_args(streaming)
    assert _test_pod_env(plain)["STREAMING"] == "0"
    assert _test_pod_env(streaming)["STREAMING"] == "1"
    # The pods wait for the streaming key, which differs from the plain one in its variant.
    plain_path, stream_path = _model_path(plain), _model_path(streaming)
    assert plain_path.rsplit("-", 1)[0] == stream_path.rsplit("-", 1)[0]
    assert plain_path != stream_path
    assert {s["metadata"]["name"] for s in plain["Service"]} == {
        s["metadata"]["name"] for s in streaming["Service"]
    }


def test_notes_tell_how_to_call_a_streaming_model():
    streaming = rc.notes(set_values=("triton.streaming=true",))
    assert 'scripts/complete --url 127.0.0.1:8001 --model codegen "def is_even(n):"' in streaming
    assert "port-forward svc/codegen-model-triton 8001:8001" in streaming
    assert "curl" not in streaming
    plain = rc.notes()
    assert "scripts/complete --url 127.0.0.1:8001 --model codegen --no-stream" in plain
    # HTTP is on the pod's loopback only: port-forward to the pod, not the Service.
    assert "port-forward deploy/codegen-model-triton 8000:8000" in plain
    assert "/v2/models/codegen/infer" in plain
