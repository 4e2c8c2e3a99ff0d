"""``convert_checkpoint``: a Hugging Face checkpoint directory -> ``OUTPUT_DIR/<T>-gpu/``.

Everything that can be wrong with the input is checked before anything is written: config.json,
the architecture, T and P against the model's dimensions, the requested dtype, every shard's
header, the set of tensors (none missing, none unexpected) and their shapes, and free disk space.
Then the files are written in one streaming pass (see :mod:`loader.convert.writer`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loader.checkpoint import Checkpoint, open_checkpoint, read_hf_config
from loader.errors import (
    CheckpointError,
    DtypeError,
    InsufficientDiskSpaceError,
    OutputExistsError,
    OutputPathError,
)
from loader.formats.fastertransformer import FTConfig
from loader.parallel import Parallelism
from loader.progress import byte_progress, human_bytes

from .dtypes import OUTPUT_DTYPES, SOURCE_DTYPES, output_dtype_name
from .registry import Architecture, get_architecture
from .writer import DEFAULT_CHUNK_BYTES, atomic_directory, write_outputs

log = logging.getLogger(__name__)

CONFIG_INI = "config.ini"
#: Longest model_name written to config.ini.
MODEL_NAME_MAX = 128
_LIST_AT_MOST = 6


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote."""

    output_path: Path  # OUTPUT_DIR/<T>-gpu
    files: tuple[str, ...]  # file names inside output_path, config.ini first
    bytes_written: int
    seconds: float
    dtype: str  # weight_data_type of the files: "fp16" or "fp32"
    source_dtype: str
    config: FTConfig  # the [gptj] hyper-parameters written to config.ini
    #: file name inside output_path -> (size, sha256), computed while writing
    digests: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / max(self.seconds, 1e-9)


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_AT_MOST])
    more = len(names) - _LIST_AT_MOST
    return shown + (f" and {more} more" if more > 0 else "")


def _check_tensors(
    ckpt: Checkpoint, expected: dict[str, tuple[int, ...]], arch: Architecture
) -> str:
    """Missing / unexpected / misshapen tensors are errors; returns the source dtype."""
    model_type = arch.model_type
    missing = [name for name in expected if name not in ckpt]
    if missing:
        raise CheckpointError(
            f"{ckpt.directory} lacks {len(missing)} tensor(s) a {model_type} model with this "
            f"config.json needs: {_listing(missing)}.",
            "The checkpoint is incomplete or config.json does not match its weights; "
            "download the checkpoint again.",
        )
    unexpected = [n for n in ckpt.names() if n not in expected and not arch.is_ignored(n)]
    if unexpected:
        raise CheckpointError(
            f"{ckpt.directory} holds {len(unexpected)} tensor(s) a {model_type} model does not "
            f"have: {_listing(unexpected)}.",
            f"Check that config.json's model_type ({model_type}) and layer count match the weights.",
        )
    by_dtype: dict[str, int] = {}
    for name, shape in expected.items():
        info = ckpt.tensors[name]
        if info.shape != shape:
            raise CheckpointError(
                f"Tensor {name} in {info.file.name} has shape {list(info.shape)}, but config.json "
                f"implies {list(shape)}.",
                "config.json does not match the weights; use the checkpoint's own config.json.",
            )
        if info.dtype not in SOURCE_DTYPES:
            raise DtypeError(
                f"Tensor {name} in {info.file.name} is stored as {info.dtype}; weights must be "
                f"{', '.join(SOURCE_DTYPES)}.",
                "Use a floating-point checkpoint (fp16, bf16 or fp32).",
            )
        by_dtype[info.dtype] = by_dtype.get(info.dtype, 0) + info.nbytes
    source_dtype = max(by_dtype, key=by_dtype.__getitem__)
    if len(by_dtype) > 1:
        log.info("the checkpoint mixes %s; treating it as %s", sorted(by_dtype), source_dtype)
    return source_dtype


def _check_free_space(directory: Path, needed: int) -> None:
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise InsufficientDiskSpaceError(
            f"Converting needs {human_bytes(needed)} but {probe} has {human_bytes(free)} free."
        )


