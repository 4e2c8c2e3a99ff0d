"""`model-loader serve`: run the real tritonserver on this machine's CPU for a published repository."""

from __future__ import annotations

import argparse
from pathlib import Path

from loader.cli import limit_argument, nonempty_path, port
from loader.limits import STARTUP_TIMEOUT_S


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a published repository with the real tritonserver (CPU)",
        description="Serve REPOSITORY (the directory `model-loader run` printed) with the "
        "tritonserver bundled in nvidia-pytriton, on 127.0.0.1, until Ctrl-C or SIGTERM, with "
        "the Triton arguments the chart renders (`helm template` with values/local.yaml, or "
        "--values/--set): only the model path, the ports and the addresses are this machine's. "
        "Needs the [serve] extra and the checkout's helm.",
    )
    p.add_argument("repository", type=nonempty_path, metavar="REPOSITORY")
    p.add_argument(
        "-f",
        "--values",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="chart values file (repeatable; default: values/local.yaml)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="chart value, as helm's --set (repeatable)",
    )
    p.add_argument("--http-port", type=port, help="HTTP port (default: a free one)")
    p.add_argument("--grpc-port", type=port, help="gRPC port (default: a free one)")
    p.add_argument("--metrics-port", type=port, help="metrics port (default: a free one)")
    limit_argument(
        p,
        "--startup-timeout",
        STARTUP_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds to wait for readiness",
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

    STARTUP_TIMEOUT_S.check(args.startup_timeout)  # inf waited for ever, nan and -1 failed at once
    require_extra("serve", "pytriton", "tokenizers")
    from loader.serving import TritonServer, rendered_pod_args, restricted_protocols

    # SIGTERM stops the server like Ctrl-C (loader.cli.run_command's handler).
    server = TritonServer(
        args.repository,
        pod_args=rendered_pod_args(values_files=args.values, set_values=args.set),
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        startup_timeout=args.startup_timeout,
        log_verbose=1 if args.triton_verbose else 0,
        log_path=args.log_file,
    )
    with server:
        if server.http_address is not None:
            print(f"HTTP    http://{server.http_url}", flush=True)
        print(f"gRPC    {server.grpc_url}", flush=True)
        print(f"metrics {server.metrics_url}", flush=True)
        for header, token in sorted(set(restricted_protocols(server.pod_args).values())):
            # gRPC's admin protocols answer only with it, as in a pod (perf_analyzer: -H).
            print(f"admin   {header}: {token}", flush=True)
        kept = "" if args.log_file else " (removed when this stops; --log-file PATH keeps it)"
        print(f"log     {server.log_path}{kept}", flush=True)
        print("serving; press Ctrl-C to stop", flush=True)
        code = server.wait_exit()
        raise server.failure(f"tritonserver exited by itself (code {code})")
