"""The conversion plan: decided once, before any tensor data is read, and followed by both ways
of converting.

:func:`plan_conversion` takes what a checkpoint shows first, ``config.json`` and the list of
its tensors with the file holding each (an :class:`Inventory`: the index of a sharded
checkpoint, or the header of its single weight file), and decides everything that needs no
tensor data:

* the FasterTransformer hyper-parameters (the architecture's ``ft_config``: T and P against the
  model's dimensions);
* the tensors the checkpoint must hold (none missing, none unexpected) and the shape of each;
* the output dtype: ``dtype`` when one is asked for; else the dtype ``config.json`` declares
  (``torch_dtype``, or ``dtype`` since transformers 5), as transformers' ``torch_dtype="auto"``
  reads it; else, for a ``config.json`` that declares none, the dtype most of the weights'
  bytes are stored in, known once the headers are read (:meth:`ConversionPlan.resolve`);
* every output file and the weight files each one reads.

Each weight file is then checked against the plan when it is opened
(:meth:`ConversionPlan.check_file`): every tensor where the inventory places it, with the
shape ``config.json`` implies and a floating-point dtype. The sequential conversion
(:mod:`loader.convert.sequential`) opens every file before writing; the overlapped one
(:mod:`loader.convert.overlapped`) each file as it arrives. So one checkpoint gives both the
same files or the same error.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loader.checkpoint import Inventory, TensorInfo
from loader.errors import CheckpointError, DtypeError, some_names
from loader.formats.fastertransformer import FTConfig
from loader.formats.huggingface import declared_dtype
from loader.parallel import Parallelism

from .dtypes import OUTPUT_DTYPES, SOURCE_DTYPES, output_dtype_name
from .registry import Architecture, get_architecture
from .splits import OutputFile

log = logging.getLogger(__name__)

CONFIG_INI = "config.ini"
#: Longest model_name written to config.ini.
MODEL_NAME_MAX = 128

#: The remediation of a checkpoint whose parts do not match each other.
_USE_ITS_OWN_CONFIG = (
    "config.json does not match the weights; use the checkpoint's own config.json."
)


# --- the plan --------------------------------------------------------------------------------


def model_name(config: Mapping[str, Any], directory: Path) -> str:
    """The ``model_name`` written to config.ini: the checkpoint's name, reduced to letters,
    digits, ``.``, ``_`` and ``-`` (config.json is input: nothing else of it reaches the file)."""
    for candidate in (
        str(config.get("_name_or_path") or "").rstrip("/").split("/")[-1],
        Path(directory).resolve().name,
        str(config.get("model_type") or ""),
    ):
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", candidate).strip("-.")[:MODEL_NAME_MAX]
        if name:
            return name
    return "gptj"


@dataclass(frozen=True)
class ConversionPlan:
    """What a conversion writes and what it reads (see the module docstring)."""

    arch: Architecture
    #: The ``[gptj]`` hyper-parameters written to config.ini (``weight_data_type`` is the
    #: output dtype once it is known).
    config: FTConfig
    parallelism: Parallelism
    inventory: Inventory
    #: tensor name -> the shape config.json implies
    expected: Mapping[str, tuple[int, ...]]
    outputs: tuple[OutputFile, ...]
    #: The dtype the files are written in; None until the stored dtypes decide it.
    out_dtype: str | None
    #: The dtype the checkpoint is taken to be stored in (declared, or most of its bytes);
    #: None while neither is known.
    source_dtype: str | None
    #: output file name -> the weight files it reads
    needs: Mapping[str, frozenset[str]]

    @property
    def np_dtype(self) -> np.dtype:
        if self.out_dtype is None:
            raise RuntimeError("the output dtype is decided by the stored dtypes: resolve() first")
        return OUTPUT_DTYPES[self.out_dtype]

    @property
    def total_bytes(self) -> int:
        """Bytes of every output file but config.ini."""
        return sum(out.nbytes(self.np_dtype.itemsize) for out in self.outputs)

    @property
    def output_dir_name(self) -> str:
        """``<T>-gpu``: the directory FasterTransformer reads for tensor-parallel size T."""
        return f"{self.parallelism.tp}-gpu"

    def config_ini(self) -> bytes:
        return self.config.to_ini().encode("utf-8")

    # --- each weight file, when it is opened ---------------------------------------------------

    def check_file(self, name: str, infos: Mapping[str, TensorInfo]) -> None:
        """Check the tensors of the weight file ``name`` against the plan: each one where the
        inventory places it (a tensor that is not a weight may be anywhere), with the shape
        config.json implies and a floating-point dtype."""
        self.inventory.check_placement(name, infos, unlisted=self.arch.is_ignored)
        placement = self.inventory.placement
        for tensor, shape in self.expected.items():
            if placement[tensor] != name:
                continue
            info = infos[tensor]
            if info.shape != shape:
                raise CheckpointError(
                    f"Tensor {tensor} in {name} has shape {list(info.shape)}, but config.json "
                    f"implies {list(shape)}.",
                    _USE_ITS_OWN_CONFIG,
                )
            if info.dtype not in SOURCE_DTYPES:
                raise DtypeError(
                    f"Tensor {tensor} in {name} is stored as {info.dtype}; weights must be "
                    f"{', '.join(SOURCE_DTYPES)}.",
                    "Use a floating-point checkpoint (fp16, bf16 or fp32).",
                )

    def resolve(self, stored: Mapping[str, TensorInfo]) -> ConversionPlan:
        """The plan with its output dtype decided by the stored dtypes of the expected tensors
        (every weight file checked): the dtype most of their bytes are in. A plan whose dtype
        was asked for or declared stays as it is."""
        by_dtype: dict[str, int] = {}
        for name in self.expected:
            info = stored[name]
            by_dtype[info.dtype] = by_dtype.get(info.dtype, 0) + info.nbytes
        most = max(by_dtype, key=by_dtype.__getitem__)
        if len(by_dtype) > 1:
            log.info("the checkpoint mixes %s; most of it is %s", sorted(by_dtype), most)
        if self.out_dtype is not None:
            if self.source_dtype is None:  # a dtype asked for, none declared
                return dataclasses.replace(self, source_dtype=most)
            if most != self.source_dtype:
                log.warning(
                    "config.json declares %s weights but most are stored in %s; writing %s",
                    self.source_dtype,
                    most,
                    self.out_dtype,
                )
            return self
        out_dtype = output_dtype_name(None, most)
        return dataclasses.replace(
            self,
            config=dataclasses.replace(self.config, weight_data_type=out_dtype),
            out_dtype=out_dtype,
            source_dtype=most,
        )


def plan_conversion(
    config: Mapping[str, Any],
    inventory: Inventory,
    *,
    parallelism: Parallelism,
    dtype: str | None = None,
) -> ConversionPlan:
    """The plan for converting the checkpoint of ``config`` and ``inventory`` for
    ``parallelism`` (see the module docstring). ``dtype`` None keeps the source dtype;
    ``fp16``/``fp32`` (or an alias) casts."""
    requested = None if dtype is None else output_dtype_name(dtype, "fp32")
    arch = get_architecture(config.get("model_type"))
    cfg = arch.ft_config(
        config,
        parallelism=parallelism,
        model_name=model_name(config, inventory.directory),
    )
    placement, where = inventory.placement, inventory.listing
    if cfg.num_layer > len(placement):
        # Each layer has tensors: bound the work before listing the ones expected.
        raise CheckpointError(
            f"config.json n_layer {cfg.num_layer} exceeds the {len(placement)} tensors "
            f"{where} lists.",
            _USE_ITS_OWN_CONFIG,
        )
    tied = arch.ties_embeddings(dict(config), placement)
    expected = arch.expected_tensors(cfg, tied=tied)
    missing = [name for name in expected if name not in placement]
    if missing:
        raise CheckpointError(
            f"{where} lacks {len(missing)} tensor(s) a {arch.model_type} model with this "
            f"config.json needs: {some_names(missing)}.",
            "The checkpoint is incomplete or config.json does not match its weights; use a "
            "complete checkpoint with its own config.json.",
        )
    unexpected = [n for n in placement if n not in expected and not arch.is_ignored(n)]
    if unexpected:
        raise CheckpointError(
            f"{where} lists {len(unexpected)} tensor(s) a {arch.model_type} model does not "
            f"have: {some_names(unexpected)}.",
            f"Check that config.json's model_type ({arch.model_type}) and layer count match "
            "the weights.",
        )
    source_dtype = declared_dtype(config)
    out_dtype = requested or (
        None if source_dtype is None else output_dtype_name(None, source_dtype)
    )
    if out_dtype is not None:
        cfg = dataclasses.replace(cfg, weight_data_type=out_dtype)
    outputs = tuple(arch.outputs(cfg, tp=parallelism.tp, tied=tied))
    needs = {out.name: frozenset(placement[s] for s in out.sources) for out in outputs}
    return ConversionPlan(
        arch, cfg, parallelism, inventory, expected, outputs, out_dtype, source_dtype, needs
    )


# --- what a conversion wrote -----------------------------------------------------------------


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote: ``output_path`` (``<T>-gpu``) holds config.ini and every
    output file of ``plan``."""

    output_path: Path
    plan: ConversionPlan
    #: file name inside output_path -> (size, digest computed while writing it, or None when
    #: the conversion was asked for none: :mod:`loader.digest`)
    digests: dict[str, tuple[int, str | None]]
    seconds: float
    #: file name inside output_path -> the :data:`~loader.fs.Stamp` of the file its digest is
    #: of, after its last write: one written over since holds other bytes (a rename keeps it)
    stamps: Mapping[str, tuple[int, int, int, int]] = dataclasses.field(default_factory=dict)

    @property
    def files(self) -> tuple[str, ...]:
        """File names inside output_path, config.ini first."""
        return (CONFIG_INI, *(out.name for out in self.plan.outputs))

    @property
    def dtype(self) -> str:
        """weight_data_type of the files: ``fp16`` or ``fp32``."""
        return str(self.plan.out_dtype)

    @property
    def config(self) -> FTConfig:
        """The ``[gptj]`` hyper-parameters written to config.ini."""
        return self.plan.config

    @property
    def bytes_written(self) -> int:
        return sum(size for name, (size, _) in self.digests.items() if name != CONFIG_INI)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / max(self.seconds, 1e-9)

    @classmethod
    def since(
        cls,
        started: float,
        output_path: Path,
        plan: ConversionPlan,
        digests: dict,
        stamps: Mapping[str, tuple[int, int, int, int]] | None = None,
    ) -> ConvertResult:
        return cls(output_path, plan, digests, time.monotonic() - started, dict(stamps or {}))
