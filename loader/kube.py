"""What the Kubernetes API server and kubelet check that the OpenAPI schemas do not say.

`kubernetes-validate` checks rendered manifests against the real OpenAPI schemas (types, fields,
enums); :func:`problems` adds the rules the API server's validation code applies on top
(``k8s.io/apimachinery/pkg/util/validation`` and ``pkg/apis/*/validation``), and what breaks
only once a pod runs:

* names: DNS-1123 subdomains, DNS-1035 labels for Services, CronJobs within 52 characters;
  container, volume and port names; label keys and values; annotation keys and total size;
  environment variable names; image references the kubelet can pull;
* quantities: the resource.Quantity syntax, no negative amount, limits not below requests,
  sizes above 0 (an emptyDir or a memory limit of 0 stops the pod at its first write);
* numbers: int-or-percent fields (0-100% where the API says so), probe and Job counts, the
  HorizontalPodAutoscaler's bounds; int32 ranges are checked with the schema's ``format``
  (:mod:`loader.chart`);
* uniqueness: container, volume, port and mount names; volume mounts naming a volume; two
  objects of one kind and name;
* references: the Secrets and ConfigMaps an environment variable reads (a DNS-1123 subdomain
  and a key the API accepts), the keys of a Secret's data;
* NetworkPolicy address blocks: a valid CIDR, each `except` a strict subset of it
  (``ValidateIPBlock``, ``pkg/apis/networking/validation``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from fractions import Fraction

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_PORT_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
_PERCENT = re.compile(r"[0-9]+%")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
#: The reference grammar of container images (distribution/reference), without IPv6 hosts.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*(?::[0-9]+)?"
IMAGE_REFERENCE = re.compile(
    rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?(?:@sha256:[0-9a-f]{{64}})?"
)
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
#: Resources whose quantities are bytes.
BYTE_RESOURCES = frozenset({"memory", "ephemeral-storage", "storage"})
MAX_ANNOTATIONS_BYTES = 256 * 1024


def quantity(value: object) -> Fraction:
    """The value of a resource.Quantity (a string or a number), or ValueError."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(str(value))
    match = _QUANTITY.fullmatch(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a quantity")
    number = Fraction(
        match["number"] if not match["number"].endswith(".") else match["number"][:-1]
    )
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        number *= 1024 ** _BINARY[suffix]
    elif suffix in _DECIMAL:
        number *= Fraction(10) ** _DECIMAL[suffix]
    else:
        number *= Fraction(10) ** int(suffix[1:])
    return -number if match["sign"] == "-" else number


def is_qualified_key(key: object) -> bool:
    """A label or annotation key: an optional DNS-1123 subdomain prefix and `/`, then a name
    of at most 63 characters."""
    if not isinstance(key, str):
        return False
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return False
    return len(name) <= 63 and bool(_QUALIFIED_NAME.fullmatch(name))


def is_label_value(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 63 and bool(_LABEL_VALUE.fullmatch(value))


def _name_problem(kind: str, name: object) -> str | None:
    if not isinstance(name, str):
        return f"name {name!r} is not a string"
    if kind == "Service":
        if len(name) > 63 or not DNS1035_LABEL.fullmatch(name):
            return f"Service name {name!r} is not a DNS-1035 label (a-z first, a-z0-9- , <= 63)"
        return None
    limit = {"CronJob": 52, "Job": 63, "Pod": 253}.get(kind, 253)
    if len(name) > limit or not DNS1123_SUBDOMAIN.fullmatch(name):
        return f"{kind} name {name!r} is not a DNS-1123 subdomain of at most {limit} characters"
    return None


def is_config_key(key: object) -> bool:
    """A key of a Secret's or ConfigMap's data (``IsConfigMapKey``): at most 253 of
    ``[-._a-zA-Z0-9]``, neither ``.`` nor ``..`` nor starting with ``..``."""
    return (
        isinstance(key, str)
        and len(key) <= 253
        and bool(_CONFIG_KEY.fullmatch(key))
        and key != "."
        and not key.startswith("..")
    )


def _reference(where: str, selector: dict) -> list[str]:
    """A secretKeyRef or configMapKeyRef: the object's name and the key within it."""
    out = []
    name, key = selector.get("name"), selector.get("key")
    if not isinstance(name, str) or len(name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(name):
        out.append(f"{where}: name {name!r} is not a DNS-1123 subdomain")
    if not is_config_key(key):
        out.append(f"{where}: key {key!r} is not a key the API accepts")
    return out


def _network(cidr: object) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """The network of a CIDR (host bits allowed, as the API server allows them), or None.
    An IPv4 address written in IPv6 (``::ffff:a.b.c.d``) is refused: the API server's
    containment check never matches it against an IPv6 block."""
    if not isinstance(cidr, str) or "/" not in cidr:
        return None
    try:
        network = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return None
    if isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped:
        return None
    return network


def _ip_block(where: str, block: dict) -> list[str]:
    cidr = _network(block.get("cidr"))
    if cidr is None:
        return [f"{where}: cidr {block.get('cidr')!r} is not a CIDR"]
    out = []
    for text in block.get("except") or []:
        inner = _network(text)
        if inner is None:
            out.append(f"{where}: except {text!r} is not a CIDR")
        elif (
            inner.version != cidr.version
            or not inner.subnet_of(cidr)  # type: ignore[arg-type]
            or inner.prefixlen <= cidr.prefixlen
        ):
            out.append(f"{where}: except {text!r} is not a strict subset of {block['cidr']}")
    return out


def _network_policy(where: str, spec: dict) -> list[str]:
    out = _labels(f"{where}.spec.podSelector", (spec.get("podSelector") or {}).get("matchLabels"))
    for direction, peers in (("ingress", "from"), ("egress", "to")):
        for rule in spec.get(direction) or []:
            for peer in rule.get(peers) or []:
                if "ipBlock" in peer:
                    out += _ip_block(f"{where}.{direction}.ipBlock", peer["ipBlock"] or {})
    return out


def _labels(where: str, labels: object) -> list[str]:
    if labels is None:
        return []
    if not isinstance(labels, dict):
        return [f"{where}: not a map"]
    out = []
    for key, value in labels.items():
        if not is_qualified_key(key):
            out.append(f"{where}: label key {key!r} is not a qualified name")
        if not is_label_value(value):
            out.append(f"{where}: label value {value!r} of {key!r} is not a label value")
    return out


def _annotations(where: str, annotations: object) -> list[str]:
    if annotations is None:
        return []
    if not isinstance(annotations, dict):
        return [f"{where}: not a map"]
    out = [
        f"{where}: annotation key {k!r} is not a qualified name"
        for k in annotations
        if not is_qualified_key(k)
    ]
    out += [
        f"{where}: annotation {k!r} is not a string"
        for k, v in annotations.items()
        if not isinstance(v, str)
    ]
    size = sum(len(str(k).encode()) + len(str(v).encode()) for k, v in annotations.items())
    if size > MAX_ANNOTATIONS_BYTES:
        out.append(f"{where}: annotations take {size} bytes, more than 256 KiB")
    return out


def _int_or_percent(where: str, value: object, *, at_most_100: bool) -> list[str]:
    if isinstance(value, bool):
        return [f"{where}: {value!r} is neither an integer nor a percentage"]
    if isinstance(value, int):
        return [] if value >= 0 else [f"{where}: {value} is negative"]
    if isinstance(value, str) and _PERCENT.fullmatch(value):
        if at_most_100 and int(value[:-1]) > 100:
            return [f"{where}: {value} is more than 100%"]
        return []
    return [f"{where}: {value!r} is neither an integer nor a percentage"]


def _resources(where: str, resources: dict | None) -> list[str]:
    out: list[str] = []
    parsed: dict[str, dict[str, Fraction]] = {}
    for part in ("requests", "limits"):
        parsed[part] = {}
        for name, value in ((resources or {}).get(part) or {}).items():
            try:
                amount = quantity(value)
            except ValueError as exc:
                out.append(f"{where}.{part}.{name}: {exc}")
                continue
            if amount < 0:
                out.append(f"{where}.{part}.{name}: {value!r} is negative")
            if name in BYTE_RESOURCES and amount == 0 and part == "limits":
                out.append(f"{where}.{part}.{name}: a limit of 0 bytes stops every container")
            parsed[part][name] = amount
    for name, limit in parsed["limits"].items():
        request = parsed["requests"].get(name)
        if request is not None and request > limit:
            out.append(f"{where}: the {name} request {request} is above its limit {limit}")
        if (
            "/" in name
            and not name.startswith(("kubernetes.io/", "requests."))
            and request is not None
        ) and request != limit:
            out.append(f"{where}: extended resource {name} has request != limit")
    return out


def _pod(where: str, pod: dict) -> list[str]:
    out: list[str] = []
    containers = (pod.get("initContainers") or []) + (pod.get("containers") or [])
    volumes = [v.get("name") for v in pod.get("volumes") or []]
    for name in volumes:
        if not isinstance(name, str) or len(name) > 63 or not DNS1123_LABEL.fullmatch(name):
            out.append(f"{where}: volume name {name!r} is not a DNS-1123 label")
    out += [
        f"{where}: volume {n!r} appears twice"
        for n in sorted(set(volumes), key=str)
        if volumes.count(n) > 1
    ]
    for volume in pod.get("volumes") or []:
        size = (volume.get("emptyDir") or {}).get("sizeLimit")
        if size is not None:
            try:
                amount = quantity(size)
                if amount <= 0:
                    out.append(
                        f"{where}: emptyDir {volume['name']} sizeLimit {size!r} is not above 0"
                    )
            except ValueError as exc:
                out.append(f"{where}: emptyDir {volume.get('name')}: {exc}")
    names = [c.get("name") for c in containers]
    out += [
        f"{where}: container {n!r} appears twice"
        for n in sorted(set(names), key=str)
        if names.count(n) > 1
    ]
    for c in containers:
        cw = f"{where}/{c.get('name')}"
        if (
            not isinstance(c.get("name"), str)
            or not DNS1123_LABEL.fullmatch(c["name"])
            or len(c["name"]) > 63
        ):
            out.append(f"{cw}: container name is not a DNS-1123 label")
        image = c.get("image")
        if (
            not isinstance(image, str)
            or not IMAGE_REFERENCE.fullmatch(image)
            or len(image.split("@")[0].rsplit(":", 1)[0]) > 255
        ):
            out.append(f"{cw}: image {image!r} is not a reference the kubelet can pull")
        env = [e.get("name") for e in c.get("env") or []]
        out += [
            f"{cw}: env name {n!r} is not valid"
            for n in env
            if not isinstance(n, str) or not _ENV_NAME.fullmatch(n)
        ]
        out += [
            f"{cw}: env {n!r} appears twice" for n in sorted(set(env), key=str) if env.count(n) > 1
        ]
        for e in c.get("env") or []:
            for ref in ("secretKeyRef", "configMapKeyRef"):
                selector = (e.get("valueFrom") or {}).get(ref)
                if selector is not None:
                    out += _reference(f"{cw}: env {e.get('name')!r} {ref}", selector)
        mounts = c.get("volumeMounts") or []
        paths = [m.get("mountPath") for m in mounts]
        out += [
            f"{cw}: mountPath {p!r} appears twice"
            for p in sorted(set(paths), key=str)
            if paths.count(p) > 1
        ]
        out += [
            f"{cw}: volumeMount {m.get('name')!r} names no volume"
            for m in mounts
            if m.get("name") not in volumes
        ]
        ports = [p.get("name") for p in c.get("ports") or [] if "name" in p]
        for name in ports:
            if (
                not isinstance(name, str)
                or len(name) > 15
                or not _PORT_NAME.fullmatch(name)
                or "--" in name
                or not re.search("[a-z]", name)
            ):
                out.append(f"{cw}: port name {name!r} is not an IANA service name")
        out += _resources(f"{cw}.resources", c.get("resources"))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            for field in ("periodSeconds", "failureThreshold", "timeoutSeconds"):
                value = (c.get(probe) or {}).get(field)
                if value is not None and value < 1:
                    out.append(f"{cw}.{probe}.{field}: {value} is below 1")
    out += _labels(f"{where}.nodeSelector", pod.get("nodeSelector"))
    for field in ("serviceAccountName", "priorityClassName"):
        value = pod.get(field)
        if value is not None and (len(value) > 253 or not DNS1123_SUBDOMAIN.fullmatch(value)):
            out.append(f"{where}.{field}: {value!r} is not a DNS-1123 subdomain")
    for secret in pod.get("imagePullSecrets") or []:
        name = secret.get("name")
        if not isinstance(name, str) or len(name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(name):
            out.append(f"{where}.imagePullSecrets: {name!r} is not a DNS-1123 subdomain")
    for spread in pod.get("topologySpreadConstraints") or []:
        if spread.get("maxSkew", 1) < 1:
            out.append(f"{where}: topology spread maxSkew {spread['maxSkew']} is below 1")
    return out


def problems(docs: Iterable[dict]) -> list[str]:
    """Every problem of ``docs`` that the API server (or a running pod) would find and the
    OpenAPI schemas do not (see the module docstring)."""
    out: list[str] = []
    seen: set[tuple] = set()
    for doc in docs:
        kind, meta = doc.get("kind"), doc.get("metadata") or {}
        where = f"{kind}/{meta.get('name')}"
        ident = (doc.get("apiVersion"), kind, meta.get("namespace"), meta.get("name"))
        if ident in seen:
            out.append(f"{where}: rendered twice")
        seen.add(ident)
        if problem := _name_problem(str(kind), meta.get("name")):
            out.append(f"{where}: {problem}")
        out += _labels(f"{where}.metadata.labels", meta.get("labels"))
        out += _annotations(f"{where}.metadata.annotations", meta.get("annotations"))
        spec = doc.get("spec") or {}
        selector = spec.get("selector")
        if kind == "Service":
            out += _labels(f"{where}.spec.selector", selector)
        elif isinstance(selector, dict):
            out += _labels(f"{where}.spec.selector", selector.get("matchLabels"))
        if kind == "NetworkPolicy":
            out += _network_policy(where, spec)
        if kind == "Secret":
            for field in ("data", "stringData"):
                out += [
                    f"{where}.{field}: key {k!r} is not a key the API accepts"
                    for k in doc.get(field) or {}
                    if not is_config_key(k)
                ]
        template = None
        if kind == "Deployment":
            template = spec.get("template")
            strategy = (spec.get("strategy") or {}).get("rollingUpdate") or {}
            for field in ("maxSurge", "maxUnavailable"):
                if field in strategy:
                    out += _int_or_percent(
                        f"{where}.{field}", strategy[field], at_most_100=field == "maxUnavailable"
                    )
            if strategy and str(strategy.get("maxSurge")).rstrip("%") == "0" == str(
                strategy.get("maxUnavailable")
            ).rstrip("%"):
                out.append(f"{where}: maxSurge and maxUnavailable are both 0")
            if spec.get("replicas", 1) < 0:
                out.append(f"{where}: replicas is negative")
        elif kind == "CronJob":
            job = (spec.get("jobTemplate") or {}).get("spec") or {}
            template = job.get("template")
            out += _job(where, job)
        elif kind == "Job":
            template = spec.get("template")
            out += _job(where, spec)
        elif kind == "Pod":
            out += _pod(where, spec)
        elif kind == "PodDisruptionBudget":
            for field in ("maxUnavailable", "minAvailable"):
                if field in spec:
                    out += _int_or_percent(f"{where}.{field}", spec[field], at_most_100=True)
        elif kind == "HorizontalPodAutoscaler":
            low, high = spec.get("minReplicas", 1), spec.get("maxReplicas")
            if low < 1 or high is None or high < low:
                out.append(
                    f"{where}: minReplicas {low} and maxReplicas {high} are not 1 <= min <= max"
                )
        elif kind == "PersistentVolumeClaim":
            storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
            out += _resources(f"{where}.spec.resources", {"requests": {"storage": storage}})
            if storage is not None and quantity_or_none(storage) == 0:
                out.append(f"{where}: storage request is 0")
        if template is not None:
            tmeta = template.get("metadata") or {}
            out += _labels(f"{where}.template.labels", tmeta.get("labels"))
            out += _annotations(f"{where}.template.annotations", tmeta.get("annotations"))
            out += _pod(f"{where}.template", template.get("spec") or {})
    return out


def quantity_or_none(value: object) -> Fraction | None:
    try:
        return quantity(value)
    except ValueError:
        return None


def _job(where: str, job: dict) -> list[str]:
    out = []
    if job.get("backoffLimit", 0) < 0:
        out.append(f"{where}: backoffLimit is negative")
    if job.get("activeDeadlineSeconds", 1) < 1:
        out.append(f"{where}: activeDeadlineSeconds is below 1")
    if job.get("ttlSecondsAfterFinished", 0) < 0:
        out.append(f"{where}: ttlSecondsAfterFinished is negative")
    return out
