"""What Kubernetes would run for a container of a rendered chart: its environment and command line.

A container's ``env`` entries are resolved the way the kubelet resolves them (a ``value``, with
``$(VAR)`` references to the entries before it expanded, or a ``secretKeyRef`` read from a Secret
of the same rendering), then ``$(VAR)`` references in ``command`` and ``args`` are expanded from
that environment with Kubernetes' rules (``k8s.io/kubernetes/third_party/forked/golang/expansion``,
``Expand``): ``$(NAME)`` becomes the variable's value when it is defined and stays as written
otherwise, ``$$`` is a literal ``$``. The demo and the tests run the chart's own command lines
with this (:func:`loader.chart.triton_serving_args`; ``scripts/demo.py`` serves with the chart's
Triton arguments).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodSpecError(Exception):
    """The rendered pod refers to something the rendering does not hold."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """``text`` with ``$(NAME)`` replaced from ``env`` as Kubernetes does."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(replace, text)


def secrets(docs: Iterable[dict]) -> dict[str, dict[str, str]]:
    """Rendered Secrets, ``name -> {key: decoded value}`` (``data`` is base64, ``stringData`` not)."""
    found: dict[str, dict[str, str]] = {}
    for doc in docs:
        if doc.get("kind") != "Secret":
            continue
        values = {
            k: base64.b64decode(v).decode("utf-8") for k, v in (doc.get("data") or {}).items()
        }
        values.update(doc.get("stringData") or {})
        found[doc["metadata"]["name"]] = values
    return found


def environment(
    container: dict,
    docs: Iterable[dict],
    *,
    external: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, str]:
    """The container's environment; ``external`` stands in for Secrets the chart only names."""
    available = {**{k: dict(v) for k, v in (external or {}).items()}, **secrets(docs)}
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            env[name] = expand(str(entry["value"]), env)
            continue
        ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            raise PodSpecError(f"env {name}: only value and secretKeyRef are resolved here")
        secret = available.get(ref["name"])
        if secret is None or ref["key"] not in secret:
            if ref.get("optional"):
                continue
            raise PodSpecError(
                f"env {name}: Secret {ref['name']} with key {ref['key']} is not in the rendering "
                "(pass it as external=...); the kubelet would not start this container"
            )
        env[name] = secret[ref["key"]]
    return env


def command_line(
    container: dict,
    docs: Iterable[dict],
    *,
    external: Mapping[str, Mapping[str, str]] | None = None,
) -> list[str]:
    """``command`` + ``args`` of ``container`` as the kubelet passes them to the runtime."""
    docs = list(docs)
    env = environment(container, docs, external=external)
    return [
        expand(str(a), env) for a in [*container.get("command", []), *container.get("args", [])]
    ]
