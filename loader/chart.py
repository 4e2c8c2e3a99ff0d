"""Render the Helm chart offline, validate it, and describe what it would create.

The chart is not part of the package: a :class:`Chart` names its directory and where the pinned
``helm`` binaries are (``helm``, ``helm3``, ``helm4``; ``make install`` puts them in
``.tools/bin`` of a checkout, :meth:`Chart.in_checkout`), so this module works the same from a
checkout and from an installed package. Every manifest is validated with
``kubernetes-validate`` in strict mode. ``scripts/render_chart.py`` is its command line
(:mod:`loader.cli.chart`); the chart tests and the demo (step 6) use it too.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Where a checkout keeps the chart and the per-cluster values files, and its pinned tools.
CHART_DIR = Path("charts") / "model-triton"
VALUES_DIR = Path("values")
TOOLS_DIR = Path(".tools") / "bin"
#: Kubernetes versions every manifest is validated against (oldest supported, newest targeted).
KUBERNETES_VERSIONS: tuple[str, ...] = ("1.29.0", "1.35.0")
#: Kinds from CRDs: kubernetes-validate has no schema for them (checked by the tests instead).
CRD_KINDS: frozenset[str] = frozenset({"ServiceMonitor", "PrometheusRule", "ScaledObject"})
INSTALL_HINT = "run `make install` (or `TOOLS_DIR=.tools bash scripts/tools/install-{name}.sh`)"


class ChartError(Exception):
    """helm failed (lint, template or a values error); ``output`` is what helm printed."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(f"{message}\n{output}".strip())
        self.output = output


def _value_args(values_files: Iterable[Path | str], set_values: Iterable[str]) -> list[str]:
    args: list[str] = []
    for f in values_files:
        _regular_values_file(f)
        args += ["-f", str(f)]
    for s in set_values:
        args += ["--set", s]
    return args


def _regular_values_file(path: Path | str) -> None:
    """A values file that is there must be a regular file (through links): helm opens a FIFO
    and waits for a writer for good, and reads a device such as /dev/zero without end. One
    that is missing (or a URL, which helm fetches) is left to helm's own error."""
    try:
        found = os.stat(path)
    except (OSError, ValueError):
        return
    if not stat.S_ISREG(found.st_mode):
        kind = (
            "a directory" if stat.S_ISDIR(found.st_mode)
            else "a FIFO" if stat.S_ISFIFO(found.st_mode)
            else "a socket" if stat.S_ISSOCK(found.st_mode)
            else "a device"
        )  # fmt: skip
        raise ChartError(f"the values file {path!r} is {kind}, not a regular file")


