"""``model-loader run``: fetch -> check -> convert -> write the repository -> publish.

:func:`run` publishes one model repository under ``ROOT/<key>`` (see
:mod:`loader.repository.key`) and returns where it is. The steps, in order:

1. compute the key and check the FasterTransformer placement rules that need no model
   (nothing written yet);
2. if ``ROOT/<key>`` is complete and verified: nothing to do (unless ``force``);
3. take the key's publish lock (other loaders of the same key wait; see
   :mod:`loader.repository.lock`) and check again: the loader we waited for may have published;
4. fetch the checkpoint, read its ``config.json``, check the layer split, the GPU memory (with
   ``gpu_memory_gib``) and the tokenizer: still nothing written into ``ROOT`` but the lock;
5. convert the weights straight into a staging directory (written once), write the model
   directories, ``manifest.json`` and finally ``.ready``;
6. rename the staging directory to ``ROOT/<key>`` (atomic), remove the downloaded copy.

A loader killed at any point leaves ``ROOT/<key>`` absent or complete; the next run removes the
leftover staging directory, takes over the dead loader's lock and completes.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from loader import __version__
from loader.errors import RepositoryError
from loader.parallel import Parallelism
from loader.plan import ModelShape, Topology, check_memory, check_placement, estimate_memory
from loader.repository import layout, manifest, publish
from loader.repository.config import RepositorySpec
from loader.repository.key import ServingSettings, key_filename, model_key, resolve_revision
from loader.repository.lock import PublishLock

log = logging.getLogger(__name__)

WORK_DIR = ".work"
#: ``torch_dtype`` / ``dtype`` of config.json -> the dtype FT files keep by default.
_HF_DTYPES = {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16"}


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
    lock_expiry_s: float = 120.0
    lock_timeout_s: float = 6 * 3600.0

    @property
    def topology(self) -> Topology:
        return Topology(
            gpus_per_replica=self.gpus_per_replica or self.parallelism.gpus_per_instance
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
        target, key=key, checksums=request.verify_checksums, workers=request.workers
    )
    if problems:
        log.warning(
            "%s exists but is not a complete repository (%s); publishing it again",
            target,
            "; ".join(problems[:3]),
        )
        return False
    return True


def _source_dtype(hf_config: dict) -> str:
    name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    return _HF_DTYPES.get(name, name)


def _check_model(request: RunRequest, hf_config: dict) -> None:
    """Placement rules that need the model, and the GPU-memory check."""
    shape = ModelShape.from_hf_config(hf_config)
    check_placement(request.parallelism, request.topology, n_layer=shape.n_layer)
    request.parallelism.split(shape.n_head, "The attention head count")
    request.parallelism.split(shape.n_inner, "The MLP width (n_inner)")
    if request.gpu_memory_gib is None:
        return
    dtype = request.settings.dtype
    estimate = estimate_memory(
        shape,
        request.parallelism,
        dtype=_source_dtype(hf_config) if dtype == "auto" else dtype,
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


def _build(
    request: RunRequest,
    key: str,
    root: Path,
    checkpoint: Path,
    fetched_revision: str | None,
    tokenizer: list[Path],
) -> Path:
    """Convert and write the whole repository into a new staging directory; returns it."""
    from loader.convert import convert_checkpoint

    staging = publish.new_staging_dir(root, key)
    log.info("staging the repository in %s", staging)
    try:
        par, settings = request.parallelism, request.settings
        converted = convert_checkpoint(
            checkpoint,
            layout.weights_dir(staging),
            tp_size=par.tp,
            pp_size=par.pp,
            dtype=None if settings.dtype == "auto" else settings.dtype,
            workers=request.workers,
        )
        spec = RepositorySpec(
            name=request.model_name,
            parallelism=par,
            settings=settings,
            data_type=str(converted.dtype),
            end_id=converted.config.end_id,
        )
        layout.write_models(staging, spec, tokenizer=tokenizer)
        meta = {
            "key": key,
            "model_name": request.model_name,
            "source": request.source,
            "revision": resolve_revision(request.source, request.revision),
            "source_revision": fetched_revision,
            "parallelism": {"tp": par.tp, "pp": par.pp, "instance_count": par.instance_count},
            "settings": settings.as_dict(),
            "data_type": spec.data_type,
            "weights": Path(converted.output_path).relative_to(staging).as_posix(),
            "loader_version": __version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        manifest.write_manifest(
            staging, manifest.build_manifest(staging, meta, workers=request.workers)
        )
        manifest.write_ready(staging, key)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def run(request: RunRequest) -> RunResult:
    """Publish ``request``'s repository (see the module docstring)."""
    from loader.sources import fetch, parse_uri

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
    if not request.force and _complete(target, key, request):
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
        if not request.force and _complete(target, key, request):
            log.info("another loader published %s while this one waited; nothing to do", target)
            return RunResult(target, key, False, time.monotonic() - start)
        publish.clear_staging(root, key)
        work = Path(request.work_dir or root / WORK_DIR / key_filename(key)).absolute()
        if fetched is None:
            fetched = fetch(request.source, work / "source", workers=request.workers)
        tokenizer = _check_checkpoint(request, Path(fetched.path))
        staging = _build(request, key, root, Path(fetched.path), fetched.revision, tokenizer)
        try:
            lock.check_held()
            publish.publish(staging, root, key, replace=target.exists())
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if Path(fetched.path).absolute().is_relative_to(work):
            shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - start
    log.info("published %s in %.1f s", target, seconds)
    return RunResult(target, key, True, seconds)
