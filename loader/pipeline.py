"""``model-loader run``: fetch -> check -> convert -> write the repository -> publish.

:func:`run` publishes one model repository under ``ROOT/<key>`` (see
:mod:`loader.repository.key`) and returns where it is. The steps, in order:

1. compute the key and check the FasterTransformer placement rules that need no model
   (nothing written yet);
2. if ``ROOT/<key>`` is complete and verified and its source still holds what it was built
   from (the source fingerprint in its manifest, :mod:`loader.sources.fingerprint`): nothing to
   do (unless ``force``). A source that changed under a published key is a
   :class:`~loader.errors.SourceChangedError`, unless ``follow_source`` asks to publish it again;
3. take the key's publish lock (other loaders of the same key wait; see
   :mod:`loader.repository.lock`) and check again: the loader we waited for may have published;
4. fetch the checkpoint (remote sources into ``WORK/<key>/source``, ``WORK`` being
   ``--work-dir`` or ``ROOT/.work``), read its ``config.json``, check the layer split, the GPU
   memory (with ``gpu_memory_gib``) and the tokenizer: still nothing written into ``ROOT`` but
   the lock;
5. convert the weights straight into a staging directory (written once; free space is checked
   for everything the repository holds), write the model directories, ``manifest.json`` and
   finally ``.ready``;
6. rename the staging directory to ``ROOT/<key>`` (atomic), remove the download directory
   ``WORK/<key>`` (only that, and only if this loader created it).

A gs:// or hf:// source of sharded safetensors (on the same file system as ``ROOT``) converts
while it downloads (steps 4 and 5 overlap, :mod:`loader.convert.overlap`): the small files are
fetched and checked first, then each output file is written into ``WORK/<key>/converted`` as
soon as the shards it reads are verified, and each shard is deleted once nothing left reads it;
the finished directory moves into the staging directory. A killed run's successor keeps the
outputs already written and downloads only the shards still needed. ``overlap=False`` (``run
--no-overlap``) downloads everything first.

A loader killed at any point leaves ``ROOT/<key>`` absent or complete; the next run removes the
leftover staging directory, takes over the dead loader's lock and completes. A loader whose
lock was taken over (it stalled past the expiry) stops with a
:class:`~loader.errors.LockLostError` before publishing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loader import __version__
from loader.errors import (
    InsufficientDiskSpaceError,
    LockLostError,
    RepositoryError,
    SourceChangedError,
    TransientSourceError,
)
from loader.formats.fastertransformer import check_head_size
from loader.formats.huggingface import config_dtype
from loader.parallel import Parallelism
from loader.plan import ModelShape, Topology, check_memory, check_placement, estimate_memory
from loader.repository import layout, manifest, publish
from loader.repository.config import RepositorySpec
from loader.repository.key import ServingSettings, key_filename, model_key, resolve_revision
from loader.repository.lock import PublishLock
from loader.sources.fingerprint import Fingerprint, describe_changes

if TYPE_CHECKING:
    from loader.convert.pipeline import ConvertResult
    from loader.sources import FetchResult

log = logging.getLogger(__name__)

WORK_DIR = publish.WORK_DIR
DOWNLOAD_MARKER = publish.DOWNLOAD_MARKER
#: Shortest --lock-expiry-s accepted: shorter ones take over loaders that merely paused.
MIN_LOCK_EXPIRY_S = 1.0
#: Ways of verifying a published key (see :attr:`RunRequest.verify`).
VERIFY_MODES = ("quick", "full")


@dataclass(frozen=True)
class RunRequest:
    """What ``model-loader run`` was asked to do (see ``model-loader run --help``)."""

    source: str
    repository: Path
    model_name: str
    parallelism: Parallelism
    settings: ServingSettings
    revision: str | None = None
    gpus_per_replica: int | None = None
    gpu_memory_gib: float | None = None
    force: bool = False
    work_dir: Path | None = None
    workers: int | None = None
    verify_checksums: bool = True
    #: How a published key is verified before "nothing to do": "quick" re-hashes only files
    #: whose seal changed since they were written (:func:`loader.repository.manifest.verify`),
    #: "full" re-hashes every file.
    verify: str = "quick"
    lock_expiry_s: float = 120.0
    lock_timeout_s: float = 6 * 3600.0
    follow_source: bool = False
    retry_deadline_s: float = 300.0
    prune_keep: int | None = None
    overlap: bool = True

    def __post_init__(self) -> None:
        checks = (
            (
                self.lock_expiry_s >= MIN_LOCK_EXPIRY_S,
                f"--lock-expiry-s must be at least {MIN_LOCK_EXPIRY_S:g} s, got "
                f"{self.lock_expiry_s:g}: a waiting loader would take over a live holder's lock.",
                "Pass --lock-expiry-s longer than any pause of a loader (default 120).",
            ),
            (
                self.lock_timeout_s >= 0,
                f"--lock-timeout-s must not be negative, got {self.lock_timeout_s:g}.",
                "Pass --lock-timeout-s 0 or more (default 21600, six hours).",
            ),
            (
                self.retry_deadline_s > 0,
                f"--retry-deadline must be positive, got {self.retry_deadline_s:g}.",
                "Pass --retry-deadline in seconds (default 300).",
            ),
            (
                self.prune_keep is None or self.prune_keep >= 1,
                f"--prune-keep must be at least 1, got {self.prune_keep}.",
                "Pass --prune-keep 1 or more (2 also keeps the key a rollout leaves).",
            ),
            (
                self.verify in VERIFY_MODES,
                f"--verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}.",
                "Pass --verify quick (the default) or --verify full (re-hash every file).",
            ),
            (
                self.workers is None or self.workers >= 1,
                f"--workers must be at least 1, got {self.workers}.",
                "Pass --workers 1 or more, or leave it out.",
            ),
        )
        for ok, message, hint in checks:
            if not ok:
                raise RepositoryError(message, hint)

    @property
    def topology(self) -> Topology:
        gpus = self.gpus_per_replica
        return Topology(
            gpus_per_replica=self.parallelism.gpus_per_instance if gpus is None else gpus
        )

    @property
    def key(self) -> str:
        """The model key this request publishes under (:func:`loader.repository.key.model_key`)."""
        return model_key(
            self.model_name, self.source, self.parallelism, self.settings, revision=self.revision
        )


@dataclass(frozen=True)
class RunResult:
    path: Path
    key: str
    published: bool  # False: an identical, verified repository was already there
    seconds: float


def _complete(target: Path, key: str, request: RunRequest) -> bool:
    if not target.exists():
        return False
    problems = manifest.verify(
        target,
        key=key,
        checksums=request.verify_checksums,
        workers=request.workers,
        quick=request.verify == "quick",
    )
    if problems:
        log.warning(
            "%s exists but is not a complete repository (%s); publishing it again",
            target,
            "; ".join(problems[:3]),
        )
        return False
    return True


def _up_to_date(target: Path, key: str, request: RunRequest) -> bool:
    """Whether ``target`` is complete and its source still holds what it was built from."""
    from loader.sources import fingerprint

    if not _complete(target, key, request):
        return False
    recorded = Fingerprint.from_dict(
        (manifest.read_manifest(target) or {}).get(manifest.SOURCE_FINGERPRINT)
    )
    if recorded is None:
        log.warning(
            "%s records no source fingerprint (an older loader published it): whether %s "
            "changed since cannot be told; --force publishes it again",
            target,
            request.source,
        )
        return True
    current = fingerprint(
        request.source,
        recorded=recorded,
        workers=request.workers,
        retry_deadline_s=request.retry_deadline_s,
    )
    changes = recorded.changes(current)
    if not changes:
        return True
    if request.follow_source:
        log.warning(
            "the source %s changed since %s was published (%s); following it "
            "(--follow-source): publishing it again",
            request.source,
            target,
            describe_changes(changes),
        )
        return False
    raise SourceChangedError(
        f"The source {request.source} no longer holds what {target} was built from: "
        f"{describe_changes(changes)}. That key keeps serving the old weights."
    )


def _check_model(request: RunRequest, hf_config: dict) -> None:
    """The head size, placement rules that need the model, the hyper-parameters the converter
    reads, and the GPU-memory check."""
    from loader.convert.registry import get_architecture

    shape = ModelShape.from_hf_config(hf_config)
    check_head_size(
        shape.size_per_head, where=f"config.json (n_embd {shape.n_embd} / n_head {shape.n_head})"
    )
    check_placement(request.parallelism, request.topology, n_layer=shape.n_layer)
    request.parallelism.split(shape.n_head, "The attention head count")
    request.parallelism.split(shape.n_inner, "The MLP width (n_inner)")
    get_architecture(hf_config.get("model_type")).ft_config(
        hf_config, parallelism=request.parallelism, weight_data_type="fp32", model_name="check"
    )
    if request.gpu_memory_gib is None:
        return
    dtype = request.settings.dtype
    estimate = estimate_memory(
        shape,
        request.parallelism,
        dtype=config_dtype(hf_config) if dtype == "auto" else dtype,
        max_batch_size=request.settings.max_batch_size,
        gpus_per_replica=request.topology.gpus_per_replica,
    )
    check_memory(estimate, request.gpu_memory_gib)
    log.info(
        "memory per GPU: about %.1f GiB of %g GiB", estimate.total / 2**30, request.gpu_memory_gib
    )


def _check_checkpoint(request: RunRequest, checkpoint: Path) -> list[Path]:
    """Everything about the checkpoint that can be checked before converting; returns its
    tokenizer files."""
    from loader.checkpoint import read_hf_config

    _check_model(request, read_hf_config(checkpoint))
    return layout.tokenizer_files(checkpoint)


#: Bytes a repository holds besides the weights and tokenizer copies (configs, the Python
#: models, the manifest), with room to spare.
REPOSITORY_EXTRA_BYTES = 16 * 2**20


def _besides_weights(tokenizer: list[Path]) -> int:
    """Bytes the repository holds besides the converted weights: two tokenizer copies and the
    rest (:data:`REPOSITORY_EXTRA_BYTES`)."""
    return 2 * sum(p.stat().st_size for p in tokenizer) + REPOSITORY_EXTRA_BYTES


def _build(
    request: RunRequest,
    key: str,
    root: Path,
    checkpoint: Path,
    fetched_revision: str | None,
    tokenizer: list[Path],
    source_fingerprint: Fingerprint,
    preconverted: ConvertResult | None = None,
) -> Path:
    """Convert and write the whole repository into a new staging directory (or move the
    ``preconverted`` weights there); returns it."""
    from loader.convert import convert_checkpoint
    from loader.convert.overlap import JOURNAL

    staging = publish.new_staging_dir(root, key)
    log.info("staging the repository in %s", staging)
    try:
        par, settings = request.parallelism, request.settings
        if preconverted is not None:
            final = layout.weights_dir(staging) / preconverted.output_path.name
            final.parent.mkdir(parents=True, exist_ok=True)
            os.rename(preconverted.output_path, final)
            (final / JOURNAL).unlink()  # the resume record of the conversion, not served
            converted = dataclasses.replace(preconverted, output_path=final)
        else:
            converted = convert_checkpoint(
                checkpoint,
                layout.weights_dir(staging),
                tp_size=par.tp,
                pp_size=par.pp,
                dtype=None if settings.dtype == "auto" else settings.dtype,
                workers=request.workers,
                reserve_bytes=_besides_weights(tokenizer),
            )
        spec = RepositorySpec(
            name=request.model_name,
            parallelism=par,
            settings=settings,
            data_type=str(converted.dtype),
            end_id=converted.config.end_id,
            start_id=converted.config.start_id,
        )
        layout.write_models(staging, spec, tokenizer=tokenizer)
        meta = {
            "key": key,
            "model_name": request.model_name,
            "source": request.source,
            "revision": resolve_revision(request.source, request.revision),
            "source_revision": fetched_revision,
            manifest.SOURCE_FINGERPRINT: source_fingerprint.as_dict(),
            "parallelism": {"tp": par.tp, "pp": par.pp, "instance_count": par.instance_count},
            "settings": settings.as_dict(),
            "data_type": spec.data_type,
            "weights": Path(converted.output_path).relative_to(staging).as_posix(),
            "loader_version": __version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        weights = Path(converted.output_path).relative_to(staging).as_posix()
        known = {f"{weights}/{name}": sized for name, sized in converted.digests.items()}
        manifest.write_manifest(
            staging,
            manifest.build_manifest(staging, meta, workers=request.workers, known=known),
        )
        manifest.write_ready(staging, key)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientDiskSpaceError(
                f"The repository root {root} ran out of space while writing {key} "
                f"({exc.strerror}); the staging copy was removed."
            ) from exc
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


#: Source schemes whose fetch delivers files one by one (:class:`~loader.sources.ArrivalHooks`).
OVERLAP_SCHEMES = frozenset({"gs", "hf"})


def _can_overlap(request: RunRequest, root: Path, download: Path) -> bool:
    from loader.sources import parse_uri

    return (
        request.overlap
        and parse_uri(request.source).scheme in OVERLAP_SCHEMES
        and download.stat().st_dev == root.stat().st_dev
    )


def _fetch_overlapped(
    request: RunRequest, root: Path, download: Path
) -> tuple[FetchResult, ConvertResult | None]:
    """Fetch the small files, check them, then fetch the shards converting each output as
    soon as its shards are here (:mod:`loader.convert.overlap`); returns the fetch and the
    converted weights (None: not sharded safetensors, converted after the download)."""
    from loader.convert import overlap
    from loader.convert.overlap import OverlappedConversion, is_weight_file, plan_overlap
    from loader.convert.pipeline import ConvertResult
    from loader.progress import byte_progress
    from loader.sources import ArrivalHooks, fetch
    from loader.sources.transfer import ensure_disk_space

    started = time.monotonic()
    source = download / "source"
    options = {"workers": request.workers, "retry_deadline_s": request.retry_deadline_s}
    first = fetch(
        request.source,
        source,
        hooks=ArrivalHooks(include=lambda rel: not is_weight_file(rel)),
        **options,  # type: ignore[arg-type]
    )
    tokenizer = _check_checkpoint(request, source)
    par, dtype = request.parallelism, request.settings.dtype
    plan = plan_overlap(source, tp=par.tp, pp=par.pp, dtype=None if dtype == "auto" else dtype)
    if plan is None:
        log.info("%s is not sharded safetensors: converting after the download", request.source)
        return fetch(request.source, source, **options), None  # type: ignore[arg-type]
    out_dir = download / "converted" / f"{par.tp}-gpu"
    convert_workers = max(1, request.workers if request.workers else min(os.cpu_count() or 1, 4))
    with (
        byte_progress(f"convert {out_dir.name}", plan.total_bytes) as progress,
        OverlappedConversion(
            plan,
            out_dir,
            revision=first.revision,
            progress=progress,
            workers=convert_workers,
            window=overlap.DEFAULT_WINDOW,
        ) as conversion,
    ):
        left = plan.total_bytes - sum(size for size, _ in conversion.written.values())
        shard_bytes = first.bytes // max(1, len(plan.shards))
        ensure_disk_space(
            root,
            left + (conversion.window + 1) * shard_bytes + _besides_weights(tokenizer),
            what=f"converting {request.source} while it downloads",
        )
        log.info(
            "converting %s while it downloads: %d output file(s) to write, %d of %d shard(s) "
            "to fetch",
            request.source,
            len(plan.outputs) - len(conversion.written),
            len(plan.shards - conversion.skip),
            len(plan.shards),
        )
        fetched = fetch(
            request.source,
            source,
            check_disk_space=False,
            slice_bytes=overlap.SLICE_BYTES,
            hooks=ArrivalHooks(
                skip=conversion.skip,
                arrived=conversion.arrived,
                admit=conversion.admit,
                transient=True,
            ),
            **options,  # type: ignore[arg-type]
        )
        if first.fingerprint and fetched.fingerprint:
            changes = first.fingerprint.changes(fetched.fingerprint)
            if changes:
                raise TransientSourceError(
                    f"The source {request.source} changed while it was loading "
                    f"({describe_changes(changes)}); nothing was published.",
                    "Run the loader again once the upload is complete.",
                )
        digests = conversion.finish()
        peak = conversion.peak_shard_bytes
    log.info("shards held at once: at most %.1f MB", peak / 1e6)
    converted = ConvertResult(
        output_path=out_dir,
        files=tuple(digests),
        bytes_written=sum(size for name, (size, _) in digests.items() if name != "config.ini"),
        seconds=time.monotonic() - started,
        dtype=plan.out_dtype,
        source_dtype=plan.out_dtype,
        config=plan.cfg,
        digests=digests,
    )
    return fetched, converted


def _download_dir(request: RunRequest, root: Path, key: str) -> Path:
    """``WORK/<key as one name>``, marked as created by the loader (see :func:`_remove_download`)."""
    work = Path(request.work_dir).absolute() if request.work_dir else root / WORK_DIR
    path = work / key_filename(key)
    if not path.exists():
        path.mkdir(parents=True)
        (path / DOWNLOAD_MARKER).write_text(f"{key}\n")
    return path


def _remove_download(path: Path, root: Path) -> None:
    """Remove a download directory only if the loader created it; then ``ROOT/.work`` if
    that is left empty. Nothing else under ``--work-dir`` is touched."""
    if not (path / DOWNLOAD_MARKER).is_file():
        log.info("keeping %s: this loader did not create it", path)
        return
    shutil.rmtree(path, ignore_errors=True)
    if path.parent == root / WORK_DIR:
        with contextlib.suppress(OSError):  # other keys' downloads are there
            path.parent.rmdir()


def run(request: RunRequest) -> RunResult:
    """Publish ``request``'s repository (see the module docstring); with ``prune_keep``, then
    prune the root, keeping the key just published (:mod:`loader.repository.prune`)."""
    result = _run(request)
    if request.prune_keep is not None:
        _prune_after(request, result)
    return result


def _prune_after(request: RunRequest, result: RunResult) -> None:
    from loader.repository.prune import prune

    try:
        report = prune(
            Path(request.repository).absolute(),
            keep=request.prune_keep or 1,
            in_use=(result.key,),
            lock_expiry_s=request.lock_expiry_s,
        )
    except (OSError, RepositoryError) as exc:  # the model is published: pruning is a bonus
        log.warning("pruning %s failed: %s", request.repository, exc)
        return
    log.info("pruned %s item(s), %s bytes", len(report.removed), report.bytes)


def _run(request: RunRequest) -> RunResult:
    from loader.sources import fetch, fingerprint, parse_uri

    start = time.monotonic()
    root = Path(request.repository).absolute()
    key = request.key
    check_placement(request.parallelism, request.topology)
    fetched = None
    if parse_uri(request.source).scheme == "file":
        # Local checkpoints are used in place: check them before writing anything.
        fetched = fetch(request.source, None, workers=request.workers)
        _check_checkpoint(request, Path(fetched.path))
    target = publish.published_path(root, key)
    log.info("model key %s", key)
    if not request.force and _up_to_date(target, key, request):
        log.info("%s is already published and verified; nothing to do", target)
        return RunResult(target, key, False, time.monotonic() - start)

    try:
        root.mkdir(parents=True, exist_ok=True)
        writable = os.access(root, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        raise RepositoryError(
            f"Cannot write to the repository root {root}.",
            "Point --repository at a writable directory (the loader mounts the volume "
            "read-write; Triton mounts it read-only).",
        )
    with PublishLock(
        root, key, expiry_s=request.lock_expiry_s, timeout_s=request.lock_timeout_s
    ) as lock:
        if not request.force and _up_to_date(target, key, request):
            log.info("another loader published %s while this one waited; nothing to do", target)
            return RunResult(target, key, False, time.monotonic() - start)
        publish.clear_leftovers(root, key, idle_s=request.lock_expiry_s)
        download = None
        preconverted = None
        try:
            if fetched is None:
                download = _download_dir(request, root, key)
                if _can_overlap(request, root, download):
                    fetched, preconverted = _fetch_overlapped(request, root, download)
                else:
                    fetched = fetch(
                        request.source,
                        download / "source",
                        workers=request.workers,
                        retry_deadline_s=request.retry_deadline_s,
                    )
            source_fingerprint = fetched.fingerprint or fingerprint(
                request.source, workers=request.workers
            )
            tokenizer = _check_checkpoint(request, Path(fetched.path))
            staging = _build(
                request,
                key,
                root,
                Path(fetched.path),
                fetched.revision,
                tokenizer,
                source_fingerprint,
                preconverted,
            )
            try:
                lock.check_held()
                publish.publish(staging, root, key, replace=target.exists())
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        except Exception as exc:
            if not isinstance(exc, LockLostError) and not lock.held():
                raise LockLostError(
                    f"The publish lock of {key} was taken over by another loader while this "
                    f"one worked (it had stalled past --lock-expiry-s {request.lock_expiry_s:g}); "
                    f"it stopped without publishing ({type(exc).__name__})."
                ) from exc
            raise
        if download is not None:
            _remove_download(download, root)
    seconds = time.monotonic() - start
    log.info("published %s in %.1f s", target, seconds)
    return RunResult(target, key, True, seconds)
