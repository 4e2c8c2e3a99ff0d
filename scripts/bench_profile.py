#!/usr/bin/env python3
"""Where a conversion's time goes, stage by stage: ``convert`` against ``cp`` of the same bytes,
and the overlapped ``run`` from the GCS emulator against its own stages run alone.

In one run, ``--repeat`` rounds side by side, each process started after ``sync``, with the
1-minute load average it started under:

* ``cp`` of the converter benchmark's fp16 GPT-J checkpoint (``scripts/bench_convert.py``,
  ``--layers``), then ``model-loader convert`` of it at ``--tp-size`` (keeping fp16): the
  ratio convert/cp of their times;
* against a local fake-gcs-server holding the cold-start benchmark's sharded CodeGen
  checkpoint (``scripts/bench_coldstart.py``, ``--cs-layers``/``--cs-hidden``/
  ``--shard-mib``): ``fetch`` alone, ``convert`` of the local copy alone, and the
  overlapped ``run``: the ratio run / max(fetch, convert) (goal <= 1.15) and the run's CPU
  seconds per GB (goal <= 3.5).

Every loader process runs with ``MODEL_LOADER_PROFILE`` (:mod:`loader.stages`): the fastest
round's stage table (calls, MB, wall and CPU seconds, wall minus CPU, page faults, the
stage's rate) goes into the report. Then, with ``py-spy`` (``--py-spy``, default: the one
next to this Python or on ``PATH``; ``--py-spy none`` skips it), one more ``convert`` and one
more ``run`` are sampled (``--idle``: waiting threads are sampled too) and the functions
holding the most samples are listed, each with the thread state that dominated.

Writes ``profile.md`` (the tables, the ratios and the command) and ``profile.json`` into
``--output-dir`` (default ``bench/work/results``).

Usage: ``make bench-profile`` or ``python scripts/bench_profile.py [--layers 16] [--tp-size 2]
[--repeat 3] [--output-dir DIR [--overwrite]]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_coldstart  # noqa: E402
import bench_convert  # noqa: E402

from loader.bench import machine  # noqa: E402
from tests.servers import GcsServer  # noqa: E402

MIB = 2**20
#: The goals of docs/conversion-profile.md.
GOAL_CONVERT_VS_CP = 0.9
GOAL_OVERLAP = 1.15
GOAL_CPU_PER_GB = 3.5


def tree_cpu_seconds(pid: int) -> float:
    """User + system seconds of ``pid`` and its descendants so far (the GCS emulator's)."""
    total, stack, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
        stack += bench_convert._children(p)
    return total


def timed(
    name: str,
    argv: list[str],
    env: dict,
    cwd: Path,
    profile: Path | None,
    server_pid: int,
    recycle: int = 0,
) -> dict:
    """Run ``argv`` once (after ``sync`` and, with ``recycle`` bytes, after recycling that much
    memory: :func:`loader.bench.machine.recycle_pages`); wall, CPU, the emulator's CPU
    meanwhile, load, io pressure and, with ``profile``, its stages."""
    env = dict(env)
    if profile is not None:
        profile.unlink(missing_ok=True)
        env["MODEL_LOADER_PROFILE"] = str(profile)
    subprocess.run(["sync"], check=True)
    if recycle:
        machine.recycle_pages(cwd, recycle)
    io = machine.pressure("io")
    server_cpu = tree_cpu_seconds(server_pid)
    run = machine.measured(argv, env=env, cwd=cwd)
    server_cpu = tree_cpu_seconds(server_pid) - server_cpu
    if run.returncode != 0:
        raise SystemExit(f"{name} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    stages = json.loads(profile.read_text()) if profile is not None else None
    print(
        f"  {name:<28} {run.seconds:7.2f} s {run.cpu_s:6.2f} CPU s   load {run.load:4.1f}"
        f"   io pressure {io if io is not None else '-'} %",
        flush=True,
    )
    return {
        "seconds": run.seconds,
        "cpu_s": run.cpu_s,
        "load": run.load,
        "io_pressure": io,
        "server_cpu_s": server_cpu,
        "stages": stages,
    }


#: The overlapped run of a checkpoint a third the size: with the full one, it separates the
#: run's fixed CPU (start-up, the small files, build and publish) from its CPU per GB.
SMALL = "run (overlapped, 1/3 the layers)"


def run_command(loader: list[str], source: str, repository: Path) -> list[str]:
    """``model-loader run`` of ``source`` into ``repository``, T=1, P=1, one instance."""
    return [
        *loader, "run", "--source", source, "--model-name", "bench", "--tp-size", "1",
        "--pp-size", "1", "--instance-count", "1", "--repository", str(repository),
    ]  # fmt: skip


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def stage_table(result: dict, gigabytes: float) -> list[str]:
    """A markdown table of one run's stages, largest wall first."""
    prof = result["stages"]
    lines = [
        f"process: {result['seconds']:.2f} s wall (from exec to exit), {result['cpu_s']:.2f} CPU s "
        f"({result['cpu_s'] / gigabytes:.2f} CPU s/GB), load {result['load']:.1f} and io pressure "
        f"{result['io_pressure']} % at its start; "
        f"inside `main`: {prof['process']['wall_s']:.2f} s wall, "
        f"{prof['process']['cpu_s']:.2f} CPU s",
        f"start-up and exit (imports, unmapping, outside `main`): "
        f"{result['seconds'] - prof['process']['wall_s']:.2f} s wall",
        "",
        "| stage | calls | MB | wall s | CPU s | queued for a CPU s | blocked s | page faults "
        "| MB/s of wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = sorted(prof["stages"].items(), key=lambda kv: -kv[1]["wall_s"])
    for name, row in rows:
        mb = row["bytes"] / 1e6
        # the counters are read at slightly different instants: a few ms below 0 is 0
        blocked = max(0.0, row["wall_s"] - row["cpu_s"] - row["queued_s"])
        rate = f"{mb / row['wall_s']:.0f}" if mb and row["wall_s"] > 0 else ""
        lines.append(
            f"| {name} | {row['calls']} | {mb:.0f} | {row['wall_s']:.3f} | {row['cpu_s']:.3f} | "
            f"{row['queued_s']:.3f} | {blocked:.3f} | "
            f"{row['faults']} | {rate} |"
        )
    return lines


def find_py_spy(arg: str | None) -> str | None:
    if arg == "none":
        return None
    if arg:
        return arg
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def sampled(py_spy: str, name: str, argv: list[str], env: dict, cwd: Path, raw: Path) -> list:
    """Sample ``argv`` with py-spy (100 Hz, idle threads too, its child processes too: the
    loader works in a child of its supervisor); the top functions by samples, the supervisor's
    waiting left out."""
    cmd = [py_spy, "record", "--idle", "--subprocesses", "--format", "raw", "-r", "100"]
    cmd += ["-o", str(raw), "--", *argv]
    subprocess.run(["sync"], check=True)
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0 or not raw.is_file():
        print(f"  py-spy of {name} failed: {done.stderr[-500:]}", flush=True)
        return []
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or "loader/cli/supervise.py" in stack:
            continue
        leaf[stack.split(";")[-1]] += int(count)  # the function running (or waiting)
        total += int(count)
    print(f"  py-spy {name}: {total} samples", flush=True)
    return [(fn, n, n / total) for fn, n in leaf.most_common(15)] if total else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench" / "work" / "profile")
    parser.add_argument("--layers", type=int, default=16, help="GPT-J layers (16 ~ 2 GB)")
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--cs-layers", type=int, default=36)
    parser.add_argument("--cs-hidden", type=int, default=1024)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the fastest counts")
    machine.add_cold_pages_option(parser)
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="also run convert and run with the loader of this checkout, in the same rounds",
    )
    parser.add_argument("--py-spy", default=None, help="py-spy to sample with ('none': skip)")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)

    md_path, json_path = machine.output_files(
        args.output_dir, ["profile.md", "profile.json"], root=ROOT, overwrite=args.overwrite
    )
    work = args.work_dir.absolute()
    work.mkdir(parents=True, exist_ok=True)
    convert_src = work / f"gptj-fp16-{args.layers}"
    convert_bytes, _ = bench_convert.build_checkpoint(convert_src, args.layers)
    cs_src = (
        ROOT
        / "bench"
        / "work"
        / "coldstart"
        / f"src-{args.cs_layers}x{args.cs_hidden}-{args.shard_mib}"
    )
    cs_bytes = bench_coldstart.build_checkpoint(
        cs_src, args.cs_layers, args.cs_hidden, args.shard_mib
    )
    small_layers = max(1, args.cs_layers // 3)
    small_src = cs_src.with_name(f"src-{small_layers}x{args.cs_hidden}-{args.shard_mib}")
    small_bytes = bench_coldstart.build_checkpoint(
        small_src, small_layers, args.cs_hidden, args.shard_mib
    )
    bench_convert.warm(convert_src)
    bench_convert.warm(cs_src)
    bench_convert.warm(small_src)
    env = machine.loader_env(None)
    loader = [sys.executable, "-m", "loader", "-q"]
    shards = [str(f) for f in sorted(convert_src.glob("*.safetensors"))]
    #: Every command starts on recently freed memory, as much as the largest writes.
    recycle = 0 if args.cold_pages else convert_bytes + 512 * MIB
    watch = machine.LoadWatch()
    out, prof = work / "out", work / "stages.json"
    rounds: dict[str, list[dict]] = collections.defaultdict(list)
    server = GcsServer(work).start()
    try:
        server.upload_dir(bench_coldstart.BUCKET, bench_coldstart.PREFIX, cs_src)
        server.upload_dir(bench_coldstart.BUCKET, "small", small_src)
        source = f"gs://{bench_coldstart.BUCKET}/{bench_coldstart.PREFIX}"
        gcs_env = {**env, "STORAGE_EMULATOR_HOST": server.url}
        commands = {
            "cp": (["cp", *shards, str(out)], None),
            f"convert T={args.tp_size}": (
                [
                    *loader,
                    "convert",
                    str(convert_src),
                    str(out / "c"),
                    "--tp-size",
                    str(args.tp_size),
                ],
                prof,
            ),
            "fetch (GCS)": ([*loader, "fetch", source, str(out / "f")], prof),
            "convert (local copy)": (
                [*loader, "convert", str(cs_src), str(out / "c"), "--tp-size", "1"],
                prof,
            ),
            "run (overlapped)": (run_command(loader, source, out / "r"), prof),
            SMALL: (
                run_command(loader, f"gs://{bench_coldstart.BUCKET}/small", out / "r"),
                prof,
            ),
        }
        envs = {name: gcs_env for name in commands}
        if args.baseline is not None:
            base_env = {**machine.loader_env(args.baseline), "STORAGE_EMULATOR_HOST": server.url}
            for name in (f"convert T={args.tp_size}", "run (overlapped)"):
                commands[f"{name} [baseline]"] = commands[name]
                envs[f"{name} [baseline]"] = base_env
        for i in range(args.repeat):
            print(f"round {i + 1} of {args.repeat}:", flush=True)
            for name, (cmd, profile) in commands.items():
                fresh(out)
                rounds[name].append(
                    timed(name, cmd, envs[name], work, profile, server.proc.pid, recycle)
                )
        spied = {}
        py_spy = find_py_spy(args.py_spy)
        if py_spy is not None:
            for name in (f"convert T={args.tp_size}", "run (overlapped)"):
                fresh(out)
                spied[name] = sampled(
                    py_spy, name, commands[name][0], gcs_env, work, work / "py-spy.txt"
                )
        shutil.rmtree(out, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(work / "storage", ignore_errors=True)
    load = watch.stop()

    best = {name: min(runs, key=lambda r: r["seconds"]) for name, runs in rounds.items()}
    conv = f"convert T={args.tp_size}"
    per_round = {
        "convert / cp (time)": [
            c["seconds"] / p["seconds"] for c, p in zip(rounds[conv], rounds["cp"], strict=True)
        ],
        "run / max(fetch, convert)": [
            r["seconds"] / max(f["seconds"], c["seconds"])
            for r, f, c in zip(
                rounds["run (overlapped)"],
                rounds["fetch (GCS)"],
                rounds["convert (local copy)"],
                strict=True,
            )
        ],
    }
    if args.baseline is not None:
        for name in (conv, "run (overlapped)"):
            per_round[f"{name}: time / baseline's"] = [
                a["seconds"] / b["seconds"]
                for a, b in zip(rounds[name], rounds[f"{name} [baseline]"], strict=True)
            ]
            per_round[f"{name}: CPU s / baseline's"] = [
                a["cpu_s"] / b["cpu_s"]
                for a, b in zip(rounds[name], rounds[f"{name} [baseline]"], strict=True)
            ]
    ratios = {k: sorted(v)[len(v) // 2] for k, v in per_round.items()}
    cs_gb = cs_bytes / 1e9
    run_cpu_per_gb = (
        sorted(r["cpu_s"] for r in rounds["run (overlapped)"])[args.repeat // 2] / cs_gb
    )
    throughput_vs_cp = 1 / ratios["convert / cp (time)"]
    small_gb = small_bytes / 1e9
    small_cpu = sorted(r["cpu_s"] for r in rounds[SMALL])[args.repeat // 2]
    big_cpu = sorted(r["cpu_s"] for r in rounds["run (overlapped)"])[args.repeat // 2]
    marginal_cpu_per_gb = (big_cpu - small_cpu) / (cs_gb - small_gb)
    fixed_cpu = big_cpu - marginal_cpu_per_gb * cs_gb

    command = (
        (
            f"python scripts/bench_profile.py --layers {args.layers} --tp-size {args.tp_size} "
            f"--cs-layers {args.cs_layers} --cs-hidden {args.cs_hidden} --shard-mib "
            f"{args.shard_mib} --repeat {args.repeat}"
        )
        + (f" --baseline {args.baseline}" if args.baseline is not None else "")
        + (" --cold-pages" if args.cold_pages else "")
    )
    lines = [
        "# Conversion profile, stage by stage",
        "",
        f"Made by `{command}` (`make bench-profile`); {os.cpu_count()} CPUs, "
        f"{watch.words()}. Each process started after `sync`, sources in the page cache, "
        + (
            "free memory as found (`--cold-pages`). "
            if args.cold_pages
            else f"on recently freed memory ({recycle / 1e9:.1f} GB written and deleted just "
            "before: `loader.bench.machine.recycle_pages`). "
        )
        + "Explained in docs/conversion-profile.md.",
        "",
        "## Side by side (median of the rounds' ratios)",
        "",
        "| figure | value | goal | per round | loads |",
        "|---|---:|---:|---|---|",
        f"| convert throughput / cp throughput (T={args.tp_size}, "
        f"{convert_bytes / 1e9:.2f} GB fp16) | {throughput_vs_cp:.2f} | >= {GOAL_CONVERT_VS_CP} | "
        + ", ".join(f"{1 / x:.2f}" for x in per_round["convert / cp (time)"])
        + " | "
        + ", ".join(f"{r['load']:.1f}" for r in rounds[conv])
        + " |",
        f"| overlapped run / max(fetch, convert) ({cs_gb:.2f} GB) | "
        f"{ratios['run / max(fetch, convert)']:.2f} | <= {GOAL_OVERLAP} | "
        + ", ".join(f"{x:.2f}" for x in per_round["run / max(fetch, convert)"])
        + " | "
        + ", ".join(f"{r['load']:.1f}" for r in rounds["run (overlapped)"])
        + " |",
        f"| overlapped run, CPU s per GB | {run_cpu_per_gb:.2f} | <= {GOAL_CPU_PER_GB} | "
        + ", ".join(f"{r['cpu_s'] / cs_gb:.2f}" for r in rounds["run (overlapped)"])
        + " | |",
        f"| overlapped run, CPU s per GB beyond its fixed {fixed_cpu:.2f} CPU s (medians of "
        f"{cs_gb:.2f} GB and {small_gb:.2f} GB: the slope) | {marginal_cpu_per_gb:.2f} | <= "
        f"{GOAL_CPU_PER_GB} | | |",
    ]
    run_best = best["run (overlapped)"]
    floor = (run_best["cpu_s"] + run_best["server_cpu_s"]) / (os.cpu_count() or 1)
    slowest = max(best["fetch (GCS)"]["seconds"], best["convert (local copy)"]["seconds"])
    lines.append(
        f"| CPU floor of the overlapped run: (its CPU s + the emulator's) / {os.cpu_count()} CPUs"
        f" = {floor:.2f} s, over max(fetch, convert) | {floor / slowest:.2f} | <= "
        f"{GOAL_OVERLAP} | | |"
    )
    lines += [
        f"| {k} | {ratios[k]:.2f} | | " + ", ".join(f"{x:.2f}" for x in v) + " | |"
        for k, v in per_round.items()
        if "baseline" in k
    ]
    lines += [
        "",
        "| command | fastest s | CPU s (its round) | CPU s/GB | the emulator's CPU s | load "
        "| io pressure % |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in best.items():
        gb = convert_bytes / 1e9 if name in ("cp", conv, f"{conv} [baseline]") else cs_gb
        gb = small_gb if name == SMALL else gb
        lines.append(
            f"| {name} | {r['seconds']:.2f} | {r['cpu_s']:.2f} | {r['cpu_s'] / gb:.2f} | "
            f"{r['server_cpu_s']:.2f} | {r['load']:.1f} | {r['io_pressure']} |"
        )
    for name in (conv, "fetch (GCS)", "convert (local copy)", "run (overlapped)"):
        gb = convert_bytes / 1e9 if name == conv else cs_gb
        lines += ["", f"## {name}: stages of the fastest round", ""]
        lines += stage_table(best[name], gb)
    for name, top in spied.items():
        lines += ["", f"## py-spy: {name}, functions holding the most samples (idle included)", ""]
        lines += ["| function | samples | share |", "|---|---:|---:|"]
        lines += [f"| `{fn}` | {n} | {share:.0%} |" for fn, n, share in top]
    md_path.write_text("\n".join(lines) + "\n")
    json_path.write_text(
        json.dumps(
            {
                "command": command,
                "machine": {**machine.describe(), **load},
                "ratios": ratios,
                "per_round": per_round,
                "run_cpu_s_per_gb": run_cpu_per_gb,
                "run_marginal_cpu_s_per_gb": marginal_cpu_per_gb,
                "run_fixed_cpu_s": fixed_cpu,
                "rounds": rounds,
                "py_spy": spied,
            },
            indent=1,
        )
        + "\n"
    )
    print("\n".join(lines[: lines.index(f"## {conv}: stages of the fastest round")]))
    print(f"results: {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
