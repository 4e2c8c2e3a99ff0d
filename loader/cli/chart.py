"""``scripts/render_chart.py``: render the Helm chart offline, validate it, and print what it
would create (the work is in :mod:`loader.chart`).

    python scripts/render_chart.py -f values/local.yaml              # resources, GPU maths, key
    python scripts/render_chart.py -f values/staging.yaml --validate # + helm lint, OpenAPI strict
    python scripts/render_chart.py --helm helm3 -f values/production.yaml --output out.yaml
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from loader import values_doc
from loader.chart import (
    CHART_DIR,
    KUBERNETES_VERSIONS,
    TOOLS_DIR,
    Chart,
    ChartError,
    describe,
    documents,
    validate,
)

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="render_chart.py", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("-f", "--values", action="append", default=[], help="values file(s)")
    parser.add_argument("--set", action="append", default=[], help="helm --set overrides")
    parser.add_argument(
        "--helm",
        default="helm",
        help="helm, helm3 or helm4 from --tools, or the path of a helm binary (default: helm)",
    )
    parser.add_argument("--release", default="codegen")
    parser.add_argument("--namespace", default="model-triton")
    parser.add_argument(
        "--chart", type=Path, default=CHART_DIR, help=f"the chart directory (default: {CHART_DIR})"
    )
    parser.add_argument(
        "--tools",
        type=Path,
        default=TOOLS_DIR,
        help=f"where the pinned helm binaries are (default: {TOOLS_DIR}, as make install puts them)",
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="also helm lint --strict and validate against Kubernetes "
        + " and ".join(KUBERNETES_VERSIONS),
    )
    parser.add_argument("--output", type=Path, help="write the rendered manifests here")
    parser.add_argument(
        "--values-doc",
        action="store_true",
        help="write the chart README's table of values from values.yaml's `# --` comments",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.values_doc:
        changed = values_doc.write(args.chart)
        print(f"{args.chart / 'README.md'}: {'updated' if changed else 'up to date'}")
        return 0
    chart = Chart(args.chart, args.tools)
    try:
        text = chart.render(
            helm=args.helm,
            values_files=args.values,
            set_values=args.set,
            release=args.release,
            namespace=args.namespace,
        )
        if args.validate:
            chart.lint(helm=args.helm, values_files=args.values, set_values=args.set)
    except (ChartError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    docs = documents(text)
    if args.output:
        args.output.write_text(text)
        log.info("wrote %s (%d manifests)", args.output, len(docs))
    label = ", ".join(args.values) or "chart defaults"
    print(f"chart {args.chart} with {label} renders {len(docs)} resources:")
    for doc in docs:
        r = describe(doc)
        print(f"  {r.kind:<22} {r.name:<34} {r.detail}")
    if args.validate:
        problems = validate(docs)
        for p in problems:
            print(f"invalid: {p}", file=sys.stderr)
        if problems:
            return 1
        print(
            f"helm lint --strict: ok; every manifest valid (strict) on Kubernetes "
            f"{', '.join(KUBERNETES_VERSIONS)}"
        )
    return 0
