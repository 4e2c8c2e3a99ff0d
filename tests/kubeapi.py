"""A read-only Kubernetes API on 127.0.0.1 holding a few objects, enough for the real Helm's
`helm template --dry-run=server` to reach the cluster: version, discovery, empty release storage,
and GET of the objects given (everything else is 404). It lets tests exercise the chart's
`lookup` of a live Deployment without a control plane; it validates nothing and stores nothing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

#: group/version -> (kind, plural, namespaced) of the kinds the chart renders.
RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [
        ("Namespace", "namespaces", False),
        ("Pod", "pods", True),
        ("Secret", "secrets", True),
        ("Service", "services", True),
        ("ServiceAccount", "serviceaccounts", True),
        ("PersistentVolumeClaim", "persistentvolumeclaims", True),
        ("ConfigMap", "configmaps", True),
    ],
    "apps/v1": [("Deployment", "deployments", True)],
    "batch/v1": [("Job", "jobs", True), ("CronJob", "cronjobs", True)],
    "policy/v1": [("PodDisruptionBudget", "poddisruptionbudgets", True)],
    "autoscaling/v2": [("HorizontalPodAutoscaler", "horizontalpodautoscalers", True)],
    "networking.k8s.io/v1": [("NetworkPolicy", "networkpolicies", True)],
}


def _resource_list(group_version: str) -> dict:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": [
            {
                "name": plural,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": ["get", "list", "create", "update", "patch", "delete"],
            }
            for kind, plural, namespaced in RESOURCES[group_version]
        ],
    }


def _group_list() -> dict:
    groups = []
    for gv in RESOURCES:
        if "/" not in gv:
            continue
        group, version = gv.split("/")
        entry = {"groupVersion": gv, "version": version}
        groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def _path_of(obj: dict) -> str:
    gv = obj["apiVersion"]
    base = "/api/v1" if gv == "v1" else f"/apis/{gv}"
    [plural] = [p for k, p, _ in RESOURCES[gv] if k == obj["kind"]]
    meta = obj["metadata"]
    return f"{base}/namespaces/{meta['namespace']}/{plural}/{meta['name']}"


class _Handler(BaseHTTPRequestHandler):
    objects: ClassVar[dict[str, dict]] = {}

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/version":
            return self._send(200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0"})
        if path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            return self._send(200, _group_list())
        if path == "/api/v1":
            return self._send(200, _resource_list("v1"))
        if path.startswith("/apis/") and path.count("/") == 3:
            gv = path[len("/apis/") :]
            if gv in RESOURCES:
                return self._send(200, _resource_list(gv))
        if path in self.objects:
            return self._send(200, self.objects[path])
        if path.endswith("/secrets") or path.endswith("/configmaps"):
            # Helm's release storage: no release yet
            return self._send(200, {"kind": "List", "apiVersion": "v1", "items": []})
        return self._send(
            404,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "NotFound",
                "code": 404,
                "message": f"{path} not found",
            },
        )


@contextmanager
def kube_api(objects: list[dict], directory: Path) -> Iterator[Path]:
    """Serve ``objects``; yields a kubeconfig file that points at the server."""
    handler = type("Handler", (_Handler,), {"objects": {_path_of(o): o for o in objects}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = directory / "kubeconfig"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {"server": f"http://127.0.0.1:{server.server_port}"},
                    }
                ],
                "users": [{"name": "local", "user": {"token": "unused"}}],
                "contexts": [{"name": "local", "context": {"cluster": "local", "user": "local"}}],
                "current-context": "local",
            }
        )
    )
    try:
        yield config
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
