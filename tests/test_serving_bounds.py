"""The bounds of a request (``loader/repository/bounds.py``) on the real CPU ``tritonserver``
started with the chart's arguments, and the edges the stand-in answers as the C++ does.

The published tiny model has a context of 512 tokens (:data:`tests.tinymodels.SERVING_CONTEXT`)
and a vocabulary of 320 ids. Every refusal comes from the first step that sees the request
(``preprocessing``), names the field and the limit, is INVALID_ARGUMENT on this server (2.51's
Python backend carries error codes; 23.05 sends the same message as INTERNAL), and the request
after it is answered.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from loader.completion import build_inputs, complete, load_request
from loader.repository.config import read_config
from loader.serving import TritonServer
from tests.tinymodels import SERVING_CONTEXT, TINY_REQUEST_FILE

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)

MODEL = "codegen"
VOCAB = 320
REQUEST = {**load_request(TINY_REQUEST_FILE), "request_output_len": [4]}
CLIENTS = {"grpc": grpcclient, "http": httpclient}
#: What each client reports for INVALID_ARGUMENT.
INVALID = {"grpc": "StatusCode.INVALID_ARGUMENT", "http": "400"}


@pytest.fixture(scope="module")
def server(published_tiny_python_repository: Path) -> Iterator[TritonServer]:
    with TritonServer(published_tiny_python_repository) as running:
        yield running


def _refusal(server: TritonServer, protocol: str, request: dict) -> tuple[str, str]:
    module = CLIENTS[protocol]
    url = server.grpc_url if protocol == "grpc" else server.http_url
    client = module.InferenceServerClient(url)
    try:
        client.infer(MODEL, build_inputs(module, request))
    except InferenceServerException as exc:
        return str(exc.status()), exc.message()
    finally:
        client.close()
    raise AssertionError(f"{request} was answered")


def test_the_bounds_are_published_in_preprocessings_config(published_tiny_python_repository):
    config = read_config(published_tiny_python_repository / "preprocessing" / "config.pbtxt")
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    assert parameters["max_sequence_length"] == str(SERVING_CONTEXT)
    assert parameters["vocab_size"] == str(VOCAB)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"request_output_len": [2_000_000]}, ["request_output_len", "context of 512"]),
        ({"request_output_len": [2**32 - 1]}, ["request_output_len", "context of 512"]),
        ({"prompt": ["x = 1\n" * 400]}, ["prompt's", "context of 512 (max_sequence_length)"]),
        ({"prompt": ["a" * 2**20]}, ["prompt: 1048576 bytes", "context of 512 tokens"]),
        ({"start_id": [VOCAB]}, ["start_id: 320", "vocabulary of 320 ids"]),
        ({"end_id": [2**32 - 1]}, ["end_id: 4294967295", "vocabulary of 320 ids"]),
    ],
    ids=[
        "output-2M",
        "output-uint32-max",
        "prompt-tokens",
        "prompt-1MiB",
        "start_id",
        "end_id",
    ],
)
def test_a_request_beyond_a_bound_is_refused_naming_it_and_the_next_is_answered(
    server, protocol, fields, named
):
    status, message = _refusal(server, protocol, {**REQUEST, **fields})
    assert status == INVALID[protocol], message
    for words in named:
        assert words in message
    url = server.grpc_url if protocol == "grpc" else server.http_url
    assert complete(url, MODEL, REQUEST, protocol=protocol).text


def test_a_prompt_and_output_exactly_at_the_context_are_served(server):
    from tokenizers import Tokenizer

    prompt = REQUEST["prompt"][0]
    tokenizer_dir = server.repository / "preprocessing" / "1" / "tokenizer"
    tokens = len(Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(prompt).ids)
    at_limit = {**REQUEST, "request_output_len": [SERVING_CONTEXT - tokens], "runtime_top_k": [1]}
    answer = complete(server.http_url, MODEL, at_limit)
    assert answer.sequence_length <= SERVING_CONTEXT
    status, message = _refusal(
        server, "http", {**at_limit, "request_output_len": [SERVING_CONTEXT - tokens + 1]}
    )
    assert status == "400" and f"ask for at most {SERVING_CONTEXT - tokens} tokens" in message


def test_more_rows_than_max_batch_size_are_refused_by_triton(server):
    config = read_config(server.repository / MODEL / "config.pbtxt")
    rows = config.max_batch_size + 1
    prompt = np.array([[b"def f():"]] * rows, dtype=np.object_)
    length = np.full((rows, 1), 4, dtype=np.uint32)
    inputs = [httpclient.InferInput("prompt", [rows, 1], "BYTES"),
              httpclient.InferInput("request_output_len", [rows, 1], "UINT32")]  # fmt: skip
    inputs[0].set_data_from_numpy(prompt)
    inputs[1].set_data_from_numpy(length)
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(MODEL, inputs)
    finally:
        client.close()
    assert refused.value.status() == "400"
    assert f"must be <= {config.max_batch_size}" in refused.value.message()


# --- the edges, as the C++ answers them ---------------------------------------------------------


def test_request_output_len_0_answers_the_prompt_and_nothing_more(server):
    """FT GptJ::forward runs no step for W + 0 (GptJTritonModelInstance::convert_inputs adds the
    width; the loop is ``step < max_output_seq_len``): the answer is the prompt, an empty
    completion."""
    from tokenizers import Tokenizer

    tokenizer_dir = server.repository / "preprocessing" / "1" / "tokenizer"
    prompt = REQUEST["prompt"][0]
    ids = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(prompt).ids
    for protocol in ("http", "grpc"):
        url = server.grpc_url if protocol == "grpc" else server.http_url
        answer = complete(url, MODEL, {**REQUEST, "request_output_len": [0]}, protocol=protocol)
        assert answer.text == ""
        assert answer.sequence_length == len(ids)
        assert answer.output_ids[: len(ids)].tolist() == ids


def _ft_call(server: TritonServer, prompt: list[int], n_out: int, **extra: np.ndarray):
    """One row sent to the step model ``fastertransformer`` itself (its wire contract)."""
    arrays = {
        "input_ids": np.array([prompt], dtype=np.uint32),
        "input_lengths": np.array([[len(prompt)]], dtype=np.uint32),
        "request_output_len": np.array([[n_out]], dtype=np.uint32),
        "runtime_top_k": np.array([[1]], dtype=np.uint32),
        "end_id": np.array([[VOCAB - 1]], dtype=np.uint32),
        **extra,
    }
    inputs = []
    for name, array in arrays.items():
        dtype = {np.uint32: "UINT32", np.int32: "INT32"}[array.dtype.type]
        tensor = httpclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return client.infer("fastertransformer", inputs)
    finally:
        client.close()


def test_an_empty_stop_word_stops_the_row_after_one_token_and_an_empty_bad_word_bans_nothing(
    server,
):
    """stop_criteria_kernels.cu stop_words_criterion: item_size 0 matches at once;
    ban_bad_words.cu ban_bad_words: ``should_ban = item_size == 1`` (FT's own
    sample_request_single.json sends such an entry)."""
    prompt = [5, 6, 7]
    plain = _ft_call(server, prompt, 5)
    generated = plain.as_numpy("output_ids")[0, 0, 3:8].tolist()
    empty_first = np.array([[[0, 0], [0, -1]]], dtype=np.int32)  # one word, ending at offset 0
    stopped = _ft_call(server, prompt, 5, stop_words_list=empty_first)
    assert int(stopped.as_numpy("sequence_length")[0, 0]) == 3 + 1
    assert stopped.as_numpy("output_ids")[0, 0, 3] == generated[0]
    not_banned = _ft_call(server, prompt, 5, bad_words_list=empty_first)
    assert not_banned.as_numpy("output_ids")[0, 0, 3:8].tolist() == generated


def test_the_step_model_refuses_a_row_longer_than_the_planned_context(server):
    """GptJTritonModelInstance::forward sizes FT's buffers for the width + the largest
    request_output_len and allocates them outside any try, in ThreadForward's thread
    (libfastertransformer.cc): a failed allocation aborts tritonserver. The stand-in refuses a
    row beyond the context the deployment's memory is planned for, and answers the next."""
    with pytest.raises(InferenceServerException) as refused:
        _ft_call(server, [5, 6, 7], 2_000_000)
    assert "request_output_len" in refused.value.message()
    assert f"context of {SERVING_CONTEXT}" in refused.value.message()
    assert int(_ft_call(server, [5, 6, 7], 2).as_numpy("sequence_length")[0, 0]) == 5
