"""Local checkpoints: ``file:///abs/path`` and plain paths.

A local directory is used in place: :func:`fetch_source` checks that it exists and is a
directory and returns it without copying (``dest`` is unused). With ``copy=True`` its files are
copied under ``dest`` (each to a temporary name, then renamed), skipping files already there
with the same size and content.
"""

from __future__ import annotations

import filecmp
import logging
import shutil
from pathlib import Path

from loader.errors import SourceError, SourceNotFoundError
from loader.progress import byte_progress
from loader.sources import FetchOptions, FetchResult, SourceURI
from loader.sources.transfer import (
    PARTIAL_DIR,
    clear_partials,
    ensure_disk_space,
    place,
    temporary_download,
)

log = logging.getLogger(__name__)


def list_files(root: Path) -> list[str]:
    """Regular files under ``root`` as sorted POSIX relative paths, hidden entries excluded."""
    files = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        files.append(rel.as_posix())
    return sorted(files)


def fetch_source(uri: SourceURI, dest: Path | None, options: FetchOptions) -> FetchResult:
    root = Path(uri.location)
    if not root.exists():
        raise SourceNotFoundError(
            f"Local source {root} (from {uri.raw!r}) does not exist.",
            "Check the path; it must be a checkpoint directory readable by the loader.",
        )
    if not root.is_dir():
        raise SourceNotFoundError(
            f"Local source {root} (from {uri.raw!r}) is not a directory.",
            "Point the loader at the checkpoint directory (the one holding config.json), "
            "not at a single file.",
        )
    files = list_files(root)
    total = sum((root / f).stat().st_size for f in files)
    if not options.copy:
        log.info("using local checkpoint %s in place (%s files)", root, len(files))
        return FetchResult(path=root, revision=None, files=files, bytes=total)
    if dest is None:
        raise SourceError(
            "Copying a local source needs a destination directory.",
            "Pass a destination (model-loader fetch URI DEST).",
        )
    return _copy(root, dest.absolute(), files, total, options)


def _copy(
    root: Path, dest: Path, files: list[str], total: int, options: FetchOptions
) -> FetchResult:
    if dest.resolve() == root.resolve():
        return FetchResult(path=root, revision=None, files=files, bytes=total)
    dest.mkdir(parents=True, exist_ok=True)
    clear_partials(dest)
    todo = [f for f in files if not _same(root / f, dest / f)]
    needed = sum((root / f).stat().st_size for f in todo)
    if options.check_disk_space:
        ensure_disk_space(dest, needed, what=f"copying {root}")
    log.info("copying %s of %s files from %s to %s", len(todo), len(files), root, dest)
    with byte_progress(f"copy {root.name}", needed) as progress:
        for rel in todo:
            with temporary_download(dest, rel) as tmp:
                shutil.copyfile(root / rel, tmp)
                if not filecmp.cmp(root / rel, tmp, shallow=False):
                    raise SourceError(
                        f"Copy of {root / rel} differs from its source.",
                        "Check the disks (the copy was discarded) and run again.",
                    )
                place(tmp, dest / rel)
            progress.update((dest / rel).stat().st_size)
    shutil.rmtree(dest / PARTIAL_DIR, ignore_errors=True)
    return FetchResult(path=dest, revision=None, files=files, bytes=total, downloaded_bytes=needed)


def _same(src: Path, dst: Path) -> bool:
    return (
        dst.is_file()
        and dst.stat().st_size == src.stat().st_size
        and filecmp.cmp(src, dst, shallow=False)
    )
