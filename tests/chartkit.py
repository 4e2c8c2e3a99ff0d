"""Rendering the chart for generated values: values files any string survives, the chart's own
helpers rendered many cases at once, and the outcome of one values set (refused, or manifests).

Generated values go to Helm as files, never as `--set` arguments: a NUL byte cannot be an
argument, and `--set` parses commas, dots and brackets. :func:`yaml_text` writes JSON syntax (a
subset of YAML) with every character outside printable ASCII escaped, so that YAML's line breaks
(NEL, LS, PS) and the control characters its parser refuses raw reach Helm unchanged.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests import chart as rc


def _quote(text: str) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def yaml_text(value) -> str:
    """``value`` (dicts, lists, strings, numbers, booleans, None) as YAML Helm reads back equal."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_quote(str(k))}: {yaml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    if isinstance(value, str):
        return _quote(value)
    return json.dumps(value)


def write_values(directory: Path, values: dict, name: str = "values.yaml") -> Path:
    path = directory / name
    path.write_text(yaml_text(values) + "\n", encoding="ascii")
    return path


@dataclass(frozen=True)
class Outcome:
    """What `helm template` made of one values set: helm's error, or the manifests and the
    problems a strict validation finds in them (a manifest that repeats a key is one)."""

    error: str | None
    text: str = ""
    docs: tuple[dict, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        return self.error is not None


def render_values(
    helm: str,
    values: dict,
    *,
    base: tuple[Path, ...] = (),
    release: str = "codegen",
    namespace: str = "model-triton",
) -> Outcome:
    """`helm template` of the real chart with ``base`` files and then ``values``."""
    with tempfile.TemporaryDirectory(prefix="chart-values-") as tmp:
        path = write_values(Path(tmp), values)
        try:
            text = rc.render(
                helm=helm, values_files=(*base, path), release=release, namespace=namespace
            )
        except rc.ChartError as exc:
            return Outcome(exc.output)
    try:
        docs = tuple(rc.documents(text))
    except rc.ChartError as exc:
        return Outcome(None, text, (), (str(exc),))
    return Outcome(None, text, docs, tuple(rc.validate(docs)))


def get(values: dict, path: str, default=None):
    """The value at a dotted ``path`` of nested maps, or ``default``."""
    node = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def names_a_key(error: str, keys) -> bool:
    """Helm's error names one of ``keys`` (dotted paths): as the chart's rules write them
    (`model-triton: a.b`), as Helm 3's schema errors do (`a.b`) or Helm 4's (`/a/b`)."""
    return any(k in error or "/" + k.replace(".", "/") in error for k in keys)


def generated(strategy, count: int) -> list:
    """``count`` examples drawn by Hypothesis (its edge-case bias included), for a batched run
    whose failures are reported together. Derandomized: the same examples on every run, so a
    check that the batch reaches both verdicts (``assert_class``) cannot fail by the luck of
    one draw (40 cases all refused happened about once in three full runs)."""
    from hypothesis import HealthCheck, given, settings

    found: list = []

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw(example):
        found.append(example)

    draw()
    return found


def render_helpers(helm: str, template: str, values: dict) -> object:
    """Render ``template`` in a scratch chart holding the chart's own helper files
    (``templates/_*.tpl``, unchanged) and its Chart.yaml; the template writes one JSON value,
    base64-encoded (``toJson | b64enc``), which is returned decoded.

    This renders thousands of cases of a helper in one Helm run: the helpers are the chart's,
    only the loop around them is the test's."""
    with tempfile.TemporaryDirectory(prefix="chart-helpers-") as tmp:
        chart = Path(tmp) / "model-triton"
        (chart / "templates").mkdir(parents=True)
        shutil.copy(rc.CHART / "Chart.yaml", chart / "Chart.yaml")
        for helper in (rc.CHART / "templates").glob("_*.tpl"):
            shutil.copy(helper, chart / "templates" / helper.name)
        (chart / "templates" / "harness.yaml").write_text(template)
        values_file = write_values(Path(tmp), values)
        proc = subprocess.run(
            [str(rc.tool(helm)), "template", "harness", str(chart), "-f", str(values_file)],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
    if proc.returncode != 0:
        raise rc.ChartError(f"{helm} template of the helper harness failed", proc.stderr)
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("result: ")]
    return json.loads(base64.b64decode(line.removeprefix("result: ")))
