"""A small client of the Kubernetes API for the tests: CRUD, server-side apply, watch and waits,
over HTTPS with the cluster's CA and a bearer token (what kubectl reads from a kubeconfig)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

#: apiVersion -> kind -> (plural, namespaced) for the kinds the tests touch; anything else is
#: found through discovery.
_KNOWN: dict[str, dict[str, tuple[str, bool]]] = {
    "v1": {
        "Namespace": ("namespaces", False),
        "Node": ("nodes", False),
        "PersistentVolume": ("persistentvolumes", False),
        "Pod": ("pods", True),
        "Service": ("services", True),
        "ServiceAccount": ("serviceaccounts", True),
        "PersistentVolumeClaim": ("persistentvolumeclaims", True),
        "ConfigMap": ("configmaps", True),
        "Secret": ("secrets", True),
        "Event": ("events", True),
    },
    "apps/v1": {"Deployment": ("deployments", True), "ReplicaSet": ("replicasets", True)},
    "batch/v1": {"Job": ("jobs", True), "CronJob": ("cronjobs", True)},
    "coordination.k8s.io/v1": {"Lease": ("leases", True)},
    "storage.k8s.io/v1": {"StorageClass": ("storageclasses", False)},
    "apiextensions.k8s.io/v1": {"CustomResourceDefinition": ("customresourcedefinitions", False)},
}


class ApiError(Exception):
    """The API server answered with an error Status."""

    def __init__(self, status: int, body: dict | str) -> None:
        self.status = status
        self.body = body
        message = body.get("message", body) if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")

    @property
    def reason(self) -> str:
        return self.body.get("reason", "") if isinstance(self.body, dict) else ""


@dataclass(frozen=True)
class Credentials:
    server: str
    token: str
    ca_file: Path

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Credentials:
        config = yaml.safe_load(path.read_text())
        context = next(
            c["context"] for c in config["contexts"] if c["name"] == config["current-context"]
        )
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        ca = Path(cluster["certificate-authority"])
        if not ca.is_absolute():
            ca = path.parent / ca
        return cls(cluster["server"], user["token"], ca)


class Api:
    """One API server. Paths are built from (apiVersion, kind, namespace, name)."""

    def __init__(self, credentials: Credentials, *, timeout: float = 30.0) -> None:
        self.credentials = credentials
        self.timeout = timeout
        self.session = requests.Session()
        # Only the cluster's CA, whatever REQUESTS_CA_BUNDLE says (requests prefers the
        # environment over a session's `verify`), and no proxy for a local server.
        self.session.trust_env = False
        self.session.verify = str(credentials.ca_file)
        self.session.headers["Authorization"] = f"Bearer {credentials.token}"
        self._resources: dict[tuple[str, str], tuple[str, bool]] = {}

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Api:
        return cls(Credentials.from_kubeconfig(path))

    # -- paths

    def _resource(self, api_version: str, kind: str) -> tuple[str, bool]:
        known = _KNOWN.get(api_version, {}).get(kind)
        if known:
            return known
        if (api_version, kind) not in self._resources:
            base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            for r in self.request("GET", base)["resources"]:
                if "/" not in r["name"]:
                    self._resources[(api_version, r["kind"])] = (r["name"], r["namespaced"])
        return self._resources[(api_version, kind)]

    def path(
        self, api_version: str, kind: str, namespace: str | None = None, name: str | None = None
    ) -> str:
        plural, namespaced = self._resource(api_version, kind)
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        if namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{plural}"
        return f"{base}/{name}" if name else base

    def path_of(self, obj: dict) -> str:
        meta = obj["metadata"]
        return self.path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])

    # -- requests

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> dict:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        response = self.session.request(
            method,
            self.credentials.server + path,
            data=data,
            params=params,
            headers=headers,
            timeout=timeout or self.timeout,
        )
        try:
            payload = response.json()
        except ValueError:
            payload = response.text
        if response.status_code >= 400:
            raise ApiError(response.status_code, payload)
        return payload

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict:
        return self.request("GET", self.path(api_version, kind, namespace, name))

    def find(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        try:
            return self.get(api_version, kind, namespace, name)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        labels: dict[str, str] | None = None,
        fields: str | None = None,
    ) -> list[dict]:
        params = {}
        if labels:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in labels.items())
        if fields:
            params["fieldSelector"] = fields
        return self.request("GET", self.path(api_version, kind, namespace), params=params)["items"]

    def create(self, obj: dict, *, params: dict | None = None) -> dict:
        meta = obj["metadata"]
        path = self.path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return self.request("POST", path, obj, params=params)

    def apply(self, obj: dict, *, dry_run: bool = False, manager: str = "model-triton-tests"):
        """Server-side apply (what `kubectl apply --server-side` sends)."""
        params = {"fieldManager": manager, "force": "true"}
        if dry_run:
            params["dryRun"] = "All"
        return self.request(
            "PATCH",
            self.path_of(obj),
            obj,
            params=params,
            content_type="application/apply-patch+yaml",
        )

    def patch(self, obj_or_path: dict | str, patch: dict, *, subresource: str = "") -> dict:
        path = obj_or_path if isinstance(obj_or_path, str) else self.path_of(obj_or_path)
        if subresource:
            path += f"/{subresource}"
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, obj_or_path: dict | str, body: dict | None = None) -> None:
        path = obj_or_path if isinstance(obj_or_path, str) else self.path_of(obj_or_path)
        try:
            self.request("DELETE", path, body)
        except ApiError as exc:
            if exc.status != 404:
                raise

    def watch(
        self, path: str, *, resource_version: str = "", params: dict | None = None
    ) -> Iterator[dict]:
        """Watch events (``{"type", "object"}``) until the server closes the stream."""
        # The server ends the stream after timeoutSeconds; the read timeout is longer.
        query = {
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "50",
            **(params or {}),
        }
        if resource_version:
            query["resourceVersion"] = resource_version
        with self.session.get(
            self.credentials.server + path,
            params=query,
            stream=True,
            timeout=(self.timeout, 90),
        ) as response:
            if response.status_code >= 400:
                raise ApiError(response.status_code, response.text)
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)

    # -- waits

    def wait_for(
        self,
        what: str,
        check: Callable[[], Any],
        *,
        timeout: float = 120.0,
        interval: float = 0.25,
    ) -> Any:
        """Poll ``check`` until it returns a truthy value; TimeoutError naming ``what``."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(interval)
        raise TimeoutError(f"{what}: not after {timeout:.0f}s (last: {last!r})")
