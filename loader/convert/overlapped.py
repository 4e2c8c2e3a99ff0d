"""Conversion overlapped with the download: each output file is written as soon as the shards
holding its tensors have arrived and been verified, and each shard is deleted once every output
that reads it is written.

:func:`plan_overlap` reads what arrives first (``config.json`` and the safetensors index) and
checks, before any weight is downloaded, everything that needs no tensor data: the architecture,
T against the model, the tensor names the index lists (none missing, none unexpected) and the
output dtype. :class:`OverlappedConversion` then consumes the shards as the fetch delivers them
(:class:`~loader.sources.ArrivalHooks`):

* ``arrived``: a verified shard's header is parsed and its tensors checked against the index
  and the shapes ``config.json`` implies; every output whose shards are all here is handed to a
  small pool of writers (:func:`~loader.convert.writer.write_file`, which hashes as it writes);
* ``admit``: one shard downloads at a time (all the fetch's streams on it, so it arrives as
  early as it can while the one before converts), and at most ``window`` shards are held (one
  more when the ones held cannot progress without it), so the disk holds the outputs plus a
  few shards;
* every finished output is fsynced (by one thread of its own, so the disk writes back while the
  writers go on) and recorded in a journal beside the outputs
  (``name size sha256 inode mtime_ns``, under a header naming the source revision and dtype):
  a killed run's successor keeps those files and does not download the shards only they read
  (``skip``).

The outputs are written into a directory of the download area, never where Triton looks; the
caller moves it into its staging repository once :meth:`OverlappedConversion.finish` returned.
Memory stays bounded as in :mod:`loader.convert.writer`: the shards are memory-mapped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loader.checkpoint import SafetensorsFile, TensorInfo, read_hf_config
from loader.errors import CheckpointError
from loader.formats.fastertransformer import FTConfig
from loader.formats.huggingface import CONFIG_DTYPES, WEIGHT_FILES
from loader.parallel import Parallelism
from loader.progress import Progress

from .dtypes import OUTPUT_DTYPES, SOURCE_DTYPES, output_dtype_name
from .registry import get_architecture
from .sequential import CONFIG_INI, _listing, _model_name
from .splits import OutputFile
from .writer import DEFAULT_CHUNK_BYTES, write_file

log = logging.getLogger(__name__)

#: The index the overlapped path needs (sharded safetensors); other layouts convert after the
#: download.
INDEX = WEIGHT_FILES[0].index
#: Journal of the outputs written, beside them.
JOURNAL = ".written"
#: File name endings of weights: everything else is fetched first.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
#: Shards downloaded or waiting at a time by default.
DEFAULT_WINDOW = 2
#: Byte-range slices of a shard: small enough that every stream of the fetch works on the one
#: shard downloading.
SLICE_BYTES = 16 * 2**20


def is_weight_file(relpath: str) -> bool:
    return relpath.endswith(WEIGHT_SUFFIXES)


@dataclass(frozen=True)
class OverlapPlan:
    """What the overlapped conversion writes and which shard each output reads."""

    cfg: FTConfig
    tp: int
    outputs: tuple[OutputFile, ...]
    out_dtype: str
    expected: dict[str, tuple[int, ...]]
    weight_map: dict[str, str]  # tensor -> shard (relative path)
    needs: dict[str, frozenset[str]]  # output file name -> shards it reads

    @property
    def np_dtype(self) -> np.dtype:
        return OUTPUT_DTYPES[self.out_dtype]

    @property
    def shards(self) -> frozenset[str]:
        return frozenset(self.weight_map.values())

    @property
    def total_bytes(self) -> int:
        return sum(out.nbytes(self.np_dtype.itemsize) for out in self.outputs)


def plan_overlap(
    source_dir: Path, *, tp: int, pp: int = 1, dtype: str | None
) -> OverlapPlan | None:
    """The plan for a checkpoint whose small files are in ``source_dir``; None when it is not
    sharded safetensors with a ``torch_dtype`` (those convert after the download)."""
    index_path = Path(source_dir) / INDEX
    if not index_path.is_file():
        return None
    hf = read_hf_config(source_dir)
    source_dtype = CONFIG_DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype") or ""))
    if source_dtype is None:
        return None
    try:
        weight_map = dict(json.loads(index_path.read_text(encoding="utf-8"))["weight_map"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{index_path} is not a valid index (a JSON object with a weight_map): {exc}."
        ) from exc
    for shard in set(weight_map.values()):
        if not isinstance(shard, str) or "/" in shard or not shard.endswith(".safetensors"):
            raise CheckpointError(f"{index_path} names a shard {shard!r} that is not a file of it.")
    arch = get_architecture(hf.get("model_type"))
    parallelism = Parallelism(tp=tp, pp=pp)
    cfg = arch.ft_config(
        hf, parallelism=parallelism, weight_data_type="fp32",
        model_name=_model_name(hf, Path(source_dir)),
    )  # fmt: skip
    expected = arch.expected_tensors(cfg)
    missing = [name for name in expected if name not in weight_map]
    if missing:
        raise CheckpointError(
            f"{index_path} lacks {len(missing)} tensor(s) a {arch.model_type} model with this "
            f"config.json needs: {_listing(missing)}.",
            "The checkpoint is incomplete or config.json does not match its weights; "
            "upload the checkpoint again.",
        )
    unexpected = [n for n in weight_map if n not in expected and not arch.is_ignored(n)]
    if unexpected:
        raise CheckpointError(
            f"{index_path} lists {len(unexpected)} tensor(s) a {arch.model_type} model does not "
            f"have: {_listing(unexpected)}.",
            f"Check that config.json's model_type ({arch.model_type}) and layer count match "
            "the weights.",
        )
    out_dtype = output_dtype_name(dtype, source_dtype)
    cfg = dataclasses.replace(cfg, weight_data_type=out_dtype)
    outputs = tuple(arch.outputs(cfg, tp=tp))
    needs = {out.name: frozenset(weight_map[s] for s in out.sources) for out in outputs}
    return OverlapPlan(cfg, tp, outputs, out_dtype, expected, weight_map, needs)


def _start_writeback(path: Path) -> None:
    """Have the kernel start writing ``path`` back now, without waiting (the fsync that follows
    then finds its pages on their way, and the cache keeps no copy of weights already used)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Arrived:
    """The tensors of the shards arrived so far, as :func:`write_file` reads a checkpoint."""

    def __init__(self) -> None:
        self.shards: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._where: dict[str, SafetensorsFile] = {}

    def add(self, rel: str, shard: SafetensorsFile) -> None:
        self.shards[rel] = shard
        for name, info in shard.infos().items():
            self.tensors[name] = info
            self._where[name] = shard

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)

    def file_span(self, name: str) -> tuple[Path, int] | None:
        shard = self._where[name]
        offset = shard.data_offset(name)
        return None if offset is None else (shard.path, offset)

    def remove(self, rel: str) -> SafetensorsFile:
        shard = self.shards.pop(rel)
        for name in shard.infos():
            self.tensors.pop(name, None)
            self._where.pop(name, None)
        return shard


