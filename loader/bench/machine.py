"""What every benchmark result records about where it ran, and where it may be written.

A figure means little without the machine and its load: :func:`describe` gives the CPUs, the
platform, Python and the 1-minute load average, and :class:`LoadWatch` the load before and
after a run. :func:`output_file` keeps a benchmark from writing over committed results unless
asked: by default results go under ``bench/work/``, and a file that exists is replaced only
with ``--overwrite``.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from loader.errors import LoaderError

#: Where results go unless a directory is given (never a committed folder).
WORK_RESULTS = Path("bench") / "work" / "results"


def load_average() -> float:
    return os.getloadavg()[0]


def describe() -> dict[str, object]:
    """The machine in a few fields (written beside every result)."""
    return {
        "cpus": os.cpu_count(),
        "platform": f"{platform.system().lower()} {platform.machine()}",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


class LoadWatch:
    """The 1-minute load average when created and when :meth:`stop` is called."""

    def __init__(self) -> None:
        self.before = load_average()
        self.after: float | None = None

    def stop(self) -> dict[str, float]:
        self.after = load_average()
        return {"load_before": round(self.before, 1), "load_after": round(self.after, 1)}

    def words(self) -> str:
        after = self.after if self.after is not None else load_average()
        return f"1-minute load average {self.before:.1f} before, {after:.1f} after"


def output_file(directory: Path | None, name: str, *, root: Path, overwrite: bool) -> Path:
    """``directory/name`` (default ``<root>/bench/work/results``); an existing file is kept
    unless ``overwrite`` (committed results are regenerated on purpose, never by accident)."""
    path = Path(directory or root / WORK_RESULTS) / name
    if path.exists() and not overwrite:
        raise LoaderError(
            f"{path} holds the result of an earlier run",
            "Pass another --output-dir (the default is bench/work/results), or --overwrite "
            "to replace it.",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def output_files(
    directory: Path | None, names: Sequence[str], *, root: Path, overwrite: bool
) -> list[Path]:
    """:func:`output_file` for a benchmark script: a refusal is printed as ``error:`` and
    ``hint:`` lines and ends the script with exit code 2."""
    try:
        return [output_file(directory, n, root=root, overwrite=overwrite) for n in names]
    except LoaderError as exc:
        print(f"error: {exc.message}\nhint: {exc.remediation}", file=sys.stderr)
        raise SystemExit(2) from exc
