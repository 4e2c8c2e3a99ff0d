#!/usr/bin/env python3
"""Converter benchmark: ``model-loader convert`` against a plain ``cp`` of the same bytes.

Builds (once, cached under ``bench/work/``) a synthetic fp16 GPT-J checkpoint of about 2 GB as
sharded safetensors with random weights, then in one run measures, ``--repeat`` rounds of:

* ``cp`` of the weight files (the I/O limit of this machine),
* ``model-loader convert`` at T=1 and T=2, with the source dtype,
* ``cp`` of the weight files twice (as many bytes as the fp32 files: their I/O limit),
* ``model-loader convert`` at T=1 and T=2 with ``--dtype fp32``,

(with ``--baseline CHECKOUT``, each convert also with that checkout's loader, in the same
rounds) and prints per row: seconds (the fastest run, each started after ``sync`` and on
recently freed memory, :func:`loader.bench.machine.recycle_pages`; ``--cold-pages``: as
found), CPU seconds
(user + system of the process tree, median) and CPU seconds per GB written, MB/s (bytes written
per second), the efficiency convert/cp (throughput against the cp row above it), the peak
anonymous memory (RssAnon summed over the process tree, sampled from ``/proc`` every 50 ms)
against the bound ``2 x largest tensor + 256 MiB``, and the median 1-minute load average the
runs started under. The source files are read once before timing so every run starts from the
page cache, like ``cp`` does. With a baseline, each convert's CPU seconds are also given as a
share of the baseline's, round by round.

The goals, within the memory bound: convert/cp >= 0.9 for the rows that keep the source dtype
(a conversion that computes no digest moves bytes about as cheaply as ``cp``), >= 0.5 for the
rows that cast to fp32. The summary says whether they were met and, when not, which row missed
and by how much, with the machine's load average (a busy machine slows the CPU-bound convert
more than ``cp``); the exit code is then 3. Results go to ``convert.json`` in ``--output-dir``
(default ``bench/work/results``).

Usage: ``make bench-convert`` or ``python scripts/bench_convert.py [--layers N] [--repeat N]
[--baseline CHECKOUT] [--output-dir DIR [--overwrite]]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loader.bench import machine  # noqa: E402

MIB = 2**20

# GPT-J-like shape: n_embd 2048, 16 heads, inter 8192, vocab 50400; 16 layers ~ 2.0 GB in fp16.
CONFIG = {
    "model_type": "gptj",
    "architectures": ["GPTJForCausalLM"],
    "n_embd": 2048,
    "n_head": 16,
    "n_inner": 8192,
    "rotary_dim": 64,
    "vocab_size": 50400,
    "n_positions": 2048,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
    "tie_word_embeddings": False,
    "dtype": "float16",
}


def tensor_shapes(config: dict, layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, as the converter expects them."""
    from loader.convert import get_architecture
    from loader.parallel import Parallelism

    arch = get_architecture(config["model_type"])
    cfg = arch.ft_config({**config, "n_layer": layers}, parallelism=Parallelism(), model_name="b")
    return arch.expected_tensors(cfg)


def write_safetensors(
    path: Path, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator
) -> None:
    """A safetensors file of random finite fp16 values (|x| < 2), written in 32 MiB pieces."""
    from loader.checkpoint import safetensors_header

    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as fh:
        fh.write(safetensors_header(shapes.items(), "fp16"))
        for shape in shapes.values():
            left = int(np.prod(shape))
            while left:
                n = min(left, 16 * MIB)
                bits = rng.integers(0, 2**16, n, dtype=np.uint16) & np.uint16(0xBBFF)
                fh.write(bits.tobytes())
                left -= n
    tmp.rename(path)


def build_checkpoint(directory: Path, layers: int) -> tuple[int, int]:
    """Write the checkpoint (if not already there); returns (weight bytes, largest tensor bytes)."""
    shapes = tensor_shapes(CONFIG, layers)
    sizes = {n: int(np.prod(s)) * 2 for n, s in shapes.items()}
    config = {**CONFIG, "n_layer": layers}
    marker = directory / ".complete"
    if marker.is_file() and json.loads(marker.read_text()) == config:
        print(f"using the checkpoint in {directory}", flush=True)
    else:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        print(f"writing a synthetic fp16 GPT-J checkpoint to {directory} ...", flush=True)
        rng = np.random.default_rng(0)
        shards: list[dict[str, tuple[int, ...]]] = [{}]
        size = 0
        for name, shape in shapes.items():
            if shards[-1] and size + sizes[name] > 1000 * MIB:
                shards.append({})
                size = 0
            shards[-1][name] = shape
            size += sizes[name]
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(directory / fname, shard, rng)
            weight_map.update(dict.fromkeys(shard, fname))
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (directory / "config.json").write_text(json.dumps(config, indent=1))
        marker.write_text(json.dumps(config))
    return sum(sizes.values()), max(sizes.values())


