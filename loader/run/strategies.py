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
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from loader.convert.overlapped import SLICE_BYTES, OverlappedConversion
from loader.convert.plan import ConvertResult
from loader.convert.schedule import DEFAULT_WINDOW
from loader.convert.sequential import convert_planned
from loader.errors import TransientSourceError
from loader.formats.huggingface import WEIGHT_FILES, is_weight_file
from loader.progress import byte_progress
from loader.repository import publish
from loader.repository.key import key_filename
from loader.run.request import RunRequest
from loader.run.verify import Verified
from loader.sources import ArrivalHooks, FetchResult, fetch, parse_uri
from loader.sources.fingerprint import describe_changes
from loader.sources.transfer import ensure_disk_space

log = logging.getLogger(__name__)

#: Source schemes whose fetch delivers files one by one (:class:`~loader.sources.ArrivalHooks`).
OVERLAP_SCHEMES = frozenset({"gs", "hf"})


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

    def fetch(self, **options: object) -> FetchResult:
        request = self.request
        return fetch(
            request.source,
            self.source,
            workers=request.workers,
            retry_deadline_s=request.retry_deadline_s,
            **options,  # type: ignore[arg-type]
        )

    def convert(self, verified: Verified, into: Path) -> ConvertResult:
        return convert_planned(
            verified.plan,
            into,
            workers=self.request.workers,
            reserve_bytes=verified.besides_weights,
        )


class Overlapped(Sequential):
    """Fetch the small files first, then convert while the shards download (see the module
    docstring). ``root`` is the repository root (the disk the outputs end up on)."""

    def __init__(self, request: RunRequest, download: Path, root: Path) -> None:
        super().__init__(request, download)
        self.root = root
        self.converted = download / "converted"
        self._first: FetchResult | None = None

    def fetch(self, **options: object) -> FetchResult:
        first = super().fetch(hooks=ArrivalHooks(include=lambda rel: not is_weight_file(rel)))
        if not any((first.path / f.index).is_file() for f in WEIGHT_FILES):
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
                ),
            )
            _unchanged(request.source, first, fetched)
            result = conversion.finish()
            log.info("shards held at once: at most %.1f MB", conversion.peak_shard_bytes / 1e6)
            return conversion.move_into(result, into)


def _unchanged(source: str, first: FetchResult, fetched: FetchResult) -> None:
    """The source must hold at the end of an overlapped fetch what it held at its start."""
    if first.fingerprint and fetched.fingerprint:
        changes = first.fingerprint.changes(fetched.fingerprint)
        if changes:
            raise TransientSourceError(
                f"The source {source} changed while it was loading "
                f"({describe_changes(changes)}); nothing was published.",
                "Run the loader again once the upload is complete.",
            )


@contextlib.contextmanager
def strategy_for(request: RunRequest, root: Path, key: str) -> Iterator[Strategy]:
    """The strategy for ``request`` (see the module docstring), with its download directory."""
    scheme = parse_uri(request.source).scheme
    if scheme == "file":
        yield Sequential(request, None)
        return
    download = _download_dir(request, root, key)
    overlap = (
        request.overlap
        and scheme in OVERLAP_SCHEMES
        and download.stat().st_dev == root.stat().st_dev
    )
    yield Overlapped(request, download, root) if overlap else Sequential(request, download)
    _remove_download(download, root)


def _download_dir(request: RunRequest, root: Path, key: str) -> Path:
    """``WORK/<key as one name>``, marked as created by the loader (see :func:`_remove_download`)."""
    work = Path(request.work_dir).absolute() if request.work_dir else root / publish.WORK_DIR
    path = work / key_filename(key)
    if not path.exists():
        path.mkdir(parents=True)
        (path / publish.DOWNLOAD_MARKER).write_text(f"{key}\n")
    return path


def _remove_download(path: Path, root: Path) -> None:
    """Remove a download directory only if the loader created it; then ``ROOT/.work`` if
    that is left empty. Nothing else under ``--work-dir`` is touched."""
    if not (path / publish.DOWNLOAD_MARKER).is_file():
        log.info("keeping %s: this loader did not create it", path)
        return
    shutil.rmtree(path, ignore_errors=True)
    if path.parent == root / publish.WORK_DIR:
        with contextlib.suppress(OSError):  # other keys' downloads are there
            path.parent.rmdir()
