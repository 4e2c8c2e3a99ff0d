"""How a checkpoint gets from its source into converted weights: two strategies with one
interface.

A :class:`Strategy` has two steps, around the verification of the checkpoint:

* :meth:`~Strategy.fetch`: what must be here to verify the checkpoint;
* :meth:`~Strategy.convert`: the weights, by the verified plan, into ``<into>/<T>-gpu``.

:class:`Sequential` fetches everything (a local source: nothing, it is used in place), then
converts (:func:`loader.convert.convert_planned`). :class:`Overlapped` fetches the small files
first, then the shards one by one, converting each output as soon as its shards are here
(:class:`loader.convert.overlapped.OverlappedConversion`); a checkpoint it cannot convert that
way (no index, or no dtype known before the tensors) it fetches whole and converts like
:class:`Sequential`.

:func:`strategy_for` picks one; used as a context manager it owns the download directory
``WORK/<key>`` (``WORK`` is ``--work-dir`` or ``ROOT/.work``): created and marked as the
loader's, removed once the block succeeded, kept after a failure so that the next run resumes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from loader import digest, fs
from loader.convert.overlapped import SLICE_BYTES, Journal, OverlappedConversion
from loader.convert.plan import ConvertResult
from loader.convert.schedule import DEFAULT_WINDOW
from loader.convert.sequential import convert_planned
from loader.errors import DirectoryRemovedError, NotOursError, TransientSourceError
from loader.formats.huggingface import WEIGHT_FILES, is_weight_file
from loader.fs import Dir
from loader.progress import byte_progress
from loader.repository import layout, publish
from loader.repository.key import key_filename
from loader.run.request import RunRequest
from loader.run.verify import Verified
from loader.sources import ArrivalHooks, FetchResult, fetch, parse_uri
from loader.sources.fingerprint import Fingerprint, describe_changes
from loader.sources.transfer import ensure_disk_space

log = logging.getLogger(__name__)

#: Source schemes whose fetch delivers files one by one (:class:`~loader.sources.ArrivalHooks`).
OVERLAP_SCHEMES = frozenset({"gs", "hf"})
#: The directory of a download directory that an overlapped conversion writes its outputs
#: (and their journals) into.
CONVERTED = "converted"


class Strategy(Protocol):
    def fetch(self) -> FetchResult:
        """Fetch what the verification needs; returns where the checkpoint is."""
        ...

    def convert(self, verified: Verified, into: Path) -> ConvertResult:
        """Convert the verified checkpoint into ``into/<T>-gpu``."""
        ...


class Sequential:
    """Fetch the whole checkpoint into ``download/source`` (None: a local checkpoint, used in
    place), then convert it."""

    def __init__(self, request: RunRequest, download: Path | None) -> None:
        self.request = request
        self.source = None if download is None else download / "source"
        #: the last fetch's result: the files it verified are the ones converted
        self._fetched: FetchResult | None = None

    def fetch(self, **options: object) -> FetchResult:
        request = self.request
        self._fetched = fetch(
            request.source,
            self.source,
            workers=request.workers,
            retry_deadline_s=request.retry_deadline_s,
            **options,  # type: ignore[arg-type]
        )
        return self._fetched

    def convert(self, verified: Verified, into: Path) -> ConvertResult:
        return convert_planned(
            verified.plan,
            into,
            workers=self.request.workers,
            reserve_bytes=verified.besides_weights,
            algorithm=digest.DEFAULT,  # for the manifest
            checked=self._fetched.stamps if self._fetched is not None else None,
        )


class Overlapped(Sequential):
    """Fetch the small files first, then convert while the shards download (see the module
    docstring). ``root`` is the repository root (the disk the outputs end up on)."""

    def __init__(self, request: RunRequest, download: Path, root: Path) -> None:
        super().__init__(request, download)
        self.root = root
        self.converted = download / CONVERTED
        self._first: FetchResult | None = None

    def fetch(self, **options: object) -> FetchResult:
        first = super().fetch(hooks=ArrivalHooks(include=lambda rel: not is_weight_file(rel)))
        # Sharded as the source lists it now (the download area may hold an earlier listing's).
        indexed = any(f.index in first.files for f in WEIGHT_FILES)
        if not indexed:
            log.info("%s is not sharded: converting after the download", self.request.source)
            return super().fetch()
        self._first = first
        return first

    def convert(self, verified: Verified, into: Path) -> ConvertResult:
        plan = verified.plan
        if self._first is None or plan.out_dtype is None:
            if self._first is not None:
                log.info(
                    "config.json of %s declares no dtype: converting after the download",
                    self.request.source,
                )
                _unchanged(self.request.source, self._first, super().fetch())
            return super().convert(verified, into)
        request, first = self.request, self._first
        with (
            byte_progress(f"convert {plan.output_dir_name}", plan.total_bytes) as progress,
            OverlappedConversion(
                plan,
                self.converted / plan.output_dir_name,
                revision=first.revision,
                progress=progress,
                workers=request.workers,
                window=DEFAULT_WINDOW,
            ) as conversion,
        ):
            shard_bytes = first.bytes // max(1, len(plan.inventory.files))
            ensure_disk_space(
                self.root,
                conversion.bytes_left
                + (conversion.schedule.window + 1) * shard_bytes
                + verified.besides_weights,
                what=f"converting {request.source} while it downloads",
            )
            log.info(
                "converting %s while it downloads: %d output file(s) to write, %d of %d "
                "shard(s) to fetch",
                request.source,
                len(plan.outputs) - len(conversion.written),
                len(plan.inventory.files) - len(conversion.skip),
                len(plan.inventory.files),
            )
            fetched = super().fetch(
                check_disk_space=False,
                slice_bytes=SLICE_BYTES,
                hooks=ArrivalHooks(
                    skip=conversion.skip,
                    arrived=conversion.arrived,
                    admit=conversion.admit,
                    transient=True,
                    planned=first.revision,  # the revision the outputs are journaled under
                ),
            )
            _unchanged(request.source, first, fetched)
            result = conversion.finish()
            log.info("shards held at once: at most %.1f MB", conversion.peak_shard_bytes / 1e6)
            return conversion.move_into(result, into)


def _unchanged(source: str, first: FetchResult, fetched: FetchResult) -> None:
    """The source must hold at the end of an overlapped fetch what it held at its start."""
    if first.fingerprint and fetched.fingerprint:
        unchanged(source, first.fingerprint, fetched.fingerprint)


def unchanged(source: str, before: Fingerprint, after: Fingerprint) -> None:
    """The source must hold after it was read what it held before, and no local file of it
    may have been written to meanwhile (its bytes while it was read may have been others: a
    :class:`~loader.errors.TransientSourceError` otherwise: nothing is published)."""
    changes = before.changes(after) + before.written(after)
    if changes:
        raise TransientSourceError(
            f"The source {source} changed while it was loading "
            f"({describe_changes(changes)}); nothing was published.",
            "Run the loader again once the upload (or copy) is complete.",
        )


@contextlib.contextmanager
def strategy_for(request: RunRequest, root: Path, key: str) -> Iterator[Strategy]:
    """The strategy for ``request`` (see the module docstring), with its download directory."""
    scheme = parse_uri(request.source).scheme
    if scheme == "file":
        yield Sequential(request, None)
        return
    download = _download_dir(request, root, key)
    _reclaim(download, root, key, idle_s=request.lock_expiry_s)
    overlap = request.overlap and scheme in OVERLAP_SCHEMES and _same_disk(download, root)
    yield Overlapped(request, download, root) if overlap else Sequential(request, download)
    try:
        _remove_download(download, key, area=not request.work_dir)
    except OSError as exc:  # the repository is published: the next run or prune removes it
        log.warning("could not remove the download directory %s: %s", download, exc)


def _same_disk(download: Path, root: Path) -> bool:
    """Whether the download directory is on ``ROOT``'s file system (both open as
    descriptors: the download directory entered from its anchor, never through a link)."""
    with Dir.open(download) as d, Dir.open(root) as r:
        return d.stat().st_dev == r.stat().st_dev


def _work(request: RunRequest, root: Path, *, create: bool = True) -> Dir:
    """``WORK``, open: ``--work-dir`` (the user's path, followed as given) or ``ROOT/.work``
    (the loader's: never through a link); without ``create`` a missing one is a
    ``FileNotFoundError``."""
    if request.work_dir:
        return Dir.open(Path(request.work_dir).absolute(), create=create)
    with Dir.open(root, create=create) as r:
        return r.sub(publish.WORK_DIR, create=create, what="download area")


def _download_dir(request: RunRequest, root: Path, key: str) -> Path:
    """``WORK/<key as one name>``, marked as created by the loader (see :func:`_remove_download`).
    One that exists without the loader's marker for ``key`` is not the loader's: a
    :class:`~loader.errors.NotOursError`, nothing written into it."""
    try:
        return _make_download_dir(request, root, key)
    except DirectoryRemovedError as exc:
        # Another loader's clean-up removes ``ROOT/.work`` once it is empty: the one this
        # loader had just opened. Made again, once (a link put there instead is refused).
        if request.work_dir or exc.directory != Path(root).absolute() / publish.WORK_DIR:
            raise
        log.info("%s was removed meanwhile (another loader cleared it); making it again",
                 exc.directory)  # fmt: skip
        return _make_download_dir(request, root, key)


def _make_download_dir(request: RunRequest, root: Path, key: str) -> Path:
    name = download_name(request, root, key)
    with _work(request, root) as work:
        for unfinished in work.unfinished_marked(name + ".", publish.DOWNLOAD_MARKER, key,
                                                 idle_s=request.lock_expiry_s):  # fmt: skip
            log.info("removing unfinished download directory %s", work.path / unfinished)
            work.remove_tree(unfinished, marks=(publish.DOWNLOAD_MARKER,))
        if work.is_dir(name) and not work.marked(name, publish.DOWNLOAD_MARKER, key):
            with contextlib.suppress(OSError):  # an empty directory holds nothing: made anew
                work.rmdir(name)
        if not work.make_marked(name, publish.DOWNLOAD_MARKER, key) and not work.marked(
            name, publish.DOWNLOAD_MARKER, key
        ):
            if work.is_dir(name):  # a directory whose marker is gone or names another key
                raise NotOursError(
                    work.path / name,
                    f"a directory without the loader's marker for {key} "
                    f"({publish.DOWNLOAD_MARKER} naming the key)",
                    "the loader's download directory",
                )
            raise work.not_ours(name, f"the loader's download directory for {key}")
        return work.path / name


def download_name(request: RunRequest, root: Path, key: str) -> str:
    """The download directory's name in ``WORK``: the key as one name; in a ``--work-dir``
    (which several repository roots may share) with the root's digest too, so that two roots
    never download the same key into one directory."""
    name = key_filename(key)
    if not request.work_dir:
        return name
    return f"{name}.{fs.host_digest(str(Path(root).absolute()))}"


def remove_download(request: RunRequest, root: Path, key: str) -> None:
    """Remove the download directory of ``key`` if one is there (a remote source's, left by
    an interrupted run) and the loader created it."""
    path = download_left(request, root, key)
    if path is not None:
        log.info("removing the download directory %s an earlier run left", path)
        _remove_download(path, key, area=not request.work_dir)


def download_left(request: RunRequest, root: Path, key: str) -> Path | None:
    """The download directory of ``key`` if one is there (reads only)."""
    if parse_uri(request.source).scheme == "file":
        return None
    name = download_name(request, root, key)
    try:
        with _work(request, root, create=False) as work:
            return work.path / name if work.lstat(name) is not None else None
    except (FileNotFoundError, NotADirectoryError):
        return None


def _remove_download(path: Path, key: str, *, area: bool) -> None:
    """Remove a download directory only if the loader created it for ``key``; then, with
    ``area`` (the download directory is in ``ROOT/.work``, the loader's), ``ROOT/.work`` if that
    is left empty. Nothing else under ``--work-dir`` is touched, nor that directory itself,
    whatever its name."""
    with Dir.open(path.parent) as work:
        if not work.marked(path.name, publish.DOWNLOAD_MARKER, key):
            log.info("keeping %s: this loader did not create it", path)
            return
        work.remove_tree(path.name, marks=(publish.DOWNLOAD_MARKER,))
        if area and path.parent.name == publish.WORK_DIR and not work.names():
            with Dir.open(path.parent.parent) as root, contextlib.suppress(OSError):
                root.rmdir(publish.WORK_DIR)  # other keys' downloads may arrive meanwhile


def _reclaim(download: Path, root: Path, key: str, *, idle_s: float) -> None:
    """Outputs of an overlapped conversion that a killed run had moved into its staging
    directory (:meth:`~loader.convert.overlapped.Journal.moved_to`) go back to
    ``download/converted``, so this run keeps them, before the staging directory is cleared as
    a leftover. Only from an abandoned staging directory of ``key`` that carries the loader's
    marker, named by one name in ``ROOT/.staging`` and reached from there one name at a time
    (never through a link): nothing a journal says leads anywhere else."""
    with Dir.open(download) as d:
        if d.lstat(CONVERTED) is None:
            return
        out = d.sub(CONVERTED)
    with out:
        journals = [n for n in out.names() if n.endswith(Journal.SUFFIX)]
        for name in journals:
            output = name[: -len(Journal.SUFFIX)]
            staging = Journal(out.path / output, "", parent=out).moved_to()
            if staging is None or not fs.is_name(output) or out.lstat(output) is not None:
                continue
            with Dir.open(root) as r:
                if not r.is_dir(publish.STAGING_DIR):
                    continue
                with r.sub(publish.STAGING_DIR) as base:
                    if not publish.owned(base, staging, key) or not publish.abandoned_in(
                        base, staging, key_filename(key), idle_s=idle_s
                    ):
                        continue
                    try:
                        weights = base.sub(staging).walk_in((layout.FASTERTRANSFORMER,
                                                             layout.VERSION))  # fmt: skip
                    except (FileNotFoundError, NotOursError):
                        continue
                    with weights:
                        if not weights.is_dir(output):
                            continue
                        weights.rename(
                            output, out, output, how="replace"
                        )  # rename(2): never onto a non-empty directory
            log.info("kept the outputs a stopped run had moved to %s", weights.path / output)
