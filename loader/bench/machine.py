"""What every benchmark result records about where it ran, and where it may be written.

A figure means little without the machine and its load: :func:`describe` gives the CPUs, the
platform, Python and the 1-minute load average, and :class:`LoadWatch` the load before and
after a run. :func:`output_file` keeps a benchmark from writing over committed results unless
asked: by default results go under ``bench/work/``, and a file that exists is replaced only
with ``--overwrite``.

On a shared machine wall time moves with the other work, CPU time much less: :func:`measured`
runs a command and reports both, the CPU seconds (user + system) of its whole process tree and
the load it started under. :func:`loader_env` runs the loader of another checkout (the code
before a change) in the same invocation, so that a before/after ratio comes from runs side by
side.

On a virtual machine whose hypervisor takes back free memory (virtio-balloon's free page
reporting: pages left free for a couple of seconds are handed back), the first touch of such a
page costs the guest several times a normal write: writing 1 GiB into the page cache took 1.3
to 2.1 CPU s after 5 s idle and 0.26 to 0.35 CPU s right after another 1 GiB was written and
deleted. :func:`recycle_pages` gives every benchmarked command the same start (recently freed
pages, as a busy host has), so a ratio between two commands measures them, not which of them
ran after a pause.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loader.errors import LoaderError

#: Where results go unless a directory is given (never a committed folder).
WORK_RESULTS = Path("bench") / "work" / "results"


def load_average() -> float:
    return os.getloadavg()[0]


def pressure(resource: str) -> float | None:
    """The share of the last 10 s in which some task waited for ``resource`` ("io", "cpu",
    "memory"; the kernel's pressure stall information), in percent; None where it keeps none.
    A disk saturated by another workload shows here when the load average hides it."""
    try:
        with open(f"/proc/pressure/{resource}") as fh:
            first = fh.readline().split()
        return float(dict(f.split("=") for f in first[1:])["avg10"])
    except (OSError, KeyError, ValueError):
        return None


#: One write of :func:`recycle_pages`.
_RECYCLE_CHUNK = 16 * 1024 * 1024


def add_cold_pages_option(parser: argparse.ArgumentParser) -> None:
    """``--cold-pages``: a benchmark's commands start on free memory as found instead of on
    memory :func:`recycle_pages` freed just before."""
    parser.add_argument(
        "--cold-pages",
        action="store_true",
        help="start each command with the free memory as found, not recycled just before "
        "(on a VM that hands free memory back, its first touch costs several times more)",
    )


def recycle_pages(directory: Path, nbytes: int) -> None:
    """Write ``nbytes`` into a scratch file in ``directory`` and delete it (never flushed: the
    pages are dropped dirty), so the next command's writes and allocations get recently freed
    pages instead of ones the hypervisor may have taken back meanwhile (see above)."""
    chunk = bytes(_RECYCLE_CHUNK)
    path = Path(directory) / f".recycle-pages-{os.getpid()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
    finally:
        os.close(fd)
        path.unlink()


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


def written_bytes() -> int | None:
    """Bytes this process and its exited, waited-for children sent (or were about to send) to
    storage: written minus cancelled (pages of a file deleted before the kernel wrote them
    back), from /proc/self/io; None where the kernel does not account it."""
    try:
        with open("/proc/self/io") as fh:
            fields = dict(line.split(": ", 1) for line in fh.read().splitlines() if ": " in line)
        return int(fields["write_bytes"]) - int(fields["cancelled_write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def children_cpu_seconds() -> tuple[float, float]:
    """User and system CPU seconds of this process's children that have exited and been
    waited for (their own waited-for children included): the whole tree of a command once it
    ended. System time is the kernel's work for it: copies into and out of the page cache,
    page faults, and reclaiming memory when the machine has little free (which other work on
    a shared machine makes vary)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime, usage.ru_stime


@dataclass(frozen=True)
class Measured:
    """One run of a command: wall seconds, CPU seconds of its process tree, the bytes it wrote
    to storage (:func:`written_bytes`), the 1-minute load average it started under, and its
    exit code and output."""

    seconds: float
    user_s: float
    sys_s: float
    disk_write_bytes: int | None
    load: float
    returncode: int
    stdout: str
    stderr: str

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "seconds": round(self.seconds, 3),
            "cpu_s": round(self.cpu_s, 3),
            "user_s": round(self.user_s, 3),
            "sys_s": round(self.sys_s, 3),
            "disk_write_bytes": self.disk_write_bytes,
            "load": round(self.load, 1),
        }


def measured(
    argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Measured:
    """Run ``argv`` to its end (output captured) and measure it (see :class:`Measured`). Run
    one at a time: the CPU seconds are those of every child waited for meanwhile."""
    load = load_average()
    user, sys_ = children_cpu_seconds()
    written = written_bytes()
    started = time.perf_counter()
    proc = subprocess.run(
        list(argv), env=env, cwd=cwd, capture_output=True, text=True, errors="backslashreplace"
    )
    seconds = time.perf_counter() - started
    after = written_bytes()
    user_after, sys_after = children_cpu_seconds()
    return Measured(
        seconds=seconds,
        user_s=user_after - user,
        sys_s=sys_after - sys_,
        disk_write_bytes=None if written is None or after is None else after - written,
        load=load,
        returncode=proc.returncode,
        stdout=proc.stdout,
        stderr=proc.stderr,
    )


def loader_env(checkout: Path | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment under which ``python -m loader`` runs the package of ``checkout`` (None:
    this one), checked by importing it: a ``--baseline`` that holds no ``loader`` package, or
    that this interpreter would not pick, ends the benchmark with exit code 2. Run the commands
    in a directory without a ``loader`` package of its own (Python looks there first)."""
    env = dict(os.environ if env is None else env)
    if checkout is None:
        return env
    checkout = Path(checkout).resolve()
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [env.get("PYTHONPATH")])])
    found = subprocess.run(
        [sys.executable, "-c", "import loader; print(loader.__file__)"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not found or Path(found).resolve().parent.parent != checkout:
        print(
            f"error: {checkout} is not a checkout whose loader package this Python imports "
            f"(it imports {found or 'nothing'})\nhint: pass the root of a checkout of this "
            "project (git worktree add, or git archive of a commit unpacked), whose "
            "dependencies this virtualenv has",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return env