class OverlappedConversion:
    """Convert ``plan``'s outputs into ``out_dir`` from shards as they arrive (see the module
    docstring). Use as a context manager; call :meth:`finish` after the fetch returned."""

    def __init__(
        self,
        plan: OverlapPlan,
        out_dir: Path,
        *,
        revision: str | None,
        progress: Progress,
        workers: int = 2,
        window: int = DEFAULT_WINDOW,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.plan = plan
        self.out_dir = Path(out_dir)
        self.window = max(1, window)
        self._progress = progress
        self._chunk_bytes = chunk_bytes
        self._header = f"{revision} {plan.out_dtype} {plan.tp}"
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._arrived = _Arrived()
        self._held: set[str] = set()
        self._running = 0
        self._error: BaseException | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="overlap")
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-sync")
        self._syncing = 0
        self.written: dict[str, tuple[int, str]] = self._resume()
        self._pending = {o.name: o for o in plan.outputs if o.name not in self.written}
        self._users: dict[str, set[str]] = {shard: set() for shard in plan.shards}
        for name in self._pending:
            for shard in plan.needs[name]:
                self._users[shard].add(name)
        #: Peak bytes of shards held at once (arrived, not yet deleted).
        self.peak_shard_bytes = 0

    # --- resume ---------------------------------------------------------------------------

    @property
    def journal(self) -> Path:
        return self.out_dir / JOURNAL

    def _resume(self) -> dict[str, tuple[int, str]]:
        """Outputs a killed run finished (journaled, same size and seal); anything else in
        ``out_dir`` is removed."""
        lines = self.journal.read_text().splitlines() if self.journal.is_file() else []
        kept: dict[str, tuple[int, str]] = {}
        if lines and lines[0] == self._header:
            for line in lines[1:]:
                fields = line.split()
                if len(fields) != 5:
                    continue
                name, size, digest, ino, mtime = fields
                path = self.out_dir / name
                try:
                    stat = path.stat()
                except OSError:
                    continue
                if (stat.st_size, stat.st_ino, stat.st_mtime_ns) == (
                    int(size),
                    int(ino),
                    int(mtime),
                ):
                    kept[name] = (int(size), digest)
        if self.out_dir.exists() and not kept:
            shutil.rmtree(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for path in self.out_dir.iterdir():
            if path.name not in kept:
                path.unlink()
        with open(self.journal, "w") as fh:
            fh.write(self._header + "\n")
            for name, (size, digest) in kept.items():
                stat = (self.out_dir / name).stat()
                fh.write(f"{name} {size} {digest} {stat.st_ino} {stat.st_mtime_ns}\n")
        if kept:
            log.info("resuming: %d output file(s) already written in %s", len(kept), self.out_dir)
        return kept

    @property
    def skip(self) -> frozenset[str]:
        """Shards nothing left to write reads: not to be downloaded."""
        return frozenset(shard for shard, users in self._users.items() if not users)

    # --- hooks the fetch calls ------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def admit(self, rel: str) -> bool:
        if rel not in self._users:
            return True
        with self._cond:
            self._raise_if_failed()
            downloading = set(self._held) - set(self._arrived.shards)
            stuck = self._running == 0 and not downloading
            if (len(self._held) < self.window and not downloading) or stuck:
                self._held.add(rel)
                return True
            self._cond.wait(0.05)
            return False

    def arrived(self, rel: str, path: Path) -> None:
        if rel not in self._users:
            return
        shard = SafetensorsFile(path)
        self._check(rel, shard)
        with self._cond:
            self._raise_if_failed()
            self._held.add(rel)
            self._arrived.add(rel, shard)
            held = sum(s.path.stat().st_size for s in self._arrived.shards.values())
            self.peak_shard_bytes = max(self.peak_shard_bytes, held)
            if not self._users[rel]:
                self._release(rel)
            self._submit_ready()
            self._cond.notify_all()

    def _check(self, rel: str, shard: SafetensorsFile) -> None:
        plan = self.plan
        for name, info in shard.infos().items():
            if plan.weight_map.get(name) != rel:
                raise CheckpointError(
                    f"{INDEX} places tensor {name} in {plan.weight_map.get(name)}, but {rel} "
                    "holds it.",
                    "The index and the shards do not match: upload the checkpoint again.",
                )
            if name in plan.expected and info.shape != plan.expected[name]:
                raise CheckpointError(
                    f"Tensor {name} in {rel} has shape {list(info.shape)}, but config.json "
                    f"implies {list(plan.expected[name])}.",
                    "config.json does not match the weights; use the checkpoint's own config.json.",
                )
            if name in plan.expected and info.dtype not in SOURCE_DTYPES:
                raise CheckpointError(
                    f"Tensor {name} in {rel} is stored as {info.dtype}; weights must be "
                    f"{', '.join(SOURCE_DTYPES)}."
                )
        lacking = [n for n, s in plan.weight_map.items() if s == rel and n not in shard.infos()]
        if lacking:
            raise CheckpointError(
                f"{INDEX} places {_listing(lacking)} in {rel}, but that file does not hold it.",
                "The index and the shards do not match: upload the checkpoint again.",
            )

    # --- writing --------------------------------------------------------------------------

    def _submit_ready(self) -> None:
        """Hand every output whose shards are all here to the writers (lock held)."""
        here = set(self._arrived.shards)
        for name in [n for n in self._pending if self.plan.needs[n] <= here]:
            out = self._pending.pop(name)
            self._running += 1
            self._pool.submit(self._write, out)

    def _write(self, out: OutputFile) -> None:
        try:
            size, digest = write_file(
                out, self._arrived, self.out_dir, dtype=self.plan.np_dtype,  # type: ignore[arg-type]
                progress=self._progress, chunk_bytes=self._chunk_bytes, stop=self._stop,
            )  # fmt: skip
            _start_writeback(self.out_dir / out.name)
            with self._cond:
                self.written[out.name] = (size, digest)
                self._running -= 1
                self._syncing += 1
                for shard in self.plan.needs[out.name]:
                    self._users[shard].discard(out.name)
                    if not self._users[shard] and shard in self._arrived.shards:
                        self._release(shard)
                self._submit_ready()
                self._cond.notify_all()
            self._syncer.submit(self._sync, out.name, size, digest)
        except BaseException as exc:
            with self._cond:
                self._running -= 1
                self._fail(exc)

    def _sync(self, name: str, size: int, digest: str) -> None:
        """fsync a written output, then journal it (one thread: the disk writes back while
        the writers go on)."""
        try:
            path = self.out_dir / name
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            stat = path.stat()
            with open(self.journal, "a") as fh:
                fh.write(f"{name} {size} {digest} {stat.st_ino} {stat.st_mtime_ns}\n")
            with self._cond:
                self._syncing -= 1
                self._cond.notify_all()
        except BaseException as exc:
            with self._cond:
                self._syncing -= 1
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Record the first failure and stop the writers (lock held)."""
        if self._error is None:
            self._error = exc
        self._stop.set()
        self._cond.notify_all()

    def _release(self, rel: str) -> None:
        """Close and delete a shard nothing left to write reads (lock held)."""
        shard = self._arrived.remove(rel)
        shard.close()
        shard.path.unlink(missing_ok=True)
        self._held.discard(rel)
        self._cond.notify_all()

    # --- the end --------------------------------------------------------------------------

    def finish(self) -> dict[str, tuple[int, str]]:
        """Wait for the last outputs; write config.ini; returns every file's (size, sha256).
        The journal stays until the caller moved the outputs (and removes it there)."""
        with self._cond:
            while self._error is None and (self._pending or self._running or self._syncing):
                if not self._running and not self._syncing and self._pending:
                    missing = sorted(set().union(*(self.plan.needs[n] for n in self._pending)))
                    raise CheckpointError(
                        f"The download ended without {_listing(missing)}, which the index names.",
                        "Upload every shard the index names, then run the loader again.",
                    )
                self._cond.wait(0.1)
            self._raise_if_failed()
        ini = self.plan.cfg.to_ini().encode("utf-8")
        (self.out_dir / CONFIG_INI).write_bytes(ini)
        return {**self.written, CONFIG_INI: (len(ini), hashlib.sha256(ini).hexdigest())}

    def close(self) -> None:
        """Stop the writers (waiting for the chunks in flight) and unmap the shards."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._syncer.shutdown(wait=True, cancel_futures=True)
        for rel in list(self._arrived.shards):
            self._arrived.remove(rel).close()

    def __enter__(self) -> OverlappedConversion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
