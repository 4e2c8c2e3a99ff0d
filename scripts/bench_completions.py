#!/usr/bin/env python3
"""What the completions service costs: the same requests sent to Triton's ``llm`` model
directly (gRPC streaming, as the service sends them) and through the service (HTTP, as the
``openai`` client sends them), at increasing concurrency, on the local CPU Triton.

For each concurrency level C, C clients each send requests back to back until the level's
requests are done, in four runs side by side: direct and through the service, unary and
streamed. Every request is the same greedy completion (``temperature`` 0, ``--max-tokens``)
of the users' prompt (``bench/test.json``). Reported, per level and path: completed requests
per second, median latency, median time to the first token (streamed), tokens per response.

The figures (goal: under 1 ms per request, under 5 % of throughput):

* **overhead per request**: median unary latency through the service minus direct, at C = 1;
* **overhead per streamed token**: the median time from the first to the last token through
  the service minus direct, divided by the tokens after the first, at C = 1;
* **the service's CPU time** per request and per streamed token (its process's user + system
  time over a run, divided): on a busy machine, where waiting for a CPU inflates wall-clock
  differences, the cost a quiet machine would see;
* **throughput ratio at saturation**: through the service / direct, unary and streamed, at the
  level where Triton saturates: the first whose direct throughput is less than 10 % above the
  previous level's (the last level if none).

The load generator, the service and Triton share this machine's CPUs: on a busy machine every
figure includes the contention; the 1-minute load average before and after is recorded beside
them, and the figures of a loaded machine are only indicative.

The repository: ``--repository`` (one that ``model-loader run`` published, with the ``llm``
model), else the tiny GPT-J test checkpoint (random weights, built once under
``bench/work/completions/``) published with ``--backend python``; ``--standin`` serves the
service tests' stand-in ``llm`` model instead (no model work: the service's cost alone).

Usage: ``make bench-completions`` or ``python scripts/bench_completions.py [--levels 1 2 4 8]
[--requests 40] [--max-tokens 16] [--repository DIR | --standin] [--output-dir DIR]
[--overwrite]``. Writes ``completions.json`` and ``completions.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if os.environ.get("MODEL_TRITON_NO_REEXEC") is None and Path(sys.prefix) != ROOT / ".venv":
    venv_python = ROOT / ".venv" / "bin" / "python"
    if venv_python.exists():
        os.environ["MODEL_TRITON_NO_REEXEC"] = "1"
        os.execv(str(venv_python), [str(venv_python), *sys.argv])
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from tritonclient.grpc.aio import InferenceServerClient  # noqa: E402

from completions_service.sampling import Sampling  # noqa: E402
from completions_service.triton import (  # noqa: E402
    CHANNEL_OPTIONS,
    Generation,
    build_inputs,
    end_stream,
    model_info,
    piece_of,
)
from loader.bench import machine  # noqa: E402
from loader.serving import TritonServer  # noqa: E402
from tests.completions_harness import CompletionsService  # noqa: E402

WORK = ROOT / "bench" / "work" / "completions"
PROMPT = json.loads((ROOT / "bench" / "test.json").read_text())["data"][0]["prompt"]["content"][0]
#: A level's direct throughput must beat the previous level's by this much, else Triton is
#: saturated there.
SATURATION_GAIN = 1.10
GREEDY = Sampling(greedy=True, temperature=None, top_p=None, top_k=1, seed=None)


@dataclass(frozen=True)
class Sample:
    latency_s: float
    ttft_s: float  # the first response with text (unary: the response)
    last_s: float  # the last response with text
    tokens: int  # responses with text (streamed) or the model's count (unary)


@dataclass(frozen=True)
class Run:
    path: str  # direct or service
    stream: bool
    concurrency: int
    requests: int
    seconds: float
    throughput: float  # completed requests per second
    latency_ms: float  # medians
    ttft_ms: float
    per_token_ms: float | None  # (last - first) / (tokens - 1)
    tokens: float
    cpu_ms_per_request: float | None  # the service process's CPU time (service path only)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(
    path, stream, concurrency, samples: list[Sample], seconds: float, cpu: float | None
) -> Run:
    spans = [(s.last_s - s.ttft_s) / (s.tokens - 1) for s in samples if stream and s.tokens > 1]
    return Run(
        path=path,
        stream=stream,
        concurrency=concurrency,
        requests=len(samples),
        seconds=round(seconds, 3),
        throughput=round(len(samples) / seconds, 2),
        latency_ms=round(1000 * statistics.median(s.latency_s for s in samples), 3),
        ttft_ms=round(1000 * statistics.median(s.ttft_s for s in samples), 3),
        per_token_ms=round(1000 * statistics.median(spans), 3) if spans else None,
        tokens=round(statistics.mean(s.tokens for s in samples), 2),
        cpu_ms_per_request=None if cpu is None else round(1000 * cpu / len(samples), 3),
    )


async def direct_request(client, model, info, stream: bool, max_tokens: int) -> Sample:
    generation = Generation(PROMPT, max_tokens, stream, GREEDY, ())
    inputs = build_inputs(generation, info.batched)
    done = asyncio.Event()

    async def requests():
        yield {"model_name": model, "inputs": inputs}
        await done.wait()

    start = time.perf_counter()
    first = last = None
    tokens = 0
    end = None
    responses = client.stream_infer(requests())
    try:
        async for result, error in responses:
            if error is not None:
                raise RuntimeError(error.message())
            piece = piece_of(result)
            now = time.perf_counter() - start
            if piece.text:
                tokens += 1
                first = now if first is None else first
                last = now
            if piece.finish_reason is not None:
                if not stream:
                    tokens = piece.completion_tokens or tokens
                end = now
                break
    finally:
        done.set()
        await end_stream(responses, finished=end is not None)  # as the service ends a stream
    end = end if end is not None else time.perf_counter() - start
    return Sample(end, first if first is not None else end, last or end, tokens)


async def service_request(http: httpx.AsyncClient, model, stream: bool, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    if not stream:
        response = await http.post("/v1/completions", json=body)
        response.raise_for_status()
        end = time.perf_counter() - start
        return Sample(end, end, end, response.json()["usage"]["completion_tokens"])
    first = last = None
    tokens = 0
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0]["text"]:
                now = time.perf_counter() - start
                tokens += 1
                first = now if first is None else first
                last = now
    end = time.perf_counter() - start
    return Sample(end, first if first is not None else end, last or end, tokens)


async def level(send, concurrency: int, requests: int) -> tuple[list[Sample], float]:
    samples: list[Sample] = []
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            samples.append(await send())

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


async def measure(grpc_url: str, service_url: str, service_pid: int, args) -> list[Run]:
    client = InferenceServerClient(grpc_url, channel_args=CHANNEL_OPTIONS)
    info = model_info(await client.get_model_config("llm", as_json=True), "llm")
    limits = httpx.Limits(max_connections=max(args.levels) * 2)
    async with httpx.AsyncClient(base_url=service_url, timeout=300, limits=limits) as http:
        senders = {
            ("direct", False): lambda: direct_request(client, "llm", info, False, args.max_tokens),
            ("service", False): lambda: service_request(http, info.name, False, args.max_tokens),
            ("direct", True): lambda: direct_request(client, "llm", info, True, args.max_tokens),
            ("service", True): lambda: service_request(http, info.name, True, args.max_tokens),
        }
        for send in senders.values():  # warm up every path (connections, caches)
            await level(send, 2, 4)
        runs = []
        for concurrency in args.levels:
            count = max(args.requests, 2 * concurrency)
            for (path, stream), send in senders.items():
                before = cpu_seconds(service_pid)
                samples, seconds = await level(send, concurrency, count)
                cpu = cpu_seconds(service_pid) - before if path == "service" else None
                run = summarize(path, stream, concurrency, samples, seconds, cpu)
                print(
                    f"C={concurrency:<3} {path:8} {'stream' if stream else 'unary':6} "
                    f"{run.throughput:8.2f} req/s  latency {run.latency_ms:8.2f} ms  "
                    f"ttft {run.ttft_ms:8.2f} ms  tokens {run.tokens}  "
                    f"service CPU {run.cpu_ms_per_request} ms/request",
                    flush=True,
                )
                runs.append(run)
    await client.close()
    return runs


def figures(runs: list[Run]) -> dict[str, object]:
    def find(path, stream, concurrency) -> Run:
        return next(
            r for r in runs if (r.path, r.stream, r.concurrency) == (path, stream, concurrency)
        )

    levels = sorted({r.concurrency for r in runs})
    low = levels[0]
    unary = find("service", False, low).latency_ms - find("direct", False, low).latency_ms
    direct_stream, service_stream = find("direct", True, low), find("service", True, low)
    per_token = None
    if direct_stream.per_token_ms is not None and service_stream.per_token_ms is not None:
        per_token = round(service_stream.per_token_ms - direct_stream.per_token_ms, 3)
    saturated = levels[-1]
    for before, after in itertools.pairwise(levels):
        if (
            find("direct", False, after).throughput
            < SATURATION_GAIN * find("direct", False, before).throughput
        ):
            saturated = after
            break
    ratios = {
        kind: round(
            find("service", stream, saturated).throughput
            / find("direct", stream, saturated).throughput,
            3,
        )
        for kind, stream in (("unary", False), ("stream", True))
    }
    unary_cpu = find("service", False, low).cpu_ms_per_request
    stream_cpu = find("service", True, low).cpu_ms_per_request
    return {
        "overhead_per_request_ms": round(unary, 3),
        "service_cpu_ms_per_request": unary_cpu,
        "service_cpu_ms_per_streamed_token": round(
            (stream_cpu - unary_cpu) / max(service_stream.tokens, 1), 4
        ),
        "overhead_ttft_ms": round(service_stream.ttft_ms - direct_stream.ttft_ms, 3),
        "overhead_per_streamed_token_ms": per_token,
        "saturation_concurrency": saturated,
        "throughput_ratio_at_saturation": ratios,
        "goals": {"overhead_per_request_ms": 1.0, "throughput_loss": 0.05},
    }


def tiny_repository() -> Path:
    """The tiny GPT-J test checkpoint, published with --backend python (built once)."""
    from loader.demo.tokenizer import train_tokenizer
    from loader.parallel import Parallelism
    from loader.repository.key import ServingSettings
    from loader.run import RunRequest, run
    from tests.conftest import TOKENIZER_CORPUS
    from tests.tinymodels import make_tiny_checkpoint

    checkpoint = WORK / "checkpoint"
    if not (checkpoint / "tokenizer.json").exists():
        checkpoint.mkdir(parents=True, exist_ok=True)
        make_tiny_checkpoint(checkpoint, arch="gptj")
        train_tokenizer(TOKENIZER_CORPUS, 320, checkpoint)
    request = RunRequest(
        source=str(checkpoint),
        repository=WORK / "models",
        model_name="codegen",
        parallelism=Parallelism(tp=1, pp=1, instance_count=1),
        settings=ServingSettings(backend="python", dynamic_batching=True, streaming=True),
    )
    return run(request).path


def markdown(result: dict) -> str:
    f = result["figures"]
    lines = [
        "# What the completions service costs",
        "",
        f"`{result['command']}` on {result['machine']['cpus']} CPUs, "
        f"1-minute load average {result['load']['load_before']} before and "
        f"{result['load']['load_after']} after ({result['model']}).",
        "",
        "| C | path | mode | req/s | median latency ms | median TTFT ms | ms per token | tokens "
        "| service CPU ms/request |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['concurrency']} | {r['path']} | {'stream' if r['stream'] else 'unary'} | "
            f"{r['throughput']} | {r['latency_ms']} | {r['ttft_ms']} | {r['per_token_ms']} | "
            f"{r['tokens']} | {r['cpu_ms_per_request']} |"
        )
    lines += [
        "",
        f"- overhead per request (unary, C = lowest): {f['overhead_per_request_ms']} ms "
        "(goal < 1 ms)",
        f"- the service's CPU time per request (unary, C = lowest): "
        f"{f['service_cpu_ms_per_request']} ms; per streamed token beyond that: "
        f"{f['service_cpu_ms_per_streamed_token']} ms (CPU time does not grow with the load "
        "of other processes as wall time does)",
        f"- overhead of the time to first token: {f['overhead_ttft_ms']} ms",
        f"- overhead per streamed token: {f['overhead_per_streamed_token_ms']} ms",
        f"- throughput through the service / direct at saturation (C = "
        f"{f['saturation_concurrency']}): {f['throughput_ratio_at_saturation']} (goal >= 0.95)",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests", type=int, default=40, help="requests per level and path")
    p.add_argument("--max-tokens", type=int, default=16)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--repository", type=Path)
    source.add_argument("--standin", action="store_true")
    p.add_argument("--output-dir", type=Path)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args()
    outputs = machine.output_files(
        args.output_dir,
        ["completions.json", "completions.md"],
        root=ROOT,
        overwrite=args.overwrite,
    )
    if args.standin:
        from tests.completions_standin import make_standin_repository

        repository = WORK / "standin"
        if not (repository / "llm").exists():
            make_standin_repository(repository, max_model_len=2048)
        model = "the stand-in llm model: no model work"
    else:
        repository = args.repository or tiny_repository()
        model = f"the llm model of {repository.name}"
        if not (repository / "llm" / "config.pbtxt").exists():
            print(
                f"error: {repository} has no llm model\nhint: publish it again with this "
                "checkout's model-loader run, or pass --standin",
                file=sys.stderr,
            )
            return 2
    load = machine.LoadWatch()
    with TritonServer(repository) as triton:
        log = WORK / "service.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        extra = ["--max-concurrency", str(max(args.levels) * 2)]
        with CompletionsService(triton.grpc_url, log=log, extra=extra) as service:
            assert service.proc is not None
            runs = asyncio.run(measure(triton.grpc_url, service.url, service.proc.pid, args))
    result = {
        "command": shlex.join(["scripts/bench_completions.py", *sys.argv[1:]]),
        "machine": machine.describe(),
        "load": load.stop(),
        "model": model,
        "runs": [asdict(r) for r in runs],
        "figures": figures(runs),
    }
    outputs[0].write_text(json.dumps(result, indent=2) + "\n")
    outputs[1].write_text(markdown(result))
    print(markdown(result))
    print(f"({load.words()}; written to {outputs[0].parent})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
