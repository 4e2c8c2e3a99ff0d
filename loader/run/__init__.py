"""``model-loader run``: fetch -> verify -> convert -> build -> publish.

:func:`run` publishes one model repository under ``ROOT/<key>`` (see
:mod:`loader.repository.key`) and returns where it is. In order:

1. the key, and the FasterTransformer placement rules that need no model (nothing written);
   a local checkpoint is used in place, so it is verified here already (step 4);
2. if ``ROOT/<key>`` is complete and verified and its source still holds what it was built
   from (:mod:`loader.run.published`): nothing to do (unless ``force``);
3. take the key's publish lock (other loaders of the same key wait; see
   :mod:`loader.repository.lock`) and check again: the loader we waited for may have published;
4. **fetch** and **verify**: a :class:`~loader.run.strategies.Strategy` fetches what the
   verification needs (:mod:`loader.run.strategies`: everything, or only the small files when
   the conversion overlaps the download), and :func:`~loader.run.verify.verify` makes the
   conversion plan and checks the GPU memory and the tokenizer: still nothing written into
   ``ROOT`` but the lock;
5. **convert** the weights straight into a new staging directory (written once; free space is
   checked for everything the repository holds), then **build** the rest of the repository
   around them (:mod:`loader.run.build`: the model directories, ``manifest.json``, finally
   ``.ready``); a local source, read in place, is then hashed again: one that changed since
   it was first fingerprinted (weights or the tokenizer the build copied) publishes nothing;
6. **publish**: rename the staging directory to ``ROOT/<key>`` (atomic); the strategy removes
   its download directory ``WORK/<key>``.

A loader killed at any point leaves ``ROOT/<key>`` absent or complete; the next run removes the
leftover staging directory, takes over the dead loader's lock and completes (an overlapped
conversion resumes with the outputs it wrote). A loader whose lock was taken over (it stalled
past the expiry) stops with a :class:`~loader.errors.LockLostError` before publishing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from loader import fs, stages
from loader.errors import CorruptFileError, FileContentError, LockLostError, RepositoryError
from loader.fs import Dir
from loader.plan import check_placement
from loader.repository import layout, publish
from loader.repository.lock import PublishLock, lock_left
from loader.repository.prune import prune, try_lock
from loader.run.build import build
from loader.run.published import Warnings, up_to_date
from loader.run.request import VERIFY_MODES, RunRequest, RunResult
from loader.run.strategies import download_left, remove_download, strategy_for, unchanged
from loader.run.verify import Verified, verify
from loader.sources import FetchResult, fetch, fingerprint, parse_uri

log = logging.getLogger(__name__)

__all__ = ["VERIFY_MODES", "RunRequest", "RunResult", "run"]


def run(request: RunRequest) -> RunResult:
    """Publish ``request``'s repository (see the module docstring); with ``prune_keep``, then
    prune the root, keeping the key just published (:mod:`loader.repository.prune`). Below
    ``ROOT`` and ``--work-dir`` every path is entered one name at a time, never through a link
    (:func:`loader.fs.confined`); a local source is read as the user named it."""
    local = parse_uri(request.source)
    with (
        fs.confined(request.root, request.work_dir),
        fs.followed(local.location if local.scheme == "file" else None),
    ):
        return _run(request)


def _run(request: RunRequest) -> RunResult:
    started = time.monotonic()
    root, key = request.root, request.key
    target = publish.published_path(root, key)
    check_placement(request.parallelism, request.topology)
    if publish.replaced_copy_waiting(root, key):  # before the source is read: it may be down
        with PublishLock(
            root, key, expiry_s=request.lock_expiry_s, timeout_s=request.lock_timeout_s
        ):
            publish.recover(root, key)
    fetched: FetchResult | None = None
    verified: Verified | None = None
    if parse_uri(request.source).scheme == "file":
        fetched = fetch(request.source, None, workers=request.workers)
        verified = verify(request, fetched.path)
    log.info("model key %s", key)
    log.debug(
        "serving settings %s; placement checked for %s",
        request.settings.canonical(),
        request.topology,
    )
    warned = Warnings()  # the key is checked twice (before and under its lock): say things once
    if not request.force and up_to_date(target, key, request, warned):
        log.info("%s is already published and verified; nothing to do", target)
        _tidy(request, root, key)
        return _done(request, RunResult(target, key, False, time.monotonic() - started))
    _writable(root)
    with PublishLock(
        root, key, expiry_s=request.lock_expiry_s, timeout_s=request.lock_timeout_s
    ) as lock:
        publish.recover(root, key)
        if not request.force and up_to_date(target, key, request, warned):
            log.info("another loader published %s while this one waited; nothing to do", target)
            return _done(request, RunResult(target, key, False, time.monotonic() - started))
        with (
            _stops_if_lost(lock, request, key),
            strategy_for(request, root, key) as strategy,
            _blamed_on_the_source(lambda: fetched),
        ):
            publish.clear_leftovers(root, key, idle_s=request.lock_expiry_s)
            before = None
            if fetched is not None:  # a local source, read in place: fingerprinted first,
                before = fingerprint(request.source, workers=request.workers)
                verified = verify(request, fetched.path, again=verified)  # verified, read
            with stages.stage("run: fetch (what verify needs)"):
                fetched = fetched or strategy.fetch()
            with stages.stage("run: verify"):  # what the source holds now, nothing else
                verified = verified or verify(
                    request, fetched.path, listed=fetched.files, checked=fetched.stamps
                )
            with _staging(root, key) as (staging, made):
                # Entered by its path only while it is the very directory made (fs.pinned):
                # the converter and the build never write into one renamed to its name.
                with fs.pinned(staging, made):
                    with stages.stage("run: convert (overlapped: with the fetch)"):
                        converted = strategy.convert(verified, layout.weights_dir(staging))
                    publish.check_staging(staging, made)  # still the one this run made
                    with stages.stage("run: build (model dirs, manifest, .ready)"):
                        build(
                            staging,
                            request,
                            key=key,
                            source_revision=fetched.revision,
                            source_fingerprint=fetched.fingerprint
                            or before
                            or fingerprint(request.source, workers=request.workers),
                            verified=verified,
                            converted=converted,
                            expected=made,
                        )
                if before is not None:  # and still what it was once every file was read (the
                    # tokenizer is copied by the build): hashed again, never judged by the stat
                    # stamps of the first look (a write through a shared mapping changes bytes
                    # without moving mtime or ctime)
                    after = fingerprint(request.source, workers=request.workers)
                    unchanged(request.source, before, after)
                lock.check_held()
                with stages.stage("run: publish (rename to ROOT/<key>)"):
                    publish.publish(
                        staging, root, key, replace=publish.present(root, key), expected=made
                    )
    seconds = time.monotonic() - started
    log.info("published %s in %.1f s", target, seconds)
    return _done(request, RunResult(target, key, True, seconds))


@contextlib.contextmanager
def _blamed_on_the_source(fetched: Callable[[], FetchResult | None]) -> Iterator[None]:
    """A checkpoint file that does not parse although it matched the checksum its remote
    source lists (``fetched().origins``) is corrupt at that source: downloading it again gives
    the same bytes, so the error names the object and says to replace it there. A file whose
    content is refused otherwise (a config.json that is no JSON, a tensor in a dtype the loader
    does not read: :class:`~loader.errors.FileContentError`) is named by its object too, its
    download in parentheses. A file of a local source keeps the hint to copy it again."""
    try:
        yield
    except (CorruptFileError, FileContentError) as exc:
        origin = _origin(fetched(), exc.path)
        if origin is None or exc.origin is not None:
            raise
        raise exc.at_source(origin) from exc


def _origin(fetched: FetchResult | None, path: Path) -> str | None:
    """The remote object ``path`` (a file of ``fetched``) was verified against, if any."""
    if fetched is None or not fetched.origins:
        return None
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(fetched.path))
    if rel.startswith(".."):
        return None
    return fetched.origins.get(Path(rel).as_posix())


def _tidy(request: RunRequest, root: Path, key: str) -> None:
    """A key found published: what an interrupted run of it left (a staging directory, a
    download, its lock: one killed after it published) is removed, unless a loader holds the
    key's lock right now. A failure only leaves it for the next run or ``prune``: the key is
    published."""
    try:
        if (
            not publish.staging_left(root, key)
            and download_left(request, root, key) is None
            and not lock_left(root, key)
        ):
            return  # nothing to remove: nothing written (the volume may be read-only)
        lock = try_lock(root, key, request.lock_expiry_s)
    except (OSError, RepositoryError) as exc:
        log.warning("could not look for what an earlier run of %s left: %s", key, exc)
        return
    if lock is None:
        log.info("another loader holds the lock of %s: what an earlier run left is its own", key)
        return
    try:
        publish.clear_leftovers(root, key, idle_s=request.lock_expiry_s)
        remove_download(request, root, key)
    except (OSError, RepositoryError) as exc:
        log.warning("could not remove what an earlier run of %s left: %s", key, exc)
    finally:
        lock.release()


def _writable(root: Path) -> None:
    if not root.parent.is_dir():
        raise RepositoryError(
            f"The repository root {root} cannot be created: {root.parent} "
            f"{fs.not_a_directory(root.parent)}.",
            "Point --repository at the model repository volume (e.g. /models) or a folder "
            "inside an existing directory; the loader creates at most the root itself.",
        )
    with Dir.open(root, create=True):  # a failure here is the file system's typed error
        writable = os.access(root, os.W_OK)
    if not writable:
        raise RepositoryError(
            f"Cannot write to the repository root {root}.",
            "Point --repository at a writable directory (the loader mounts the volume "
            "read-write; Triton mounts it read-only).",
        )


@contextlib.contextmanager
def _stops_if_lost(lock: PublishLock, request: RunRequest, key: str) -> Iterator[None]:
    """A failure after the lock was taken over is reported as the lost lock it follows from."""
    try:
        yield
    except Exception as exc:
        try:
            lost = not lock.held()
        except OSError:
            lost = False  # cannot tell: the failure itself is reported
        if not isinstance(exc, LockLostError) and lost:
            raise LockLostError(
                f"The publish lock of {key} was taken over by another loader while this "
                f"one worked (it had stalled past its lock expiry, {request.lock_expiry_s:g} s); "
                f"it stopped without publishing ({type(exc).__name__})."
            ) from exc
        raise


@contextlib.contextmanager
def _staging(root: Path, key: str) -> Iterator[tuple[Path, publish.Identity]]:
    """A new staging directory for ``key`` and what it is (:func:`publish.identity`: the run
    builds, seals and publishes only that very directory), removed unless the block published
    it (a failure to remove it is logged: the error that stopped the run is the one reported,
    and the next loader of the key removes the leftover)."""
    staging = publish.new_staging_dir(root, key)
    log.info("staging the repository in %s", staging)
    made = None
    try:
        made = publish.identity(staging)
        yield staging, made
    except BaseException:
        try:
            publish.discard_staging(staging, key, made)
        except OSError as exc:
            log.warning("could not remove the staging directory %s: %s", staging, exc)
        raise


def _done(request: RunRequest, result: RunResult) -> RunResult:
    """With ``prune_keep``, prune the root keeping the key just published or verified."""
    if request.prune_keep is None:
        return result
    try:
        report = prune(
            request.root,
            keep=request.prune_keep,
            in_use=(result.key,),
            lock_expiry_s=request.lock_expiry_s,
        )
    except (OSError, RepositoryError) as exc:  # the model is published: pruning is a bonus
        log.warning("pruning %s failed: %s", request.repository, exc)
    else:
        log.info("pruned %s item(s), %s bytes", len(report.removed), report.bytes)
    return result
