"""The local ``tritonserver`` runs the pod the chart renders, and the pod serves what the
cluster's objects target.

:class:`loader.serving.TritonServer` takes the arguments ``helm template`` renders and changes
only what a pod gets from Kubernetes and its image (the model path, ports, addresses, the
backend directory): checked here argument by argument. Then, on the real CPU server, with the
pod's address played by 127.0.0.2 and its loopback by 127.0.0.1: every port a Service, the
ServiceMonitor or a probe targets answers on the pod's address, for each HTTP mode.
"""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from loader.serving import (
    ADDRESS_FLAGS,
    HEALTH_SERVING,
    PORT_FLAGS,
    TritonServer,
    grpc_health,
    rendered_pod_args,
)
from tests import chart as rc

POD_ADDRESS = "127.0.0.2"
LOCAL = [rc.VALUES_DIR / "local.yaml"]
#: Flags the harness maps onto this machine (TritonServer.command); nothing else may change.
MAPPED = {
    "--model-repository",
    "--backend-directory",
    *PORT_FLAGS.values(),
    *ADDRESS_FLAGS.values(),
}


def _name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _docs(*sets: str) -> list[dict]:
    return rc.documents(rc.render(values_files=LOCAL, set_values=sets))


@pytest.mark.parametrize(
    "sets",
    [(), ("triton.security.http=off",), ("triton.security.http=network",)],
    ids=["loopback", "off", "network"],
)
def test_the_local_server_runs_the_rendered_arguments_and_maps_only_the_pods_placement(
    sets, tmp_path
):
    rendered = rc.triton_serving_args(_docs(*sets))
    server = TritonServer(tmp_path, pod_args=rendered, host=POD_ADDRESS)
    command = server.command(tmp_path / "backends")
    assert [a for a in command[1:] if _name(a) not in MAPPED] == [
        a for a in rendered if _name(a) not in MAPPED
    ]
    added = [a for a in command[1:] if _name(a) in MAPPED]
    assert f"--model-repository={tmp_path}" in added
    assert f"--backend-directory={tmp_path / 'backends'}" in added
    for endpoint, flag in PORT_FLAGS.items():
        assert f"{flag}={getattr(server.ports, endpoint)}" in added
    # Each address is the pod's, mapped: never one the chart did not imply.
    for endpoint, flag in ADDRESS_FLAGS.items():
        given = [a.split("=", 1)[1] for a in rendered if _name(a) == flag]
        local = [a.split("=", 1)[1] for a in added if _name(a) == flag]
        expected = {"0.0.0.0": POD_ADDRESS, "127.0.0.1": "127.0.0.1"}
        if given:
            assert local == [expected[given[-1]]], endpoint
        elif endpoint == "metrics":
            assert local == [], "an absent --metrics-address follows the HTTP address"
        else:
            assert local == [POD_ADDRESS], endpoint


def test_with_no_arguments_given_the_local_server_renders_the_chart_for_values_local(tmp_path):
    rendered = rendered_pod_args()
    ours = rc.triton_serving_args(_docs())
    secret = [a for a in ours if a.startswith("--grpc-restricted-protocol=")]
    # The admin token is random per rendering; everything else is the same.
    assert [a for a in rendered if a not in secret and "restricted" not in a] == [
        a for a in ours if a not in secret
    ]
    assert TritonServer(tmp_path).pod_args[0] == ours[0]


def _targeted_container_ports(docs: list[dict]) -> dict[int, str]:
    """containerPort -> what targets it: every Service port, every ServiceMonitor endpoint
    (through the Service port it names) and every probe of the Triton container."""
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    [triton] = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "triton"
    ]
    named = {p["name"]: p["containerPort"] for p in triton.get("ports", [])}
    targeted: dict[int, str] = {}

    def resolve(port) -> int:
        return named[port] if isinstance(port, str) else int(port)

    services = [d for d in docs if d["kind"] == "Service"]
    for service in services:
        for port in service["spec"]["ports"]:
            target = resolve(port.get("targetPort", port["port"]))
            targeted[target] = f"Service/{service['metadata']['name']}:{port['port']}"
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        for endpoint in monitor["spec"]["endpoints"]:
            for service in services:
                for port in service["spec"]["ports"]:
                    if port.get("name") == endpoint["port"]:
                        target = resolve(port.get("targetPort", port["port"]))
                        targeted[target] = f"ServiceMonitor/{monitor['metadata']['name']}"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        handler = triton.get(probe) or {}
        for kind in ("grpc", "httpGet", "tcpSocket"):
            if kind in handler:
                targeted[resolve(handler[kind]["port"])] = probe
    return targeted


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.mark.server
@pytest.mark.parametrize(
    "sets",
    [
        ("metrics.serviceMonitor.enabled=true",),
        ("metrics.serviceMonitor.enabled=true", "triton.security.http=off"),
    ],
    ids=["loopback", "off"],
)
def test_every_port_a_service_servicemonitor_or_probe_targets_answers_on_the_pods_address(
    published_tiny_python_repository: Path, sets
):
    docs = _docs(*sets)
    targeted = _targeted_container_ports(docs)
    assert any(what.startswith("ServiceMonitor") for what in targeted.values())
    rendered = rc.triton_serving_args(docs)
    flags = {int(a.split("=", 1)[1]): _name(a) for a in rendered if _name(a) in PORT_FLAGS.values()}
    endpoints = {flag: endpoint for endpoint, flag in PORT_FLAGS.items()}
    with TritonServer(
        published_tiny_python_repository, pod_args=rendered, host=POD_ADDRESS
    ) as server:
        for container_port, what in sorted(targeted.items()):
            endpoint = endpoints[flags[container_port]]
            local = getattr(server.ports, endpoint)
            assert _connects(POD_ADDRESS, local), (
                f"{what} targets {container_port} ({endpoint}), which does not listen on the "
                f"pod's address: {server.command(Path('backends'))}"
            )
            if endpoint == "grpc":
                assert grpc_health(f"{POD_ADDRESS}:{local}") == HEALTH_SERVING
            if endpoint == "metrics":
                url = f"http://{POD_ADDRESS}:{local}/metrics"
                with urllib.request.urlopen(url, timeout=10) as response:
                    assert "nv_inference_request_success" in response.read().decode()
        assert server.metrics_url == f"http://{POD_ADDRESS}:{server.ports.metrics}/metrics"
