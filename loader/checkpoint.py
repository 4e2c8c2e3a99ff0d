"""Lazy access to the tensors of a Hugging Face checkpoint directory, one tensor at a time.

A checkpoint directory holds ``config.json`` and its weights in one of these layouts (looked for
in this order; :data:`loader.formats.huggingface.WEIGHT_FILES` names them, :data:`OPENERS` reads them):

* ``model.safetensors.index.json`` + shards, or a single ``model.safetensors``;
* ``pytorch_model.bin.index.json`` + shards, or a single ``pytorch_model.bin``.

:func:`read_inventory` reads which tensors a checkpoint lists and the file holding each (from
the index, before the shards need to be there). :func:`open_checkpoint` validates the layout and
every shard's header up front (a truncated or corrupt shard is a
:class:`~loader.errors.CheckpointError` naming the file) and returns a :class:`Checkpoint` that
knows every tensor's name, dtype and shape without reading any data.
:meth:`Checkpoint.get` then returns one tensor as a NumPy array *viewing a read-only memory map*
of the file: no tensor is copied into anonymous memory, the page cache holds the bytes. For
safetensors the (simple, documented) header is parsed here directly so the view can be
zero-copy; PyTorch files are opened with ``torch.load(mmap=True, weights_only=True)`` (torch is
imported only for them). bfloat16 tensors come back as their ``uint16`` bit patterns, tagged
``"bf16"`` in :attr:`TensorInfo.dtype`.

A checkpoint is only read, by path (:func:`loader.fs.open_read`, :func:`loader.fs.read_file`):
the user's own directory, followed as given (its links too), or one downloaded below ``ROOT`` or
``--work-dir``, which :mod:`loader.fs` walks from its anchor one name at a time, never through
a link. Nothing here writes.
"""

from __future__ import annotations

import bisect
import codecs
import collections
import contextlib
import errno
import io
import json
import logging
import math
import mmap
import os
import pickle
import re
import struct
import threading
import zipfile
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from loader import fs, ledger
from loader.errors import (
    CheckpointError,
    CorruptFileError,
    FileContentError,
    ResourceExhaustedError,
    SourceShrankError,
    TensorDtypeError,
    shown,
    some_names,
)
from loader.formats import jsondoc
from loader.formats.huggingface import CONFIG_FILE, WEIGHT_FILES, WeightFiles

log = logging.getLogger(__name__)


#: Our dtype names -> NumPy storage dtype (bf16 is kept as raw uint16 bits).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "fp32": np.dtype("<f4"),
    "fp16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
    "fp64": np.dtype("<f8"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}

