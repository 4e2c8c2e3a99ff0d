"""The shard writer: every output file written once, in bounded chunks, into a temp directory
that is renamed into place only when everything succeeded.

* :func:`atomic_directory` creates ``.<name>.partial-<pid>-<random>`` beside the final directory,
  yields it, and renames it to the final name at the end; on any failure (or interrupt) it is
  removed, so Triton can never load a half-written ``<T>-gpu``. It opens the parent once and
  yields the temp directory open: every step after, and every output, is a descriptor and one
  name (:class:`loader.fs.Dir`), never a path. A run killed with SIGKILL leaves
  its ``.partial`` directory (never a ``<T>-gpu``); the next run names it in a warning.
* :func:`write_outputs` writes :class:`~loader.convert.splits.OutputFile` s with a small thread
  pool (the transposes, casts and writes release the GIL). Each job holds at most one chunk
  buffer (``chunk_bytes``) plus, for CodeGen's row selections, the gathered blocks of one chunk
  (each thread reuses its buffers: fresh pages cost a fault each), so the anonymous memory in
  flight is about ``workers x 2 x chunk_bytes`` whatever the model size:
  the source tensors are memory-mapped views, not copies. A file that is a plain run of source
  bytes (a replicated tensor kept in its dtype, from safetensors) is copied by the kernel with
  ``copy_file_range``, like ``cp`` does.
* No output holds a NaN or an infinity (FasterTransformer would load it and generate garbage):
  each chunk is checked where its bytes already pass through Python (the buffer a cast or a
  transpose filled, the view written as it is); a file the kernel copies is read once for the
  check (its pages are then in the page cache the copy reads). The tensor is named (exit 2).
* Where the caller needs the files' digests (``model-loader run``: the manifest lists them),
  each file's digest (:mod:`loader.digest`) is computed from the very buffers handed to
  ``write``, so the manifest needs no second pass over the weights; such a file is never
  copied by the kernel, whose bytes the hash would have to read again. ``model-loader
  convert`` publishes no manifest and computes no digest.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

from loader import digest as digests
from loader import fs, ledger, stages
from loader.checkpoint import NUMPY_DTYPES, Checkpoint
from loader.errors import (
    CheckpointError,
    DtypeError,
    NotOursError,
    OutputExistsError,
    SourceShrankError,
    shown,
    some_names,
)
from loader.fs import Dir
from loader.progress import Progress
from loader.waits import wait_in_steps

from .plan import CONFIG_INI
from .splits import OutputFile
from .transpose import copy_into

log = logging.getLogger(__name__)

#: Output bytes produced per step of one file.
DEFAULT_CHUNK_BYTES = 16 * 2**20
#: Writers when none are asked for: the CPUs, at most this many (more only queue on the disk).
MAX_DEFAULT_WORKERS = 4


def default_workers(workers: int | None) -> int:
    """``workers`` writer threads, or the default (:data:`MAX_DEFAULT_WORKERS`) when None."""
    return max(1, workers if workers is not None else min(os.cpu_count() or 1, MAX_DEFAULT_WORKERS))


#: errno values meaning "copy_file_range cannot do this here" (old kernel, filesystem).
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}


class _Stopped(Exception):
    """Another job failed or the run was interrupted; stop writing."""


def _leftovers(parent: Dir, name: str) -> list[Path]:
    names = parent.names()
    return [
        parent.path / n
        for prefix in (f".{name}.partial-", f".{name}.old-")
        for n in names
        if n.startswith(prefix)
    ]


def not_replaceable(parent: Dir, name: str) -> str | None:
    """Why ``--force`` may not replace ``parent/name`` (None: it may): only a directory that
    holds nothing but what a conversion writes (``config.ini`` and ``*.bin`` regular files)
    is replaced; a link, a file, or a directory holding anything else was not made by a
    conversion and is the user's."""
    kind = parent.kind(name)
    if kind != "a directory":
        return kind
    with parent.sub(name) as d:
        for entry in d.names():
            found = d.kind(entry)
            if found not in (None, "a file"):
                return f"a directory holding {found} ({shown(entry)})"
            if entry != CONFIG_INI and not entry.endswith(".bin"):
                return f"a directory holding a file no conversion writes ({shown(entry)})"
    return None


