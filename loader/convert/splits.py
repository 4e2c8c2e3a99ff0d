"""Shared splitting helpers: how one FasterTransformer file is cut out of source tensors.

An :class:`OutputFile` is described, not computed: its file name, its shape, and the
:class:`Part` windows of source tensors that fill its columns. The writer asks for any range of
rows (:meth:`OutputFile.blocks`) and gets views or small copies, so a file is produced in
bounded chunks straight from the memory-mapped source and written once.

Part semantics, for output row ``i`` (2-D view of the file: ``rows x columns``)::

    transposed=False:  src[row_offset + i, select]      (1-D sources are viewed as (n, 1))
    transposed=True:   src[select, row_offset + i]

The helpers below encode ``docs/fastertransformer.md`` ("Files") (``np.split`` into equal contiguous
chunks, rank r gets chunk r); architecture modules only name the tensors and pick the helper.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

Selection = slice | np.ndarray


@dataclass(frozen=True, eq=False)
class Part:
    """A window of one source tensor that fills some columns of an output file."""

    source: str
    select: Selection | None = None  # None: the whole axis
    row_offset: int = 0
    transposed: bool = False

    def block(self, src: np.ndarray, start: int, stop: int, *, slot: int = 0) -> np.ndarray:
        """Rows ``start:stop`` of this part (a view whenever ``select`` is a slice). A row
        selection of a transposed part is gathered into this thread's scratch buffer number
        ``slot``, valid until the thread's next gather into the same slot."""
        a = src.reshape(-1, 1) if src.ndim == 1 else src
        rows = slice(self.row_offset + start, self.row_offset + stop)
        select = slice(None) if self.select is None else self.select
        if self.transposed:
            if isinstance(select, np.ndarray):
                return _gather_rows(a[:, rows], select, slot).T
            return a[select, rows].T
        return a[rows, select]


@dataclass(frozen=True, eq=False)
class OutputFile:
    """One ``.bin`` file: its name, shape in the file, and the parts filling its columns."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    sources: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(dict.fromkeys(p.source for p in self.parts)))

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_elements(self) -> int:
        return math.prod(self.shape[1:])

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.shape) * itemsize

    def blocks(self, tensors: dict[str, np.ndarray], start: int, stop: int) -> list[np.ndarray]:
        """The column blocks of rows ``start:stop``, left to right, each (stop-start, cols);
        a gathered block is valid until this thread's next call."""
        return [p.block(tensors[p.source], start, stop, slot=i) for i, p in enumerate(self.parts)]


_gathered = threading.local()


def _runs(index: np.ndarray) -> list[tuple[int, int, int]]:
    """``index`` as runs of consecutive rows: (position in ``index``, first row, length)."""
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(index)]
    return [(s, int(index[s]), e - s) for s, e in zip(starts, ends, strict=True)]


#: A selection in more runs than this is gathered by NumPy's fancy indexing (a temporary copy).
MAX_RUNS = 64


def _gather_rows(a: np.ndarray, index: np.ndarray, slot: int) -> np.ndarray:
    """``a[index]`` (rows of a 2-D view) into this thread's reusable buffer ``slot``, run by
    run of consecutive rows (CodeGen's Q, K, V are 4 runs each): a fresh array per chunk would
    cost a page fault per page, every chunk, and ``np.take`` first copies all of ``a``."""
    runs = _runs(index)
    if len(runs) > MAX_RUNS:
        return a[index]
    shape = (len(index), a.shape[1])
    nbytes = math.prod(shape) * a.itemsize
    buffers = getattr(_gathered, "buffers", None)
    if buffers is None:
        buffers = _gathered.buffers = {}
    buf = buffers.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = buffers[slot] = np.empty(nbytes, np.uint8)
    out = buf[:nbytes].view(a.dtype).reshape(shape)
    for at, first, count in runs:
        np.copyto(out[at : at + count], a[first : first + count])
    return out


def contiguous(index: Sequence[int] | np.ndarray) -> Selection:
    """``index`` as a slice when it is a contiguous ascending run (so blocks stay views)."""
    idx = np.asarray(index)
    if idx.size and np.array_equal(idx, np.arange(idx[0], idx[0] + idx.size)):
        return slice(int(idx[0]), int(idx[0]) + idx.size)
    return idx


def chunk(size: int, tp: int, rank: int) -> slice:
    """Rank ``rank``'s contiguous share of ``size`` split ``tp`` ways (np.split semantics)."""
    part = size // tp
    return slice(rank * part, (rank + 1) * part)


def _suffix(name: str, rank: int | None) -> str:
    return f"{name}.bin" if rank is None else f"{name}.{rank}.bin"


# --- the split rules --------------------------------------------------------------------------


def replicated(name: str, source: str, shape: tuple[int, ...]) -> OutputFile:
    """Copied as is, every rank loads the same file (embeddings, LayerNorms, lm_head, ...)."""
    return OutputFile(_suffix(name, None), shape, (Part(source),))


def column_parallel_weight(
    name: str, source: str, out_features: int, in_features: int, *, tp: int, rank: int
) -> OutputFile:
    """HF Linear weight [out, in] -> transposed [in, out], split on the last axis (out)."""
    cols = chunk(out_features, tp, rank)
    return OutputFile(
        _suffix(name, rank),
        (in_features, cols.stop - cols.start),
        (Part(source, select=cols, transposed=True),),
    )


def row_parallel_weight(
    name: str, source: str, out_features: int, in_features: int, *, tp: int, rank: int
) -> OutputFile:
    """HF Linear weight [out, in] -> transposed [in, out], split on axis 0 (in)."""
    rows = chunk(in_features, tp, rank)
    return OutputFile(
        _suffix(name, rank),
        (rows.stop - rows.start, out_features),
        (Part(source, row_offset=rows.start, transposed=True),),
    )


def split_vector(name: str, source: str, size: int, *, tp: int, rank: int) -> OutputFile:
    """A bias of a column-parallel layer: rank r's contiguous chunk."""
    rows = chunk(size, tp, rank)
    return OutputFile(
        _suffix(name, rank), (rows.stop - rows.start,), (Part(source, row_offset=rows.start),)
    )


@dataclass(frozen=True, eq=False)
class RowsOf:
    """A logical [h_out, h_in] projection stored as rows ``rows`` of a source tensor."""

    source: str
    rows: np.ndarray | None = None  # None: all rows, in order

    def select(self, wanted: slice) -> Selection:
        if self.rows is None:
            return wanted
        return contiguous(self.rows[wanted])


def fused_qkv(
    name: str, q: RowsOf, k: RowsOf, v: RowsOf, hidden: int, *, tp: int, rank: int
) -> OutputFile:
    """Q, K, V [h_out, h_in] -> stack [3, h_out, h_in] -> permute [h_in, 3, h_out] -> split last axis.

    Rank r's file is [h_in, 3, h/tp]: for each of q|k|v the same output columns (heads).
    """
    cols = chunk(hidden, tp, rank)
    parts = tuple(Part(m.source, select=m.select(cols), transposed=True) for m in (q, k, v))
    return OutputFile(_suffix(name, rank), (hidden, 3, cols.stop - cols.start), parts)
