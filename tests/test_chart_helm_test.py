"""The chart's `helm test` Pod, run for real against a CPU Triton serving a published repository
with the chart's own Triton arguments (the security defaults included: admin gRPC protocols
behind the header, HTTP off the network).

Its command (``model-loader complete --check-ready ...``) is taken from the rendered test Pod
(values/local.yaml), its ``$(VAR)`` references expanded from the Pod's environment as Kubernetes
does (:mod:`loader.podspec`), and run with this checkout's loader, only the Service address
pointing at a ``tritonserver`` on 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loader import podspec
from loader.serving import TritonServer
from tests import chart as rc

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)

ROOT = Path(__file__).resolve().parent.parent


def _rendering(*set_values: str) -> list[dict]:
    return rc.documents(
        rc.render(values_files=[rc.VALUES_DIR / "local.yaml"], set_values=set_values)
    )


def _container(*set_values: str) -> dict:
    [pod] = [d for d in _rendering(*set_values) if d["kind"] == "Pod"]
    [container] = pod["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def helm_test_container() -> dict:
    return _container()


@pytest.fixture(scope="module")
def streaming_helm_test_container() -> dict:
    return _container("triton.streaming=true")


@pytest.fixture(scope="module")
def triton(published_tiny_python_repository: Path):
    chart_args = rc.triton_serving_args(_rendering())
    with TritonServer(published_tiny_python_repository, pod_args=chart_args) as server:
        yield server


def run_helm_test(
    container: dict, triton: TritonServer, **overrides
) -> subprocess.CompletedProcess:
    env = podspec.environment(container, [])
    env.update(TRITON_GRPC_URL=triton.grpc_url, **overrides)
    command = [podspec.expand(arg, env) for arg in container["command"]]
    assert command[0] == "model-loader"
    return subprocess.run(
        [sys.executable, "-m", "loader", *command[1:]],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_helm_test_checks_health_and_completes_a_prompt(helm_test_container, triton):
    proc = run_helm_test(helm_test_container, triton)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "server ready"
    assert lines[1] == "model codegen ready"
    assert "".join(lines[2:]).strip()  # the completion


def test_helm_test_fails_when_the_model_is_not_served(helm_test_container, triton):
    proc = run_helm_test(helm_test_container, triton, MODEL_NAME="not-served")
    assert proc.returncode == 2
    assert "error: model not-served is not ready" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def streaming_triton(tiny_checkpoint_with_tokenizer: Path, tmp_path_factory):
    from loader.parallel import Parallelism
    from loader.repository.key import ServingSettings
    from loader.run import RunRequest, run

    request = RunRequest(
        source=str(tiny_checkpoint_with_tokenizer),
        repository=tmp_path_factory.mktemp("streaming") / "models",
        model_name="codegen",
        parallelism=Parallelism(tp=1, pp=1, instance_count=1),
        settings=ServingSettings(backend="python", dynamic_batching=False, streaming=True),
    )
    chart_args = rc.triton_serving_args(_rendering("triton.streaming=true"))
    with TritonServer(run(request).path, pod_args=chart_args) as server:
        yield server


def test_helm_test_streams_over_grpc_when_streaming_is_on(
    streaming_helm_test_container, streaming_triton
):
    assert "--stream" in streaming_helm_test_container["command"]
    proc = run_helm_test(streaming_helm_test_container, streaming_triton)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["server ready", "model codegen ready"]
    assert "".join(lines[2:]).strip()
