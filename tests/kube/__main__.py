"""`python -m tests.kube up|down|status [DIR]`: the local cluster for people (`make cluster-up`,
`make cluster-down`); `serve DIR` is the supervisor process itself."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.kube import cluster
from tests.kube.controlplane import ROOT, ControlPlaneError

DEFAULT_DIR = ROOT / ".cluster"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.kube", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "serve"])
    parser.add_argument("dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--people", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = args.dir.resolve()
    if args.command == "serve":
        return cluster.Supervisor(root, people=args.people).run()
    if args.command == "up":
        try:
            found = cluster.up(root)
        except ControlPlaneError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"cluster up at {found.server}; logs in {root}")
        print(f"  export KUBECONFIG={root / 'kubeconfig'}")
        print("  kubectl get nodes    # fake GPU nodes; `make cluster-down` stops it")
        return 0
    if args.command == "down":
        print("cluster stopped" if cluster.down(root) else f"no cluster running under {root}")
        return 0
    state = cluster._read_state(root)
    if state and not state.get("failed") and cluster._alive(root / "supervisor.pid"):
        print(f"running: {state['server']} (KUBECONFIG={state['kubeconfig']})")
        return 0
    print(f"not running (under {root})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
