"""Streaming completions on the real tritonserver (CPU): ``model-loader run --streaming``.

One streaming repository (CPU reference backend, dynamic batching on) and the non-streaming
session repository are published from the same tiny checkpoint and each served once for the
module; the streamed results are checked against the non-streaming ones for the same request
and seed. The request is the users' ``test.json`` (``bench/test.json``).
"""

from __future__ import annotations

import concurrent.futures
import csv
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tokenizers import Tokenizer

from loader.bench.stream import (
    CSV_COLUMNS,
    Sample,
    StreamSweep,
    measure_level,
    percentile,
    write_stream_report,
)
from loader.bench.variants import ensemble_name, read_configs
from loader.completion import build_inputs, complete, load_request
from loader.errors import EndpointError
from loader.parallel import Parallelism
from loader.repository.config import RepositorySpec, build_all
from loader.repository.key import ServingSettings
from loader.repository.tensors import ENSEMBLE_INPUTS, STREAMING_OUTPUTS
from loader.serving import TritonServer
from loader.streaming import (
    StreamEvent,
    StreamingClient,
    collect,
    is_final,
    stream_completion,
)
from tests.tinymodels import TINY_REQUEST_FILE, for_tiny_model

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)


ROOT = Path(__file__).resolve().parent.parent
MODEL = "codegen"
#: The users' request, its start/end ids inside the tiny vocabulary (the bounds refuse others).
SEED_REQUEST = for_tiny_model(load_request(ROOT / "bench" / "test.json"))


@pytest.fixture(scope="module")
def streaming_repository(tiny_checkpoint_with_tokenizer: Path, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("streaming") / "models"
    cmd = [
        sys.executable, "-m", "loader", "run", "--source", str(tiny_checkpoint_with_tokenizer),
        "--repository", str(root), "--model-name", MODEL, "--tp-size", "1", "--pp-size", "1",
        "--instance-count", "1", "--backend", "python", "--streaming",
        "--max-queue-delay-us", "2000",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    published = Path(done.stdout.strip().splitlines()[-1])
    assert (published / ".ready").is_file()
    return published


@pytest.fixture(scope="module")
def streaming(streaming_repository: Path):
    with TritonServer(streaming_repository) as server:
        yield server


@pytest.fixture(scope="module")
def plain(published_tiny_python_repository: Path):
    """The same checkpoint published without --streaming (the ensemble)."""
    with TritonServer(published_tiny_python_repository) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint_with_tokenizer: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint_with_tokenizer / "tokenizer.json"))


def _stream(server: TritonServer, request: dict) -> list[StreamEvent]:
    return list(stream_completion(server.grpc_url, MODEL, request, timeout_s=60))


# --- what model-loader run --streaming writes ---------------------------------------------------


def test_streaming_repository_serves_a_decoupled_model_with_the_ensemble_contract(streaming):
    client = httpclient.InferenceServerClient(streaming.http_url)
    try:
        front = client.get_model_config(MODEL)
        ft = client.get_model_config("fastertransformer")
    finally:
        client.close()
    assert front["backend"] == "python"
    assert front["model_transaction_policy"]["decoupled"] is True
    assert [i["name"] for i in front["input"]] == [t.name for t in ENSEMBLE_INPUTS]
    assert [o["name"] for o in front["output"]] == [t.name for t in STREAMING_OUTPUTS]
    assert ft["model_transaction_policy"]["decoupled"] is True
    assert "dynamic_batching" in ft


def test_the_bench_finds_the_model_clients_call_in_a_streaming_repository(streaming_repository):
    assert ensemble_name(read_configs(streaming_repository)) == MODEL


def test_without_streaming_the_model_clients_call_stays_an_ensemble():
    spec = RepositorySpec(
        name=MODEL,
        parallelism=Parallelism(1, 1, 1),
        settings=ServingSettings(),
        data_type="fp32",
        end_id=2,
    )
    configs = build_all(spec)
    assert configs[MODEL].platform == "ensemble"
    assert not configs["fastertransformer"].model_transaction_policy.decoupled