def _put_in_place(parent: Dir, tmp: str, final: Path, token: str, *, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``final`` (replacing it, atomically, with ``overwrite``,
    if it holds only a conversion's files): names in ``parent``, the directory holding both."""
    name = final.name
    if parent.lstat(name) is not None:
        if not overwrite:
            raise OutputExistsError(f"{final} already exists.")
        why = not_replaceable(parent, name)
        if why is not None:
            raise NotOursError(final, why, "a converted checkpoint's directory (to replace)")
        old = f".{name}.old-{token}"
        parent.rename(name, parent, old, how="replace")
        try:
            parent.rename(tmp, parent, name, how="replace")
        except BaseException:
            parent.rename(old, parent, name, how="replace")  # put the previous conversion back
            raise
        late = not_replaceable(parent, old)
        if late is not None:  # something else landed in it since it was looked at: kept
            log.warning("keeping %s (the replaced %s): it is %s", parent.path / old, name, late)
            return
        parent.remove_tree(old)
    else:
        try:
            parent.rename(tmp, parent, name, how="noreplace")
        except OSError as exc:  # another run published the same directory meanwhile
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise OutputExistsError(f"{final} was created by another run meanwhile.") from exc
            if exc.errno not in fs.NO_RENAMEAT2:
                raise
            parent.rename(tmp, parent, name, how="replace")


@contextmanager
def atomic_directory(final: Path, *, overwrite: bool = False) -> Iterator[Dir]:
    """Yield a fresh temp dir beside ``final``, open (every output is a name in it); rename it
    to ``final`` when the block succeeds, every file in it given :data:`loader.fs.FILE_MODE`
    whatever the umask (its directory has :data:`loader.fs.DIR_MODE`). ``final``'s parent is opened once (below a
    :func:`~loader.fs.confined` tree one name at a time, never through a link) and every step
    after is that descriptor and one name; which of its levels are missing is looked up the same
    way (:meth:`~loader.fs.Dir.deepest`), and those this run created are removed on failure. A failure to create or fill it is the file system's
    typed error (:func:`loader.errors.typed_os_error`, through the command line's funnel)."""
    final = Path(final).absolute()
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = f".{final.name}.partial-{token}"
    top, missing = Dir.deepest(final.parent)  # this run creates ``missing`` below ``top``
    with top, top.makedirs(missing) as d:
        for stale in _leftovers(d, final.name):
            log.warning(
                "%s was left by an interrupted run; remove it when no loader is running", stale
            )
        try:
            # Made inside the block that removes it: a signal right after it leaves nothing.
            d.mkdir(tmp)
            ledger.note_temporary(d.path / tmp)  # a supervisor removes it should this be killed
            with d.sub(tmp) as out:
                yield out
                for name in out.names():  # FasterTransformer may run as another uid
                    out.chmod(name, fs.FILE_MODE)
            with stages.stage("rename into place"):
                _put_in_place(d, tmp, final, token, overwrite=overwrite)
        except BaseException:
            with suppress(OSError):
                d.remove_tree(tmp)
            for n in range(len(missing), 0, -1):  # innermost first; only those this run made
                try:
                    with top.enter(missing[: n - 1]) as above:
                        above.rmdir(missing[n - 1])
                except OSError:
                    break
            raise


_buffers = threading.local()


def _chunk_buffer(nbytes: int) -> np.ndarray:
    """This thread's reusable scratch buffer (fresh pages cost a fault each; reuse is free)."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, np.uint8)
        _buffers.buf = buf
    return buf[:nbytes]


def write_file(
    out: OutputFile,
    ckpt: Checkpoint,
    directory: Dir,
    *,
    dtype: np.dtype,
    progress: Progress,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    stop: threading.Event | None = None,
    algorithm: str | None = None,
    stamps: dict[str, fs.Stamp] | None = None,
) -> tuple[int, str | None]:
    """Write one output file in row chunks; returns the bytes written and, with an
    ``algorithm`` (:data:`loader.digest.ALGORITHMS`), their digest (None without).
    ``stamps`` gets the :data:`~loader.fs.Stamp` of the descriptor written through, after
    the last write: the file the digest is of (one written over since is not)."""
    tensors = {name: ckpt.get(name) for name in out.sources}
    source_dtypes = [ckpt.tensors[p.source].dtype for p in out.parts]
    row_bytes = max(out.row_elements * dtype.itemsize, 1)
    step = max(1, chunk_bytes // row_bytes)
    narrowing = dtype == np.float16 and any(d != "fp16" for d in source_dtypes)
    written = 0
    digest = None if algorithm is None else digests.new(algorithm)
    path = directory.path / out.name
    with stages.stage("open output"):
        fh = directory.create(out.name)
    with fh:
        span = _byte_span(out, ckpt, dtype) if digest is None else None
        if span is not None:  # bytes the kernel copies unread: read once here for the check
            for start in range(0, out.rows, step):
                (block,) = out.blocks(tensors, start, min(out.rows, start + step))
                _check_finite(block, [block], source_dtypes, out)
        if span is not None and _copy_in_kernel(
            span,
            out.nbytes(dtype.itemsize),
            fh,
            ckpt,
            progress=progress,
            step=chunk_bytes,
            stop=stop,
        ):
            if stamps is not None:
                stamps[out.name] = fs.stamp(os.fstat(fh.fileno()))
            return out.nbytes(dtype.itemsize), None
        for start in range(0, out.rows, step):
            if stop is not None and stop.is_set():
                raise _Stopped
            stop_row = min(out.rows, start + step)
            with stages.stage("split (views)"):
                blocks = out.blocks(tensors, start, stop_row)
            direct = blocks[0]
            if (
                len(blocks) == 1
                and direct.dtype == dtype
                and source_dtypes[0] != "bf16"
                and direct.flags.c_contiguous
            ):
                data = direct  # a view of the memory-mapped source: no copy at all
            else:
                nbytes = (stop_row - start) * row_bytes
                data = _chunk_buffer(nbytes).view(dtype).reshape(stop_row - start, -1)
                col = 0
                with stages.stage("fault-in + cast/transpose", nbytes), np.errstate(over="ignore"):
                    for block, src_dtype in zip(blocks, source_dtypes, strict=True):
                        width = block.shape[1]
                        copy_into(data[:, col : col + width], block, source_dtype=src_dtype)
                        col += width
                if narrowing:
                    _check_in_range(data, blocks, source_dtypes, out)
            _check_finite(data, blocks, source_dtypes, out)
            with stages.stage("write" if data is not direct else "fault-in + write", data.nbytes):
                _write(fh.fileno(), data, path, ckpt)
            if digest is not None:  # the buffer just written, not a copy read back
                with stages.stage("digest", data.nbytes):
                    digest.update(memoryview(data).cast("B"))
            written += data.nbytes
            progress.update(data.nbytes)
            del data, blocks, direct
        if stamps is not None:
            stamps[out.name] = fs.stamp(os.fstat(fh.fileno()))
    return written, None if digest is None else digest.hexdigest()


#: The largest finite fp16 value: a larger fp32 or bf16 weight is infinite once cast.
FP16_MAX = float(np.finfo(np.float16).max)


def _not_finite(values: np.ndarray, source_dtype: str | None = None) -> np.ndarray:
    """Which of ``values`` (fp16 or fp32; ``bf16``: their bits as uint16) are an infinity or
    a NaN: every exponent bit set."""
    if source_dtype == "bf16":
        mask = np.uint16(0x7F80)
        return np.bitwise_and(values, mask) == mask
    return ~np.isfinite(values)


#: The bits of a 2-byte float with every exponent bit set (an infinity or a NaN), the sign
#: aside: fp16's, and bf16's (kept as its raw bits).
_NOT_FINITE_BITS = {"fp16": 0x7C00, "bf16": 0x7F80}

_scratch = threading.local()
#: Elements a 2-byte float check looks at per step: its scratch stays in the CPU's cache.
_CHECK_ELEMENTS = 2**18


def _any_not_finite(values: np.ndarray, source_dtype: str | None = None) -> bool:
    """Whether any of ``values`` (fp32 or fp16; ``bf16``: their bits as uint16) is an
    infinity or a NaN. A 2-byte float is judged by its bits, a few rows at a time in this
    thread's small reusable buffer (NumPy's ``isfinite`` of fp16 is a quarter as fast)."""
    if values.size == 0:
        return False
    kind = "bf16" if source_dtype == "bf16" else "fp16" if values.dtype == np.float16 else None
    if kind is None:
        return not bool(np.isfinite(values).all())
    rows = values.reshape(-1, values.shape[-1]) if values.ndim != 2 else values
    step = max(1, _CHECK_ELEMENTS // max(1, rows.shape[1]))
    need = min(rows.shape[0], step) * rows.shape[1]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < need:
        buf = np.empty(need, np.uint16)
        _scratch.buf = buf
    for start in range(0, rows.shape[0], step):
        part = rows[start : start + step]
        bits = buf[: part.size].reshape(part.shape)
        np.bitwise_and(part.view(np.uint16), np.uint16(0x7FFF), out=bits)
        if int(bits.max()) >= _NOT_FINITE_BITS[kind]:
            return True
    return False


def _check_finite(
    data: np.ndarray, blocks: Sequence[np.ndarray], source_dtypes: Sequence[str], out: OutputFile
) -> None:
    """Refuse a chunk about to be written that holds an infinity or a NaN: FasterTransformer
    loads such a file and every sum through that weight is inf or NaN (it generates garbage).
    The tensor that holds it is named (a chunk cast into fp16 whose weight grew past fp16's
    range was refused before, by :func:`_check_in_range`)."""
    if not _any_not_finite(data):
        return
    held = [
        part.source
        for part, block, dtype in zip(out.parts, blocks, source_dtypes, strict=True)
        if _any_not_finite(block, dtype)
    ]
    names = some_names(sorted(set(held) or set(out.sources)))
    raise CheckpointError(
        f"{names} {'holds' if len(set(held)) <= 1 else 'hold'} a NaN or an infinite weight: "
        f"FasterTransformer would load it ({out.name}) and every sum through it would be NaN "
        "or infinite; the conversion stopped.",
        "The checkpoint's weights are damaged (a training run that diverged, or a broken "
        "export): use another checkpoint or revision, or repair that tensor at the source.",
    )


def _check_in_range(
    data: np.ndarray, blocks: Sequence[np.ndarray], source_dtypes: Sequence[str], out: OutputFile
) -> None:
    """Refuse a chunk cast into fp16 where a weight is an infinity or NaN that its own source
    element was not: a weight beyond fp16's range, which FasterTransformer would load and sum
    into inf and NaN (what a source already held is refused next, by :func:`_check_finite`).
    Element by element: a NaN elsewhere in the same chunk, or the same tensor, excuses no
    other weight: the weight beyond fp16's range is named, with the hint to convert to fp32."""
    if not _not_finite(data).any():
        return
    col, made = 0, False
    for block, dtype in zip(blocks, source_dtypes, strict=True):
        width = block.shape[1]
        made = made or bool(
            (_not_finite(data[:, col : col + width]) & ~_not_finite(block, dtype)).any()
        )
        col += width
    if not made:
        return
    raise DtypeError(
        f"{some_names(sorted(out.sources))} {'holds' if len(out.sources) == 1 else 'hold'} a "
        f"weight beyond fp16's range (at most {FP16_MAX:g} in magnitude): written in fp16 it "
        f"would be infinite, and FasterTransformer's sums through it inf or NaN ({out.name}); "
        "the conversion stopped.",
        "Convert to fp32 (--dtype fp32), whose range holds the checkpoint's weights.",
    )


def _write(fd: int, data: np.ndarray, path: Path, ckpt: Checkpoint) -> None:
    """Write ``data`` (maybe a view of a source's memory map) to ``fd``. The kernel answers
    EFAULT where it cannot read the mapped pages: a source cut short meanwhile, the error that
    names it (transient); any other ``EFAULT`` stays the bug it is."""
    try:
        fs.write_fd(fd, data, path)
    except OSError as exc:
        shrank = ckpt.shrunk() if exc.errno == errno.EFAULT else []
        if shrank:
            raise SourceShrankError(shrank) from exc
        raise


def _byte_span(out: OutputFile, ckpt: Checkpoint, dtype: np.dtype) -> tuple[Path, int, str] | None:
    """(file, offset, tensor) when the output is a plain run of source bytes (same dtype, no
    transpose)."""
    if len(out.parts) != 1:
        return None
    part = out.parts[0]
    info = ckpt.tensors[part.source]
    if part.transposed or part.select is not None or info.dtype == "bf16":
        return None
    if NUMPY_DTYPES[info.dtype] != dtype:
        return None
    span = ckpt.file_span(part.source)
    if span is None:
        return None
    path, offset = span
    return path, offset + part.row_offset * out.row_elements * dtype.itemsize, part.source


def _copy_in_kernel(
    span: tuple[Path, int, str],
    nbytes: int,
    fh,
    ckpt: Checkpoint,
    *,
    progress: Progress,
    step: int,
    stop: threading.Event | None,
) -> bool:
    """Copy ``nbytes`` from ``span`` into ``fh`` with copy_file_range (no user-space copy).

    Returns False, having copied nothing, where the kernel or filesystem cannot do it, or
    where the file at the span's path is no longer the one the tensor is read from (replaced
    since its header was checked: its bytes were copied unchecked; the caller writes from the
    checked file's map instead).
    """
    path, offset, tensor = span
    done = 0
    with fs.open_read(path) as src:
        if not ckpt.reads_from(tensor, os.fstat(src.fileno())):
            return False
        while done < nbytes:
            if stop is not None and stop.is_set():
                raise _Stopped
            try:
                with stages.stage("copy_file_range", min(step, nbytes - done)):
                    n = fs.copy_range(src.fileno(), fh.fileno(), min(step, nbytes - done),
                                      offset + done, path)  # fmt: skip
            except OSError as exc:
                if done == 0 and exc.errno in _NO_COPY_FILE_RANGE:
                    return False
                raise
            if n == 0:  # cut short since its header was checked: the error naming it
                shrank = ckpt.shrunk()
                if shrank:
                    raise SourceShrankError(shrank)
                raise CheckpointError(f"{path} ended early while reading it; was it modified?")
            done += n
            progress.update(n)
    return True


def _largest_first(outputs: Sequence[OutputFile]) -> list[OutputFile]:
    """Longest jobs first, so the workers finish together instead of one writing a big tail."""
    return sorted(outputs, key=lambda out: out.rows * out.row_elements, reverse=True)


def write_outputs(
    outputs: Sequence[OutputFile],
    ckpt: Checkpoint,
    directory: Dir,
    *,
    dtype: np.dtype,
    progress: Progress,
    workers: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    algorithm: str | None = None,
    stamps: dict[str, fs.Stamp] | None = None,
) -> dict[str, tuple[int, str | None]]:
    """Write every output file, ``workers`` at a time, largest first; returns each file's name
    -> (bytes written, its digest with ``algorithm``, else None); ``stamps``: see
    :func:`write_file`."""
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="convert") as pool:
        ordered = _largest_first(outputs)
        futures = [
            pool.submit(
                write_file, out, ckpt, directory, dtype=dtype, progress=progress,
                chunk_bytes=chunk_bytes, stop=stop, algorithm=algorithm, stamps=stamps,
            )
            for out in ordered
        ]  # fmt: skip
        try:
            wait_in_steps(futures)
        except BaseException:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        for future in futures:
            if future.done() and future.exception() is not None:
                stop.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise future.exception()  # type: ignore[misc]
        written = {out.name: f.result() for out, f in zip(ordered, futures, strict=True)}
    return written
