"""`model-loader run`: fetch, convert, write and publish one Triton model repository.

The published directory's absolute path is the LAST line of standard output (scripts and the
chart's Job read it); logs go to standard error.
"""

from __future__ import annotations

import argparse

from loader.cli import limit_argument, nonempty_path, print_path
from loader.errors import LoaderError
from loader.limits import (
    GPU_MEMORY_GIB,
    LOCK_EXPIRY_S,
    LOCK_TIMEOUT_S,
    PRUNE_KEEP,
    RETRY_DEADLINE_S,
    WORKERS,
)
from loader.parallel import Parallelism
from loader.repository.key import BACKENDS, ServingSettings
from loader.run import VERIFY_MODES, RunRequest, run


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="fetch, convert and publish a model repository for Triton",
        description="Fetch a checkpoint, convert it for the tensor-parallel size, write a Triton "
        "model repository (ensemble, pre/post-processing, fastertransformer) and publish it "
        "atomically as ROOT/<key>. Prints the published path as the last line.",
    )
    p.add_argument("--source", required=True, help="checkpoint URI: path, file://, gs://, hf://")
    p.add_argument(
        "--repository",
        required=True,
        type=nonempty_path,
        metavar="ROOT",
        help="repository root (the shared volume, e.g. /models)",
    )
    p.add_argument("--model-name", required=True, help="Triton model name clients call")
    p.add_argument(
        "--revision",
        default=None,
        help="revision for the key (default: the URI's @rev, else a hash of the URI)",
    )
    p.add_argument("--tp-size", type=int, required=True, help="tensor-parallel size T")
    p.add_argument("--pp-size", type=int, required=True, help="pipeline-parallel size P")
    p.add_argument("--instance-count", type=int, required=True, help="FT instances I")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="fastertransformer",
        help="fastertransformer (GPUs) or python (the CPU reference model)",
    )
    p.add_argument(
        "--dtype",
        choices=("fp16", "fp32"),
        default=None,
        help="weight file dtype (default: the source's)",
    )
    p.add_argument(
        "--max-batch-size", type=int, default=8, help="requests one instance batches (default 8)"
    )
    p.add_argument(
        "--dynamic-batching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let Triton batch concurrent requests (default on)",
    )
    p.add_argument(
        "--preferred-batch-size",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="batch sizes the dynamic batcher aims for (default: none, any size)",
    )
    p.add_argument(
        "--max-queue-delay-us",
        type=int,
        default=100,
        metavar="US",
        help="how long the dynamic batcher waits to fill a batch (default 100)",
    )
    p.add_argument(
        "--streaming",
        action="store_true",
        help="stream completions token by token: decoupled fastertransformer and a streaming "
        "front model (clients use gRPC streaming, e.g. scripts/complete)",
    )
    p.add_argument(
        "--gpus-per-replica",
        type=int,
        default=None,
        help="GPUs one Triton replica sees (default: T x P)",
    )
    limit_argument(
        p,
        "--gpu-memory-gib",
        GPU_MEMORY_GIB,
        help="GPU memory per GPU; refuse a configuration that cannot fit",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="publish a fresh copy even if the key is already published",
    )
    p.add_argument(
        "--follow-source",
        action="store_true",
        help="when the source no longer holds what the published key was built from (a moved "
        "branch, a re-uploaded prefix, an overwritten file), publish it again under the same "
        "key instead of failing",
    )
    p.add_argument(
        "--work-dir",
        type=nonempty_path,
        default=None,
        help="where remote checkpoints are downloaded, into WORK/<key>/ (removed after "
        "publishing; default: ROOT/.work)",
    )
    limit_argument(
        p,
        "--prune-keep",
        PRUNE_KEEP,
        type=int,
        default=None,
        metavar="N",
        help="after success, run `model-loader prune --keep N` on ROOT, the key just published "
        "in use (default: no pruning)",
    )
    limit_argument(
        p,
        "--retry-deadline",
        RETRY_DEADLINE_S,
        metavar="SECONDS",
        help="longest time to keep retrying a failing source, and to wait on one network read",
    )
    limit_argument(
        p,
        "--workers",
        WORKERS,
        type=int,
        help="parallel download and conversion workers (default: chosen per source)",
    )
    p.add_argument(
        "--no-verify-checksums",
        dest="verify_checksums",
        action="store_false",
        help="check an existing repository's file sizes only, not their digests",
    )
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="download the whole checkpoint before converting it (by default a gs:// or "
        "hf:// source of sharded safetensors converts while it downloads)",
    )
    p.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default="quick",
        help="how an existing repository is verified: quick (default) re-hashes only the files "
        "changed since they were written; full re-hashes every file, and every file of a local "
        "source",
    )
    limit_argument(
        p,
        "--lock-expiry-s",
        LOCK_EXPIRY_S,
        help="a publish lock without heartbeat for this long is taken over",
    )
    limit_argument(
        p,
        "--lock-timeout-s",
        LOCK_TIMEOUT_S,
        help="give up waiting for another loader after this long",
    )
    p.set_defaults(func=main, writes_below="--repository (and --work-dir)")


def main(args: argparse.Namespace) -> int:
    result = run(request_from_args(args))
    print_path(result.path)
    return 0


def request_from_args(args: argparse.Namespace) -> RunRequest:
    """The :class:`RunRequest` that ``model-loader run`` builds from its parsed flags."""
    if not args.dynamic_batching and args.preferred_batch_size:
        raise LoaderError(
            "--preferred-batch-size has no effect with --no-dynamic-batching",
            "Drop --preferred-batch-size, or drop --no-dynamic-batching to batch requests.",
        )
    return RunRequest(
        source=args.source,
        repository=args.repository,
        model_name=args.model_name,
        parallelism=Parallelism(args.tp_size, args.pp_size, args.instance_count),
        settings=ServingSettings(
            backend=args.backend,
            dtype=args.dtype or "auto",
            max_batch_size=args.max_batch_size,
            dynamic_batching=args.dynamic_batching,
            preferred_batch_sizes=tuple(args.preferred_batch_size),
            max_queue_delay_us=args.max_queue_delay_us,
            streaming=args.streaming,
        ),
        revision=args.revision,
        gpus_per_replica=args.gpus_per_replica,
        gpu_memory_gib=args.gpu_memory_gib,
        force=args.force,
        work_dir=args.work_dir,
        workers=args.workers,
        verify_checksums=args.verify_checksums,
        verify=args.verify,
        overlap=args.overlap,
        lock_expiry_s=args.lock_expiry_s,
        lock_timeout_s=args.lock_timeout_s,
        follow_source=args.follow_source,
        retry_deadline_s=args.retry_deadline,
        prune_keep=args.prune_keep,
    )
