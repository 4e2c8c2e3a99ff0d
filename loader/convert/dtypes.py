"""Output dtypes of FasterTransformer weight files and the element-wise casts into them.

Casts follow the reference converters exactly: NumPy ``astype`` (round to nearest, ties to
even, the same as torch ``.half()``) for fp32 -> fp16, and exact widening for fp16 -> fp32.
bfloat16 sources (stored as ``uint16`` bits) are widened exactly to fp32 first.
"""

from __future__ import annotations

import functools

import numpy as np

from loader.errors import DtypeError

#: ``--dtype`` value (and ``weight_data_type`` in config.ini) -> NumPy dtype of the files.
OUTPUT_DTYPES: dict[str, np.dtype] = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2")}

_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16"}

#: Source dtypes a checkpoint may hold its weights in.
SOURCE_DTYPES = ("fp32", "fp16", "bf16")


def output_dtype_name(requested: str | None, source: str) -> str:
    """The file dtype: ``requested`` (``fp16``/``fp32`` or an alias), else the source's."""
    if requested is None:
        if source not in OUTPUT_DTYPES:
            raise DtypeError(
                f"The checkpoint is stored in {source}, which FasterTransformer files are not "
                "written in by default.",
                "Pass --dtype fp16 or --dtype fp32.",
            )
        return source
    name = _ALIASES.get(requested.lower(), requested.lower())
    if name not in OUTPUT_DTYPES:
        raise DtypeError(f"Unknown dtype {requested!r}; supported: {', '.join(OUTPUT_DTYPES)}.")
    return name


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """Exact bfloat16 -> float32 widening of ``uint16`` bit patterns."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@functools.cache
def _fp16_to_fp32_table() -> np.ndarray:
    """float32 value of every float16 bit pattern, made by NumPy's own cast (so identical)."""
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def cast_rows(dst: np.ndarray, src: np.ndarray, *, source_dtype: str) -> None:
    """Element-wise ``dst[...] = src`` with the reference converters' cast.

    fp16 -> fp32 goes through a 65536-entry table (a gather is faster than NumPy's scalar
    float16 conversion and gives the very same bits); bf16 bits are widened exactly.
    """
    if source_dtype == "bf16":
        np.copyto(dst, bf16_bits_to_fp32(src), casting="unsafe")
    elif src.dtype == np.float16 and dst.dtype == np.float32:
        np.take(_fp16_to_fp32_table(), src.view(np.uint16), out=dst, mode="wrap")
    else:
        np.copyto(dst, src, casting="unsafe")
