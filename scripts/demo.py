#!/usr/bin/env python3
"""`make demo`: the whole path on this machine, no GPU, no cluster, no network.

1. builds a small CodeGen checkpoint locally (a tokenizer trained on the standard library's
   Python sources, a tiny model trained briefly on them), cached in demo-work/;
2. publishes it with `model-loader run` for T=2, P=1, I=2 with the CPU reference backend;
3. starts the real tritonserver (from the nvidia-pytriton wheel) on 127.0.0.1 with the Triton
   arguments the chart renders for values/local.yaml, and shows an admin call refused without
   the header and answered with it;
4. sends the users' request (bench/test.json: `<python>def is_even(na: int) ->`) and prints the
   completion;
5. starts the OpenAI-compatible completions service in front of that Triton and prints one
   completion through it (`POST /v1/completions`, as an editor or the `openai` client sends);
6. prints the `model-loader plan` tables (this model on a 2-GPU node; CodeGen-16B on the
   production node type);
7. renders the Helm chart for every values file (all resources for values/local.yaml, the
   Triton Deployment with its GPUs and model key for the others) with the project's helm;
then stops everything it started.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loader.completion import complete, load_request  # noqa: E402
from loader.demo.checkpoint import RECIPE_FILE, build_demo_checkpoint, describe  # noqa: E402
from loader.errors import LoaderError  # noqa: E402
from loader.serving import RESTRICTED_FLAG, TritonServer, restricted_protocols  # noqa: E402

WORK = ROOT / "demo-work"
CHECKPOINT = WORK / "checkpoint"
REPOSITORY_ROOT = WORK / "models"
MODEL_NAME = "codegen"
TP, PP, INSTANCES = 2, 1, 2
REQUEST_FILE = ROOT / "bench" / "test.json"
VALUES_DIR = ROOT / "values"
LOCAL_VALUES = VALUES_DIR / "local.yaml"

TOTAL_STEPS = 7


def section(number: int, title: str) -> None:
    print(
        f"\n\033[1m[{number}/{TOTAL_STEPS}] {title}\033[0m"
        if sys.stdout.isatty()
        else f"\n[{number}/{TOTAL_STEPS}] {title}"
    )
    print("-" * (len(title) + 6))


def indent(text: str) -> str:
    return textwrap.indent(text.rstrip("\n"), "    ")


def loader_command(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m loader ...` (the installed model-loader) and return its output."""
    env = {**os.environ, "MODEL_LOADER_LOG_LEVEL": "WARNING"}
    done = subprocess.run(
        [sys.executable, "-m", "loader", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(
            f"model-loader {args[0]} failed (exit {done.returncode}):\n{done.stdout}{done.stderr}"
        )
    return done


def step_checkpoint() -> None:
    section(1, "A small CodeGen checkpoint, built and trained on this machine")
    before = describe(CHECKPOINT) if (CHECKPOINT / RECIPE_FILE).is_file() else None
    build_demo_checkpoint(CHECKPOINT)
    info = describe(CHECKPOINT)
    recipe = info["recipe"]
    reused = before == info
    print(
        indent(
            f"{CHECKPOINT.relative_to(ROOT)}/ ({'reused from an earlier run' if reused else 'built now'})\n"
            f"CodeGen: {recipe['n_layer']} layers, {recipe['n_head']} heads, hidden {recipe['n_embd']}, "
            f"vocabulary {recipe['vocab_size']} (byte-level BPE trained locally)\n"
            f"trained {info['steps']} steps on {info['corpus_tokens']:,} tokens of the standard "
            f"library's Python sources; final loss {info['final_loss']:.2f}"
        )
    )


def step_publish() -> Path:
    section(2, f"model-loader run: T={TP}, P={PP}, I={INSTANCES}, CPU reference backend")
    args = [
        "run",
        "--source",
        str(CHECKPOINT),
        "--repository",
        str(REPOSITORY_ROOT),
        "--model-name",
        MODEL_NAME,
        "--tp-size",
        str(TP),
        "--pp-size",
        str(PP),
        "--instance-count",
        str(INSTANCES),
        "--backend",
        "python",
        # The recipe digest is the checkpoint's revision: a rebuilt checkpoint gets a new key.
        "--revision",
        f"demo-{describe(CHECKPOINT)['digest']}",
        # Rebuilt from the same recipe, its bytes may still differ: publish them again.
        "--follow-source",
    ]
    print(
        indent(
            "model-loader "
            + " ".join(
                a if not a.startswith(str(ROOT)) else str(Path(a).relative_to(ROOT)) for a in args
            )
        )
    )
    started = time.monotonic()
    done = loader_command(*args)
    published = Path(done.stdout.strip().splitlines()[-1])
    models = sorted(p.name for p in published.iterdir() if (p / "config.pbtxt").is_file())
    print(
        indent(
            f"published in {time.monotonic() - started:.1f} s: {published.relative_to(ROOT)}\n"
            f"models: {', '.join(models)}; weights in fastertransformer/1/{TP}-gpu/"
        )
    )
    return published


def step_serve_and_complete(published: Path) -> None:
    section(3, "The real Triton server, on the CPU, with the chart's arguments")
    from loader import chart as render_chart

    chart = render_chart.Chart.in_checkout(ROOT)
    docs = render_chart.documents(chart.render(values_files=[LOCAL_VALUES]))
    chart_args = render_chart.triton_serving_args(docs)
    started = time.monotonic()
    with TritonServer(published, pod_args=chart_args) as server:
        print(
            indent(
                f"tritonserver ready in {time.monotonic() - started:.1f} s on 127.0.0.1: "
                f"HTTP {server.ports.http}, gRPC {server.ports.grpc}, metrics {server.ports.metrics}"
            )
        )
        print(indent(show_restrictions(server)))
        section(4, "A completion for the users' request (bench/test.json)")
        end_id = model_end_id()
        # The seed request names the end-of-text id of the 50k-token CodeGen vocabulary; this
        # model's own is in its config.json.
        request = {**load_request(REQUEST_FILE), "start_id": [end_id], "end_id": [end_id]}
        settings = ", ".join(
            f"{k}={v[0]:.3g}" if isinstance(v[0], float) else f"{k}={v[0]}"
            for k, v in request.items()
            if k != "prompt"
        )
        print(indent(f"settings: {settings} (start/end ids: this model's end-of-text token)"))
        started = time.monotonic()
        result = complete(server.http_url, MODEL_NAME, request)
        elapsed = time.monotonic() - started
        prompt = request["prompt"][0]
        generated = result.sequence_length - prompt_length(prompt)
        print(indent(f"prompt:\n{indent(prompt)}\ncompletion:\n{indent(prompt + result.text)}"))
        print(
            indent(
                f"{generated} tokens in {elapsed:.2f} s; cum_log_probs {result.cum_log_prob:.2f}"
            )
        )
        print(
            indent(
                "This model is tiny and trained for seconds: its completions look like code and "
                "mean little.\nWhat shows the path is right is greedy parity: the same prompt, "
                "greedy, through Triton and through Hugging Face transformers on the checkpoint:"
            )
        )
        print(indent(greedy_parity(server.http_url, prompt, end_id)))
        step_openai(server, prompt)
        print(indent("stopping tritonserver ..."))
    print(indent("tritonserver stopped"))


def step_openai(server: TritonServer, prompt: str) -> None:
    """One completion through the completions service (python -m completions_service) in
    front of this Triton, with the admin header for the model-config protocol the chart
    restricts (docs/completions.md)."""
    import json
    import tempfile
    import urllib.error
    import urllib.request

    from loader.serving import free_port

    section(5, "The OpenAI-compatible completions service in front of it")
    port = free_port()
    cmd = [
        sys.executable, "-m", "completions_service", "--triton-url", f"grpc://{server.grpc_url}",
        "--listen", f"127.0.0.1:{port}", "--log-level", "warning",
    ]  # fmt: skip
    restricted = restricted_protocols(server.pod_args)
    with tempfile.TemporaryDirectory(dir=WORK) as private:
        if "model-config" in restricted:
            header, token = restricted["model-config"]
            token_file = Path(private) / "triton-token"
            token_file.write_text(token)
            token_file.chmod(0o600)
            cmd += [
                "--triton-protocol-header",
                header,
                "--triton-protocol-token-file",
                str(token_file),
            ]
        url = f"http://127.0.0.1:{port}"
        service = subprocess.Popen(cmd, cwd=ROOT)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health/ready", timeout=5):
                        break
                except (urllib.error.URLError, OSError) as exc:
                    if service.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(
                            f"the completions service did not get ready: {exc}"
                        ) from exc
                    time.sleep(0.2)
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
                model = json.load(response)["data"][0]
            body = {"model": model["id"], "prompt": prompt, "max_tokens": 16, "temperature": 0}
            print(indent(f"completions-service {' '.join(cmd[3:7])} (model {model['id']!r}, "
                         f"context {model['max_model_len']} tokens)"))  # fmt: skip
            print(indent(f"POST {url}/v1/completions {json.dumps(body)}"))
            request = urllib.request.Request(
                f"{url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                answer = json.load(response)
            choice = answer["choices"][0]
            print(indent(f"completion ({choice['finish_reason']}, {answer['usage']}):"))
            print(indent(indent(prompt + choice["text"])))
        finally:
            service.terminate()
            service.wait(timeout=30)


def show_restrictions(server: TritonServer) -> str:
    """What the chart's security arguments do on this server: an admin gRPC call (the log
    settings) without the header, then with it (SECURITY.md)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    restricted = restricted_protocols(server.pod_args)
    lines = [
        "arguments from the chart (values/local.yaml): "
        + " ".join(a for a in server.pod_args if not a.startswith(RESTRICTED_FLAG)),
        f"restricted gRPC protocols: {', '.join(restricted)}",
    ]
    if "logging" not in restricted:
        return "\n".join(lines)
    header, token = restricted["logging"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        try:
            client.get_log_settings()
            lines.append("log settings without the header: answered (not restricted!)")
        except InferenceServerException as exc:
            lines.append(f"log settings without the header: {exc.status()} {exc.message()}")
        client.get_log_settings(headers={header: token})
        lines.append(f"log settings with {header}: answered (the token is in the chart's Secret)")
    finally:
        client.close()
    return "\n".join(lines)


def model_end_id() -> int:
    """The demo checkpoint's end-of-text id (config.json ``eos_token_id``)."""
    import json

    return int(json.loads((CHECKPOINT / "config.json").read_text())["eos_token_id"])


def prompt_length(prompt: str) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).encode(prompt).ids)


def greedy_parity(url: str, prompt: str, end_id: int, tokens: int = 16) -> str:
    """Greedy ids from Triton and from ``transformers``' ``generate``; a mismatch ends the demo."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    request = {
        "prompt": [prompt],
        "request_output_len": [tokens],
        "runtime_top_k": [1],
        "end_id": [end_id],
    }
    served = complete(url, MODEL_NAME, request)
    ids = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).encode(prompt).ids
    triton = served.output_ids[len(ids) : served.sequence_length].tolist()
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=end_id,
            pad_token_id=end_id,
        )
    reference = out[0, len(ids) :].tolist()
    if triton != reference[: len(triton)] or len(triton) != len(reference):
        raise SystemExit(
            f"greedy tokens differ: Triton {triton}, transformers {reference}; this is a bug"
        )
    return f"  {len(triton)} greedy tokens, identical: {triton}"


def step_plan() -> None:
    section(6, "model-loader plan")
    demo = loader_command(
        "plan",
        "--source",
        str(CHECKPOINT),
        "--tp-size",
        str(TP),
        "--pp-size",
        str(PP),
        "--instance-count",
        str(INSTANCES),
        "--gpus-per-node",
        "2",
        "--gpu-memory-gib",
        "16",
    )
    print(indent("This model on a node with 2 GPUs of 16 GiB:\n\n" + demo.stdout))
    production = loader_command(
        "plan",
        "--model",
        "codegen-16b",
        "--gpus-per-node",
        "16",
        "--gpu-memory-gib",
        "40",
        "--tp-size",
        "1",
        "2",
        "4",
        "--instance-count",
        "1",
        "2",
    )
    print()
    print(
        indent("CodeGen-16B on the production node type (16 A100 40 GB):\n\n" + production.stdout)
    )


def step_chart() -> None:
    section(7, "The Helm chart, rendered for every values file")
    from loader import chart as render_chart

    chart = render_chart.Chart.in_checkout(ROOT)

    for values in sorted(VALUES_DIR.glob("*.yaml")):
        try:
            docs = render_chart.documents(chart.render(values_files=[values], release=MODEL_NAME))
        except (render_chart.ChartError, FileNotFoundError) as exc:
            raise SystemExit(f"helm template failed for {values.name}: {exc}") from exc
        name = values.relative_to(ROOT)
        print(
            indent(
                f"helm template {MODEL_NAME} charts/model-triton -f {name}: {len(docs)} resources"
            )
        )
        for doc in docs:
            if values == LOCAL_VALUES or doc["kind"] == "Deployment":
                r = render_chart.describe(doc)
                print(indent(f"  {r.kind:<22} {r.name:<34} {r.detail}"))
        print()


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    print(
        "model-triton demo: load, convert, publish and serve a code model on a real Triton "
        "server (CPU)"
    )
    try:
        step_checkpoint()
        published = step_publish()
        step_serve_and_complete(published)
        step_plan()
        step_chart()
    except LoaderError as exc:
        print(f"error: {exc.message}\nhint: {exc.remediation}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Every server and process a step started is stopped by its context manager on the way
        # here; the checkpoint and repositories already written stay for the next run.
        print("\ninterrupted (Ctrl-C); nothing left running", file=sys.stderr)
        return 130
    print(f"\ndone in {time.monotonic() - started:.0f} s; nothing left running.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
