"""The chart README's table of values, generated from the `# --` comments of values.yaml.

values.yaml is the one place a value is described: each documented key has a comment block
whose first line starts with ``# --`` right above it (a key documented as a whole, such as a
map of resources, documents its children). :func:`table` turns them into a Markdown table with
each key's default; :func:`update` writes it between the README's markers, and
``python scripts/render_chart.py --values-doc`` runs it. ``tests/test_chart_docs.py`` fails when
the README's table is not what values.yaml gives.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

BEGIN = "<!-- values:begin (generated from values.yaml: python scripts/render_chart.py --values-doc) -->"
END = "<!-- values:end -->"
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")


def entries(text: str) -> list[tuple[str, str]]:
    """(dotted key, description) of every documented key of a values.yaml, in file order."""
    lines = text.splitlines()
    stack: list[tuple[int, str]] = []
    documented: list[tuple[str, str]] = []
    for i, line in enumerate(lines):
        match = _KEY.match(line)
        if not match:
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [match["key"]])
        stack.append((indent, match["key"]))
        block = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            block.insert(0, lines[j].strip())
            j -= 1
        starts = [n for n, c in enumerate(block) if c.startswith("# --")]
        if not starts:
            continue
        if any(path.startswith(p + ".") for p, _ in documented):
            continue
        words = [c.lstrip("#").strip() for c in block[starts[-1] :]]
        words[0] = words[0].removeprefix("--").strip()
        documented.append((path, " ".join(w for w in words if w)))
    return documented


def _default(values: dict, path: str) -> str:
    node = values
    for part in path.split("."):
        node = node[part]
    text = json.dumps(node, ensure_ascii=False)
    return f"`{text}`".replace("|", "\\|")


def table(values_yaml: str) -> str:
    """The Markdown table of every documented value: key, default, description."""
    values = yaml.safe_load(values_yaml)
    rows = ["| value | default | description |", "|---|---|---|"]
    for path, description in entries(values_yaml):
        escaped = description.replace("|", "\\|")
        rows.append(f"| `{path}` | {_default(values, path)} | {escaped} |")
    return "\n".join(rows)


def update(readme: str, values_yaml: str) -> str:
    """``readme`` with the table between its markers replaced by :func:`table`."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + table(values_yaml) + "\n" + readme[end:]


def write(chart: Path) -> bool:
    """Update the chart's README.md from its values.yaml; True when it changed."""
    readme = chart / "README.md"
    old = readme.read_text(encoding="utf-8")
    new = update(old, (chart / "values.yaml").read_text(encoding="utf-8"))
    if new != old:
        readme.write_text(new, encoding="utf-8")
    return new != old
