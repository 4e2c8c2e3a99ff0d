"""FasterTransformer's GPT-J format: ``config.ini``, the limits of its kernels, its constants.

Upstream FasterTransformer (v5.1+, Triton backend v1.2+) reads the model hyper-parameters of a
GPT-J checkpoint from ``<T>-gpu/config.ini`` (``docs/fastertransformer.md``). :class:`FTConfig`
is its ``[gptj]`` section; :meth:`FTConfig.to_ini` writes it (the converter) and
:meth:`FTConfig.from_ini` reads it back (the CPU reference model). The constants below are the
facts of FasterTransformer's C++ that the converter, the planner and the CPU reference share;
each names the upstream file it comes from. Depends on the standard library and
:mod:`loader.errors` only (the module is copied into CPU-reference repositories).
"""

from __future__ import annotations

import configparser
import dataclasses
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from loader.errors import CheckpointError, ParallelismError

SECTION = "gptj"

#: Head sizes the generation-time attention kernel has a case for (FasterTransformer
#: ``src/fastertransformer/kernels/decoder_masked_multihead_attention.cu``,
#: ``multihead_attention_``: a ``switch (params.hidden_size_per_head)``). Any other head size
#: hits the default branch, an assert compiled out of release builds: the model loads and
#: generates garbage.
SUPPORTED_HEAD_SIZES: tuple[int, ...] = (32, 48, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256)

#: GPT-J's LayerNorm epsilon inside FasterTransformer: a constant
#: (``src/fastertransformer/models/gptj/GptJ.h``: ``layernorm_eps_ = 1e-6f``), not read from
#: ``config.ini`` and not the checkpoint's ``layer_norm_epsilon`` (1e-5 for GPT-J and CodeGen).
LAYERNORM_EPS = 1e-6

#: The largest checkpoint ``layer_norm_epsilon`` FasterTransformer's fixed one stands in for. A
#: LayerNorm divides by ``sqrt(variance + epsilon)``: with 1e-6 in place of an epsilon up to
#: 1e-4 a normalised value of unit variance changes by less than 5e-5 of itself, about a tenth
#: of fp16's rounding error (2**-11); a larger epsilon is another model (1e-2 changes it by
#: 0.5 %, in every LayerNorm of every layer).
LAYERNORM_EPS_MOST = 1e-4

#: Hugging Face's GPT-J and CodeGen ``layer_norm_epsilon`` when config.json has none.
HF_LAYERNORM_EPS = 1e-5


class UnsupportedHeadSizeError(CheckpointError):
    """The model's attention head size has no FasterTransformer generation kernel."""

    def __init__(self, head_size: int, *, where: str = "the checkpoint") -> None:
        supported = ", ".join(str(n) for n in SUPPORTED_HEAD_SIZES)
        super().__init__(
            f"{where} has attention heads of size {head_size} (n_embd / n_head); "
            f"FasterTransformer's generation kernel supports only head sizes {supported}, and "
            "any other size produces garbage without an error",
            "Serve a model whose n_embd / n_head is one of those sizes (every published GPT-J "
            "and CodeGen model is); a model of your own needs n_head chosen accordingly.",
        )
        self.head_size = head_size


def check_head_size(head_size: int, *, where: str = "the checkpoint") -> None:
    """Raise :class:`UnsupportedHeadSizeError` unless FasterTransformer can generate with it."""
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise UnsupportedHeadSizeError(head_size, where=where)


#: The largest value of a C ``int``: FasterTransformer computes the sizes of its weight buffers
#: and most kernel indices in ``int``.
INT32_MAX = 2**31 - 1

#: Elements one thread of the attention kernels rotates at once, by the kernel's head-size
#: bucket (the head size rounded up to a power of two, ``Dh_MAX``), for fp16 and bf16, the
#: widest: ``kernels/decoder_masked_multihead_attention/decoder_masked_multihead_attention_template.hpp``,
#: ``Qk_vec_m_`` (fp32 uses at most as many). ``apply_rotary_embedding``
#: (``kernels/decoder_masked_multihead_attention_utils.h``) rotates a whole vector once its first
#: element is below ``rotary_embedding_dim``, so a rotary dimension that is not a multiple of the
#: width also rotates the dimensions after it, with frequencies the model was never trained with.
ROTARY_VECTOR_WIDTH: dict[int, int] = {32: 2, 64: 2, 128: 4, 256: 8}

