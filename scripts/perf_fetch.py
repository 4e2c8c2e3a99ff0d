#!/usr/bin/env python3
"""Where the CPU of a gs:// download goes, below Python: ``perf record`` of one
``model-loader fetch`` from the local GCS emulator (fake-gcs-server, 127.0.0.1), with call
graphs, summarised by what each sample was doing: the functions on its call chain (the socket
receive, the page-cache write, a page fault) or the library it was in (Python, CRC32C, libc).

The checkpoint is ``make bench-fetch``'s (random bytes, config.json plus shards, built once
under ``bench/work/fetch/src``). Every download starts on recently freed memory
(:func:`loader.bench.machine.recycle_pages`), as the other benchmarks do. Needs ``perf`` (Debian:
``linux-perf``) and permission to sample the kernel (root, or ``kernel.perf_event_paranoid`` <= 1).

Usage: ``python scripts/perf_fetch.py [--size-mib 1024] [--shards 4] [--repeat 2]
[--output FILE.md]``; prints a Markdown table (and writes it to ``--output``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_fetch import BUCKET, PREFIX, build_checkpoint  # noqa: E402

from tests.servers import GcsServer  # noqa: E402

#: What a sample was doing, from the functions on its call chain (first match wins): the
#: system calls and the fault that lead into the kernel's work. A copy (``rep_movs...``) is
#: then counted where it was called from, not as one anonymous kernel function.
CHAIN_KINDS = (
    (
        "kernel: socket receive (recv, TCP, copy to user)",
        re.compile(r"^(__x64_sys_recv\w*|__sys_recv\w*|sock_recvmsg|tcp_recvmsg\w*)$"),
    ),
    (
        "kernel: page-cache write (write, copy from user, folios)",
        re.compile(r"^(__x64_sys_p?write\w*|ksys_p?write\w*|vfs_write|generic_perform_write)$"),
    ),
    (
        "kernel: page faults (allocate and clear pages)",
        re.compile(r"^(asm_exc_page_fault|exc_page_fault|handle_mm_fault)$"),
    ),
    (
        "kernel: receiving on loopback (softirq, the sender's side)",
        re.compile(r"^(__do_softirq|net_rx_action|__netif_receive_skb\w*|tcp_v4_rcv)$"),
    ),
    (
        "kernel: futexes, epoll, scheduling",
        re.compile(r"^(__x64_sys_futex|__x64_sys_epoll_wait|schedule|__schedule)$"),
    ),
)


def _kind(chain: list[tuple[str, str]]) -> str:
    """``chain``: (symbol, dso), the sampled function first."""
    for name, pattern in CHAIN_KINDS:
        if any(pattern.match(symbol) for symbol, _ in chain):
            return name
    dso = Path(chain[0][1]).name if chain else "?"  # the object's name, not its folders
    if "kernel" in dso:
        return "kernel: other"
    if "crc32c" in dso:
        return "CRC32C (google-crc32c)"
    if "python" in dso:
        return "Python interpreter"
    if dso.startswith(("libc.", "libc-", "ld-linux")):
        return "libc (memcpy, malloc, ...)"
    return "other libraries"


_FRAME = re.compile(r"^\s+[0-9a-f]+ (.+?)(?:\+0x[0-9a-f]+)? \((.*)\)$")


def _samples(data: Path) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Samples by kind (:func:`_kind`) and by sampled function, from ``perf script``."""
    out = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "ip,sym,dso"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    kinds: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for block in out.split("\n\n"):
        chain = [(m[1], m[2]) for m in map(_FRAME.match, block.splitlines()) if m]
        if chain:
            kinds[_kind(chain)] += 1
            leaves[f"{chain[0][0]} ({Path(chain[0][1]).name})"] += 1
    return kinds, leaves


