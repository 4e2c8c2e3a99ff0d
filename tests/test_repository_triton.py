"""A repository written by `model-loader run` loads in the real Triton server (2.51, CPU).

Checks what the config writer decides: Triton accepts the ensemble (its validation of the step
mappings, dtypes and dims is stricter than parsing), optional ensemble inputs may be left out
of a request (they feed optional inputs of the fastertransformer model, which then applies its
defaults), and the server reports the instance count and batching the loader wrote.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from loader.serving import TritonServer

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)


PROMPT = "<python>def is_even(na: int) ->"


@pytest.fixture(scope="module")
def server(tiny_checkpoint_with_tokenizer: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-repo")
    argv = [
        "run", "--source", str(tiny_checkpoint_with_tokenizer), "--repository", str(root),
        "--model-name", "tiny", "--tp-size", "2", "--pp-size", "1", "--instance-count", "1",
        "--backend", "python", "--preferred-batch-size", "2", "--max-queue-delay-us", "500",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "loader", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    with (
        TritonServer(proc.stdout.splitlines()[-1]) as triton,
        httpclient.InferenceServerClient(triton.http_url) as client,
    ):
        yield client


def _input(name: str, value, dtype: str) -> httpclient.InferInput:
    array = np.array([[value]], dtype=object if dtype == "BYTES" else None)
    if dtype != "BYTES":
        array = array.astype({"UINT32": np.uint32, "UINT64": np.uint64, "FP32": np.float32,
                              "BOOL": np.bool_}[dtype])  # fmt: skip
    tensor = httpclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _complete(client, **optional) -> httpclient.InferResult:
    types = {"runtime_top_k": "UINT32", "random_seed": "UINT64", "temperature": "FP32"}
    inputs = [_input("prompt", PROMPT.encode(), "BYTES"), _input("request_output_len", 6, "UINT32")]
    inputs += [_input(name, value, types[name]) for name, value in optional.items()]
    return client.infer("tiny", inputs)


def test_a_request_with_only_the_required_inputs_completes(server):
    result = _complete(server)
    ids = result.as_numpy("output_ids")
    assert ids.shape[:2] == (1, 1)
    assert result.as_numpy("sequence_length")[0, 0] == ids.shape[2]
    assert result.as_numpy("completion").shape == (1, 1)


def test_optional_inputs_reach_the_model_and_left_out_ones_take_its_defaults(server):
    greedy = _complete(server).as_numpy("output_ids")
    assert np.array_equal(_complete(server, runtime_top_k=1).as_numpy("output_ids"), greedy)
    sampled = [
        _complete(server, runtime_top_k=50, temperature=5.0, random_seed=seed).as_numpy(
            "output_ids"
        )
        for seed in (1, 2, 3)
    ]
    assert any(not np.array_equal(s, greedy) for s in sampled)  # the sampling inputs arrived


def test_server_reports_the_instances_and_batching_the_loader_wrote(server):
    config = server.get_model_config("fastertransformer")
    assert [(g["count"], g["kind"]) for g in config["instance_group"]] == [(1, "KIND_CPU")]
    assert config["dynamic_batching"]["preferred_batch_size"] == [2]
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 500
    ensemble = server.get_model_config("tiny")
    optional = {i["name"] for i in ensemble["input"] if i.get("optional")}
    assert optional == {
        "runtime_top_k", "runtime_top_p", "temperature", "repetition_penalty", "start_id",
        "end_id", "random_seed", "is_return_log_probs",
    }  # fmt: skip