#: The smallest per-rank MLP width the GELU kernel can launch for in fp16
#: (``kernels/activation_kernels.cu``, ``invokeGenericActivation``: ``block.x = n / 4 / 2``,
#: zero threads below 8).
MIN_INTER_PER_RANK = 8

#: The smallest vocabulary the logits kernel can launch for in fp32 (the same
#: ``invokeGenericActivation``, ``block.x = vocab_size_padded / 4``).
MIN_VOCAB_SIZE = 4


class UnloadableConfigError(CheckpointError):
    """A hyper-parameter FasterTransformer's GPT-J would fail on or compute garbage with."""


class UnloadableParallelismError(ParallelismError):
    """A tensor-parallel size that leaves FasterTransformer a per-rank width it cannot handle."""


def rotary_vector_width(size_per_head: int) -> int:
    """The width of :data:`ROTARY_VECTOR_WIDTH` for a head size (its power-of-two bucket)."""
    bucket = 1 << max(size_per_head - 1, 1).bit_length()
    return ROTARY_VECTOR_WIDTH.get(max(bucket, 32), ROTARY_VECTOR_WIDTH[256])


def _f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (a C ``float``)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def padded_vocab_size(vocab_size: int, tp: int, *, half: bool) -> int:
    """``vocab_size_padded_`` as FasterTransformer computes it, in float arithmetic
    (``models/gptj/GptJ.cc``, the ``GptJ`` constructor: ``ceil(vocab_size_ / 1.f / T)``, then
    rounded up to a multiple of 8 for ``half``, times T). A float holds whole numbers exactly
    only up to 2**24, so a larger vocabulary can come out smaller than it is."""
    local = math.ceil(_f32(_f32(float(vocab_size)) / float(tp)))
    if half:
        local = math.ceil(_f32(float(local)) / 8.0) * 8
    return local * tp


