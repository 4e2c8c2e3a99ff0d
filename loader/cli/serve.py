"""`model-loader serve`: run the real tritonserver on this machine's CPU for a published repository."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a published repository with the real tritonserver (CPU)",
        description="Serve REPOSITORY (the directory `model-loader run` printed) with the "
        "tritonserver bundled in nvidia-pytriton, on 127.0.0.1, until Ctrl-C or SIGTERM. "
        "Needs the [serve] extra.",
    )
    p.add_argument("repository", type=Path, metavar="REPOSITORY")
    p.add_argument("--http-port", type=int, help="HTTP port (default: a free one)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default: a free one)")
    p.add_argument("--metrics-port", type=int, help="metrics port (default: a free one)")
    p.add_argument(
        "--startup-timeout", type=float, default=120.0, help="seconds to wait for readiness"
    )
    p.add_argument("--triton-verbose", action="store_true", help="Triton's verbose log")
    p.add_argument(
        "--log-file",
        type=Path,
        default=None,
        help="write Triton's log here and keep it (default: a temporary file, removed when "
        "serve stops)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loader.cli import require_extra

    require_extra("serve", "pytriton", "tokenizers")
    from loader.serving import TritonServer

    # SIGTERM stops the server like Ctrl-C (loader.cli.run_command's handler).
    server = TritonServer(
        args.repository,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        startup_timeout=args.startup_timeout,
        log_verbose=1 if args.triton_verbose else 0,
        log_path=args.log_file,
    )
    with server:
        print(f"HTTP    http://{server.http_url}", flush=True)
        print(f"gRPC    {server.grpc_url}", flush=True)
        print(f"metrics {server.metrics_url}", flush=True)
        kept = "" if args.log_file else " (removed when this stops; --log-file PATH keeps it)"
        print(f"log     {server.log_path}{kept}", flush=True)
        print("serving; press Ctrl-C to stop", flush=True)
        assert server.process is not None
        code = server.process.wait()
        raise server.failure(f"tritonserver exited by itself (code {code})")
