"""`model-loader prune`: remove leftovers of killed loaders and published keys beyond the newest."""

from __future__ import annotations

import argparse

from loader.cli import limit_argument, nonempty_path
from loader.limits import LOCK_EXPIRY_S, PRUNE_KEEP
from loader.progress import human_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prune",
        help="remove leftovers and old published keys from a repository root",
        description="Remove what killed or stalled loaders left under ROOT (staging, replaced "
        "copies, downloads) and published keys beyond the KEEP newest per model name. Never "
        "touches a key whose publish lock is live, a key passed with --in-use, or anything the "
        "loader did not create.",
    )
    p.add_argument(
        "--repository",
        required=True,
        type=nonempty_path,
        metavar="ROOT",
        help="repository root (the shared volume, e.g. /models)",
    )
    limit_argument(
        p,
        "--keep",
        PRUNE_KEEP,
        type=int,
        metavar="N",
        help="published keys kept per model name, newest first",
    )
    p.add_argument(
        "--in-use",
        action="append",
        default=[],
        metavar="KEY",
        help="a model key still served (repeatable); the chart passes its Deployment's key",
    )
    limit_argument(
        p,
        "--lock-expiry-s",
        LOCK_EXPIRY_S,
        help="a publish lock rewritten within this many seconds is live",
    )
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.set_defaults(func=run, writes_below="--repository")


def run(args: argparse.Namespace) -> int:
    from loader.repository.prune import prune

    report = prune(
        args.repository,
        keep=args.keep,
        in_use=tuple(args.in_use),
        lock_expiry_s=args.lock_expiry_s,
        dry_run=args.dry_run,
    )
    verb = "would remove" if report.dry_run else "removed"
    for removal in report.removed:
        print(f"{verb} {removal.path} ({removal.reason})")
    for key, why in report.kept:
        print(f"kept {key} ({why})")
    print(f"{verb} {len(report.removed)} item(s), {human_bytes(report.bytes)}")
    return 0
