"""The chart's security arguments on the real CPU ``tritonserver`` (SECURITY.md, item by item).

Each server runs the command line the chart renders for values/local.yaml, Secret resolved and
``$(VAR)`` expanded as the kubelet does (:func:`loader.chart.triton_serving_args`), only
the model path, ports and shutdown timing chosen locally. The pod is played by two loopback
addresses: 127.0.0.2 is the pod's address (what the network reaches: the Service, other pods,
the kubelet's probes), 127.0.0.1 its loopback (what `kubectl port-forward` reaches).

Checked under the defaults: every restricted gRPC protocol refuses a call without the header
or with a wrong token and answers with it; inference and health answer without it; HTTP's admin
paths cannot be reached from the network. Then `http: off` and a loosened values set, to show
that the server enforces exactly what the values say.

The local server is Triton 2.51 (the ``nvidia-pytriton`` wheel), the pods run 23.05: the flag
syntax, the protocol names and the header are the same in both (``src/command_line_parser.cc``,
``src/grpc/grpc_server.cc`` at r23.05 and r24.10). 2.51 also refuses unknown protocol names and
any network change of the log or trace file; 23.05 does neither, which is why the chart's
schema lists the names and why logging and trace stay restricted.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from loader.bench.perf_analyzer import PerfAnalyzerOptions, find_perf_analyzer, measure_level
from loader.completion import complete
from loader.endpoint import Endpoint
from loader.errors import EndpointError, ServerStartError
from loader.serving import HEALTH_SERVING, TritonServer, grpc_health, restricted_protocols
from tests import chart as rc
from tests.tinymodels import TINY_REQUEST_FILE

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)

ROOT = Path(__file__).resolve().parent.parent

MODEL = "codegen"
POD_ADDRESS = "127.0.0.2"
LOOPBACK = "127.0.0.1"
REQUEST = {"prompt": ["def is_even(n):"], "request_output_len": [4]}

#: One call of each 23.05 gRPC protocol but inference and health, by its name in
#: src/grpc/grpc_server.cc.
ADMIN_CALLS: dict[str, Callable[[grpcclient.InferenceServerClient, dict | None], object]] = {
    "logging": lambda c, h: c.get_log_settings(headers=h),
    "trace": lambda c, h: c.get_trace_settings(headers=h),
    "shared-memory": lambda c, h: c.get_system_shared_memory_status(headers=h),
    "model-repository": lambda c, h: c.get_model_repository_index(headers=h),
    "statistics": lambda c, h: c.get_inference_statistics(MODEL, headers=h),
    "model-config": lambda c, h: c.get_model_config(MODEL, headers=h),
    "metadata": lambda c, h: c.get_server_metadata(headers=h),
}
#: HTTP paths of the same admin APIs (src/http_server.cc, HTTPAPIServer::Handle).
HTTP_ADMIN_PATHS = (
    "/v2/logging",
    "/v2/trace/setting",
    "/v2/systemsharedmemory/status",
    "/v2/cudasharedmemory/status",
    "/v2/repository/index",
    f"/v2/models/{MODEL}/stats",
    f"/v2/models/{MODEL}/config",
    "/v2",
)


def chart_server(repository: Path, *set_values: str) -> TritonServer:
    docs = rc.documents(
        rc.render(values_files=[rc.VALUES_DIR / "local.yaml"], set_values=set_values)
    )
    return TritonServer(
        repository, host=POD_ADDRESS, pod_args=rc.triton_serving_args(docs), startup_timeout=180
    )


def refusal(call: Callable[[], object]) -> str | None:
    """None when ``call`` is answered, else the status and message of the refusal."""
    try:
        call()
    except InferenceServerException as exc:
        return f"{exc.status()} {exc.message()}"
    return None


def connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return False
    return True


def http_get(host: str, port: int, path: str) -> int:
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as response:
        return response.status


@pytest.fixture(scope="module")
def default_server(published_tiny_python_repository: Path) -> Iterator[TritonServer]:
    with chart_server(published_tiny_python_repository) as server:
        yield server


@pytest.fixture(scope="module")
def client(default_server: TritonServer) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(default_server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def admin(default_server: TritonServer) -> tuple[str, str]:
    [header] = set(restricted_protocols(default_server.pod_args).values())
    return header


def test_the_defaults_restrict_every_admin_protocol(default_server):
    assert set(restricted_protocols(default_server.pod_args)) == set(ADMIN_CALLS)


@pytest.mark.parametrize("protocol", sorted(ADMIN_CALLS))
def test_a_restricted_protocol_refuses_without_the_header_and_answers_with_it(
    client, admin, protocol
):
    call = ADMIN_CALLS[protocol]
    header, token = admin
    expected = f"StatusCode.UNAVAILABLE This protocol is restricted, expecting header '{header}'"
    assert refusal(lambda: call(client, None)) == expected
    assert refusal(lambda: call(client, {header: token + "x"})) == expected
    assert refusal(lambda: call(client, {header: token[:-1]})) == expected
    assert refusal(lambda: call(client, {"triton-grpc-protocol-other": token})) == expected
    assert refusal(lambda: call(client, {header: token})) is None


def test_a_changed_log_file_needs_the_header(client, admin):
    header, token = admin
    settings = {"log_file": "/tmp/written-by-a-stranger.log"}
    assert "This protocol is restricted" in refusal(lambda: client.update_log_settings(settings))
    # With the header, 2.51 refuses this one change for everybody; 23.05 makes it (CVE-2024-0087).
    message = refusal(lambda: client.update_log_settings(settings, headers={header: token}))
    assert "log file location can not be updated through network protocol" in message


def test_health_and_inference_answer_without_the_header(default_server, client):
    # what the kubelet's gRPC probes call, on the pod's address
    assert grpc_health(f"{POD_ADDRESS}:{default_server.ports.grpc}") == HEALTH_SERVING
    # what `helm test` and clients call
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    completion = complete(default_server.grpc_url, MODEL, dict(REQUEST), protocol="grpc")
    assert completion.text and completion.sequence_length > 0
    # a header of no restriction changes nothing
    assert client.is_model_ready(MODEL, headers={"triton-grpc-protocol-x": "ignored"})


def test_http_is_unreachable_from_the_network_and_answers_on_loopback_only(default_server):
    port = default_server.ports.http
    assert not connects(POD_ADDRESS, port)
    for path in HTTP_ADMIN_PATHS:
        with pytest.raises(urllib.error.URLError):
            http_get(POD_ADDRESS, port, path)
    # `kubectl port-forward deploy/...` reaches the pod's loopback, where HTTP serves (the
    # README's curl examples): Kubernetes RBAC (pods/portforward) is the credential there.
    assert http_get(LOOPBACK, port, "/v2/health/ready") == 200
    assert http_get(LOOPBACK, port, "/v2/logging") == 200
    body = json.dumps(
        {
            "inputs": [
                {"name": "prompt", "datatype": "BYTES", "shape": [1, 1], "data": ["def f():"]},
                {"name": "request_output_len", "datatype": "UINT32", "shape": [1, 1], "data": [4]},
            ]
        }
    ).encode()
    request = urllib.request.Request(
        f"http://{LOOPBACK}:{port}/v2/models/{MODEL}/infer", data=body, method="POST"
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        outputs = {o["name"]: o for o in json.load(response)["outputs"]}
    assert outputs["completion"]["data"][0]


def test_grpc_and_metrics_serve_on_the_pod_address(default_server):
    assert connects(POD_ADDRESS, default_server.ports.grpc)
    assert connects(POD_ADDRESS, default_server.ports.metrics)


def test_model_control_is_off(client, admin):
    header, token = admin
    message = refusal(lambda: client.unload_model(MODEL, headers={header: token}))
    assert message and "explicit model load / unload is not allowed" in message
    assert client.is_model_ready(MODEL)


def test_perf_analyzer_sends_the_admin_header_over_grpc(default_server, admin):
    # perf_analyzer reads the model's metadata, configuration and statistics first, restricted
    # protocols: without the header it is refused and told to pass -H; with -H it measures.
    options = PerfAnalyzerOptions(
        input_data=TINY_REQUEST_FILE,
        measurement_mode="count_windows",
        measurement_request_count=3,
        stability_percentage=1000,
        widenings=0,
    )
    endpoint = Endpoint(default_server.grpc_url, "grpc")
    with pytest.raises(EndpointError) as info:
        measure_level(endpoint, MODEL, 1, options=options, binary=find_perf_analyzer())
    assert "This protocol is restricted" in info.value.message
    assert "-H triton-grpc-protocol-admin-key:" in info.value.remediation
    with_header = Endpoint(default_server.grpc_url, "grpc", headers=(admin,))
    level = measure_level(with_header, MODEL, 1, options=options, binary=find_perf_analyzer())
    assert level.measurement.throughput > 0


def test_an_empty_token_keeps_triton_from_starting(published_tiny_python_repository):
    # Your own Secret with an empty token: Triton refuses the flag (23.05 and 2.51 alike,
    # ParseGenericConfigOption), so the pod never serves with the protocols open.
    docs = rc.documents(
        rc.render(
            values_files=[rc.VALUES_DIR / "local.yaml"],
            set_values=("triton.security.adminSecret.name=ops",),
        )
    )
    empty = {"kind": "Secret", "metadata": {"name": "ops"}, "stringData": {"token": ""}}
    args = rc.triton_serving_args([*docs, empty])
    assert any(a.endswith(":admin-key=") for a in args)
    with pytest.raises(ServerStartError) as info:
        TritonServer(published_tiny_python_repository, host=POD_ADDRESS, pod_args=args).start()
    assert "grpc-restricted-protocol" in info.value.message


def test_http_off_serves_no_http_at_all(published_tiny_python_repository):
    with chart_server(published_tiny_python_repository, "triton.security.http=off") as server:
        assert not connects(LOOPBACK, server.ports.http)
        assert not connects(POD_ADDRESS, server.ports.http)
        assert grpc_health(server.grpc_url) == HEALTH_SERVING


def test_a_loosened_values_set_is_served_as_it_says(published_tiny_python_repository):
    loosened = (
        "triton.security.http=network",
        "triton.security.restrictedGrpcProtocols={trace,shared-memory}",
        "triton.security.adminHeader=ops",
    )
    with chart_server(published_tiny_python_repository, *loosened) as server:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            assert refusal(lambda: ADMIN_CALLS["logging"](c, None)) is None
            assert refusal(lambda: ADMIN_CALLS["metadata"](c, None)) is None
            restricted = refusal(lambda: ADMIN_CALLS["trace"](c, None))
            assert "expecting header 'triton-grpc-protocol-ops'" in restricted
        finally:
            c.close()
        assert http_get(POD_ADDRESS, server.ports.http, "/v2/logging") == 200


@pytest.mark.parametrize("client", ["model-loader", "scripts/complete"])
def test_a_client_without_model_is_told_to_name_it_where_the_list_is_restricted(
    default_server, client
):
    """The chart keeps gRPC's model-repository protocol behind the admin header, so a client
    cannot find the model over gRPC by itself: it says to pass --model, and does with it."""
    import subprocess
    import sys

    command = (
        [sys.executable, "-m", "loader", "complete"]
        if client == "model-loader"
        else [sys.executable, str(Path(__file__).parents[1] / "scripts" / "complete")]
    )
    url = ["--url", f"grpc://{default_server.grpc_url}", "--max-tokens", "2"]
    alone = subprocess.run(
        [*command, *url, "def f():"], capture_output=True, text=True, timeout=120
    )
    assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr
    assert "--model" in alone.stderr and "admin header" in alone.stderr
    assert "without a scheme" not in alone.stderr  # not sent to the HTTP port
    named = subprocess.run(
        [*command, *url, "--model", MODEL, "def f():"], capture_output=True, text=True, timeout=120
    )
    assert named.returncode == 0, named.stderr
