"""The sequential conversion: every weight file is on disk, the outputs are written in one
streaming pass into ``OUTPUT_DIR/<T>-gpu/`` (atomically).

Everything that can be wrong with the input is checked before anything is written: the plan
(:mod:`loader.convert.plan`: config.json, the architecture, T and P against the model's
dimensions, the requested dtype, the set of tensors), then every weight file's header against
it (shapes, dtypes, where each tensor is), and free disk space. Then the files are written
(:mod:`loader.convert.writer`).

:func:`convert_checkpoint` is ``model-loader convert``; :func:`convert_planned` converts by a
plan already made (``model-loader run`` verifies the checkpoint before it takes its lock).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from loader import digest, fs, stages
from loader.checkpoint import Checkpoint, is_regular_file, read_hf_config, read_inventory
from loader.errors import (
    InsufficientDiskSpaceError,
    NotOursError,
    OutputExistsError,
    OutputPathError,
)
from loader.fs import Dir
from loader.limits import WORKERS
from loader.parallel import Parallelism
from loader.progress import byte_progress, human_bytes

from .dtypes import output_dtype_name
from .plan import CONFIG_INI, ConversionPlan, ConvertResult, plan_conversion
from .writer import (
    DEFAULT_CHUNK_BYTES,
    atomic_directory,
    default_workers,
    not_replaceable,
    write_outputs,
)

log = logging.getLogger(__name__)


def _output_level(output_dir: Path) -> tuple[Dir, tuple[str, ...]]:
    """The deepest existing level of OUTPUT_DIR, open, and the names still to create: below a
    confined tree (``run``'s work directory) entered one name at a time, a link on the way a
    :class:`~loader.errors.NotOursError`, never followed. OUTPUT_DIR must be a directory or
    creatable as one: an :class:`OutputPathError` naming the file in the way otherwise (the
    write itself maps a read-only file system the same way,
    :func:`~loader.convert.writer.atomic_directory`)."""
    try:
        return Dir.deepest(output_dir)
    except NotADirectoryError as exc:
        raise OutputPathError(
            f"Cannot write the converted checkpoint under {output_dir}: {exc.filename} is "
            f"{exc.strerror}, not a directory."
        ) from None


def _check_free_space(directory: Path, needed: int) -> None:
    level, _ = _output_level(directory)
    with level:
        found = os.fstatvfs(level.fd)  # the disk of the level found, through its descriptor
    free = found.f_bavail * found.f_frsize
    if free < needed:
        raise InsufficientDiskSpaceError(
            f"Converting needs {human_bytes(needed)} but {level.path} has {human_bytes(free)} free."
        )


def open_planned(
    plan: ConversionPlan, checked: Mapping[str, fs.Stamp] | None = None
) -> tuple[ConversionPlan, Checkpoint]:
    """Open every weight file of ``plan``'s checkpoint, in name order, each checked against the
    plan, then the files missing (as an overlapped conversion finds them: after the others);
    returns the plan with its output dtype decided and the opened checkpoint. ``checked``:
    the stamps of the files a download verified (:attr:`loader.sources.FetchResult.stamps`),
    each of which must be the file opened."""
    inventory = plan.inventory
    ckpt = Checkpoint(inventory.directory)
    try:
        present = [name for name in inventory.files if is_regular_file(inventory.directory / name)]
        for name in present:
            shard = inventory.open(name, checked=(checked or {}).get(name))
            try:
                plan.check_file(name, shard.infos())
                ckpt.add(shard, only=plan.expected)  # what is not read may be anywhere
            except BaseException:
                shard.close()
                raise
        if len(present) < len(inventory.files):
            raise inventory.missing(set(inventory.files) - set(present))
        return plan.resolve(ckpt.tensors), ckpt
    except BaseException:
        ckpt.close()
        raise


def convert_checkpoint(
    source_dir: Path | str,
    output_dir: Path | str,
    *,
    tp_size: int,
    pp_size: int = 1,
    dtype: str | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> ConvertResult:
    """Convert ``source_dir`` into ``output_dir/<tp_size>-gpu/`` (atomically).

    ``dtype`` None keeps the source dtype (see :func:`~loader.convert.plan.plan_conversion`);
    ``"fp16"``/``"fp32"`` cast. ``pp_size`` is only checked (FasterTransformer needs n_layer
    divisible by it; files do not depend on it). ``overwrite`` replaces an existing ``<T>-gpu``
    (atomically) instead of refusing.
    """
    WORKERS.check(workers)
    source_dir = Path(source_dir)
    parallelism = Parallelism(tp=tp_size, pp=pp_size)
    if dtype is not None:
        output_dtype_name(dtype, "fp32")  # an unknown --dtype fails before any file is opened
    config = read_hf_config(source_dir)
    plan = plan_conversion(config, read_inventory(source_dir), parallelism=parallelism, dtype=dtype)
    return convert_planned(
        plan, output_dir, workers=workers, overwrite=overwrite, chunk_bytes=chunk_bytes
    )


def convert_planned(
    plan: ConversionPlan,
    output_dir: Path | str,
    *,
    workers: int | None = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    reserve_bytes: int = 0,
    algorithm: str | None = None,
    checked: Mapping[str, fs.Stamp] | None = None,
) -> ConvertResult:
    """Convert the checkpoint ``plan`` was made for into ``output_dir/<T>-gpu/``.

    ``reserve_bytes``: what the caller will write beside the weights on the same disk, counted
    in the free-space check. ``algorithm``: the digest (:mod:`loader.digest`) to compute of
    every file while writing it (``model-loader run``'s manifest lists them); None computes
    none. ``checked``: see :func:`open_planned`.
    """
    started = time.monotonic()
    output_dir = Path(output_dir)
    final = output_dir / plan.output_dir_name
    level, missing = _output_level(output_dir)
    with level:  # what is at ``final`` is looked at, never followed
        there = None if missing else level.kind(final.name)
        if there == "a symbolic link" and not overwrite:
            raise level.not_ours(final.name, "a converted checkpoint's directory")
        why = None if there is None or not overwrite else not_replaceable(level, final.name)
        if why is not None:  # refused before the work, not after
            raise NotOursError(final, why, "a converted checkpoint's directory (to replace)")
    if there is not None and not overwrite:
        raise OutputExistsError(f"{final} already exists.")
    with stages.stage("open + map + check headers"):
        plan, ckpt = open_planned(plan, checked)
    stamps: dict[str, fs.Stamp] = {}
    with ckpt:
        total = plan.total_bytes
        _check_free_space(output_dir, total + reserve_bytes)
        log.info(
            "converting %s (%s, %s, %d layers) to %s: T=%d, %s -> %s, %d files, %s",
            plan.inventory.directory, plan.arch.model_type, plan.source_dtype,
            plan.config.num_layer, final, plan.parallelism.tp, plan.source_dtype, plan.out_dtype,
            len(plan.outputs) + 1, human_bytes(total),
        )  # fmt: skip
        with atomic_directory(final, overwrite=overwrite) as tmp:
            ini = plan.config_ini()
            stamps[CONFIG_INI] = tmp.write(CONFIG_INI, ini, sync=False)
            with (
                byte_progress(f"convert {final.name}", total) as progress,
                stages.stage("write outputs (all writers, wall of the pool)"),
            ):
                digests = write_outputs(
                    plan.outputs, ckpt, tmp, dtype=plan.np_dtype, progress=progress,
                    workers=default_workers(workers), chunk_bytes=chunk_bytes,
                    algorithm=algorithm, stamps=stamps,
                )  # fmt: skip
            ckpt.as_checked()  # what was read is what was verified: only then kept
            digests[CONFIG_INI] = (len(ini), algorithm and digest.of_bytes(ini, algorithm))
    result = ConvertResult.since(started, final, plan, digests, stamps)
    log.info(
        "wrote %d files, %s in %.1f s (%.0f MB/s) to %s",
        len(result.files), human_bytes(result.bytes_written), result.seconds, result.mb_per_s,
        final,
    )  # fmt: skip
    return result
