"""The package's import graph obeys the layers of docs/architecture.md and has no cycle.

Every ``import`` and ``from ... import`` of every module of ``loader`` counts, at module level
or inside a function (a lazy import is still a dependency). The layers are read from the table
in docs/architecture.md, so the document and the test cannot drift.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "loader"
#: Triton Python models copied into repositories: they run inside Triton, not in the package.
NOT_IMPORTED = PACKAGE / "repository" / "models"


def layers() -> dict[str, int]:
    """Module prefix -> layer number, from the table of docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table: dict[str, int] = {}
    for match in re.finditer(r"^\| (\d+) [^|]*\| ([^|]+)\|", text, re.MULTILINE):
        for name in re.findall(r"`([\w.]+)`", match[2]):
            table[name] = int(match[1])
    return table


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for p in sorted(PACKAGE.rglob("*.py"))
        if NOT_IMPORTED not in p.parents and "__pycache__" not in p.parts
    }


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (a name imported from a package counts as its
    submodule when there is one)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    # Importing a submodule imports its parent packages: not a dependency of its own.
    return {t for t in found if not name.startswith(t + ".")}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def layer_of(name: str, table: dict[str, int]) -> int | None:
    prefixes = [p for p in table if name == p or name.startswith(p + ".")]
    return table[max(prefixes, key=len)] if prefixes else None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_architecture_document_defines_the_layers():
    table = layers()
    assert table["loader.errors"] == 0 and table["loader.cli"] == 5
    assert table["loader.bench"] < table["loader.cli"]
    assert table["loader.repository.tensors"] < table["loader.repository"]


def test_every_module_belongs_to_a_layer():
    table = layers()
    unplaced = [name for name in modules() if layer_of(name, table) is None]
    assert not unplaced, f"add these modules to a layer in docs/architecture.md: {unplaced}"


def test_no_module_imports_from_a_higher_layer():
    table = layers()
    upward = []
    for name, targets in graph().items():
        own = layer_of(name, table)
        for target in sorted(targets):
            other = layer_of(target, table)
            if own is not None and other is not None and other > own:
                upward.append(f"{name} (layer {own}) imports {target} (layer {other})")
    assert not upward, "\n".join(upward)


def test_there_is_no_import_cycle():
    assert cycles(graph()) == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(edges, expected):
    assert cycles(edges) == expected


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from loader.bench import tune\n    from . import errors\n")
    found = imports("loader.x", source, {"loader.bench.tune", "loader.errors", "loader.bench"})
    assert found == {"loader.bench", "loader.bench.tune", "loader.errors"}