_SAFETENSORS_DTYPES = {
    "F32": "fp32", "F16": "fp16", "BF16": "bf16", "F64": "fp64", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip

_MAX_HEADER = 100 * 2**20
#: The largest safetensors header the loader reads (the format allows 100 MB). A header lists
#: a tensor in about 100 bytes (a 6B GPT-J's: about 30 kB); parsed, it takes up to about 28
#: times its size (an empty list every 3 bytes): 100 MB held about 2.8 GB and most of a minute
#: of CPU, each time a run opened the file.
MAX_READ_HEADER = 16 * 2**20


def safetensors_header(tensors: Iterable[tuple[str, tuple[int, ...]]], dtype: str) -> bytes:
    """The start of a safetensors file holding ``tensors`` (name, shape), all of ``dtype``,
    stored one after another in that order: the header's length, then the header padded to 8
    bytes. The tensors' bytes follow it."""
    names = {ours: theirs for theirs, ours in _SAFETENSORS_DTYPES.items()}
    itemsize = NUMPY_DTYPES[dtype].itemsize
    header, offset = {}, 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        header[name] = {
            "dtype": names[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class TensorInfo:
    """Name, dtype name (``fp16``, ``fp32``, ``bf16``...), shape and file of one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * NUMPY_DTYPES[self.dtype].itemsize


def is_regular_file(path: Path) -> bool:
    """Whether a regular file is at ``path`` (:func:`loader.fs.regular_size`: the user's
    directory followed as given; below ``ROOT`` or ``--work-dir`` walked one name at a time, a
    link there a :class:`~loader.errors.NotOursError`, never looked through). A link loop is
    no file."""
    try:
        return fs.regular_size(path) is not None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return False
        raise


def read_hf_config(
    checkpoint_dir: Path | str, *, checked: fs.Stamp | None = None
) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory as a dict (at most
    :data:`~loader.formats.jsondoc.MAX_CONFIG_JSON_BYTES`; deeper nesting than a parser takes is a
    :class:`CheckpointError` like any malformed document); ``checked``: the
    :data:`~loader.fs.Stamp` of the file its download verified (:func:`loader.fs.as_checked`)."""
    path = Path(checkpoint_dir) / CONFIG_FILE
    if not Path(checkpoint_dir).is_dir():
        raise CheckpointError(f"{checkpoint_dir} is not a directory.")
    try:
        data = fs.read_file(path, limit=jsondoc.MAX_CONFIG_JSON_BYTES, checked=checked)
        config = jsondoc.loads(data.decode("utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{path} is missing: not a Hugging Face checkpoint directory."
        ) from exc
    except fs.TooLargeError as exc:
        raise FileContentError(
            path,
            f"is larger than {jsondoc.MAX_CONFIG_JSON_BYTES // 2**20} MiB: not a config.json",
        ) from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise FileContentError(path, f"cannot be read as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise FileContentError(path, "does not hold a JSON object")
    return config


# --- one weight file ----------------------------------------------------------------------


class ShardFile(Protocol):
    path: Path
    #: The file's size when it was opened (its header checked).
    size: int
    #: The file opened (:func:`loader.fs.stamp` of its descriptor when it was opened).
    stamp: fs.Stamp

    def infos(self) -> dict[str, TensorInfo]: ...

    def get(self, name: str) -> np.ndarray: ...

    def data_offset(self, name: str) -> int | None: ...

    def as_checked(self) -> None: ...

    def close(self) -> None: ...


def _whole(value: object) -> int:
    """A non-negative integer of a safetensors header (a bool, a float or a negative number is
    not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _check_spans(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors' byte spans follow each other from 0 to ``data_size`` exactly."""
    expected = 0
    previous = None
    for begin, end, name in sorted(spans):
        if begin < expected:
            raise _corrupt(
                path, f"tensor {shown(name)} overlaps tensor {shown(previous)} (they share bytes)"
            )
        if begin > expected:
            raise _corrupt(
                path, f"tensor {shown(name)} starts at byte {begin}, after a gap at {expected}"
            )
        expected, previous = end, name
    if expected != data_size:
        raise _corrupt(
            path,
            f"the header describes {expected} data bytes but the file holds {data_size}",
        )


def _corrupt(path: Path, what: str) -> CorruptFileError:
    return CorruptFileError(path, what)


class SafetensorsFile:
    """A ``.safetensors`` file: header parsed and checked at open, tensors viewed via mmap
    (``checked``: the :data:`~loader.fs.Stamp` of the file its download verified, which the one
    opened must be: :func:`loader.fs.as_checked`).

    The header gets the checks the ``safetensors`` library itself makes before it hands out a
    tensor (``safetensors/src/tensor.rs``: ``SafeTensors::read_metadata`` and
    ``Metadata::validate``): a header length within the file and at most 100 MB (the loader
    reads one of at most :data:`MAX_READ_HEADER`), a JSON object, a ``__metadata__`` (if any)
    of text values,
    every entry's byte span as long as its dtype and shape say, and the spans, in offset order,
    one after the other from 0 to the end of the file: no gap, no overlap (two tensors viewing
    the same bytes), nothing beyond the file, nothing after the last tensor.
    """

    def __init__(self, path: Path, checked: fs.Stamp | None = None) -> None:
        self.path = path
        self._mmap: mmap.mmap | None = None
        self._lock = threading.Lock()
        try:
            with fs.open_read(path) as fh:
                fs.as_checked(fh.fileno(), path, checked)  # before a byte of it is read
                opened = os.fstat(fh.fileno())
                size = opened.st_size
                prefix = fh.read(8)
                if len(prefix) < 8:
                    raise _corrupt(path, f"{size} bytes, shorter than the 8-byte header length")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > min(size - 8, _MAX_HEADER):
                    raise _corrupt(path, f"header length {header_len} exceeds the file size {size}")
                if header_len > MAX_READ_HEADER:
                    raise FileContentError(
                        path,
                        f"has a header of {header_len} bytes, larger than the "
                        f"{MAX_READ_HEADER // 2**20} MiB the loader reads (a checkpoint's lists "
                        "its tensors in about 100 bytes each)",
                        "Save the weights again without padding or bulky metadata "
                        "(safetensors.torch.save_file(model.state_dict(), ...)).",
                    )
                raw = fh.read(header_len)
                st = os.fstat(fh.fileno())
                # Kept open, and mapped from it on the first read: the tensors are read from
                # the file whose header is checked (it was opened by its path again, and a
                # file put there meanwhile was read with the first one's header).
                kept = os.dup(fh.fileno())
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path} is missing.") from exc
        try:
            self._read_header(raw, header_len, size)
        except BaseException:
            os.close(kept)
            raise
        #: the descriptor the tensors are mapped from, kept open until :meth:`close` (the
        #: file read is looked at through it: :meth:`as_checked`)
        self._fd: int | None = kept
        self._checked = checked
        #: (device, inode) of the file read: what is at its path may be another file now
        self.identity = (st.st_dev, st.st_ino)
        self.stamp = fs.stamp(opened)

    def _read_header(self, raw: bytes, header_len: int, size: int) -> None:
        path = self.path
        try:
            header = jsondoc.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise _corrupt(path, f"header is not valid JSON ({exc})") from exc
        if not isinstance(header, dict):
            raise _corrupt(path, "header is not a JSON object")
        self._data_start = 8 + header_len
        self.size = size
        self._infos: dict[str, TensorInfo] = {}
        self._offsets: dict[str, int] = {}
        spans: list[tuple[int, int, str]] = []
        for name, entry in header.items():
            if name == "__metadata__":
                # text to text, as the safetensors library reads it (it refuses anything else)
                if entry is not None and not (
                    isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())
                ):
                    raise _corrupt(path, "its __metadata__ is not an object of text values")
                continue
            try:
                dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
                shape = tuple(_whole(d) for d in entry["shape"])
                begin, end = (_whole(x) for x in entry["data_offsets"])
            except KeyError as exc:
                if isinstance(entry, dict) and entry.get("dtype") not in _SAFETENSORS_DTYPES:
                    raise TensorDtypeError(
                        path,
                        f"holds tensor {shown(name)} in dtype {entry.get('dtype')!r}, which the "
                        "loader does not read",
                    ) from exc
                raise _corrupt(path, f"header entry for {shown(name)} is incomplete") from exc
            except (TypeError, ValueError) as exc:
                raise _corrupt(path, f"header entry for {shown(name)} is malformed") from exc
            info = TensorInfo(name, dtype, shape, path)
            if end - begin != info.nbytes:
                raise _corrupt(
                    path, f"tensor {shown(name)} spans {end - begin} bytes, not {info.nbytes}"
                )
            self._infos[name] = info
            self._offsets[name] = begin
            spans.append((begin, end, name))
        _check_spans(path, spans, size - self._data_start)

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def get(self, name: str) -> np.ndarray:
        info = self._infos[name]
        mapped = self._mapped(name)
        offset = self._data_start + self._offsets[name]
        if info.nbytes and hasattr(mmap, "MADV_WILLNEED"):  # start reading it in now
            start = offset - offset % mmap.PAGESIZE
            mapped.madvise(mmap.MADV_WILLNEED, start, offset + info.nbytes - start)
        count = math.prod(info.shape)
        arr = np.frombuffer(mapped, dtype=NUMPY_DTYPES[info.dtype], count=count, offset=offset)
        return arr.reshape(info.shape)

    def _mapped(self, name: str) -> mmap.mmap:
        """The file's map, made from the descriptor kept open on the first read (the writers'
        threads read at once)."""
        with self._lock:
            if self._mmap is not None:
                return self._mmap
            if self._fd is None:
                raise CheckpointError(
                    f"{self.path} was closed before tensor {shown(name)} was read."
                )
            size = os.fstat(self._fd).st_size
            if size < self.size:  # cut short since its header was checked
                raise SourceShrankError([(self.path, self.size, size)])
            ledger.note_mapped(self.path, self._fd)
            self._mmap = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            return self._mmap

    def data_offset(self, name: str) -> int | None:
        """Byte offset of the tensor's data in the file (it is stored contiguously)."""
        return self._data_start + self._offsets[name]

    def as_checked(self) -> None:
        """The file read must still be the one its download verified (:func:`fs.as_checked`,
        asked once its tensors were read): bytes written in place since it was opened may
        have been read as the source's."""
        with self._lock:
            if self._fd is not None:
                fs.as_checked(self._fd, self.path, self._checked)

    def close(self) -> None:
        # Arrays handed out keep the mapping alive; dropping our reference lets it go with them.
        with self._lock:
            self._mmap = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class TorchFile:
    """A PyTorch ``.bin`` (zip) file, memory-mapped by ``torch.load(mmap=True)`` (``checked``:
    see :class:`SafetensorsFile`)."""

    def __init__(self, path: Path, checked: fs.Stamp | None = None) -> None:
        self.path = path
        if not is_regular_file(path):
            raise CheckpointError(f"{path} is missing.")
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is in requirements.txt
            raise CheckpointError(
                f"{path} is a PyTorch file and reading it needs torch.",
                "Install torch (pip install 'model-triton-loader[torch]') or use safetensors.",
            ) from exc
        self._torch = torch
        # Opened once: the archive whose records are checked is the one torch.load maps, by
        # this descriptor (it opened the path again: a FIFO put there meanwhile held it for
        # good, another archive was loaded unchecked).
        with fs.open_read(path) as fh:
            fs.as_checked(fh.fileno(), path, checked)  # before a byte of it is read
            opened = os.fstat(fh.fileno())
            self.size, self.stamp = opened.st_size, fs.stamp(opened)
            self._checked = checked
            try:
                _check_records(path, fh)
            except CorruptFileError as exc:
                _unless_shrunk(path, self.size, exc)
                raise
            if ledger.active():  # the size it is mapped at, for the supervisor
                ledger.note_mapped(path, fh.fileno())
            try:
                state = torch.load(
                    fs.by_descriptor(path, fh.fileno()),
                    map_location="cpu",
                    mmap=True,
                    weights_only=True,
                )
            except Exception as exc:
                _unless_shrunk(path, self.size, exc)
                _unless_out_of_memory(path, exc)
                raise _corrupt(path, f"torch.load failed ({type(exc).__name__}: {exc})") from exc
            #: the file mapped, kept open until :meth:`close` (:meth:`as_checked`)
            self._held: int | None = os.dup(fh.fileno())
        try:
            self._read_state(path, torch, state)
        except BaseException:
            self.close()
            raise

    def _read_state(self, path: Path, torch: Any, state: object) -> None:
        if not isinstance(state, dict):
            raise _corrupt(path, "it does not hold a state dict")
        # detached: a parameter saved as one (requires_grad) is read like any tensor
        self._state = {k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)}
        odd = [k for k in self._state if not isinstance(k, str)]
        if odd:  # a safetensors header names every tensor by text, as the plan does
            raise _corrupt(
                path, f"it names a tensor by {shown(repr(odd[0])[:80])}, which is not a text name"
            )
        self._infos = {}
        for name, tensor in self._state.items():
            kind = _not_plain(torch, tensor)
            if kind is not None:
                raise FileContentError(
                    path,
                    f"holds tensor {shown(name)} as {kind}, which the loader does not read",
                    "Save the checkpoint's tensors as plain dense CPU tensors "
                    "(torch.save(model.state_dict())) and use that file.",
                )
            dtype = _torch_dtype_name(tensor.dtype)
            if dtype is None:
                raise TensorDtypeError(
                    path,
                    f"holds tensor {shown(name)} in dtype {tensor.dtype}, which the loader does "
                    "not read",
                )
            self._infos[name] = TensorInfo(name, dtype, tuple(tensor.shape), path)

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def get(self, name: str) -> np.ndarray:
        tensor = self._state[name]
        if tensor.dtype == self._torch.bfloat16:
            return tensor.view(self._torch.int16).numpy().view(np.uint16)
        return tensor.numpy()

    def data_offset(self, name: str) -> int | None:
        return None  # inside a zip member; read it through the memory map instead

    def as_checked(self) -> None:
        """See :meth:`SafetensorsFile.as_checked`."""
        if self._held is not None:
            fs.as_checked(self._held, self.path, self._checked)

    def close(self) -> None:
        self._state = {}
        if self._held is not None:
            os.close(self._held)
            self._held = None


#: How a zip archive starts: the only files ``torch.load(mmap=True)`` opens.
_ZIP_MAGIC = b"PK\x03\x04"
#: The largest pickle of a state dict's tensors read. A real one takes about 100 bytes a
#: tensor (a GPT-J or CodeGen file of a hundred layers: about 150 kB). Unpickling builds up
#: to about 220 bytes of objects for each byte (an empty set a byte), and ``torch.load``'s own
#: unpickler reads it again, in Python: 64 MiB held about 14 GB in the check, or minutes in
#: ``torch.load``; at 4 MiB, less than a GB and seconds.
_MAX_PICKLE = 4 * 2**20
#: The most classes (``module.name``) a pickle of a state dict's tensors may name: a real one
#: names a handful (an ``OrderedDict``, a storage type or two, ``_rebuild_tensor_v2``...), and
#: ``torch.load`` refuses every one its ``weights_only`` unpickler does not list.
_MAX_CLASSES = 256


class _Stand:
    """What any class or call of a pickle stands for while its storages are listed: nothing
    of the pickle is built or run."""

    def __new__(cls, *args: object, **kwargs: object) -> _Stand:
        return object.__new__(cls)

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Stand:
        return _Stand()

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, value: object) -> None:
        pass

    def extend(self, values: object) -> None:
        pass


class _TooManyClasses(pickle.UnpicklingError):
    """A pickle naming more than :data:`_MAX_CLASSES` classes."""


class _Storages(pickle.Unpickler):
    """The storages a ``torch.save`` pickle names, (key, storage type, element count) each
    time one is named, read without building anything (every class a stand-in that knows the
    ``module.name`` the pickle gave it: one stand-in per name, however often it is named, and
    at most :data:`_MAX_CLASSES` names; a class made anew for each naming cost about 2 kB and
    40 us, so a pickle of 5-byte namings within :data:`_MAX_PICKLE` held the check for minutes
    in tens of GB)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._classes: dict[tuple[str, str], type] = {}
        #: every storage named, as often as named (torch.load views a key at the size it is
        #: first named with; each naming must fit its record); the type is the global's
        #: ``module.name``, None where the pickle gives anything else
        self.found: list[tuple[str, str | None, object]] = []

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):  # how protocol 2 pickles bytes: real ones
            return codecs.encode
        stand = self._classes.get((module, name))
        if stand is None:
            if len(self._classes) >= _MAX_CLASSES:
                raise _TooManyClasses(module, name)
            stand = type(name, (_Stand,), {"_global": f"{module}.{name}"})
            self._classes[(module, name)] = stand
        return stand

    def persistent_load(self, pid: object) -> _Stand:
        # torch.load takes the type name as text or as bytes (``_maybe_decode_ascii``)
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage"):
            kind = pid[1].__dict__.get("_global") if isinstance(pid[1], type) else None
            self.found.append((str(pid[2]), kind, pid[4]))
        return _Stand()


def _storage_itemsizes(torch: Any) -> dict[str, int]:
    """``module.name`` -> bytes per element of every storage type ``torch.load`` takes in a
    storage's name (those its ``weights_only`` unpickler allows), as ``torch.load`` sizes it."""
    sizes = {}
    for kind in torch._storage_classes:
        if kind is torch.storage.TypedStorage:
            continue
        dtype = (
            torch.uint8
            if kind is torch.UntypedStorage
            else torch.storage._get_dtype_from_pickle_storage_type(kind.__name__)
        )
        sizes[f"{kind.__module__}.{kind.__name__}"] = torch._utils._element_size(dtype)
    return sizes


def _folded(name: str) -> bytes:
    """A record name as PyTorch's reader (miniz) looks it up: its bytes, ASCII letters in
    lower case (``data/0`` and ``DATA/0`` name one record there)."""
    return name.encode("utf-8", "surrogatepass").lower()


def _data_start(fh: Any, info: zipfile.ZipInfo) -> int | None:
    """Where the bytes of ``info`` start, as PyTorch's reader finds them: after its local
    header, by the name and extra lengths that header gives (None: no local header there)."""
    fh.seek(info.header_offset)
    local = fh.read(30)
    if len(local) < 30 or local[:4] != _ZIP_MAGIC:
        return None
    name_len, extra_len = struct.unpack_from("<HH", local, 26)
    return info.header_offset + 30 + name_len + extra_len


def _check_records(path: Path, opened: BinaryIO | None = None) -> None:
    """Every storage a PyTorch zip archive's pickle names has a record holding its bytes.
    ``torch.load(mmap=True)`` views each storage at its record's offset for as many bytes as
    the pickle says, whatever the record holds: a record cut short inside a valid archive
    would be read on into the records after it (a :class:`CheckpointError` here). A file that
    is no zip archive (it does not start as one: ``torch.load`` opens none other) is left to
    ``torch.load`` to refuse; one whose directory Python's ``zipfile`` cannot read is refused
    here (PyTorch's own reader may read it, unchecked: a version field it ignores, say).

    The archive is read as ``torch.load`` reads it: the pickle is ``data.pkl`` in the folder of
    the archive's first record (another record named ``data.pkl`` elsewhere is not the one
    read); a name recorded twice, or twice but for the case of its letters (PyTorch's reader
    finds records case-insensitively), is refused (``zipfile`` reads one such record, PyTorch's
    reader may view another); a storage's type is one ``torch.load`` takes, sized as it sizes
    it; a storage's record is stored as it is (``torch.load`` maps its bytes, never inflates
    them) and holds the bytes its directory entry says, before what follows it starts.
    ``opened``: the file, already open (read from its start; left open), else ``path`` is
    opened."""
    import torch

    with contextlib.nullcontext(opened) if opened is not None else fs.open_read(path) as fh:
        fh.seek(0)
        try:
            archive = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as exc:
            fh.seek(0)
            if fh.read(4) != _ZIP_MAGIC:
                return  # torch.load(mmap=True) opens no other file
            raise _corrupt(
                path, f"its zip directory does not read ({type(exc).__name__}: {exc})"
            ) from exc
        with archive:
            infos = archive.infolist()
            count = collections.Counter(_folded(i.filename) for i in infos)
            twice = sorted(i.filename for i in infos if count[_folded(i.filename)] > 1)
            if twice:
                doubled = len({_folded(n) for n in twice})
                raise _corrupt(
                    path,
                    f"it holds {doubled} record name(s) twice, {shown(twice[0])} first (PyTorch's "
                    "reader finds a record whatever the case of its letters)",
                )
            if not infos or "/" not in infos[0].filename:
                return  # not in one folder: torch.load refuses it
            prefix = infos[0].filename.partition("/")[0] + "/"
            by_name = {_folded(i.filename): i for i in infos}
            listing = by_name.get(_folded(f"{prefix}data.pkl"))
            if listing is None:
                return
            if listing.file_size > _MAX_PICKLE:
                raise _corrupt(path, f"its tensor list is larger than {_MAX_PICKLE // 2**20} MiB")
            try:
                scan = _Storages(archive.read(listing))
                scan.load()
            except _TooManyClasses as exc:
                raise _corrupt(
                    path,
                    f"its tensor list names more than {_MAX_CLASSES} classes (a state dict's "
                    "names a few, and torch.load takes none it does not know)",
                ) from exc
            except MemoryError as exc:  # within _MAX_PICKLE: the machine's, not the file's
                raise ResourceExhaustedError(
                    f"The loader ran out of memory reading the tensor list of {shown(path)}."
                ) from exc
            except Exception as exc:  # any malformed pickle: nothing of it was run
                raise _corrupt(
                    path, f"its tensor list does not read ({type(exc).__name__})"
                ) from exc
            bounds = sorted({i.header_offset for i in infos} | {archive.start_dir})
            records: dict[str, tuple[zipfile.ZipInfo, int]] = {}
            for key, _, _ in scan.found:
                info = by_name.get(_folded(f"{prefix}data/{key}"))
                if info is None or key in records:
                    continue
                start = _data_start(fh, info)
                if start is None:
                    raise _corrupt(path, f"its tensor record {shown(key)} has no local header")
                records[key] = info, start
        _check_storages(path, torch, scan.found, records, bounds)


def _check_storages(
    path: Path,
    torch: Any,
    found: Iterable[tuple[str, str | None, object]],
    records: Mapping[str, tuple[zipfile.ZipInfo, int]],
    bounds: list[int],
) -> None:
    """Every naming of a storage fits its record, and the record holds what it says."""
    itemsizes = _storage_itemsizes(torch)
    for key, kind, numel in found:
        itemsize = itemsizes.get(kind or "")
        if itemsize is None:
            raise _corrupt(
                path,
                f"its tensor list names storage {shown(key)} with "
                f"{'type ' + shown(kind) if kind else 'no type'}, not a storage type torch.load "
                "takes",
            )
        if key not in records:
            raise _corrupt(path, f"its tensor record {shown(key)} is missing")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise _corrupt(path, f"its tensor record {shown(key)} has {numel!r} elements")
        info, start = records[key]
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise _corrupt(
                path,
                f"its tensor record {shown(key)} is compressed (torch.load maps a record's "
                "bytes as they are stored)",
            )
        after = bounds[min(bisect.bisect_right(bounds, info.header_offset), len(bounds) - 1)]
        if start + info.file_size > after:
            raise _corrupt(
                path,
                f"its tensor record {shown(key)} says it holds {info.file_size} bytes, but "
                f"what follows it starts {max(0, after - start)} bytes in",
            )
        held = info.file_size
        if held < numel * itemsize:
            raise _corrupt(
                path,
                f"its tensor record {shown(key)} holds {held} bytes, fewer than the "
                f"{numel * itemsize} its {numel} {(kind or '').rpartition('.')[2]} elements "
                "take",
            )


def _unless_shrunk(path: Path, size: int, exc: BaseException) -> None:
    """A file that is shorter now than when it was opened failed to parse because another
    process cut it short meanwhile (a transient error: the next run reads it again), not
    because it is corrupt."""
    try:
        now = os.stat(path).st_size
    except OSError:
        return
    if now < size:
        raise SourceShrankError([(path, size, now)]) from exc


def _unless_out_of_memory(path: Path, exc: BaseException) -> None:
    """``torch.load`` maps the whole file: a process without the memory or address space for
    it (``ulimit -v``, the container's limit) fails with a ``RuntimeError`` saying so (it
    could not ``mmap``: ENOMEM), or a ``MemoryError``: the machine's trouble, transient, not
    the file's (it was called corrupt, to be downloaded again). Only torch's own words for a
    failed map are taken: a message quoting the file (a class a pickle names) says anything."""
    failed_map = isinstance(exc, RuntimeError) and re.fullmatch(
        rf"unable to mmap \d+ bytes from file <[^>]*>: {re.escape(os.strerror(errno.ENOMEM))} "
        rf"\({errno.ENOMEM}\)",
        str(exc),
    )
    if isinstance(exc, MemoryError) or failed_map:
        raise ResourceExhaustedError(
            f"The loader ran out of memory mapping {shown(path)} "
            f"({type(exc).__name__}: {str(exc)[:200]})."
        ) from exc


def _not_plain(torch: Any, tensor: Any) -> str | None:
    """What ``tensor`` is, where it is no dense run of values in the file that NumPy can view
    as it is (None: it is one)."""
    if tensor.is_nested:
        return "a nested tensor"
    if tensor.layout != torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor"
    if tensor.device.type != "cpu":
        return f"a {tensor.device.type} tensor (no values in the file)"
    if tensor.is_neg() or tensor.is_conj():
        return "a negated or conjugated view (its values are not the bytes stored)"
    return None


def _torch_dtype_name(dtype: Any) -> str | None:
    return {
        "torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16",
        "torch.float64": "fp64", "torch.int64": "int64", "torch.int32": "int32",
        "torch.int16": "int16", "torch.int8": "int8", "torch.uint8": "uint8", "torch.bool": "bool",
    }.get(str(dtype))  # fmt: skip


# --- the directory layout registry -----------------------------------------------------------


#: Weight format name (``loader.formats.huggingface.WEIGHT_FILES``) -> its shard reader
#: (``opener(path, checked)``: see :class:`SafetensorsFile`).
OPENERS: dict[str, Callable[[Path, fs.Stamp | None], ShardFile]] = {
    "safetensors": SafetensorsFile,
    "pytorch": TorchFile,
}

_INDEX_MISMATCH = (
    "The index and the weight files do not match: use a complete, unmodified checkpoint."
)


@dataclass(frozen=True)
class Inventory:
    """The tensors a checkpoint directory lists and the weight file holding each: read from its
    index (the weight files need not be there yet) or from its single weight file's header."""

    directory: Path
    layout: WeightFiles
    #: The file that lists the tensors: the index, or the single weight file.
    listing: str
    #: tensor name -> weight file (a plain file name inside ``directory``)
    placement: dict[str, str]
    #: weight file -> its size when the inventory read it (the single weight file): opened
    #: again shorter, it was cut short meanwhile, not corrupt (:class:`SourceShrankError`)
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def sharded(self) -> bool:
        return self.listing == self.layout.index

    @property
    def files(self) -> list[str]:
        """The weight files, by name (the order sources deliver them in)."""
        return sorted(set(self.placement.values()))

    def open(self, name: str, *, checked: fs.Stamp | None = None) -> ShardFile:
        """Open (and check the header of) the weight file ``name``; ``checked``: the
        :data:`~loader.fs.Stamp` of the file its download verified (:func:`loader.fs.as_checked`)."""
        path = self.directory / name
        if not is_regular_file(path):
            raise self.missing([name])
        seen = self.sizes.get(name)
        try:
            shard = OPENERS[self.layout.name](path, checked)
        except CheckpointError as exc:
            if seen is not None:
                _unless_shrunk(path, seen, exc)
            raise
        if seen is not None and shard.size < seen:
            shard.close()
            raise SourceShrankError([(path, seen, shard.size)])
        return shard

    def check_placement(
        self, name: str, infos: Mapping[str, TensorInfo], *, unlisted: Callable[[str], bool]
    ) -> None:
        """Every tensor of the weight file ``name`` must be where the inventory places it (a
        tensor it does not list only where ``unlisted(tensor)`` allows it), and every tensor it
        places there must be in it."""
        for tensor in infos:
            listed = self.placement.get(tensor)
            if listed == name or (listed is None and unlisted(tensor)):
                continue
            raise CheckpointError(
                f"{self.listing} places tensor {shown(tensor)} in {listed}, but {name} holds it.",
                _INDEX_MISMATCH,
            )
        lacking = [t for t, f in self.placement.items() if f == name and t not in infos]
        if lacking:
            raise CheckpointError(
                f"{self.listing} places {some_names(lacking)} in {name}, but that file does not "
                "hold it.",
                _INDEX_MISMATCH,
            )

    def missing(self, names: Iterable[str]) -> CheckpointError:
        """The error for weight files the inventory names that the directory lacks."""
        names = sorted(names)
        return CheckpointError(
            f"{some_names(names)} listed in {self.listing} {'is' if len(names) == 1 else 'are'} "
            "missing.",
            "Add every weight file the index names (download or upload the checkpoint again), "
            "then run again.",
        )


def read_inventory(
    directory: Path | str,
    *,
    seen: Mapping[str, int] | None = None,
    listed: Collection[str] | None = None,
    checked: Mapping[str, fs.Stamp] | None = None,
) -> Inventory:
    """The inventory of ``directory``, in the first layout of
    :data:`~loader.formats.huggingface.WEIGHT_FILES` it has an index or a single file of.
    ``seen``: the sizes an earlier inventory of it recorded (:attr:`Inventory.sizes`); a
    weight file shorter now was cut short meanwhile (:class:`SourceShrankError`). ``listed``:
    the files the source holds now (a download directory may still hold files an earlier
    listing put there): only those are read, and an index naming another is refused.
    ``checked``: the stamps of the files a download verified (the index read must be its)."""
    directory = Path(directory)
    checked = checked or {}
    for layout in WEIGHT_FILES:
        if listed is not None and layout.index in listed:
            placement = _read_index(directory, layout, checked.get(layout.index))
            inventory = Inventory(directory, layout, layout.index, placement)
            unlisted = [name for name in inventory.files if name not in listed]
            if unlisted:
                raise inventory.missing(unlisted)
            return inventory
        if listed is not None and layout.single not in listed:
            continue
        if listed is None and is_regular_file(directory / layout.index):
            return Inventory(directory, layout, layout.index, _read_index(directory, layout))
        if is_regular_file(directory / layout.single):
            prior = Inventory(directory, layout, layout.single, {}, dict(seen or {}))
            shard = prior.open(layout.single)
            try:
                names = list(shard.infos())
            finally:
                shard.close()
            placement = dict.fromkeys(names, layout.single)
            return Inventory(
                directory, layout, layout.single, placement, {layout.single: shard.size}
            )
    present = sorted(p.name for p in directory.iterdir())[:20]
    looked_for = ", ".join(f"{lay.single} / {lay.index}" for lay in WEIGHT_FILES)
    raise CheckpointError(
        f"{directory} holds no weights: looked for {looked_for}; found {present or 'nothing'}."
    )


def _is_shard_name(name: str) -> bool:
    """Whether an index may name the file ``name``: one name a file can have
    (:func:`loader.fs.is_file_name`: no ``/``, no NUL, at most ``NAME_MAX`` bytes, no lone
    surrogate, which a JSON document may spell and no file system takes), every character of
    which prints (one that does not, a next-line or line-separator character included, would
    start a line of its own in a message that names the file)."""
    return fs.is_file_name(name) and name.isprintable()


def _read_index(
    directory: Path, layout: WeightFiles, checked: fs.Stamp | None = None
) -> dict[str, str]:
    """An index's weight map; every file it names must be a shard of ``layout`` inside
    ``directory`` (a name read from a checkpoint never reaches a path unchecked:
    :func:`_is_shard_name`). ``checked``: see :func:`loader.fs.as_checked`."""
    path = directory / layout.index
    try:
        limit = jsondoc.MAX_CONFIG_BYTES
        document = fs.read_file(path, limit=limit, checked=checked).decode("utf-8")
        weight_map = dict(jsondoc.loads(document)["weight_map"])
    except fs.TooLargeError as exc:
        raise FileContentError(
            path, f"is larger than {jsondoc.MAX_CONFIG_BYTES // 2**20} MiB: not an index"
        ) from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise FileContentError(
            path, f"is not a valid index (a JSON object with a weight_map): {exc}"
        ) from exc
    for tensor, name in weight_map.items():
        if not (
            isinstance(tensor, str)
            and isinstance(name, str)
            and _is_shard_name(name)
            and name.startswith(layout.shard_prefix)
            and name.endswith(layout.shard_suffix)
        ):
            raise FileContentError(
                path,
                f"places tensor {tensor!r} in {name!r}, which is not a "
                f"{layout.shard_prefix}*{layout.shard_suffix} file beside it",
                _INDEX_MISMATCH,
            )
    return weight_map


class Checkpoint:
    """The tensors of a set of opened weight files (see the module docstring); files can be
    added and removed one at a time (a conversion that reads shards as they arrive)."""

    def __init__(
        self,
        directory: Path,
        config: dict[str, Any] | None = None,
        shards: Iterable[ShardFile] = (),
    ) -> None:
        self.directory = directory
        self.config = config or {}
        self.shards: dict[str, ShardFile] = {}
        self._where: dict[str, ShardFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            self.add(shard)

    def add(self, shard: ShardFile, *, only: Container[str] | None = None) -> None:
        """Make the tensors of ``shard`` readable, those in ``only`` when given (a tensor
        stored twice is an error)."""
        infos = {n: i for n, i in shard.infos().items() if only is None or n in only}
        for name in infos:
            if name in self.tensors:
                raise CheckpointError(
                    f"tensor {shown(name)} is stored twice ({self.tensors[name].file.name} and "
                    f"{shard.path.name})."
                )
        for name, info in infos.items():
            self.tensors[name] = info
            self._where[name] = shard
        self.shards[shard.path.name] = shard

    def remove(self, name: str) -> ShardFile:
        """Forget the weight file ``name`` (its tensors are no longer readable); returns it."""
        shard = self.shards.pop(name)
        for tensor in shard.infos():
            if self._where.get(tensor) is shard:
                del self.tensors[tensor], self._where[tensor]
        return shard

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        """One tensor as a read-only array viewing the file's memory map (no copy)."""
        try:
            shard = self._where[name]
        except KeyError as exc:
            raise CheckpointError(f"{self.directory} has no tensor {name}.") from exc
        return shard.get(name)

    def file_span(self, name: str) -> tuple[Path, int] | None:
        """(file, byte offset) of a tensor stored as one contiguous run of bytes, if known."""
        shard = self._where[name]
        offset = shard.data_offset(name)
        return None if offset is None else (shard.path, offset)

    def reads_from(self, name: str, found: os.stat_result) -> bool:
        """Whether ``found`` (``fstat`` of a file opened at :meth:`file_span`'s path) is the
        very file tensor ``name`` is read from, the one whose header was checked (what is at
        that path may have been replaced since)."""
        identity = getattr(self._where[name], "identity", None)
        return identity is not None and identity == (found.st_dev, found.st_ino)

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, array)`` pairs, one tensor at a time, in file order."""
        for name in self.tensors:
            yield name, self.get(name)

    __iter__ = iter_tensors

    @property
    def files(self) -> list[Path]:
        return [s.path for s in self.shards.values()]

    def shrunk(self) -> list[tuple[Path, int, int]]:
        """``(path, size when opened, size now)`` of each weight file that is shorter now: a
        file cut short while it is read (its mapped pages past the new end cannot be read)."""
        found = []
        for shard in self.shards.values():
            try:
                now = os.stat(shard.path).st_size
            except OSError:
                continue
            if now < shard.size:
                found.append((shard.path, shard.size, now))
        return found

    def as_checked(self) -> None:
        """Every weight file read must still be the one its download verified
        (:meth:`SafetensorsFile.as_checked`): asked once the outputs read from them are
        written, before they are kept."""
        for shard in list(self.shards.values()):
            shard.as_checked()

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()


def open_checkpoint(directory: Path | str) -> Checkpoint:
    """Open a checkpoint directory: config.json, layout, every shard's header (no tensor data)."""
    directory = Path(directory)
    config = read_hf_config(directory)
    inventory = read_inventory(directory)
    missing = [name for name in inventory.files if not is_regular_file(directory / name)]
    if missing:
        raise inventory.missing(missing)
    ckpt = Checkpoint(directory, config)
    try:
        for name in inventory.files:
            shard = inventory.open(name)
            ckpt.add(shard)
            inventory.check_placement(name, shard.infos(), unlisted=lambda _: True)
    except BaseException:
        ckpt.close()
        raise
    log.debug("opened %s: %d tensors in %d file(s)", directory, len(ckpt.tensors), len(ckpt.files))
    return ckpt


def iter_tensors(directory: Path | str) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` pairs of a checkpoint directory, one tensor at a time."""
    with open_checkpoint(directory) as ckpt:
        yield from ckpt.iter_tensors()
