#!/usr/bin/env python3
"""AIPerf against the ``llm`` model on this machine's CPU Triton (``make bench-llm``).

Publishes the demo CodeGen checkpoint with ``--streaming`` (CPU reference backend), serves it
with the local ``tritonserver`` (:mod:`loader.serving`) and runs AIPerf (its own virtualenv,
``scripts/tools/install-aiperf.sh``) once per workload and concurrency level against Triton's
HTTP ``generate_stream`` endpoint of ``llm`` (AIPerf's ``template`` endpoint: the request body
is ``llm``'s fields, the streamed text is ``text_output``). Workloads:

* ``test``: the prompt and sampling fields of ``bench/test.json`` (the users' request);
* ``mixed``: the prompts of ``bench/mixed.json`` (short to long), the same sampling fields.

Each writes AIPerf's own artifacts under ``<output>/aiperf/<workload>-c<C>/``; this script
collects the metrics every LLM benchmark reports (time to first token, inter-token latency,
request latency, output tokens/s, requests/s) into ``results.csv``, ``results.md`` and
``llm_vs_concurrency.png``, with the machine and its load (:mod:`loader.bench.machine`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loader.bench.machine import LoadWatch, describe  # noqa: E402

WORKLOADS = ("test", "mixed")
#: AIPerf's metric tag -> (our column, unit): the means and p95s reported.
METRICS = {
    "time_to_first_token": "ttft_ms",
    "inter_token_latency": "itl_ms",
    "request_latency": "latency_ms",
}
THROUGHPUTS = {
    "output_token_throughput": "output_tokens_per_s",
    "request_throughput": "requests_per_s",
}
COLUMNS = (
    "workload",
    "concurrency",
    "requests",
    "errors",
    "output_tokens_mean",
    "ttft_ms_mean",
    "ttft_ms_p95",
    "itl_ms_mean",
    "itl_ms_p95",
    "latency_ms_mean",
    "latency_ms_p95",
    "output_tokens_per_s",
    "requests_per_s",
)


def seed_fields(path: Path) -> tuple[str, dict]:
    """``bench/test.json``'s prompt and its fields in ``llm``'s names."""
    from loader.completion import load_request

    request = load_request(path)
    fields = {
        "max_tokens": int(request["request_output_len"][0]),
        "temperature": float(request["temperature"][0]),
        "repetition_penalty": float(request["repetition_penalty"][0]),
        "top_k": int(request["runtime_top_k"][0]),
        "top_p": float(request["runtime_top_p"][0]),
        "seed": int(request["random_seed"][0]),
    }
    return str(request["prompt"][0]), fields


def prompts(path: Path) -> list[str]:
    document = json.loads(path.read_text(encoding="utf-8"))
    return [entry["prompt"]["content"][0] for entry in document["data"]]


def template(fields: dict) -> str:
    """AIPerf's Jinja2 body: the prompt, streaming, the prompt left out, ``fields``."""
    body = ", ".join(f'"{k}": {json.dumps(v)}' for k, v in fields.items())
    return (
        '{"text_input": {{ text|tojson }}, "stream": true, "exclude_input_in_output": true, '
        + body
        + "}"
    )


def publish(work: Path) -> Path:
    from loader.demo.checkpoint import build_demo_checkpoint
    from loader.demo.checkpoint import describe as describe_checkpoint
    from loader.parallel import Parallelism
    from loader.repository.key import ServingSettings
    from loader.run import RunRequest, run

    checkpoint = build_demo_checkpoint(work / "demo-checkpoint")
    return run(
        RunRequest(
            source=str(checkpoint.resolve()),
            repository=(work / "models").resolve(),
            model_name="codegen",
            revision=f"demo-{describe_checkpoint(checkpoint)['digest']}",
            parallelism=Parallelism(tp=1, pp=1, instance_count=1),
            settings=ServingSettings(backend="python", dynamic_batching=True, streaming=True),
        )
    ).path


#: What is kept of AIPerf's artifacts of a run: the summary (JSON, CSV, console table), the
#: per-request records and the request body; its logs and per-phase copies are removed.
KEEP = (
    "profile_export_aiperf.json",
    "profile_export_aiperf.csv",
    "profile_export_console.txt",
    "profile_export.jsonl",
    "payload.jinja",
)