def check_loadable(config: FTConfig, *, where: str, tp: int | None = None) -> None:
    """Refuse hyper-parameters FasterTransformer's GPT-J loads but cannot compute with, or fails
    on, for tensor-parallel size ``tp`` (``config.tensor_para_size`` when None). ``where`` names
    the source of the numbers in the message (``config.json`` or a ``config.ini`` path).

    Each check names the upstream code it follows; ``docs/fastertransformer.md`` ("What the
    loader refuses before converting") lists them."""
    tp = config.tensor_para_size if tp is None else tp
    # GptJTritonModel.cc: INIReader::GetInteger returns a long, stored in `int` (the ids) and
    # `size_t` members and passed on as `int` (GptJWeight's sizes): outside 0..INT32_MAX a
    # value is truncated or, negative, becomes a huge size.
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, int) and not 0 <= value <= INT32_MAX:
            raise UnloadableConfigError(
                f"{where}: {field.name} = {value} is outside the 32-bit integer range "
                f"FasterTransformer reads it into (0 to {INT32_MAX}).",
                "Use the checkpoint's original config.json.",
            )
    sizes = {
        name: getattr(config, name)
        for name in ("head_num", "size_per_head", "inter_size", "num_layer", "vocab_size")
    }
    for name, value in {**sizes, "tensor_para_size": tp}.items():
        if value < 1:
            raise UnloadableConfigError(
                f"{where}: {name} is {value}; FasterTransformer needs at least 1.", _FIX
            )
    hidden = config.hidden_size
    # GptJWeight.cc (GptJWeight::mallocWeights, loadModel) and GptJDecoderLayerWeight.cc
    # (mallocWeights, loadModel) hold the sizes in `int` and multiply them before the cast to
    # size_t: a product beyond INT32_MAX wraps, and the buffer and the bytes read are wrong.
    for what, product in (
        ("vocab_size x hidden size (the embedding table)", config.vocab_size * hidden),
        ("3 x hidden size x hidden size (a layer's QKV weight)", 3 * hidden * hidden),
        ("hidden size x inter_size (a layer's MLP weight)", hidden * config.inter_size),
    ):
        if product > INT32_MAX:
            raise UnloadableConfigError(
                f"{where}: {what} is {product}, beyond the 32-bit int FasterTransformer "
                f"computes its weight buffers' sizes in (at most {INT32_MAX}); the buffers "
                "would be allocated and filled with a wrapped size.",
                "Such a model cannot be served by FasterTransformer's GPT-J; use a smaller "
                "n_embd, n_inner or vocab_size.",
            )
    rotary, width = config.rotary_embedding, rotary_vector_width(config.size_per_head)
    # decoder_masked_multihead_attention_template.hpp and unfused_attention_kernels.cu
    # (add_fusedQKV_bias_transpose_kernel) rotate vectors of `width` elements while
    # `width * tidx < rotary_embedding_dim`; beyond the head the rotary dimension changes
    # every frequency (rotary_embedding_coefficient divides by it).
    if rotary < 0 or rotary > config.size_per_head or rotary % width:
        raise UnloadableConfigError(
            f"{where}: the rotary dimension {rotary} is not one FasterTransformer applies as "
            f"the model does: it must be between 0 and the head size {config.size_per_head} "
            f"and a multiple of {width}, the width its attention kernels rotate at once for "
            "this head size.",
            f"Use a checkpoint whose rotary_dim is a multiple of {width} up to "
            f"{config.size_per_head} (every published GPT-J and CodeGen model's is).",
        )
    if config.vocab_size < MIN_VOCAB_SIZE:
        raise UnloadableConfigError(
            f"{where}: vocab_size {config.vocab_size} is below {MIN_VOCAB_SIZE}, the smallest "
            "vocabulary FasterTransformer's logits kernel launches for.",
            "Use the checkpoint's original config.json.",
        )
    for half in (False, True):
        padded = padded_vocab_size(config.vocab_size, tp, half=half)
        if padded < config.vocab_size:
            raise UnloadableConfigError(
                f"{where}: vocab_size {config.vocab_size} pads to {padded} rows in "
                f"FasterTransformer's float arithmetic (GptJ.cc, vocab_size_padded_) at "
                f"tensor-parallel size {tp}, fewer than it has: the output embedding would be "
                "copied past its buffer.",
                "Such a vocabulary cannot be served by FasterTransformer's GPT-J (a float "
                "holds whole numbers exactly only up to 16777216).",
            )

    # activation_kernels.cu, invokeAddBiasGeluV2 and invokeGenericActivation: fp16 works on
    # pairs (n / 2: an odd width leaves its last column without bias and GELU) and launches
    # n / 4 / 2 threads per block (none below 8).
    def activates(width: int) -> bool:
        return width % 2 == 0 and width >= MIN_INTER_PER_RANK

    if not activates(config.inter_size):
        raise UnloadableConfigError(
            f"{where}: inter_size {config.inter_size} is not a width FasterTransformer's fp16 "
            f"GELU kernel handles (an even number, at least {MIN_INTER_PER_RANK}).",
            "Such a model cannot be served by FasterTransformer's GPT-J.",
        )
    local_inter = config.inter_size // tp
    if not activates(local_inter):
        fits = [
            t
            for t in range(1, min(tp, 64))
            if config.head_num % t == 0
            and config.inter_size % t == 0
            and activates(config.inter_size // t)
        ]
        raise UnloadableParallelismError(
            f"{where}: inter_size {config.inter_size} split {tp} ways leaves each rank "
            f"{local_inter} MLP columns; FasterTransformer's fp16 GELU kernel needs an even "
            f"number, at least {MIN_INTER_PER_RANK}.",
            f"Choose a smaller --tp-size: {', '.join(map(str, fits))}.",
        )


def check_token_ids(config: FTConfig) -> None:
    """``start_id`` and ``end_id`` (config.json's ``bos_token_id`` and ``eos_token_id``) are
    tokens of the vocabulary: FasterTransformer's GPT-J takes config.ini's ``end_id`` for a
    request that sends none (``models/gptj/GptJ.cc``, ``forward``: ``handleOptArg``) and looks
    each step's ids up in its embedding table, a finished row's ``end_id`` too
    (``invokeEmbeddingLookupPosEncodingPadCount``), which an id beyond it reads past. Not a
    check of :func:`check_loadable`: the CPU reference emulates such an id where it reads
    ``config.ini``."""
    for name in ("start_id", "end_id"):
        value = getattr(config, name)
        if value >= config.vocab_size:
            source = "eos_token_id" if name == "end_id" else "bos_token_id"
            raise CheckpointError(
                f"config.json's {source} gives {name} = {value}, not a token of the model's "
                f"vocabulary (vocab_size {config.vocab_size}).",
                f"Fix {source} in config.json (an id below vocab_size), or use the "
                "checkpoint's original config.json.",
            )


#: Keys FasterTransformer itself requires (it exits when one is missing).
REQUIRED_KEYS = (
    "model_name", "head_num", "size_per_head", "inter_size", "num_layer", "rotary_embedding",
    "vocab_size", "start_id", "end_id", "weight_data_type",
)  # fmt: skip

WEIGHT_DATA_TYPES = ("fp32", "fp16")

#: What a value of config.ini may hold: one word of a number or a name, nothing that could end
#: the line, open a section or start a comment.
_SAFE_VALUE = re.compile(r"[A-Za-z0-9._+-]+")


_FIX = "Convert the checkpoint again with `model-loader convert` (it writes a complete config.ini)."


def _error(message: str) -> CheckpointError:
    return CheckpointError(message, _FIX)


@dataclass(frozen=True)
class FTConfig:
    """FasterTransformer GPT-J hyper-parameters (``[gptj]`` of ``config.ini``)."""

    head_num: int
    size_per_head: int
    inter_size: int
    num_layer: int
    rotary_embedding: int
    vocab_size: int
    start_id: int
    end_id: int
    tensor_para_size: int = 1
    weight_data_type: str = "fp32"
    model_name: str = "gptj"
    max_pos_seq_len: int = 2048

    @property
    def hidden_size(self) -> int:
        return self.head_num * self.size_per_head

    def to_ini(self) -> str:
        """The text of ``config.ini`` (section ``[gptj]``, keys in FasterTransformer's order)."""
        names = [f.name for f in dataclasses.fields(self)]
        ordered = [*REQUIRED_KEYS, *(n for n in names if n not in REQUIRED_KEYS)]
        lines = [f"[{SECTION}]"]
        for name in ordered:
            value = _format(getattr(self, name))
            if not _SAFE_VALUE.fullmatch(value):
                raise CheckpointError(
                    f"config.ini value {name} = {value[:60]!r} holds characters an ini file "
                    "cannot carry safely (a line break, a section, a comment).",
                    "Fix the value in config.json (letters, digits, '.', '_', '-', '+' only).",
                )
            lines.append(f"{name} = {value}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_ini(cls, path: Path | str) -> FTConfig:
        """Read ``config.ini`` (a file, or a ``<T>-gpu`` directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.ini"
        parser = configparser.ConfigParser(interpolation=None)
        try:
            with path.open(encoding="utf-8") as fh:
                parser.read_file(fh)
        except FileNotFoundError as exc:
            raise _error(f"{path} does not exist") from exc
        except configparser.Error as exc:
            raise _error(f"{path} is not a valid ini file: {exc}") from exc
        if not parser.has_section(SECTION):
            raise _error(f"{path} has no [{SECTION}] section")
        section = parser[SECTION]
        missing = [k for k in REQUIRED_KEYS if k not in section]
        if missing:
            raise _error(f"{path} [{SECTION}] lacks {', '.join(missing)}")
        values = {}
        for field in dataclasses.fields(cls):
            if field.name not in section:
                continue
            raw = section[field.name]
            try:
                values[field.name] = _parse(field.type, raw)
            except ValueError as exc:
                raise _error(
                    f"{path} [{SECTION}] {field.name} = {raw!r} is not a valid {field.type}"
                ) from exc
        config = cls(**values)
        if config.weight_data_type not in WEIGHT_DATA_TYPES:
            raise _error(
                f"{path} weight_data_type {config.weight_data_type!r} is not one of "
                f"{', '.join(WEIGHT_DATA_TYPES)}"
            )
        check_loadable(config, where=str(path))
        return config


def _format(value: object) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


#: An integer as FasterTransformer reads it and Python reads it alike: ``INIReader::GetInteger``
#: (``3rdparty/INIReader.h``) is ``strtol(value, &end, 0)``, which reads ``010`` as octal 8,
#: ``0x10`` as 16 and ``1_0`` as 1, where ``int()`` reads 10, refuses, and reads 10.
_DECIMAL = re.compile(r"[+-]?(0|[1-9][0-9]*)")


def _parse(type_name: object, raw: str) -> object:
    kind = {"int": int, "float": float, "str": str}[str(type_name)]
    value = raw.strip()
    if kind is int and not _DECIMAL.fullmatch(value):
        raise ValueError(f"{value!r} is not a plain decimal integer")
    return kind(value)
