"""The chart of this checkout as the chart tests use it: :mod:`loader.chart` bound to
``charts/model-triton`` and the pinned helm binaries ``make install`` puts in ``.tools/bin``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loader.chart import (  # noqa: F401  (the tests' names for them)
    CRD_KINDS,
    KUBERNETES_VERSIONS,
    Chart,
    ChartError,
    describe,
    documents,
    triton_command,
    triton_serving_args,
    validate,
)
from loader.chart import pod_spec as _pod_spec  # noqa: F401
from loader.cli import chart as cli

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = Chart.in_checkout(ROOT)
CHART = CHECKOUT.path
VALUES_DIR = ROOT / "values"
TOOLS_BIN = CHECKOUT.tools

tool = CHECKOUT.tool
render = CHECKOUT.render
lint = CHECKOUT.lint
notes = CHECKOUT.notes


def main(argv: Sequence[str]) -> int:
    """``scripts/render_chart.py`` with ``argv``, on this checkout."""
    return cli.main(["--chart", str(CHART), "--tools", str(TOOLS_BIN), *argv])
