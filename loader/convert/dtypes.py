"""Output dtypes of FasterTransformer weight files and the element-wise casts into them.

Casts follow the reference converters exactly: NumPy ``astype`` (round to nearest, ties to
even, the same as torch ``.half()``) for fp32 -> fp16, and exact widening for fp16 -> fp32.
bfloat16 sources (stored as ``uint16`` bits) are widened exactly to fp32 first.
"""

from __future__ import annotations

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


#: Side of the square tiles a transposing copy is done in (keeps the source pages of one tile
#: in the TLB and its cache lines in L1; a plain strided copy touches a new page per element).
TILE = 128


def cast_into(dst: np.ndarray, src: np.ndarray, *, source_dtype: str) -> None:
    """Copy 2-D ``src`` (any strides) into ``dst`` (the output dtype), casting element-wise."""
    transposed = src.ndim == 2 and abs(src.strides[0]) < abs(src.strides[1])
    if not transposed or src.shape[0] <= TILE:
        _copy(dst, src, source_dtype)
        return
    rows, cols = src.shape
    for r0 in range(0, rows, TILE):
        for c0 in range(0, cols, TILE):
            tile = (slice(r0, r0 + TILE), slice(c0, c0 + TILE))
            _copy(dst[tile], src[tile], source_dtype)


def _copy(dst: np.ndarray, src: np.ndarray, source_dtype: str) -> None:
    if source_dtype == "bf16":
        src = bf16_bits_to_fp32(src)
    np.copyto(dst, src, casting="unsafe")