@dataclass(frozen=True)
class Chart:
    """The chart directory ``path`` and the directory ``tools`` of the pinned helm binaries
    (None: helm from ``$PATH``)."""

    path: Path
    tools: Path | None = None

    @classmethod
    def in_checkout(cls, root: Path | str) -> Chart:
        """The chart of the checkout ``root``, with the tools ``make install`` pins there."""
        return cls(Path(root) / CHART_DIR, Path(root) / TOOLS_DIR)

    def tool(self, name: str) -> Path:
        """The pinned tool ``name`` (a path: that file), or FileNotFoundError saying how to
        install it."""
        if "/" in name:
            found: Path | str | None = Path(name)
        else:
            found = self.tools / name if self.tools is not None else shutil.which(name)
        if found is None or not Path(found).exists():
            family = "checkov" if name == "checkov" else "helm"
            where = found or f"{name} on $PATH"
            raise FileNotFoundError(f"{where} is missing: {INSTALL_HINT.format(name=family)}")
        return Path(found)

    def _helm(self, helm: str, args: Sequence[str]) -> str:
        proc = subprocess.run(
            [str(self.tool(helm)), *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
            errors="backslashreplace",  # helm quotes a file name given in any bytes
        )
        if proc.returncode != 0:
            output = "\n".join(part for part in (proc.stderr, proc.stdout) if part.strip())
            raise ChartError(f"helm {args[0]} failed (exit {proc.returncode})", output)
        return proc.stdout

    def render(
        self,
        *,
        helm: str = "helm",
        values_files: Iterable[Path | str] = (),
        set_values: Iterable[str] = (),
        release: str = "codegen",
        namespace: str = "model-triton",
    ) -> str:
        """``helm template`` of the chart; raises ChartError with helm's message on failure."""
        args = ["template", release, str(self.path), "--namespace", namespace]
        return self._helm(helm, args + _value_args(values_files, set_values))

    def lint(
        self,
        *,
        helm: str = "helm",
        values_files: Iterable[Path | str] = (),
        set_values: Iterable[str] = (),
    ) -> str:
        """``helm lint --strict`` of the chart with these values; raises ChartError on failure."""
        args = ["lint", "--strict", str(self.path), *_value_args(values_files, set_values)]
        return self._helm(helm, args)

    def notes(
        self,
        *,
        values_files: Iterable[Path | str] = (),
        set_values: Iterable[str] = (),
        release: str = "codegen",
        namespace: str = "model-triton",
    ) -> str:
        """NOTES.txt as `helm install` prints it. Offline only with Helm 4 (`--dry-run=client`)."""
        args = ["install", release, str(self.path), "--dry-run=client", "--namespace", namespace]
        out = self._helm("helm4", args + _value_args(values_files, set_values))
        return out.split("NOTES:", 1)[1] if "NOTES:" in out else ""


def documents(text: str) -> list[dict]:
    """The non-empty YAML documents of a rendered chart. A mapping that repeats a key is an
    error (ChartError): YAML parsers disagree on it (Helm keeps the last; Flux, kustomize and
    Argo CD refuse the manifest)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
        keys = [loader.construct_object(k, deep=True) for k, _ in node.value]
        repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
        if repeated:
            raise ChartError(
                f"a rendered manifest repeats the key(s) {', '.join(repeated)} "
                f"(line {node.start_mark.line + 1})"
            )
        return loader.construct_mapping(node, deep=True)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return [doc for doc in yaml.load_all(text, Loader=StrictLoader) if doc]


#: Ranges of the OpenAPI schemas' integer formats (kubernetes-validate does not check them; the
#: API server refuses a number that does not fit its Go type).
_INTEGER_FORMATS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _format_checker():
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    for name, (low, high) in _INTEGER_FORMATS.items():
        checker.checks(name)(
            lambda value, low=low, high=high: (
                not isinstance(value, int) or isinstance(value, bool) or low <= value <= high
            )
        )
    return checker


def validate(docs: Iterable[dict], *, versions: Sequence[str] = KUBERNETES_VERSIONS) -> list[str]:
    """Strict OpenAPI validation of every manifest (kubernetes-validate's schemas, with int32 and
    int64 ranges enforced), then the API server's own rules (:mod:`loader.kube`); returns
    the problems (empty: all valid)."""
    import kubernetes_validate
    from kubernetes_validate import ValidationError

    from loader import kube

    docs = list(docs)
    problems = []
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        for version in versions:
            try:
                _strict(doc, version)
            except ValidationError as exc:
                where = "/".join(str(p) for p in exc.path)
                problems.append(
                    f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): "
                    f"{where}: {exc.message}"
                )
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    return problems + kube.problems(docs)


def _strict(doc: dict, version: str) -> None:
    """``kubernetes_validate.validate(doc, version, strict=True)``, with the schemas' integer
    formats checked too (raises kubernetes-validate's ValidationError)."""
    import jsonschema
    import kubernetes_validate

    validator, schema_version = _validator(doc["kind"], doc["apiVersion"], version)
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        raise kubernetes_validate.ValidationError(error, version=schema_version)


@functools.cache
def _validator(kind: str, api_version: str, version: str):
    """The strict validator of kubernetes-validate's schema for ``kind`` at ``version`` (built
    once: the tests validate thousands of manifests)."""
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions, major_minor, schema_contents
    from referencing import Registry, Resource

    versions = [v for v in all_versions() if major_minor(v) <= major_minor(version)]
    schema_dir = f"kubernetes-json-schema/v{versions[-1]}-local-strict"
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = schema_contents(f"{schema_dir}/{kind.lower()}-{api}.json", version)
    except FileNotFoundError:
        raise kubernetes_validate.SchemaNotFoundError(
            version=major_minor(version), kind=kind, api_version=api_version
        ) from None
    definitions = schema_contents(f"{schema_dir}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    validator = jsonschema.Draft202012Validator(
        schema, registry=registry, format_checker=_format_checker()
    )
    return validator, major_minor(versions[-1])


#: The values file a local CPU ``tritonserver`` plays by default: a cluster without GPUs.
LOCAL_VALUES = VALUES_DIR / "local.yaml"


def triton_command(docs: Iterable[dict]) -> list[str]:
    """The Triton container's command line as the kubelet runs it: Secrets of the rendering
    resolved, ``$(VAR)`` expanded (:mod:`loader.podspec`)."""
    from loader import podspec

    docs = list(docs)
    deployments = [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "triton"
    ]
    if len(deployments) != 1:
        raise ChartError(
            f"expected one Triton Deployment in the rendering, found {len(deployments)}"
        )
    containers = deployments[0]["spec"]["template"]["spec"]["containers"]
    (triton,) = [c for c in containers if c["name"] == "triton"]
    return podspec.command_line(triton, docs)


def triton_serving_args(docs: Iterable[dict]) -> list[str]:
    """The Triton container's arguments as the kubelet passes them (the binary left out): a
    local ``tritonserver`` (:class:`loader.serving.TritonServer`) runs exactly these, only the
    model path, the ports and the addresses mapped onto this machine."""
    command = triton_command(docs)
    if command[0] != "tritonserver":
        raise ChartError(f"the Triton container runs {command[0]!r}, not tritonserver")
    return command[1:]


def rendered_triton_args(
    chart: Chart, *, values_files: Iterable[Path | str] = (), set_values: Iterable[str] = ()
) -> list[str]:
    """:func:`triton_serving_args` of ``helm template`` of ``chart`` with these values."""
    rendered = chart.render(values_files=values_files, set_values=set_values)
    return triton_serving_args(documents(rendered))


@dataclass(frozen=True)
class Resource:
    kind: str
    name: str
    detail: str


def pod_spec(doc: dict) -> dict | None:
    spec = doc.get("spec", {})
    if doc["kind"] == "CronJob":
        return spec["jobTemplate"]["spec"]["template"]["spec"]
    if doc["kind"] in ("Deployment", "Job"):
        return spec["template"]["spec"]
    if doc["kind"] == "Pod":
        return spec
    return None


def describe(doc: dict) -> Resource:
    """One line about a resource: replicas, GPUs, images, model key, the loader's arguments."""
    kind, name = doc["kind"], doc["metadata"]["name"]
    parts = []
    annotations = doc["metadata"].get("annotations") or {}
    if "helm.sh/hook" in annotations:
        parts.append(f"hook={annotations['helm.sh/hook']}")
    if kind == "Deployment":
        parts.append(f"replicas={doc['spec'].get('replicas', 'autoscaled')}")
    pod = pod_spec(doc)
    if pod is not None:
        for c in pod["containers"]:
            limits = (c.get("resources") or {}).get("limits") or {}
            gpus = limits.get("nvidia.com/gpu", 0)
            parts.append(f"{c['name']}: image={c['image']} gpus={gpus}")
            if c["name"] == "loader":
                parts.append("args=" + " ".join(c["args"]))
    if "model-triton/model-key" in annotations:
        parts.append(f"key={annotations['model-triton/model-key']}")
    if kind == "PersistentVolumeClaim":
        spec = doc["spec"]
        parts.append(f"{spec['accessModes'][0]} {spec['resources']['requests']['storage']}")
    if kind == "Service":
        ports = ",".join(str(p["port"]) for p in doc["spec"]["ports"])
        parts.append(f"clusterIP={doc['spec'].get('clusterIP', 'auto')} ports={ports}")
    if kind == "NetworkPolicy":
        spec = doc["spec"]
        for direction in ("ingress", "egress"):
            ports = sorted({p["port"] for r in spec.get(direction, []) for p in r.get("ports", [])})
            parts.append(f"{direction}={','.join(map(str, ports)) or 'none'}")
    if kind == "Secret":
        parts.append("keys=" + ",".join(sorted(doc.get("data") or {})))
    return Resource(kind, name, "  ".join(parts))
