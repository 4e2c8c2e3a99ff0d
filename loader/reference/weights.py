"""Read a FasterTransformer GPT-J weight directory (``<T>-gpu/``) into NumPy, upcast to float32.

:func:`load_ft_checkpoint` reads ``config.ini`` and every ``.bin`` file named in
``docs/fastertransformer.md`` ("Files") with ``np.fromfile``; the shapes come from ``config.ini`` (the files are headerless).
A file whose size does not match its shape is an error (FasterTransformer itself would only log a
warning and run with uninitialised memory).

The result keeps the tensor-parallel split: :attr:`FTCheckpoint.ranks` holds, per TP rank, the
per-layer weights that rank owns (replicated tensors are shared between ranks, not copied).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loader.errors import CheckpointError
from loader.formats.fastertransformer import FTConfig

FILE_DTYPES: dict[str, type[np.floating]] = {"fp32": np.float32, "fp16": np.float16}

_FIX = "Convert the checkpoint again with `model-loader convert`; the directory is incomplete."


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as seen by one TP rank (``c`` = local hidden, ``i`` = local inter size)."""

    ln_weight: np.ndarray  # [h]        replicated
    ln_bias: np.ndarray  # [h]          replicated
    qkv: np.ndarray  # [h, 3, c]        column-parallel (heads r*H/T .. (r+1)*H/T-1)
    dense: np.ndarray  # [c, h]         row-parallel (partial sums)
    fc_in_weight: np.ndarray  # [h, i]  column-parallel
    fc_in_bias: np.ndarray  # [i]       column-parallel
    fc_out_weight: np.ndarray  # [i, h] row-parallel (partial sums)
    fc_out_bias: np.ndarray  # [h]      replicated, added once after the sum


@dataclass(frozen=True)
class RankWeights:
    """What TP rank ``rank`` loads: its slice of every layer."""

    rank: int
    layers: tuple[LayerWeights, ...]


@dataclass(frozen=True)
class FTCheckpoint:
    """A whole FT GPT-J checkpoint: ``config``, replicated tensors and per-rank layer weights."""

    path: Path
    config: FTConfig
    wte: np.ndarray  # [V, h]
    final_ln_weight: np.ndarray  # [h]
    final_ln_bias: np.ndarray  # [h]
    lm_head_weight: np.ndarray  # [V, h] (not transposed)
    lm_head_bias: np.ndarray  # [V]
    ranks: tuple[RankWeights, ...]

    @property
    def tensor_para_size(self) -> int:
        return len(self.ranks)


def tensor_para_size_of(ckpt_dir: Path, config: FTConfig) -> int:
    """T from the directory name ``<T>-gpu`` if it has that form, else from ``config.ini``."""
    match = re.fullmatch(r"(\d+)-gpu", ckpt_dir.name)
    tp = int(match.group(1)) if match else config.tensor_para_size
    if match and tp != config.tensor_para_size:
        raise CheckpointError(
            f"{ckpt_dir}: the directory name says tensor_para_size {tp} but config.ini says "
            f"{config.tensor_para_size}.",
            _FIX,
        )
    if tp < 1 or config.head_num % tp or config.inter_size % tp:
        raise CheckpointError(
            f"{ckpt_dir}: tensor_para_size {tp} does not divide head_num {config.head_num} and "
            f"inter_size {config.inter_size}.",
            _FIX,
        )
    return tp


class _Reader:
    def __init__(self, ckpt_dir: Path, config: FTConfig) -> None:
        self.dir = ckpt_dir
        try:
            self.dtype = np.dtype(FILE_DTYPES[config.weight_data_type])
        except KeyError as exc:
            raise CheckpointError(
                f"{ckpt_dir}/config.ini: weight_data_type {config.weight_data_type!r} is not one "
                f"of {', '.join(FILE_DTYPES)}.",
                _FIX,
            ) from exc

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        path = self.dir / name
        expected = int(np.prod(shape)) * self.dtype.itemsize
        try:
            size = path.stat().st_size
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path} is missing.", _FIX) from exc
        if size != expected:
            raise CheckpointError(
                f"{path} has {size} bytes, expected {expected} for shape {list(shape)} "
                f"in {self.dtype.name}.",
                _FIX,
            )
        return np.fromfile(path, dtype=self.dtype).reshape(shape).astype(np.float32)


def load_ft_checkpoint(ckpt_dir: Path | str) -> FTCheckpoint:
    """Load ``<T>-gpu/`` (``config.ini`` + ``.bin`` files) for any T, upcast to float32."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} is not a directory.", _FIX)
    config = FTConfig.from_ini(ckpt_dir)
    tp = tensor_para_size_of(ckpt_dir, config)
    h, inter, vocab = config.hidden_size, config.inter_size, config.vocab_size
    c, i = h // tp, inter // tp
    rd = _Reader(ckpt_dir, config)

    replicated = []
    for layer in range(config.num_layer):
        p = f"model.layers.{layer}."
        replicated.append(
            (
                rd.read(p + "input_layernorm.weight.bin", (h,)),
                rd.read(p + "input_layernorm.bias.bin", (h,)),
                rd.read(p + "mlp.dense_4h_to_h.bias.bin", (h,)),
            )
        )
    ranks = []
    for r in range(tp):
        layers = []
        for layer, (ln_w, ln_b, fc_out_b) in enumerate(replicated):
            p = f"model.layers.{layer}."
            layers.append(
                LayerWeights(
                    ln_weight=ln_w,
                    ln_bias=ln_b,
                    qkv=rd.read(p + f"attention.query_key_value.weight.{r}.bin", (h, 3, c)),
                    dense=rd.read(p + f"attention.dense.weight.{r}.bin", (c, h)),
                    fc_in_weight=rd.read(p + f"mlp.dense_h_to_4h.weight.{r}.bin", (h, i)),
                    fc_in_bias=rd.read(p + f"mlp.dense_h_to_4h.bias.{r}.bin", (i,)),
                    fc_out_weight=rd.read(p + f"mlp.dense_4h_to_h.weight.{r}.bin", (i, h)),
                    fc_out_bias=fc_out_b,
                )
            )
        ranks.append(RankWeights(rank=r, layers=tuple(layers)))
    return FTCheckpoint(
        path=ckpt_dir,
        config=config,
        wte=rd.read("model.wte.bin", (vocab, h)),
        final_ln_weight=rd.read("model.final_layernorm.weight.bin", (h,)),
        final_ln_bias=rd.read("model.final_layernorm.bias.bin", (h,)),
        lm_head_weight=rd.read("model.lm_head.weight.bin", (vocab, h)),
        lm_head_bias=rd.read("model.lm_head.bias.bin", (vocab,)),
        ranks=tuple(ranks),
    )
