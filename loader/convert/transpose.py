"""A cache-friendly transposing copy (with the dtype cast) for the converter's hot loop.

Copying ``S.T`` element by element reads one element per source row; with power-of-two row
lengths every one of those rows falls into the same cache set, so even tiled copies thrash.
:func:`copy_transposed` instead stages ``BLOCK`` source rows at a time: it casts them into a
small buffer whose row stride is one cache line past a page multiple (rows land in different
cache sets), then writes the transposed block out, reading from cache.
"""

from __future__ import annotations

import threading

import numpy as np

from .dtypes import cast_rows

#: Source rows staged per step. At least 500: NumPy releases the GIL for a copy only when its
#: inner loop is that long, and the transposed write-out's inner loop runs over this many.
BLOCK = 512
_LINE, _PAGE = 64, 4096
#: Below this many elements a plain strided copy is as fast.
_STAGED_MIN_ELEMENTS = 4096

_scratch = threading.local()


def _staging(rows: int, cols: int, dtype: np.dtype) -> np.ndarray:
    """This thread's (rows, cols) buffer with a row stride of k * page + one cache line."""
    stride = -(-(cols * dtype.itemsize - _LINE) // _PAGE) * _PAGE + _LINE
    nbytes = rows * stride
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, np.uint8)
        _scratch.buf = buf
    flat = buf[:nbytes].view(dtype)
    return np.lib.stride_tricks.as_strided(
        flat, shape=(rows, cols), strides=(stride, dtype.itemsize), writeable=True
    )


def is_transposed(src: np.ndarray) -> bool:
    """Whether ``src`` is a column-major-ish 2-D view (its rows are strided, columns dense)."""
    return src.ndim == 2 and src.shape[0] > 1 and abs(src.strides[0]) < abs(src.strides[1])


def copy_transposed(dst: np.ndarray, src: np.ndarray, *, source_dtype: str) -> None:
    """``dst[...] = src`` for a transposed 2-D view ``src`` (see the module docstring).

    The cast happens while staging (contiguous rows: NumPy's fast loops, the fp16 -> fp32 table
    gather); the transposed write-out is then a same-dtype copy.
    """
    rows, cols = src.shape
    source = src.T  # (cols, rows): its rows are (nearly) contiguous in memory
    for c0 in range(0, cols, BLOCK):
        count = min(BLOCK, cols - c0)
        stage = _staging(count, rows, dst.dtype)
        cast_rows(stage, source[c0 : c0 + count], source_dtype=source_dtype)
        np.copyto(dst[:, c0 : c0 + count], stage.T)


def copy_into(dst: np.ndarray, src: np.ndarray, *, source_dtype: str) -> None:
    """``dst[...] = src`` with the file cast, choosing the transposing path when it pays."""
    if is_transposed(src) and src.size >= _STAGED_MIN_ELEMENTS:
        copy_transposed(dst, src, source_dtype=source_dtype)
    else:
        cast_rows(dst, src, source_dtype=source_dtype)
