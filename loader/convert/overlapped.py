"""The overlapped conversion: each output file is written as soon as the shards holding its
tensors have arrived and been verified, and each shard is deleted once every output that reads
it is written.

It follows the same :class:`~loader.convert.plan.ConversionPlan` as the sequential conversion
(made from ``config.json`` and the index, before any weight is downloaded) and consumes the
shards as a fetch delivers them (:class:`~loader.sources.ArrivalHooks`):

* ``arrived``: a verified shard's header is checked against the plan
  (:meth:`~loader.convert.plan.ConversionPlan.check_file`); every output whose shards are all
  here is handed to a small pool of writers (:func:`~loader.convert.writer.write_file`, which
  hashes as it writes, with :data:`loader.digest.DEFAULT`);
* ``admit``: blocks until the :class:`~loader.convert.schedule.Schedule` lets the shard start
  downloading (one at a time, at most ``window`` held);
* every finished output is fsynced (by one thread of its own, so the disk writes back while the
  writers go on), then recorded in a :class:`Journal` beside the outputs: a killed run's
  successor re-verifies those files (regular, same size, inode, mtime and digest), keeps them
  and does not download the shards only they read (``skip``).

The outputs are written into a directory of the download area, never where Triton looks;
:meth:`OverlappedConversion.move_into` moves them into the staging repository once
:meth:`OverlappedConversion.finish` returned. Memory stays bounded as in
:mod:`loader.convert.writer`: the shards are memory-mapped.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import logging
import os
import re
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loader import digest, fs, stages
from loader.checkpoint import OPENERS, Checkpoint
from loader.fs import Dir
from loader.progress import Progress
from loader.waits import WAIT_STEP_S

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


def _start_writeback(d: Dir, name: str) -> None:
    """Have the kernel start writing ``d/name`` back now, without waiting (the fsync that
    follows then finds its pages on their way, and the cache keeps no copy of weights already
    used)."""
    with d.open_read(name) as fh:
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _digest_in(d: Dir, name: str, algorithm: str) -> str:
    """The ``algorithm`` digest of the regular file ``d/name``, read through a descriptor (no
    link; anything but a regular file, a FIFO swapped in since the caller looked included, is
    refused, never opened to block)."""
    hasher = digest.new(algorithm)
    with d.open_read(name) as fh:
        while chunk := fh.read(digest.CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


_HEX64 = re.compile(r"[0-9a-f]{64}")
#: A journal line naming the staging directory the outputs moved into.
MOVED = "moved-into "
#: Where the outputs go inside a staging repository: ``<staging>/fastertransformer/1/<T>-gpu``.
WEIGHTS_IN_STAGING = ("fastertransformer", "1")


def staging_name(final: Path) -> str | None:
    """The staging directory's name for the outputs' place ``final`` in it (None: ``final``
    is not inside a repository's layout, so nothing can take the outputs back from there)."""
    parent = Path(final).parent
    if parent.parts[-len(WEIGHTS_IN_STAGING) :] != WEIGHTS_IN_STAGING:
        return None
    return parent.parents[len(WEIGHTS_IN_STAGING) - 1].name


@functools.cache
def converter_digest() -> str:
    """One SHA-256 over the code that decides what an output file holds: the converter
    (``loader/convert``), the checkpoint reader and the formats' facts (file names and bytes).
    A journal records it: outputs a loader with other such code wrote (a killed run, then the
    loader upgraded, a fix to a split or a check on the weights among the changes) are written
    again, never published as this loader's."""
    package = Path(__file__).resolve().parent.parent
    files = [
        *sorted((package / "convert").glob("*.py")),
        package / "checkpoint.py",
        *sorted((package / "formats").glob("*.py")),
    ]
    digest_ = hashlib.sha256()
    for path in files:
        data = path.read_bytes()
        digest_.update(f"{path.relative_to(package).as_posix()}\0{len(data)}\0".encode())
        digest_.update(data)
    return digest_.hexdigest()


class Journal:
    """The outputs written into a directory, recorded in a file beside it
    (``<directory>.journal``: never among the outputs, which move into a repository): a header
    naming what they were converted from (source revision, dtype, T), the digest's algorithm
    and the converter's code (:func:`converter_digest`), then ``name size digest inode mtime_ns`` per output, appended once the output is durable
    (fsynced), and ``moved-into <name>`` once the finished outputs were moved into the staging
    directory ``ROOT/.staging/<name>`` (from which a run killed before publishing gets them
    back: :meth:`moved_to`). Only names are recorded, never paths.

    The directory holding both is opened once (``parent``, or :meth:`Dir.open` of it: below a
    confined tree, one name at a time, never through a link) and every step is that
    descriptor and one name (:meth:`close` closes what it opened)."""

    SUFFIX = ".journal"

    def __init__(
        self,
        directory: Path,
        header: str,
        algorithm: str = digest.DEFAULT,
        *,
        parent: Dir | None = None,
    ) -> None:
        self.directory = Path(directory).absolute()
        self.path = self.directory.with_name(self.directory.name + self.SUFFIX)
        self.algorithm = algorithm
        #: a journal of another algorithm is not reused: its digests would not compare; nor
        #: one of other converter code: its outputs may hold what this code would not write
        self.header = f"{header} {algorithm} {converter_digest()}"
        self._given = parent
        self._parent: Dir | None = parent
        self._outputs: Dir | None = None
        #: output name -> the :data:`~loader.fs.Stamp` of each output :meth:`resume` kept, as
        #: it found it before reading it again (:attr:`ConvertResult.stamps`)
        self.stamps: dict[str, fs.Stamp] = {}

    def parent(self, *, create: bool = False) -> Dir:
        """The directory holding the outputs' directory and the journal, open."""
        if self._parent is None:
            self._parent = Dir.open(self.directory.parent, create=create)
        return self._parent

    def outputs(self) -> Dir:
        """The outputs' directory, open (made by :meth:`resume`)."""
        if self._outputs is None:
            self._outputs = self.parent().sub(self.directory.name, what="output directory")
        return self._outputs

    def close(self) -> None:
        if self._outputs is not None:
            self._outputs.close()
            self._outputs = None
        if self._parent is not None and self._parent is not self._given:
            self._parent.close()
        self._parent = self._given

    def _lines(self) -> list[str]:
        try:
            data = self.parent().read(self.path.name)
        except FileNotFoundError:
            return []
        except fs.TooLargeError:
            return []  # grown past any journal the loader writes: it tells nothing
        return [] if data is None else data.decode("utf-8", "replace").splitlines()

    def moved_to(self) -> str | None:
        """The staging directory (its name in ``ROOT/.staging``) the finished outputs were last
        moved into (a ``moved-into`` line), if any: one name, checked here (no ``/``, no
        ``..``, no NUL, no longer than a name can be: :func:`loader.fs.is_file_name`), never a
        path."""
        moves = [line[len(MOVED) :] for line in self._lines() if line.startswith(MOVED)]
        return moves[-1] if moves and fs.is_file_name(moves[-1]) else None

    def resume(self) -> dict[str, tuple[int, str]]:
        """The outputs a killed run finished, as name -> (size, digest): journaled under the
        same header, still regular files with the recorded size, inode and mtime, and holding
        the recorded digest (each is read once more: a resumed run is not the common path).
        Anything else in the directory is removed (a link there is unlinked, never followed),
        and the journal rewritten to list what was kept."""
        parent = self.parent(create=True)
        lines = self._lines()
        parent.mkdir(self.directory.name, exist_ok=True, what="output directory")
        d = self.outputs()
        kept = self._verified(d, lines[1:]) if lines[:1] == [self.header] else {}
        for name in d.names():
            if name not in kept:
                d.remove_tree(name)
        text = self.header + "\n" + "".join(self._line(n, s, h) for n, (s, h) in kept.items())
        tmp = self.path.name + ".tmp"
        parent.write(tmp, text.encode(), exclusive=False, sync=True)
        parent.rename(tmp, parent, self.path.name, how="replace")
        if kept:
            log.info("resuming: %d output file(s) already written in %s", len(kept), self.directory)
        return kept

    def _verified(self, d: Dir, lines: list[str]) -> dict[str, tuple[int, str]]:
        kept: dict[str, tuple[int, str]] = {}
        for line in lines:
            fields = line.split(" ")
            if len(fields) != 5 or fields[0] in kept:
                continue
            name, size, recorded, ino, mtime = fields
            if not fs.is_file_name(name) or name.startswith(".") or not _HEX64.fullmatch(recorded):
                continue
            found = d.lstat(name)
            if found is None or not stat.S_ISREG(found.st_mode):
                continue
            if [str(found.st_size), str(found.st_ino), str(found.st_mtime_ns)] != [size, ino,
                                                                                   mtime]:  # fmt: skip
                continue
            if _digest_in(d, name, self.algorithm) != recorded:
                log.warning("%s no longer holds what was written; writing it again", d.path / name)
                continue
            kept[name] = (int(size), recorded)
            self.stamps[name] = fs.stamp(found)
        return kept

    def record(self, name: str, size: int, digest: str) -> None:
        """Journal ``name`` as written; call once it is fsynced."""
        self.parent().append(self.path.name, self._line(name, size, digest).encode())

    def record_move(self, staging: str) -> None:
        """Journal that the outputs are about to move into the staging directory named
        ``staging`` (durably, before the move)."""
        if not fs.is_name(staging):
            raise ValueError(f"not a staging directory name: {staging!r}")
        self.parent().append(self.path.name, f"{MOVED}{staging}\n".encode(), sync=True)

    def _line(self, name: str, size: int, digest: str) -> str:
        found = self.outputs().lstat(name)
        if found is None:
            raise FileNotFoundError(
                errno.ENOENT, os.strerror(errno.ENOENT), str(self.directory / name)
            )
        return f"{name} {size} {digest} {found.st_ino} {found.st_mtime_ns}\n"


def _move_new(d: Dir, name: str, to: Dir, to_name: str) -> None:
    """Rename the directory ``d/name`` to the absent ``to/to_name``: whatever someone put
    there meanwhile (an empty directory, which ``rename(2)`` would replace, included) is
    refused (:class:`~loader.errors.NotOursError`) and left as it is."""
    try:
        d.rename(name, to, to_name, how="noreplace")
        return
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise to.not_ours(to_name, "nothing yet (the place of the converted weights)") from None
        if exc.errno not in fs.NO_RENAMEAT2:
            raise
    if to.lstat(to_name) is not None:  # without renameat2: looked at, then renamed
        raise to.not_ours(to_name, "nothing yet (the place of the converted weights)")
    d.rename(name, to, to_name, how="replace")


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
        self._journal = Journal(
            self.out_dir, f"{revision} {plan.out_dtype} {plan.parallelism.tp}", digest.DEFAULT
        )
        #: output name -> (size, digest) of every output written (resumed ones included)
        try:
            self.written: dict[str, tuple[int, str]] = self._journal.resume()
        except BaseException:
            self._journal.close()
            raise
        #: output name -> the stamp of the file its digest is of (:attr:`ConvertResult.stamps`)
        self.stamps: dict[str, fs.Stamp] = dict(self._journal.stamps)
        #: the outputs' directory, open: every output is a name in it
        self._out = self._journal.outputs()
        #: shard name -> its directory, open (a shard is deleted as a name in it)
        self._shard_dirs: dict[str, Dir] = {}
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
        with self._cond, stages.stage("fetch waits in admit"):
            self._raise_if_failed()
            admitted = self._cond.wait_for(
                lambda: self._error is not None or self.schedule.may_admit(rel), ADMIT_WAIT_S
            )
            self._raise_if_failed()
            return bool(admitted) and self.schedule.admit(rel)

    def arrived(self, rel: str, path: Path, checked: fs.Stamp | None = None) -> None:
        """``rel`` arrived at ``path``, verified (``checked``: the file verified, which the
        one opened must be: :func:`loader.fs.as_checked`): check it, write
        what it completes."""
        if not self.schedule.reads(rel):
            return
        with stages.stage("open + map + check shard"):
            where = Dir.open(Path(path).parent)  # below the download area: no link followed
            try:
                shard = OPENERS[self.plan.inventory.layout.name](path, checked)
            except BaseException:
                where.close()
                raise
        try:
            with stages.stage("open + map + check shard"):
                self.plan.check_file(rel, shard.infos())
            with self._cond:
                self._raise_if_failed()
                self._shards.add(shard, only=self.plan.expected)
                self._shard_dirs[shard.path.name] = where
                held = sum(s.size for s in self._shards.shards.values())
                self.peak_shard_bytes = max(self.peak_shard_bytes, held)
                self._follow(self.schedule.arrived(rel))
        except BaseException:
            if shard.path.name not in self._shard_dirs:
                shard.close()
                where.close()
            raise

    # --- writing --------------------------------------------------------------------------

    def _follow(self, step: Step) -> None:
        """Delete the shards ``step`` releases and start the outputs it makes ready (lock held)."""
        for rel in step.delete:
            shard = self._shards.remove(rel)
            with stages.stage("unmap + delete shard"):
                shard.close()
                with self._shard_dirs.pop(shard.path.name) as where:
                    where.unlink(shard.path.name, missing_ok=True)
        outputs = {out.name: out for out in self.plan.outputs if out.name in step.write}
        for name in step.write:
            self._pool.submit(self._write, outputs[name])
        self._cond.notify_all()

    def _write(self, out: OutputFile) -> None:
        try:
            size, hexdigest = write_file(
                out, self._shards, self._out, dtype=self.plan.np_dtype,
                progress=self._progress, chunk_bytes=self._chunk_bytes, stop=self._stop,
                algorithm=digest.DEFAULT, stamps=self.stamps,
            )  # fmt: skip
            assert hexdigest is not None
            with stages.stage("start writeback (fadvise)"):
                _start_writeback(self._out, out.name)
            with self._cond:
                # the shards it was read from (held until it is written) are the files
                # verified: only then is it journaled, for a later run to keep
                self._shards.as_checked()
                self.written[out.name] = (size, hexdigest)
                self._syncing += 1
                self._follow(self.schedule.written(out.name))
            self._syncer.submit(self._sync, out.name, size, hexdigest)
        except BaseException as exc:
            with self._cond:
                self._fail(exc)

    def _sync(self, name: str, size: int, digest: str) -> None:
        """fsync a written output, then journal it (one thread: the disk writes back while
        the writers go on)."""
        try:
            with stages.stage("fsync output", size):
                self._out.fsync_file(name)
            with stages.stage("journal"):
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
        with self._cond, stages.stage("wait for the last outputs"):
            while self._error is None and not (self.schedule.finished and not self._syncing):
                missing = self.schedule.missing()
                if missing:
                    raise self.plan.inventory.missing(missing)
                self._cond.wait(WAIT_STEP_S)  # a stop signal a worker thread got, in time
            self._raise_if_failed()
        ini = self.plan.config_ini()
        with stages.stage("config.ini"):
            self.stamps[CONFIG_INI] = self._out.write(CONFIG_INI, ini, exclusive=False, sync=True)
        digests = {**self.written, CONFIG_INI: (len(ini), digest.of_bytes(ini))}
        return ConvertResult.since(self.started, self.out_dir, self.plan, digests, self.stamps)

    def move_into(self, result: ConvertResult, directory: Path) -> ConvertResult:
        """Move the finished outputs to ``directory/<T>-gpu``; the journal beside them records
        where they went (a run killed before publishing gets them back from there,
        :meth:`Journal.moved_to`) and stays until the download directory is removed. Returns
        ``result`` there."""
        final = Path(directory).absolute() / self.plan.output_dir_name
        with Dir.open(final.parent, create=True) as to:  # one name at a time, no link
            staging = staging_name(final)
            if staging is not None:
                self._journal.record_move(staging)
            with stages.stage("move into staging"):
                _move_new(self._journal.parent(), self.out_dir.name, to, final.name)
        return dataclasses.replace(result, output_path=final)

    def close(self) -> None:
        """Stop the writers (waiting for the chunks in flight) and unmap the shards."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._syncer.shutdown(wait=True, cancel_futures=True)
        self._shards.close()
        for where in self._shard_dirs.values():
            where.close()
        self._shard_dirs.clear()
        self._journal.close()

    def __enter__(self) -> OverlappedConversion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