def _check_output_dir(output_dir: Path) -> None:
    """OUTPUT_DIR must be a directory or creatable as one: an :class:`OutputPathError` naming
    the file in the way otherwise (the write itself maps a read-only file system the same way,
    :func:`~loader.convert.writer.atomic_directory`)."""
    for path in (output_dir, *output_dir.parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                raise OutputPathError(
                    f"Cannot write the converted checkpoint under {output_dir}: {path} is a file, "
                    "not a directory."
                )
            return


def _model_name(hf: dict[str, Any], source_dir: Path) -> str:
    """The ``model_name`` written to config.ini: the checkpoint's name, reduced to letters,
    digits, ``.``, ``_`` and ``-`` (config.json is input: nothing else of it reaches the file)."""
    for candidate in (
        str(hf.get("_name_or_path") or "").rstrip("/").split("/")[-1],
        source_dir.resolve().name,
        str(hf.get("model_type") or ""),
    ):
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", candidate).strip("-.")[:MODEL_NAME_MAX]
        if name:
            return name
    return "gptj"


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
    reserve_bytes: int = 0,
) -> ConvertResult:
    """Convert ``source_dir`` into ``output_dir/<tp_size>-gpu/`` (atomically).

    ``dtype`` None keeps the source dtype; ``"fp16"``/``"fp32"`` cast. ``pp_size`` is only
    checked (FasterTransformer needs n_layer divisible by it; files do not depend on it).
    ``overwrite`` replaces an existing ``<T>-gpu`` (atomically) instead of refusing.
    ``reserve_bytes``: what the caller will write beside the weights on the same disk, counted
    in the free-space check.
    """
    started = time.monotonic()
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    parallelism = Parallelism(tp=tp_size, pp=pp_size)
    if dtype is not None:
        output_dtype_name(dtype, "fp32")  # an unknown --dtype fails before any file is opened
    hf = read_hf_config(source_dir)
    arch = get_architecture(hf.get("model_type"))
    cfg = arch.ft_config(
        hf, parallelism=parallelism, weight_data_type="fp32", model_name=_model_name(hf, source_dir)
    )
    final = output_dir / f"{parallelism.tp}-gpu"
    _check_output_dir(output_dir)
    if final.exists() and not overwrite:
        raise OutputExistsError(f"{final} already exists.")
    workers = max(1, workers if workers is not None else min(os.cpu_count() or 1, 4))

    with open_checkpoint(source_dir) as ckpt:
        if cfg.num_layer > len(ckpt.tensors):
            # Each layer has tensors: bound the work before listing the ones expected.
            raise CheckpointError(
                f"config.json n_layer {cfg.num_layer} exceeds the {len(ckpt.tensors)} tensors "
                f"{ckpt.directory} holds.",
                "config.json does not match the weights; use the checkpoint's own config.json.",
            )
        source_dtype = _check_tensors(ckpt, arch.expected_tensors(cfg), arch)
        out_dtype = output_dtype_name(dtype, source_dtype)
        cfg = dataclasses.replace(cfg, weight_data_type=out_dtype)
        np_dtype = OUTPUT_DTYPES[out_dtype]
        outputs = arch.outputs(cfg, tp=parallelism.tp)
        total = sum(out.nbytes(np_dtype.itemsize) for out in outputs)
        _check_free_space(output_dir, total + reserve_bytes)
        log.info(
            "converting %s (%s, %s, %d layers) to %s: T=%d, %s -> %s, %d files, %s",
            source_dir, arch.model_type, source_dtype, cfg.num_layer, final, parallelism.tp,
            source_dtype, out_dtype, len(outputs) + 1, human_bytes(total),
        )  # fmt: skip
        with atomic_directory(final, overwrite=overwrite) as tmp:
            ini = cfg.to_ini().encode("utf-8")
            (tmp / CONFIG_INI).write_bytes(ini)
            with byte_progress(f"convert {final.name}", total) as progress:
                digests = write_outputs(
                    outputs, ckpt, tmp, dtype=np_dtype, progress=progress, workers=workers,
                    chunk_bytes=chunk_bytes,
                )  # fmt: skip
            written = sum(size for size, _ in digests.values())
            digests[CONFIG_INI] = (len(ini), hashlib.sha256(ini).hexdigest())
    seconds = time.monotonic() - started
    result = ConvertResult(
        output_path=final,
        files=(CONFIG_INI, *(out.name for out in outputs)),
        bytes_written=written,
        seconds=seconds,
        dtype=out_dtype,
        source_dtype=source_dtype,
        config=cfg,
        digests=digests,
    )
    log.info(
        "wrote %d files, %s in %.1f s (%.0f MB/s) to %s",
        len(result.files), human_bytes(written), seconds, result.mb_per_s, final,
    )  # fmt: skip
    return result