# --- the stream ----------------------------------------------------------------------------------


def _stub_of(server: TritonServer, model: str) -> int:
    """The pid of the Python-backend stub serving ``model``: a child of tritonserver whose
    command line names the model's ``model.py``."""
    assert server.process is not None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == server.process.pid and any(
            a.endswith(f"/{model}/1/model.py".encode()) for a in argv
        ):
            return int(proc.name)
    raise AssertionError(f"no Python-backend stub of {model!r} under tritonserver")


def test_increments_arrive_one_per_token_before_the_request_completes(streaming, tokenizer):
    """Streamed, not buffered, shown by what the server is doing rather than by clocks. Every
    response of the stream, the final one included, carries postprocessing's answer for its
    token, so the moment the client receives its first token it stops the postprocessing stub
    (SIGSTOP): from then on the stream cannot end, and only responses already on their way
    arrive. A streaming model that collected the increments (or the answers) and sent them at the
    end would deliver the first token together with all the others and the final response."""
    _stream(streaming, {**SEED_REQUEST, "request_output_len": [4]})  # warm up the models
    n_out = 200  # postprocessing's round trips for the rest take far longer than stopping it
    stub = _stub_of(streaming, "postprocessing")
    inbox: queue.Queue = queue.Queue()
    stopped = threading.Event()

    def arrived(result, error) -> None:  # gRPC's thread, as each response arrives
        if not stopped.is_set():
            os.kill(stub, signal.SIGSTOP)
            stopped.set()
        inbox.put((result, error, time.monotonic()))

    client = grpcclient.InferenceServerClient(streaming.grpc_url)
    client.start_stream(callback=arrived)
    received: list = []
    try:
        client.async_stream_infer(
            MODEL, build_inputs(grpcclient, {**SEED_REQUEST, "request_output_len": [n_out]})
        )
        received.append(inbox.get(timeout=120))
        time.sleep(0.5)  # what the server already had on its way arrives (the stub is stopped)
        while not inbox.empty():
            received.append(inbox.get())
        early = len(received)
        os.kill(stub, signal.SIGCONT)
        while not is_final(received[-1][0]):
            received.append(inbox.get(timeout=120))
    finally:
        os.kill(stub, signal.SIGCONT)
        client.stop_stream()
        client.close()
    assert all(error is None for _, error, _ in received)
    assert 1 <= early < n_out  # the first token came while the stream provably could not end
    prompt_len = len(tokenizer.encode(SEED_REQUEST["prompt"][0]).ids)
    lengths = [int(r.as_numpy("sequence_length").reshape(-1)[0]) for r, _, _ in received]
    # end_id 50256 lies outside the tiny vocabulary, so every token is generated; the final
    # response repeats the last length.
    assert lengths[:-1] == list(range(prompt_len + 1, prompt_len + n_out + 1))
    assert lengths[-1] == lengths[-2]
    assert [is_final(r) for r, _, _ in received] == [False] * n_out + [True]


def test_only_the_last_response_is_flagged_final(streaming):
    events = _stream(streaming, {**SEED_REQUEST, "request_output_len": [8]})
    assert [e.final for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].sequence_length == events[-2].sequence_length


def test_a_client_that_sees_no_final_flag_finds_the_end_in_the_data(streaming):
    """As on Triton 23.05: no empty final response asked for, and the triton_final_response
    parameter (which 23.05 does not send) never read; is_final is true in the last response
    only, and nothing follows it."""
    inbox: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(streaming.grpc_url)
    client.start_stream(callback=lambda result, error: inbox.put((result, error)))
    request = {**SEED_REQUEST, "request_output_len": [5]}
    try:
        client.async_stream_infer(MODEL, build_inputs(grpcclient, request))
        flags = []
        while not flags or not flags[-1]:
            result, error = inbox.get(timeout=60)
            assert error is None, error
            flags.append(bool(result.as_numpy("is_final").reshape(-1)[0]))
    finally:
        client.stop_stream()
        client.close()
    assert flags == [False] * 5 + [True]
    assert inbox.empty()