def _record(cmd: list[str], data: Path, frequency: int, env: dict) -> float:
    """Run ``cmd`` under ``perf record``; its CPU seconds (user + system)."""
    before = os.times()
    subprocess.run(
        ["perf", "record", "-q", "-F", str(frequency), "-g", "-o", str(data), "--", *cmd],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    after = os.times()
    return (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench" / "work" / "fetch")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="recorded pairs (default 2)")
    parser.add_argument("--frequency", type=int, default=2000, help="samples per second")
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (Debian: apt-get install linux-perf)")

    from loader.bench import machine

    work = args.work_dir.absolute()
    # The checkpoint and one a quarter its size: the difference is the cost per byte, without
    # the fixed cost of starting (imports, listing) that dominates small downloads.
    sizes = {"full": args.size_mib, "quarter": max(1, args.size_mib // 4)}
    sources = {
        name: build_checkpoint(work / ("src" if name == "full" else f"src-{name}"), mib,
                               args.shards)
        for name, mib in sizes.items()
    }  # fmt: skip
    nbytes = {name: sum(f.stat().st_size for f in files) for name, files in sources.items()}
    shutil.rmtree(work / "storage", ignore_errors=True)
    server = GcsServer(work).start()
    cpu: dict[str, list[float]] = {name: [] for name in sizes}
    kinds: dict[str, collections.Counter[str]] = {n: collections.Counter() for n in sizes}
    symbols: collections.Counter[str] = collections.Counter()
    try:
        for name, files in sources.items():
            server.upload_dir(BUCKET, f"{PREFIX}-{name}", files[0].parent)
        env = {**os.environ, "STORAGE_EMULATOR_HOST": server.url, "PYTHONPATH": str(ROOT)}
        load_before = os.getloadavg()[0]
        for i in range(args.repeat):
            for name in sizes:
                dest = work / "dest-perf"
                shutil.rmtree(dest, ignore_errors=True)
                machine.recycle_pages(work, nbytes[name])
                data = work / f"perf-{name}-{i}.data"
                uri = f"gs://{BUCKET}/{PREFIX}-{name}"
                cmd = [sys.executable, "-m", "loader", "fetch", uri, str(dest)]
                seconds = _record(cmd, data, args.frequency, env)
                found, leaves = _samples(data)
                # samples -> CPU seconds of this run, so runs of either size add up
                total = sum(found.values()) or 1
                kinds[name].update({k: n / total * seconds for k, n in found.items()})
                cpu[name].append(seconds)
                if name == "full":
                    symbols.update(leaves)
        load_after = os.getloadavg()[0]
    finally:
        server.stop()
    gb = {name: n / 1e9 for name, n in nbytes.items()}
    mean = {name: sum(v) / len(v) for name, v in cpu.items()}
    span = gb["full"] - gb["quarter"]
    lines = [
        f"`python scripts/perf_fetch.py --size-mib {args.size_mib} --shards {args.shards} "
        f"--repeat {args.repeat}`: `model-loader fetch` of {gb['full']:.2f} GB and of "
        f"{gb['quarter']:.2f} GB from the emulator, in turn, {args.repeat} times each, under "
        f"`perf record -g` at {args.frequency} Hz (its own cost included). CPU s per run: "
        f"{', '.join(f'{c:.2f}' for c in cpu['full'])} and "
        f"{', '.join(f'{c:.2f}' for c in cpu['quarter'])}; per GB beyond the fixed cost: "
        f"{(mean['full'] - mean['quarter']) / span:.2f}; load average {load_before:.2f} "
        f"before, {load_after:.2f} after.",
        "",
        "| what the samples were doing | CPU s, full | CPU s, quarter | CPU s per GB beyond "
        "the fixed cost |",
        "|---|---:|---:|---:|",
    ]
    for kind, _ in kinds["full"].most_common():
        full = kinds["full"][kind] / args.repeat
        quarter = kinds["quarter"][kind] / args.repeat
        lines.append(f"| {kind} | {full:.2f} | {quarter:.2f} | {(full - quarter) / span:.2f} |")
    lines += [
        "",
        "The functions sampled most (full size):",
        "",
        "| function (object) | share |",
        "|---|---:|",
    ]
    every = sum(symbols.values()) or 1
    for symbol, n in symbols.most_common(15):
        lines.append(f"| `{symbol}` | {n / every:.1%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output is not None:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
