#!/usr/bin/env python3
"""Render the Helm chart offline, validate it, and print what it would create.

    python scripts/render_chart.py -f values/local.yaml              # resources, GPU maths, key
    python scripts/render_chart.py -f values/staging.yaml --validate # + helm lint, OpenAPI strict

Started with any Python, it re-executes itself with the project's `.venv/bin/python` (`make
install` creates it). The work is in loader.cli.chart and loader.chart; this script points them at
the chart and the pinned tools of its own checkout.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"

if VENV_PYTHON.exists() and Path(sys.prefix).resolve() != VENV_PYTHON.parents[1].resolve():
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), __file__, *sys.argv[1:]])

try:
    from loader.cli.chart import main
except ModuleNotFoundError as exc:
    print(f"error: {exc.name} is not installed", file=sys.stderr)
    print("hint: run `make install` in the project (it creates .venv), then run this again.",
          file=sys.stderr)  # fmt: skip
    raise SystemExit(2) from None

checkout = ["--chart", os.path.relpath(ROOT / "charts" / "model-triton"),
            "--tools", str(ROOT / ".tools" / "bin")]  # fmt: skip
raise SystemExit(main([*checkout, *sys.argv[1:]]))