@pytest.mark.parametrize("seed", [1594506369, 7])
def test_concatenated_stream_equals_the_non_streaming_completion(streaming, plain, seed):
    request = {**SEED_REQUEST, "random_seed": [seed], "temperature": [1.5]}
    expected = complete(plain.grpc_url, MODEL, request, protocol="grpc")
    got = collect(iter(_stream(streaming, request)))
    assert got.text == expected.text
    assert expected.text  # the comparison is not between two empty strings
    np.testing.assert_array_equal(got.output_ids, expected.output_ids[: expected.sequence_length])
    assert sum(1 for e in got.events if e.text) > 1


def test_concurrent_streams_batched_together_each_equal_their_own_completion(streaming, plain):
    requests = [
        {**SEED_REQUEST, "random_seed": [seed], "request_output_len": [10 + 4 * seed]}
        for seed in range(3)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        streamed = list(pool.map(lambda r: collect(iter(_stream(streaming, r))), requests))
    for request, got in zip(requests, streamed, strict=True):
        expected = complete(plain.grpc_url, MODEL, request, protocol="grpc")
        assert got.text == expected.text
        assert got.output_tokens == request["request_output_len"][0]


def test_streams_with_different_optional_fields_share_batches_and_are_all_answered(
    streaming, plain
):
    """As through the ensemble (test_wire_contract): the streaming model sends fastertransformer
    every input, so streams whose clients sent different fields are batched together, and each
    stream still equals its non-streaming completion."""
    from test_wire_contract import _stats, batch_mixed_fields

    alone, together, inferences, executions = batch_mixed_fields(
        streaming.grpc_url,
        lambda r: collect(iter(_stream(streaming, r))),
        lambda: _stats(streaming, "fastertransformer"),
    )
    assert inferences == len(alone) + 1
    assert executions < inferences
    for a, b in zip(alone, together, strict=True):
        assert a.text == b.text
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
    request = {"prompt": ["def add(a, b):"], "request_output_len": [6], "temperature": [0.7]}
    assert alone[1].text == complete(plain.grpc_url, MODEL, request, protocol="grpc").text


def test_a_cancelled_stream_does_not_wedge_the_model_and_the_next_request_is_served(streaming):
    request = {**SEED_REQUEST, "request_output_len": [8]}
    before = collect(iter(_stream(streaming, request)))
    for _ in range(2):
        events = stream_completion(
            streaming.grpc_url, MODEL, {**SEED_REQUEST, "request_output_len": [60]}
        )
        received = [next(events) for _ in range(3)]
        events.close()  # the client closes the stream mid-way: the request is cancelled
        assert not any(e.final for e in received)
    started = time.perf_counter()
    after = collect(iter(_stream(streaming, request)))
    assert time.perf_counter() - started < 30
    assert after.text == before.text
    np.testing.assert_array_equal(after.output_ids, before.output_ids)
    assert streaming.process is not None and streaming.process.poll() is None
    client = httpclient.InferenceServerClient(streaming.http_url)
    try:
        assert client.is_model_ready(MODEL) and client.is_model_ready("fastertransformer")
    finally:
        client.close()


def test_one_connection_serves_requests_in_turn_and_recovers_after_a_cancel(streaming):
    request = {**SEED_REQUEST, "request_output_len": [6]}
    with StreamingClient(streaming.grpc_url, timeout_s=60) as client:
        first = collect(client.stream(MODEL, request))
        abandoned = client.stream(MODEL, {**SEED_REQUEST, "request_output_len": [40]})
        assert next(abandoned).sequence_length is not None
        abandoned.close()
        second = collect(client.stream(MODEL, request))
        third = collect(client.stream(MODEL, request))
    assert first.text == second.text == third.text
    assert first.output_tokens == second.output_tokens == third.output_tokens == 6


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt": [""]}, "the prompt is empty"),
        # preprocessing's bound reaches the client through the streaming model (BLS).
        ({"request_output_len": [2_000_000]}, "context of 512 \\(max_sequence_length\\)"),
        ({"temperature": [0.0]}, "temperature must be positive"),
    ],
)
def test_a_bad_request_ends_its_stream_with_the_model_error_and_the_next_is_served(
    streaming, bad, message
):
    with pytest.raises(EndpointError, match=message):
        _stream(streaming, {**SEED_REQUEST, **bad})
    assert collect(iter(_stream(streaming, {**SEED_REQUEST, "request_output_len": [3]}))).text