# --- measuring ---------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                kids += [int(x) for x in fh.read().split()]
    except OSError:
        pass
    return kids


def _rss_anon_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_anon(pid: int) -> int:
    """RssAnon of ``pid`` and all its descendants, in bytes."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += _rss_anon_kib(p)
        stack += _children(p)
    return total * 1024


def measure(
    cmd: list[str], env: dict[str, str], cwd: Path, recycle: int = 0
) -> tuple[float, float, int, float]:
    """Run ``cmd`` (with ``recycle`` bytes: on that much recently freed memory,
    :func:`loader.bench.machine.recycle_pages`); return (wall seconds, CPU seconds, peak
    RssAnon of its process tree, the 1-minute load average it started under)."""
    peak = 0
    subprocess.run(["sync"], check=True)  # start without another run's dirty pages to flush
    if recycle:
        machine.recycle_pages(cwd, recycle)
    load = machine.load_average()
    cpu = sum(machine.children_cpu_seconds())
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env, cwd=cwd)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss_anon(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = proc.wait()
    seconds = time.monotonic() - started
    done.set()
    sampler.join()
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {rc}")
    return seconds, sum(machine.children_cpu_seconds()) - cpu, peak, load


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def warm(path: Path) -> None:
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 * MIB):
                pass


#: Efficiency goals (convert/cp throughput): keeping the source dtype, and casting to fp32.
GOAL_SAME_DTYPE = 0.9
GOAL_CAST = 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench" / "work" / "convert")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16 ~ 2 GB)")
    parser.add_argument("--workers", type=int, default=None, help="passed to model-loader convert")
    parser.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="rounds; the fastest run counts (CPU seconds: the median; peak memory: the highest)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="also convert with the loader of this checkout (the code before a change), in the "
        "same rounds, and report this loader's CPU time as a share of its",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="where convert.json goes (bench/work/results)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier convert.json")
    machine.add_cold_pages_option(parser)
    args = parser.parse_args()

    [results] = machine.output_files(
        args.output_dir, ["convert.json"], root=ROOT, overwrite=args.overwrite
    )
    watch = machine.LoadWatch()
    work: Path = args.work_dir.absolute()
    source = work / "gptj-fp16"
    weight_bytes, largest = build_checkpoint(source, args.layers)
    bound = 2 * largest + 256 * MIB
    envs = {"": machine.loader_env(None)}
    if args.baseline is not None:
        envs[" [baseline]"] = machine.loader_env(args.baseline)
    loader = [sys.executable, "-m", "loader", "-q", "convert"]
    extra = ["--workers", str(args.workers)] if args.workers else []
    # (label, T, dtype, copies for cp, environment): fp32 files are twice the bytes, so their
    # I/O limit is a cp of twice the bytes (the weight files copied twice).
    runs = []
    for dtype, copies, cp_label in ((None, 1, "cp"), ("fp32", 2, "cp x2 (fp32-sized)")):
        runs.append((cp_label, None, None, copies, envs[""]))
        for tp in (1, 2):
            for suffix, env in envs.items():
                label = f"convert T={tp}" + (f" --dtype {dtype}" if dtype else "") + suffix
                runs.append((label, tp, dtype, 0, env))
    warm(source)
    # Every command starts on recently freed memory, as much as the fp32 rows write.
    recycle = 0 if args.cold_pages else 2 * weight_bytes + 512 * MIB
    measured: dict[str, list[tuple[float, float, int, int, float]]] = {r[0]: [] for r in runs}
    for round_ in range(args.repeat):
        print(f"round {round_ + 1} of {args.repeat}:", flush=True)
        for label, tp, dtype, copies, env in runs:
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            if tp is None:
                files = [str(f) for f in sorted(source.glob("*.safetensors"))]
                script = ";".join(f'mkdir {out}/{i} && cp "$@" {out}/{i}' for i in range(copies))
                cmd = ["sh", "-c", script, "cp", *files]
            else:
                cmd = [*loader, str(source), str(out), "--tp-size", str(tp), *extra]
                cmd += ["--dtype", dtype] if dtype else []
            seconds, cpu, peak, load = measure(cmd, env, work, recycle)
            written = dir_bytes(out)
            shutil.rmtree(out, ignore_errors=True)
            measured[label].append((seconds, cpu, written, peak, load))
            print(f"  {label:<36} {seconds:7.2f} s {cpu:7.2f} CPU s   load {load:4.1f}", flush=True)

    rows = []
    cp_rate = None
    for label, tp, _dtype, _copies, _env in runs:
        done = measured[label]
        seconds, _cpu, written, _peak, _load = min(done)
        cpu = statistics.median(d[1] for d in done)
        peak = max(d[3] for d in done)
        load = statistics.median(d[4] for d in done)
        rate = written / 1e6 / seconds
        if tp is None:
            cp_rate = rate  # the baseline of the convert runs below it
        rows.append({
            "run": label, "seconds": round(seconds, 2), "cpu_s": round(cpu, 2),
            "cpu_s_per_gb": round(cpu / (written / 1e9), 2), "written_bytes": written,
            "mb_per_s": round(rate), "vs_cp": round(rate / (cp_rate or rate), 2),
            "peak_rss_anon_mib": round(peak / MIB), "load": round(load, 1),
        })  # fmt: skip
    shares = {}
    if args.baseline is not None:
        for label, tp, _dtype, _copies, _env in runs:
            if tp is None or label.endswith(" [baseline]"):
                continue
            ours = [d[1] for d in measured[label]]
            theirs = [d[1] for d in measured[label + " [baseline]"]]
            per_round = [a / b for a, b in zip(ours, theirs, strict=True)]
            shares[label] = {
                "median": round(statistics.median(per_round), 3),
                "rounds": [round(x, 3) for x in per_round],
            }

    print()
    print(f"source: {weight_bytes / 1e9:.2f} GB fp16 safetensors, largest tensor "
          f"{largest / MIB:.0f} MiB, memory bound 2 x largest + 256 MiB = {bound / MIB:.0f} MiB, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    header = (
        f"{'run':<36} {'seconds':>8} {'CPU s':>6} {'CPU s/GB':>8} {'written GB':>10} "
        f"{'MB/s':>6} {'vs cp':>6} {'peak RssAnon':>13} {'load':>5}"
    )
    print(header)
    print("-" * len(header))
    misses = []
    for row in rows:
        label, ratio, peak = row["run"], row["vs_cp"], row["peak_rss_anon_mib"] * MIB
        flag = ""
        if not label.startswith("cp") and not label.endswith(" [baseline]"):
            goal = GOAL_CAST if "--dtype fp32" in label else GOAL_SAME_DTYPE
            if peak >= bound:
                misses.append(
                    f"{label}: peak {peak / MIB:.0f} MiB over the bound {bound / MIB:.0f} MiB"
                )
            if ratio < goal:
                misses.append(
                    f"{label}: {ratio:.2f}x cp's throughput, under {goal}x ({row['cpu_s']:.1f} "
                    f"CPU s in {row['seconds']:.1f} s: the conversion is CPU-bound where cp is "
                    "not)"
                )
            flag = "" if peak < bound else "  over the memory bound"
        print(f"{label:<36} {row['seconds']:8.2f} {row['cpu_s']:6.2f} {row['cpu_s_per_gb']:8.2f} "
              f"{row['written_bytes'] / 1e9:10.2f} {row['mb_per_s']:6.0f} {ratio:6.2f} "
              f"{peak / MIB:9.0f} MiB {row['load']:5.1f}{flag}")  # fmt: skip
    for label, share in shares.items():
        print(
            f"CPU s of {label}, this loader / baseline (per round): median "
            f"{share['median']:.0%} ({min(share['rounds']):.2f} to {max(share['rounds']):.2f})"
        )
    load = watch.stop()
    print()
    print(f"machine: {os.cpu_count()} CPUs, {watch.words()}")
    goals = (
        f"convert/cp >= {GOAL_SAME_DTYPE} keeping the dtype, >= {GOAL_CAST} casting to fp32, "
        "within the memory bound"
    )
    if misses:
        print(f"goal: {goals}: NOT met, because")
        for miss in misses:
            print(f"  {miss}")
        if watch.before > (os.cpu_count() or 1):
            print(
                "  (the machine was busy: its load average exceeded its CPUs, which slows the "
                "CPU-bound conversion more than cp; run it again on a quiet machine)"
            )
    else:
        print(f"goal: {goals}: met")
    command = f"python scripts/bench_convert.py --layers {args.layers} --repeat {args.repeat}"
    if args.baseline is not None:
        command += f" --baseline {args.baseline}"
    if args.cold_pages:
        command += " --cold-pages"
    results.write_text(
        json.dumps(
            {
                "command": command,
                "machine": {**machine.describe(), **load},
                "memory_bound_mib": round(bound / MIB),
                "recycled_bytes_before_each_command": recycle,
                "rows": rows,
                "cpu_share_of_baseline": shares,
                "goal_met": not misses,
                "misses": misses,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"results: {results}")
    return 3 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
