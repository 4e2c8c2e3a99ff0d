"""The overlapped conversion: each output file is written as soon as the shards holding its
tensors have arrived and been verified, and each shard is deleted once every output that reads
it is written.

It follows the same :class:`~loader.convert.plan.ConversionPlan` as the sequential conversion
(made from ``config.json`` and the index, before any weight is downloaded) and consumes the
shards as a fetch delivers them (:class:`~loader.sources.ArrivalHooks`):

* ``arrived``: a verified shard's header is checked against the plan
  (:meth:`~loader.convert.plan.ConversionPlan.check_file`); every output whose shards are all
  here is handed to a small pool of writers (:func:`~loader.convert.writer.write_file`, which
  hashes as it writes);
* ``admit``: blocks until the :class:`~loader.convert.schedule.Schedule` lets the shard start
  downloading (one at a time, at most ``window`` held);
* every finished output is fsynced (by one thread of its own, so the disk writes back while the
  writers go on) and recorded in a :class:`Journal` beside the outputs: a killed run's
  successor keeps those files and does not download the shards only they read (``skip``).

The outputs are written into a directory of the download area, never where Triton looks;
:meth:`OverlappedConversion.move_into` moves them into the staging repository once
:meth:`OverlappedConversion.finish` returned. Memory stays bounded as in
:mod:`loader.convert.writer`: the shards are memory-mapped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loader.checkpoint import OPENERS, Checkpoint
from loader.progress import Progress

from .plan import CONFIG_INI, ConversionPlan, ConvertResult
from .schedule import DEFAULT_WINDOW, Schedule, Step
from .splits import OutputFile
from .writer import DEFAULT_CHUNK_BYTES, default_workers, write_file

log = logging.getLogger(__name__)

#: Byte-range slices of a shard: small enough that every stream of the fetch works on the one
#: shard downloading.
SLICE_BYTES = 16 * 2**20
#: Longest an ``admit`` waits before answering "not yet", so the fetch can look at its own
#: downloads (a failed one) before it asks again.
ADMIT_WAIT_S = 1.0


def _start_writeback(path: Path) -> None:
    """Have the kernel start writing ``path`` back now, without waiting (the fsync that follows
    then finds its pages on their way, and the cache keeps no copy of weights already used)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """The outputs written into a directory, recorded beside them: a header naming what they
    were converted from (source revision, dtype, T), then ``name size sha256 inode mtime_ns``
    per output, appended once the output is durable."""

    NAME = ".written"

    def __init__(self, directory: Path, header: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / self.NAME
        self.header = header

    def resume(self) -> dict[str, tuple[int, str]]:
        """The outputs a killed run finished (journaled under the same header, with the same
        size, inode and mtime), as name -> (size, sha256). Anything else in the directory is
        removed, and the journal rewritten to list what was kept."""
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        kept: dict[str, tuple[int, str]] = {}
        if lines and lines[0] == self.header:
            for line in lines[1:]:
                fields = line.split()
                if len(fields) != 5 or "/" in fields[0] or fields[0] == self.NAME:
                    continue
                name, size, digest, ino, mtime = fields
                try:
                    stat = (self.directory / name).stat()
                except OSError:
                    continue
                if [str(stat.st_size), str(stat.st_ino), str(stat.st_mtime_ns)] == [
                    size,
                    ino,
                    mtime,
                ]:
                    kept[name] = (int(size), digest)
        if self.directory.exists() and not kept:
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in self.directory.iterdir():
            if path.name not in kept:
                path.unlink()
        with open(self.path, "w") as fh:
            fh.write(self.header + "\n")
            for name, (size, digest) in kept.items():
                fh.write(self._line(name, size, digest))
        if kept:
            log.info("resuming: %d output file(s) already written in %s", len(kept), self.directory)
        return kept

    def record(self, name: str, size: int, digest: str) -> None:
        with open(self.path, "a") as fh:
            fh.write(self._line(name, size, digest))

    def _line(self, name: str, size: int, digest: str) -> str:
        stat = (self.directory / name).stat()
        return f"{name} {size} {digest} {stat.st_ino} {stat.st_mtime_ns}\n"


class OverlappedConversion:
    """Convert ``plan``'s outputs into ``out_dir`` from shards as they arrive (see the module
    docstring). Use as a context manager; call :meth:`finish` after the fetch returned."""

    def __init__(
        self,
        plan: ConversionPlan,
        out_dir: Path,
        *,
        revision: str | None,
        progress: Progress,
        workers: int | None = None,
        window: int = DEFAULT_WINDOW,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.plan = plan
        self.out_dir = Path(out_dir)
        self.started = time.monotonic()
        self._journal = Journal(self.out_dir, f"{revision} {plan.out_dtype} {plan.parallelism.tp}")
        #: output name -> (size, sha256) of every output written (resumed ones included)
        self.written: dict[str, tuple[int, str]] = self._journal.resume()
        self.schedule = Schedule(plan.needs, done=self.written, window=window)
        self._shards = Checkpoint(self.out_dir)
        self._progress = progress
        self._chunk_bytes = chunk_bytes
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._syncing = 0
        self._pool = ThreadPoolExecutor(
            max_workers=default_workers(workers), thread_name_prefix="overlap"
        )
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-sync")
        #: Peak bytes of shards held at once (arrived, not yet deleted).
        self.peak_shard_bytes = 0

    @property
    def skip(self) -> frozenset[str]:
        """Shards nothing left to write reads: not to be downloaded."""
        return self.schedule.skip

    @property
    def bytes_left(self) -> int:
        """Bytes of the outputs not written yet."""
        return self.plan.total_bytes - sum(size for size, _ in self.written.values())

    # --- hooks the fetch calls ------------------------------------------------------------

    def admit(self, rel: str) -> bool:
        """Wait until ``rel`` may start downloading (True); False after :data:`ADMIT_WAIT_S`
        without a change (asked again). A failed write is raised here."""
        with self._cond:
            self._raise_if_failed()
            admitted = self._cond.wait_for(
                lambda: self._error is not None or self.schedule.may_admit(rel), ADMIT_WAIT_S
            )
            self._raise_if_failed()
            return bool(admitted) and self.schedule.admit(rel)

    def arrived(self, rel: str, path: Path) -> None:
        """``rel`` arrived at ``path``, verified: check it, write what it completes."""
        if not self.schedule.reads(rel):
            return
        shard = OPENERS[self.plan.inventory.layout.name](path)
        try:
            self.plan.check_file(rel, shard.infos())
            with self._cond:
                self._raise_if_failed()
                self._shards.add(shard, only=self.plan.expected)
                held = sum(s.path.stat().st_size for s in self._shards.shards.values())
                self.peak_shard_bytes = max(self.peak_shard_bytes, held)
                self._follow(self.schedule.arrived(rel))
        except BaseException:
            if rel not in self._shards.shards:
                shard.close()
            raise

    # --- writing --------------------------------------------------------------------------

    def _follow(self, step: Step) -> None:
        """Delete the shards ``step`` releases and start the outputs it makes ready (lock held)."""
        for rel in step.delete:
            shard = self._shards.remove(rel)
            shard.close()
            shard.path.unlink(missing_ok=True)
        outputs = {out.name: out for out in self.plan.outputs if out.name in step.write}
        for name in step.write:
            self._pool.submit(self._write, outputs[name])
        self._cond.notify_all()

    def _write(self, out: OutputFile) -> None:
        try:
            size, digest = write_file(
                out, self._shards, self.out_dir, dtype=self.plan.np_dtype,
                progress=self._progress, chunk_bytes=self._chunk_bytes, stop=self._stop,
            )  # fmt: skip
            _start_writeback(self.out_dir / out.name)
            with self._cond:
                self.written[out.name] = (size, digest)
                self._syncing += 1
                self._follow(self.schedule.written(out.name))
            self._syncer.submit(self._sync, out.name, size, digest)
        except BaseException as exc:
            with self._cond:
                self._fail(exc)

    def _sync(self, name: str, size: int, digest: str) -> None:
        """fsync a written output, then journal it (one thread: the disk writes back while
        the writers go on)."""
        try:
            _fsync(self.out_dir / name)
            self._journal.record(name, size, digest)
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

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # --- the end --------------------------------------------------------------------------

    def finish(self) -> ConvertResult:
        """Wait for the last outputs and write config.ini (after the fetch returned). The
        outputs stay in ``out_dir`` with their journal until :meth:`move_into`."""
        with self._cond:
            while self._error is None and not (self.schedule.finished and not self._syncing):
                missing = self.schedule.missing()
                if missing:
                    raise self.plan.inventory.missing(missing)
                self._cond.wait()
            self._raise_if_failed()
        ini = self.plan.config_ini()
        (self.out_dir / CONFIG_INI).write_bytes(ini)
        digests = {**self.written, CONFIG_INI: (len(ini), hashlib.sha256(ini).hexdigest())}
        return ConvertResult.since(self.started, self.out_dir, self.plan, digests)

    def move_into(self, result: ConvertResult, directory: Path) -> ConvertResult:
        """Move the finished outputs to ``directory/<T>-gpu`` and drop the journal (a record
        for resuming, not part of the weights); returns ``result`` there."""
        final = Path(directory) / self.plan.output_dir_name
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.out_dir, final)
        (final / Journal.NAME).unlink()
        return ConvertResult(final, result.plan, result.digests, result.seconds)

    def close(self) -> None:
        """Stop the writers (waiting for the chunks in flight) and unmap the shards."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._syncer.shutdown(wait=True, cancel_futures=True)
        self._shards.close()

    def __enter__(self) -> OverlappedConversion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