def _ft_inputs(module, prompt: list[int], n_out: int, seed: int) -> list:
    """Inputs of the ``fastertransformer`` model itself (loader/repository/models/README.md), one
    row; an end_id outside the vocabulary, so every requested token is generated."""
    arrays = {
        "input_ids": (np.array([prompt], dtype=np.uint32), "UINT32"),
        "input_lengths": (np.array([[len(prompt)]], dtype=np.uint32), "UINT32"),
        "request_output_len": (np.array([[n_out]], dtype=np.uint32), "UINT32"),
        "runtime_top_k": (np.array([[5]], dtype=np.uint32), "UINT32"),
        "random_seed": (np.array([[seed]], dtype=np.uint64), "UINT64"),
        "end_id": (np.array([[100_000]], dtype=np.uint32), "UINT32"),
    }
    tensors = []
    for name, (array, dtype) in arrays.items():
        tensor = module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _ft_stream(url: str, prompt: list[int], n_out: int, *, stop_after: int | None = None):
    """Stream from ``fastertransformer`` directly: ``(seconds, final, sequence_length, ids)``
    per response; with ``stop_after``, cancel the request after that many responses."""
    inbox: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: inbox.put((result, error)))
    started = time.perf_counter()
    client.async_stream_infer(
        "fastertransformer", _ft_inputs(grpcclient, prompt, n_out, 3),
        enable_empty_final_response=True,
    )  # fmt: skip
    received = []
    try:
        while stop_after is None or len(received) < stop_after:
            result, error = inbox.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            length = int(result.as_numpy("sequence_length")[0, 0]) if response.outputs else None
            ids = result.as_numpy("output_ids")[0, 0] if response.outputs else None
            received.append((time.perf_counter() - started, final, length, ids))
            if final:
                break
    finally:
        client.stop_stream(cancel_requests=stop_after is not None)
        client.close()
    return received


def test_cpu_reference_streams_one_response_per_token_and_its_last_is_the_plain_result(
    streaming, plain, tokenizer
):
    prompt = tokenizer.encode(SEED_REQUEST["prompt"][0]).ids
    n_out = 12
    received = _ft_stream(streaming.grpc_url, prompt, n_out)
    assert [r[2] for r in received] == list(range(len(prompt) + 1, len(prompt) + n_out + 1))
    assert [r[1] for r in received] == [False] * (n_out - 1) + [True]
    client = grpcclient.InferenceServerClient(plain.grpc_url)
    try:
        expected = client.infer(
            "fastertransformer", _ft_inputs(grpcclient, prompt, n_out, 3)
        ).as_numpy("output_ids")[0, 0]
    finally:
        client.close()
    np.testing.assert_array_equal(received[-1][3], expected)
    # Each response extends the previous one by exactly its new token.
    for before, after in itertools.pairwise(received):
        np.testing.assert_array_equal(after[3][: before[2]], before[3][: before[2]])


def test_cpu_reference_stops_generating_when_its_stream_is_cancelled(streaming, tokenizer):
    prompt = tokenizer.encode(SEED_REQUEST["prompt"][0]).ids
    _ft_stream(streaming.grpc_url, prompt, 4)  # warm up
    started = time.perf_counter()
    assert len(_ft_stream(streaming.grpc_url, prompt, 300)) == 300
    full = time.perf_counter() - started
    assert len(_ft_stream(streaming.grpc_url, prompt, 300, stop_after=3)) == 3
    started = time.perf_counter()
    assert len(_ft_stream(streaming.grpc_url, prompt, 4)) == 4
    # The cancelled generation did not run on: the next request did not wait for its 297 tokens.
    assert time.perf_counter() - started < 0.5 * full


