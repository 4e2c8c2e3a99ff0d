"""The chart README says exactly what holds: its table of values is what values.yaml's comments
give, every key a refusal names is a value, and its table of values sets that `helm lint
--strict` passes and `helm template` refuses is run with Helm 3 and Helm 4."""

from __future__ import annotations

import re

import pytest
import yaml

from loader import values_doc
from tests import chart as rc
from tests.chartkit import get

HELMS = ("helm3", "helm4")
README = rc.CHART / "README.md"


def test_the_readme_s_table_of_values_is_generated_from_values_yaml():
    readme = README.read_text(encoding="utf-8")
    values = (rc.CHART / "values.yaml").read_text(encoding="utf-8")
    assert values_doc.update(readme, values) == readme, (
        "the README's table of values is stale: python scripts/render_chart.py --values-doc"
    )


def test_the_table_lists_every_value_with_its_default():
    text = (rc.CHART / "values.yaml").read_text(encoding="utf-8")
    values = yaml.safe_load(text)
    listed = dict(values_doc.entries(text))

    def leaves(node, path=()):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                yield from leaves(v, (*path, k))
        else:
            yield ".".join(path)

    for leaf in leaves(values):
        assert any(leaf == k or leaf.startswith(k + ".") for k in listed), leaf
    assert all(description for description in listed.values())


def test_the_generator_reads_comments_and_defaults():
    text = "a:\n  # -- First line\n  # second line.\n  b: 1\n  # not documented\n  c: {}\n# -- Whole.\nd:\n  e: [1]\n"
    assert values_doc.entries(text) == [("a.b", "First line second line."), ("d", "Whole.")]
    assert '| `d` | `{"e": [1]}` | Whole. |' in values_doc.table(text)


def _template_messages() -> set[str]:
    found = set()
    for path in (rc.CHART / "templates").glob("*.tpl"):
        found |= set(re.findall(r'"model-triton: ([A-Za-z][\w.]*)', path.read_text()))
    return found


def test_every_key_a_refusal_names_is_a_value():
    values = yaml.safe_load((rc.CHART / "values.yaml").read_text())
    keys = {m for m in _template_messages() if "." in m}
    assert len(keys) > 20
    missing = object()
    assert [k for k in sorted(keys) if get(values, k, missing) is missing] == []


def _lint_table() -> list[tuple[str, bool, str]]:
    readme = README.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([^`]+)` \| (passes|fails) \| refused: `([^`]+)` \|$", readme, re.M)
    return [(sets, lint == "passes", message) for sets, lint, message in rows]


def test_the_readme_lists_values_lint_passes_and_template_refuses():
    rows = _lint_table()
    assert len(rows) >= 5 and any(passes for _, passes, _ in rows)


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize(("sets", "lint_passes", "message"), _lint_table())
def test_lint_and_template_do_what_the_readme_says(helm, sets, lint_passes, message):
    if lint_passes:
        assert "0 chart(s) failed" in rc.lint(helm=helm, set_values=(sets,))
    else:
        with pytest.raises(rc.ChartError):
            rc.lint(helm=helm, set_values=(sets,))
    with pytest.raises(rc.ChartError) as info:
        rc.render(helm=helm, set_values=(sets,))
    assert message in info.value.output