def prune(artifacts: Path) -> None:
    for path in artifacts.iterdir():
        if path.name not in KEEP:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def run_aiperf(
    aiperf: Path,
    url: str,
    tokenizer: Path,
    dataset: Path,
    body: str,
    concurrency: int,
    requests: int,
    artifacts: Path,
    timeout_s: float,
) -> dict:
    """One AIPerf run; its ``profile_export_aiperf.json``."""
    if artifacts.exists():
        shutil.rmtree(artifacts)
    artifacts.mkdir(parents=True)
    template_file = artifacts / "payload.jinja"
    template_file.write_text(body)
    cmd = [
        str(aiperf), "profile",
        "--model", "llm",
        "--url", f"http://{url}",
        "--endpoint-type", "template",
        "--custom-endpoint", "/v2/models/llm/generate_stream",
        "--extra-inputs", f"payload_template:{template_file}",
        "--extra-inputs", "response_field:text_output",
        "--streaming",
        "--tokenizer", str(tokenizer),
        "--input-file", str(dataset),
        "--custom-dataset-type", "single_turn",
        "--concurrency", str(concurrency),
        "--request-count", str(requests),
        "--warmup-request-count", "1",
        "--artifact-dir", str(artifacts),
        "--ui", "none",
        "--no-server-metrics",
        "--random-seed", "1",
    ]  # fmt: skip
    # AIPerf 0.13 takes any HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE value, "0" included, for offline
    # mode, in which it looks a local tokenizer directory up in the Hugging Face cache and fails
    # ("Repo id must be in the form ..."); a local directory needs no network without them.
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    with (artifacts / "aiperf.log").open("w") as log:
        done = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False, env=env
        )
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if done.returncode != 0 or not exports:
        tail = (artifacts / "aiperf.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"aiperf failed (exit {done.returncode}) in {artifacts}:\n{tail}")
    export = json.loads(exports[0].read_text())
    prune(artifacts)
    return export


def _metric(export: dict, tag: str) -> dict:
    value = export.get(tag)
    if isinstance(value, dict):
        return value
    for record in export.get("records", []) if isinstance(export.get("records"), list) else []:
        if record.get("tag") == tag:
            return record
    return {}


def row(workload: str, concurrency: int, export: dict) -> dict:
    out: dict[str, object] = {"workload": workload, "concurrency": concurrency}
    out["requests"] = _metric(export, "request_count").get("avg")
    out["errors"] = sum(int(e.get("count", 0)) for e in export.get("error_summary") or [])
    out["output_tokens_mean"] = _metric(export, "output_sequence_length").get("avg")
    for tag, column in METRICS.items():
        metric = _metric(export, tag)
        out[f"{column}_mean"] = metric.get("avg")
        out[f"{column}_p95"] = metric.get("p95")
    for tag, column in THROUGHPUTS.items():
        out[column] = _metric(export, tag).get("avg")
    return out


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return "" if value is None else str(value)


def write_results(out: Path, rows: list[dict], machine: dict, notes: list[str]) -> None:
    with (out / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "# AIPerf against `llm` (demo CodeGen, CPU Triton, streaming)",
        "",
        *notes,
        "",
        f"Machine: {json.dumps(machine)}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows),
        "",
    ]
    (out / "results.md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    for workload in sorted({r["workload"] for r in rows}):
        mine = [r for r in rows if r["workload"] == workload]
        levels = [r["concurrency"] for r in mine]
        for axis, column, label in (
            (axes[0], "ttft_ms", "time to first token (ms)"),
            (axes[1], "itl_ms", "inter-token latency (ms)"),
        ):
            axis.plot(levels, [r[f"{column}_mean"] for r in mine], "o-", label=f"{workload} mean")
            axis.plot(levels, [r[f"{column}_p95"] for r in mine], "x--", label=f"{workload} p95")
            axis.set_title(label)
        axes[2].plot(levels, [r["output_tokens_per_s"] for r in mine], "o-", label=workload)
        axes[2].set_title("output tokens/s")
    for axis in axes:
        axis.set_xlabel("concurrency")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "llm_vs_concurrency.png", dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", type=Path, default=ROOT / "bench/work/aiperf-venv/bin/aiperf")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench/work/llm")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/work/results/llm")
    parser.add_argument("--overwrite", action="store_true", help="replace existing results")
    parser.add_argument("--concurrency", default="1,2", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=8, help="requests per level")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per AIPerf run")
    args = parser.parse_args(argv)

    out = args.output_dir
    if (out / "results.csv").exists() and not args.overwrite:
        raise SystemExit(f"{out} holds results; pass --overwrite to replace them")
    if not args.aiperf.is_file():
        raise SystemExit(f"{args.aiperf} is missing: run scripts/tools/install-aiperf.sh")
    out.mkdir(parents=True, exist_ok=True)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]

    prompt, fields = seed_fields(ROOT / "bench" / "test.json")
    datasets = {
        "test": [prompt] * max(levels) * 2,
        "mixed": prompts(ROOT / "bench" / "mixed.json"),
    }
    for name, texts in datasets.items():
        (work / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    repository = publish(work)
    tokenizer = work / "demo-checkpoint"
    from loader.serving import TritonServer

    watch = LoadWatch()
    rows = []
    started = time.monotonic()
    with TritonServer(repository) as server:
        for workload in WORKLOADS:
            for level in levels:
                export = run_aiperf(
                    args.aiperf, server.http_url, tokenizer, work / f"{workload}.jsonl",
                    template(fields), level, args.requests,
                    out / "aiperf" / f"{workload}-c{level}", args.timeout_s,
                )  # fmt: skip
                rows.append(row(workload, level, export))
                print(json.dumps(rows[-1]), flush=True)
    watch.stop()
    notes = [
        f"AIPerf {_aiperf_version(args.aiperf)}, template endpoint on "
        "`/v2/models/llm/generate_stream`, streaming; request body: "
        f"`{template(fields)}` (bench/test.json's fields).",
        f"Workloads: `test` (bench/test.json's prompt), `mixed` (bench/mixed.json's "
        f"{len(datasets['mixed'])} prompts). {args.requests} requests per level, levels "
        f"{levels}; {time.monotonic() - started:.0f} s in all; {watch.words()}.",
    ]
    write_results(out, rows, describe(), notes)
    print(f"results: {out}")
    return 0


def _aiperf_version(aiperf: Path) -> str:
    python = aiperf.parent / "python"
    done = subprocess.run(
        [str(python), "-c", "from importlib.metadata import version; print(version('aiperf'))"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