# --- TTFT / TPOT ---------------------------------------------------------------------------------


def test_ttft_and_tpot_are_positive_and_ttft_is_below_total_latency(streaming, tmp_path):
    request = {**SEED_REQUEST, "request_output_len": [16]}
    one = collect(iter(_stream(streaming, request)))
    assert one.output_tokens == 16
    assert 0 < one.ttft_s < one.latency_s
    assert one.tpot_s is not None and one.tpot_s > 0
    level = measure_level(streaming.grpc_url, MODEL, request, 2, requests=4, max_seconds=60)
    assert level.requests == 4 and level.concurrency == 2
    assert level.throughput > 0 and level.output_tokens_per_s > 0
    assert 0 < level.ttft_mean_us < level.latency_mean_us
    assert 0 < level.ttft_p95_us <= level.latency_p95_us
    assert level.tpot_mean_us is not None and 0 < level.tpot_mean_us <= level.tpot_p95_us
    paths = write_stream_report([StreamSweep("stream", [level])], tmp_path)
    with open(paths["ttft_csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert int(rows[0]["ttft_mean_us"]) == level.ttft_mean_us
    assert paths["ttft_plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT mean" in paths["ttft_tables"].read_text()


def test_scripts_bench_ttft_sweeps_an_endpoint_and_a_repository_and_writes_its_report(
    streaming, streaming_repository, tmp_path
):
    out = tmp_path / "bench"
    cmd = [
        str(ROOT / "scripts" / "bench"), "--ttft", f"served=grpc://{streaming.grpc_url}",
        f"local={streaming_repository}", "--model", MODEL, "--concurrency-range", "1:2:1",
        "--requests-per-level", "3", "--output-dir", str(out), "--input-data", str(TINY_REQUEST_FILE),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "Benchmark 1: served" in done.stdout and "Benchmark 2: local" in done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("Concurrency: ")]
    assert [line.split(",")[0] for line in lines] == ["Concurrency: 1", "Concurrency: 2"] * 2
    assert all("TTFT mean" in line and "TPOT mean" in line for line in lines)
    with open(out / "ttft_tpot.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["configuration"], int(r["concurrency"])) for r in rows] == [
        ("served", 1), ("served", 2), ("local", 1), ("local", 2)
    ]  # fmt: skip
    assert all(int(r["requests"]) == 3 for r in rows)
    assert all(0 < int(r["ttft_mean_us"]) < int(r["latency_mean_us"]) for r in rows)
    for name in ("ttft_tpot_vs_concurrency.png", "results.csv", "tables.txt", "summary.txt"):
        assert (out / name).stat().st_size > 0
    assert (out / "logs" / "tritonserver-local.log").is_file()


def test_collect_counts_tokens_from_sequence_length_when_the_final_repeats_the_last_state():
    ids = np.arange(8)
    events = iter([
        StreamEvent("a", 0.10, False, 5, ids[:5]),
        StreamEvent("b", 0.20, False, 6, ids[:6]),
        StreamEvent("cd", 0.30, False, 8, ids[:8]),  # two tokens in one response
        StreamEvent("", 0.35, True, 8, ids[:8]),  # FasterTransformer's final response
    ])  # fmt: skip
    got = collect(events)
    assert got.text == "abcd"
    assert got.output_tokens == 4
    assert got.ttft_s == pytest.approx(0.10)
    assert got.tpot_s == pytest.approx((0.30 - 0.10) / 3)
    assert got.latency_s == pytest.approx(0.35)


def test_p95_is_the_nearest_rank():
    assert percentile(list(range(1, 101)), 95) == 95
    assert percentile([3.0], 95) == 3.0
    assert Sample(0.1, None, 0.2, 1).tpot_s is None


# --- scripts/complete ----------------------------------------------------------------------------


def _complete_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "scripts" / "complete"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_scripts_complete_streams_json_lines_equal_to_the_non_streaming_completion(
    streaming, plain
):
    expected = complete(plain.grpc_url, MODEL, SEED_REQUEST, protocol="grpc")
    done = _complete_script(
        "--url", streaming.grpc_url, "--model", MODEL, "--request", str(TINY_REQUEST_FILE),
        "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    texts, summary = records[:-1], records[-1]
    assert all(r["event"] == "text" for r in texts) and summary["event"] == "done"
    assert len(texts) == SEED_REQUEST["request_output_len"][0] + 1
    assert [r["final"] for r in texts][-2:] == [False, True]
    assert "".join(r["text"] for r in texts) == summary["completion"] == expected.text
    assert summary["output_tokens"] == SEED_REQUEST["request_output_len"][0]
    assert 0 < summary["ttft_s"] < summary["total_s"]


def test_scripts_complete_prints_the_text_and_the_timings(streaming, plain):
    prompt = "def add(a, b):"
    expected = complete(
        plain.grpc_url, MODEL, {"prompt": [prompt], "request_output_len": [12]}, protocol="grpc"
    )
    done = _complete_script(
        "--url", streaming.grpc_url, "--model", MODEL, "--max-tokens", "12", prompt
    )
    assert done.returncode == 0, done.stderr
    # text=True reads "\r" as a line end, as a terminal would show it.
    shown = expected.text.replace("\r\n", "\n").replace("\r", "\n") + "\n"
    assert done.stdout == shown
    assert "12 tokens" in done.stderr and "first token after" in done.stderr
    # The same client completes against a repository that does not stream, both protocols.
    for args in (["--url", plain.grpc_url, "--model", MODEL],
                 ["--no-stream", "--protocol", "http", "--url", plain.http_url]):  # fmt: skip
        again = _complete_script(*args, "--max-tokens", "12", prompt)
        assert again.returncode == 0, again.stderr
        assert again.stdout == shown
        assert "1 tokens" not in again.stderr  # one response is not one token
    # --json against a model that does not stream: no made-up token count
    [summary] = [
        json.loads(line)
        for line in _complete_script(
            "--url", plain.grpc_url, "--model", MODEL, "--json", prompt
        ).stdout.splitlines()
        if '"done"' in line
    ]
    assert summary["output_tokens"] is None and summary["responses"] == 1
    assert (
        "does not stream"
        in _complete_script("--url", plain.grpc_url, "--model", MODEL, prompt).stderr
    )


def test_scripts_complete_reports_errors_in_one_line_without_a_traceback(streaming):
    cases = [
        (["--url", streaming.grpc_url, "--model", "missing", "x"], "unknown model"),
        (["--url", streaming.grpc_url, "--model", MODEL, "--no-stream", "x"], "drop --no-stream"),
        # The chart restricts gRPC's model index to the admin header: the client says what to do.
        (["--url", streaming.grpc_url, "x"], "pass --model NAME"),
        (["--protocol", "http", "--url", streaming.http_url, "x"], "streaming needs gRPC"),
        (["--url", streaming.grpc_url], "no prompt"),
    ]
    for args, message in cases:
        done = _complete_script(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr
        assert "Traceback" not in done.stderr


# --- the chart's helm test -----------------------------------------------------------------------


def test_the_charts_helm_test_passes_against_a_streaming_repository(streaming):
    from test_streaming_chart import _by_kind

    (pod,) = [
        p
        for p in _by_kind("triton.streaming=true")["Pod"]
        if p["metadata"]["name"].endswith("-test-inference")
    ]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["STREAMING"] == "1"
    env.update(
        TRITON_HTTP_URL=streaming.http_url, TRITON_GRPC_URL=streaming.grpc_url, MODEL_NAME=MODEL
    )
    # the Pod runs `model-loader complete ...`; Kubernetes expands $(VAR) from the env
    command = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], c) for c in container["command"]]
    assert command[:2] == ["model-loader", "complete"] and "--stream" in command
    done = subprocess.run(
        [sys.executable, "-m", "loader", *command[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["server ready", f"model {MODEL} ready"]
    assert "".join(lines[2:]).strip()  # the streamed completion


def test_complete_finds_the_model_and_names_the_served_ones_when_asked_for_another(
    streaming, plain
):
    """No --model: the one model the server offers (its repository's steps left out)."""

    def loader_complete(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "loader", "complete", *args, "--max-tokens", "4", "def f():"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    found = loader_complete("--url", f"http://{plain.http_url}")
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip()
    # Over gRPC the chart restricts the model index to the admin header (HTTP stays on the
    # pod's loopback, where `kubectl port-forward` reaches it): the client asks for --model.
    over_grpc = _complete_script("--url", plain.grpc_url, "def f():")
    assert over_grpc.returncode == 2 and "pass --model NAME" in over_grpc.stderr
    wrong = loader_complete("--url", f"http://{plain.http_url}", "--model", "codegen-350m")
    assert wrong.returncode == 2
    assert f"does not serve a ready model 'codegen-350m'; it serves {MODEL}" in wrong.stderr
    assert "check the --url" not in wrong.stderr.lower()
    over_http = loader_complete("--url", f"http://{streaming.http_url}", "--model", MODEL)
    assert over_http.returncode == 2
    assert "streams its completion" in over_http.stderr and "--stream --url" in over_http.stderr


def test_scripts_complete_into_a_closed_pipe_stops_quietly(streaming):
    done = subprocess.run(
        ["bash", "-c", f'"$0" --url {streaming.grpc_url} --model {MODEL} --json "def f():" | head -n 1',
         str(ROOT / "scripts" / "complete")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["event"] == "text"
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_generate_on_a_streaming_repository_is_200_with_an_error_and_generate_stream_works(
    streaming,
):
    """What the README warns of: Triton's /generate finds out that a decoupled model sends more
    than one response after it has sent its status line, so the status is 200 and only the body
    says `error` (curl --fail-with-body cannot catch it); /generate_stream serves such a model,
    one server-sent event per response."""
    import json
    import urllib.request

    body = json.dumps({"prompt": "def f():", "request_output_len": 4}).encode()
    base = f"http://{streaming.http_url}/v2/models/{MODEL}"
    with urllib.request.urlopen(f"{base}/generate", data=body, timeout=60) as answer:
        assert answer.status == 200
        assert "exactly 1 response" in json.loads(answer.read())["error"]
    with urllib.request.urlopen(f"{base}/generate_stream", data=body, timeout=60) as answer:
        events = [
            json.loads(line[len(b"data: ") :])
            for line in answer.read().splitlines()
            if line.startswith(b"data: ")
        ]
    assert events and events[-1]["is_final"] and not any(e["is_final"] for e in events[:-1])
    assert "".join(e["completion"] for e in events)


def _cancellations(server: TritonServer) -> list[str]:
    """The gRPC stream cancellations Triton noticed (logged at --log-verbose=1)."""
    said = "Cancellation notification received for ModelStreamInferHandler"
    return [line for line in server.log_text().splitlines() if said in line]


def test_a_finished_stream_is_closed_without_cancelling_it_and_an_abandoned_one_is_cancelled(
    streaming_repository,
):
    """``StreamingClient`` half-closes a stream whose requests all finished and lets Triton
    end it. Cancelling such a stream made Triton 24.10 (the local server) keep the model
    referenced now and then: at SIGTERM it waited its whole --exit-timeout-secs (40 s) for the
    model to unload. The server runs with --log-verbose=1, which the chart does not render:
    Triton logs each stream cancellation it notices only at that level."""
    server = TritonServer(streaming_repository, log_verbose=1)
    with server:
        for _ in range(3):
            assert collect(iter(_stream(server, {**SEED_REQUEST, "request_output_len": [2]})))
        with StreamingClient(server.grpc_url, timeout_s=60) as client:
            for _ in range(2):
                assert collect(client.stream(MODEL, {**SEED_REQUEST, "request_output_len": [2]}))
        assert _cancellations(server) == []
        abandoned = stream_completion(
            server.grpc_url, MODEL, {**SEED_REQUEST, "request_output_len": [40]}
        )
        next(abandoned)
        abandoned.close()
        deadline = time.monotonic() + 30
        while not _cancellations(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _cancellations(server)
