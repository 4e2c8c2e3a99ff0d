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
import re
from dataclasses import dataclass
from pathlib import Path

from loader.errors import CheckpointError

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
        return config


def _format(value: object) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _parse(type_name: object, raw: str) -> object:
    kind = {"int": int, "float": float, "str": str}[str(type_name)]
    return kind(raw.strip())
