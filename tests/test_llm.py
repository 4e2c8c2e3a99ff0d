"""The ``llm`` model every published repository serves: Triton's LLM convention.

Three levels: its config (Triton's protobuf, the names, dtypes and parameters clients rely on),
the model on the python_backend r23.05 API (``tests/r2305/``, the Triton image's pins), and on
the real CPU ``tritonserver`` (``server``), where every answer is compared with the answer the
model named after the checkpoint gives the same request (the same FasterTransformer inputs, so
the same tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loader.parallel import Parallelism
from loader.repository import tensors
from loader.repository.config import LLM, RepositorySpec, build_all, read_config
from loader.repository.key import RESERVED_MODEL_NAMES, ServingSettings
from loader.repository.models import model_files
from tests.test_python_backend_r2305 import (
    NEEDS_TRITON_VENV,
    _drive,
    _model_module,
    _publish,
    triton_site,  # noqa: F401  (a fixture)
)

PROMPT = "def add(a, b):"
#: The contract other components are built against (names, Triton dtypes, dims, optional).
CONTRACT_INPUTS = [
    ("text_input", "TYPE_STRING", [1], False),
    ("max_tokens", "TYPE_INT32", [1], False),
    ("stream", "TYPE_BOOL", [1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("repetition_penalty", "TYPE_FP32", [1], True),
    ("seed", "TYPE_UINT64", [1], True),
    ("stop_words", "TYPE_STRING", [-1], True),
    ("bad_words", "TYPE_STRING", [-1], True),
]
CONTRACT_OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("finish_reason", "TYPE_STRING", [1]),
    ("num_input_tokens", "TYPE_INT32", [1]),
    ("num_output_tokens", "TYPE_INT32", [1]),
    ("cum_log_probs", "TYPE_FP32", [1]),
]


def _spec(**settings) -> RepositorySpec:
    return RepositorySpec(
        name="codegen-350M-mono",
        parallelism=Parallelism(1, 1, 2),
        settings=ServingSettings(**settings),
        data_type="fp16",
        end_id=50256,
        max_model_len=2048,
    )


# --- the config -------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
def test_every_repository_has_the_llm_model_with_the_contracts_names(streaming):
    from tritonclient.grpc import model_config_pb2 as mc

    configs = build_all(_spec(streaming=streaming))
    config = configs[LLM]
    assert LLM == "llm" and config.name == "llm"
    assert config.backend == "python"
    assert config.model_transaction_policy.decoupled
    assert config.max_batch_size == 1  # one prompt per request; Triton refuses more
    inputs = [
        (i.name, mc.DataType.Name(i.data_type), list(i.dims), i.optional) for i in config.input
    ]
    assert inputs == CONTRACT_INPUTS
    outputs = [(o.name, mc.DataType.Name(o.data_type), list(o.dims)) for o in config.output]
    assert outputs == CONTRACT_OUTPUTS
    assert [(g.count, g.kind) for g in config.instance_group] == [
        (1, mc.ModelInstanceGroup.KIND_CPU)
    ]
    assert {k: v.string_value for k, v in config.parameters.items()} == {
        "max_model_len": "2048",
        "served_model_name": "codegen-350M-mono",
        "streaming": "true" if streaming else "false",
    }


def test_llm_is_a_reserved_model_name():
    assert "llm" in RESERVED_MODEL_NAMES


def test_the_models_own_name_lists_are_the_contracts():
    """The model runs inside Triton and cannot import the tensor tables."""
    model = _model_module("llm")
    assert tuple(t.name for t in tensors.LLM_INPUTS) == model.INPUTS
    assert tuple(t.name for t in tensors.LLM_OUTPUTS) == model.OUTPUTS
    assert tuple(t.name for t in tensors.FASTERTRANSFORMER_INPUTS) == model.FT_INPUTS
    assert tuple(t.name for t in tensors.FT_RESULTS) == model.FT_RESULTS
    assert tuple(t.name for t in tensors.POSTPROCESSING_OUTPUTS) == model.ANSWER
    client = {t.name for t in tensors.PREPROCESSING_INPUTS}
    assert {target for target, _ in model.FIELDS.values()} <= client
    from loader.reference.generate import TOP_K_MAX

    assert model.TOP_K_MAX == TOP_K_MAX


def test_a_bound_preprocessing_enforces_is_refused_in_this_models_field_names():
    """preprocessing bounds every request first and names its own inputs; the client of llm
    sent llm's."""
    model = _model_module("llm")
    said = (
        "request_output_len: the prompt's 8 tokens + request_output_len 100000 = 100008 tokens, "
        "more than the model's context of 512 (max_sequence_length)"
    )
    assert model.in_llm_terms(said) == (
        "max_tokens: the prompt's 8 tokens + max_tokens 100000 = 100008 tokens, "
        "more than the model's context of 512 (max_sequence_length)"
    )
    assert model.in_llm_terms("prompt: longer than 2048 bytes") == (
        "text_input: longer than 2048 bytes"
    )
    assert model.in_llm_terms("end_id: 600 is outside the vocabulary") == (
        "end_id: 600 is outside the vocabulary"
    )


def test_the_writer_copies_the_model_its_bls_steps_and_tokenizer_module():
    assert [relative for _, relative in model_files("llm")] == [
        "1/model.py",
        "1/bls.py",
        "1/tokenization.py",
    ]
    assert [relative for _, relative in model_files("streaming")] == ["1/model.py", "1/bls.py"]


def test_word_lists_are_fastertransformers_layout():
    model = _model_module("llm")
    assert model.word_list([]).tolist() == [[[0], [-1]]]
    assert model.word_list([(5, 6), (7,), (8, 9, 10)]).tolist() == [
        [[5, 6, 7, 8, 9, 10], [2, 3, 6, -1, -1, -1]]
    ]
    assert model.word_list([(5,)]).dtype == np.int32


def test_text_that_may_start_a_stop_word_is_held_back():
    model = _model_module("llm")
    words = [(7, 8, 9), (4,)]
    assert model.held_back([1, 2, 7], 2, words) == 1
    assert model.held_back([1, 7, 8], 2, words) == 2
    assert model.held_back([1, 7, 8], 1, words) == 1  # never more than was generated
    assert model.held_back([1, 2, 3], 2, words) == 0
    assert model.ending_stop_word([1, 7, 8, 9], words) == 3
    assert model.ending_stop_word([1, 4], words) == 1
    assert model.ending_stop_word([1, 8, 9], words) == 0


def test_the_finish_reason_and_shown_text_follow_how_generation_ended():
    """End id: ``stop``, the end id left out of the text but counted; a stop word: ``stop``,
    its tokens left out (also when it began in the prompt); otherwise ``length``."""
    model = _model_module("llm")

    class Decoder:
        @staticmethod
        def decode_batch(batch, skip_special_tokens):
            return [" ".join(map(str, ids)) for ids in batch]

    class Req:
        stop_words = ((7, 8),)
        exclude_input = True
        prompt = "p"

    def finish(sequence: list[int]) -> tuple[list[int], str]:
        answer = model.Answer(Req(), Decoder(), prompt_tokens=3, end_id=99)
        answer.sequence = sequence
        return answer._finish()

    assert finish([1, 2, 3, 4, 5, 99]) == ([4, 5], "stop")
    assert finish([1, 2, 3, 4, 7, 8]) == ([4], "stop")
    assert finish([1, 2, 7, 8]) == ([], "stop")  # the word began in the prompt
    assert finish([1, 2, 3, 4, 5, 7]) == ([4, 5, 7], "length")


# --- on the python_backend r23.05 API (the Triton image's pins) ----------------------------------


@pytest.fixture(scope="module")
def plain(tiny_checkpoint_with_tokenizer, tmp_path_factory) -> Path:
    return _publish(
        tiny_checkpoint_with_tokenizer, tmp_path_factory.mktemp("llm") / "m", streaming=False
    )


@pytest.fixture(scope="module")
def streaming(tiny_checkpoint_with_tokenizer, tmp_path_factory) -> Path:
    return _publish(
        tiny_checkpoint_with_tokenizer, tmp_path_factory.mktemp("llms") / "m", streaming=True
    )


def _llm(max_tokens: int = 6, prompt: str = PROMPT, **optional) -> dict:
    request = {"text_input": ["BYTES", [prompt]], "max_tokens": ["INT32", [[max_tokens]]]}
    request.update(optional)
    return request


def _joined(result: dict) -> tuple[str, list[dict]]:
    """A stream's text and its responses' outputs (first value of each)."""
    outputs = [r["outputs"] for r in result["responses"] if "outputs" in r]
    text = "".join(o["text_output"][0][0] for o in outputs)
    return text, outputs


def test_a_published_repository_holds_llm_with_the_checkpoints_context(plain):
    config = read_config(plain / "llm" / "config.pbtxt")
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["served_model_name"] == "codegen"
    # the tiny checkpoint's n_positions (tests/tinymodels.py), written into config.ini
    ini = (plain / "fastertransformer" / "1" / "1-gpu" / "config.ini").read_text()
    [line] = [x for x in ini.splitlines() if x.startswith("max_pos_seq_len")]
    assert params["max_model_len"] == line.split("=")[1].strip()
    for name in ("model.py", "bls.py", "tokenization.py", "tokenizer"):
        assert (plain / "llm" / "1" / name).exists(), name


@NEEDS_TRITON_VENV
def test_llm_answers_as_the_ensemble_does_greedy_and_sampled(plain, tmp_path, triton_site):  # noqa: F811
    """The differential test on the r23.05 API: the same request through the ensemble and
    through ``llm`` gives the same tokens, text and log probability."""
    ensemble_fields = {
        "greedy": {"runtime_top_k": ["UINT32", [[1]]]},
        "sampled": {
            "runtime_top_k": ["UINT32", [[20]]],
            "runtime_top_p": ["FP32", [[0.9]]],
            "temperature": ["FP32", [[0.7]]],
            "repetition_penalty": ["FP32", [[1.2]]],
            "random_seed": ["UINT64", [[1594506369]]],
        },
    }
    llm_fields = {
        "greedy": {"top_k": ["INT32", [[1]]]},
        "sampled": {
            "top_k": ["INT32", [[20]]],
            "top_p": ["FP32", [[0.9]]],
            "temperature": ["FP32", [[0.7]]],
            "repetition_penalty": ["FP32", [[1.2]]],
            "seed": ["UINT64", [[1594506369]]],
        },
    }
    ensemble = _drive(
        plain,
        tmp_path,
        triton_site,
        "ensemble",
        [
            {
                "prompt": ["BYTES", [PROMPT]],
                "request_output_len": ["UINT32", [[8]]],
                **ensemble_fields[k],
            }
            for k in ("greedy", "sampled")
        ],
    )["results"]
    llm = _drive(
        plain,
        tmp_path,
        triton_site,
        "llm",
        [
            _llm(8, exclude_input_in_output=["BOOL", [[True]]], **llm_fields[k])
            for k in ("greedy", "sampled")
        ],
    )["results"]
    texts = []
    for expected, got in zip(ensemble, llm, strict=True):
        [response] = got["responses"]
        assert response["final"] and "error" not in response, response
        out = response["outputs"]
        assert out["text_output"] == expected["outputs"]["completion"]
        assert out["finish_reason"] == [["length"]]  # the tiny model's end_id is never sampled
        prompt_len = expected["outputs"]["sequence_length"][0][0] - 8
        assert out["num_input_tokens"] == [[prompt_len]]
        assert out["num_output_tokens"] == [[8]]
        assert out["cum_log_probs"] == expected["outputs"]["cum_log_probs"]
        assert response["dtypes"] == {
            "text_output": "object",
            "finish_reason": "object",
            "num_input_tokens": "int32",
            "num_output_tokens": "int32",
            "cum_log_probs": "float32",
        }
        texts.append(out["text_output"][0][0])
    assert texts[0] != texts[1]  # the sampled request did sample


@NEEDS_TRITON_VENV
def test_llm_streams_increments_on_the_r2305_api(streaming, plain, tmp_path, triton_site):  # noqa: F811
    """Fails if a BLS call of ``llm`` reads a fastertransformer tensor in GPU memory; the
    streamed increments join into the unary text, only the last response has a finish
    reason."""
    fields = {"top_k": ["INT32", [[1]]]}
    [streamed] = _drive(
        streaming, tmp_path, triton_site, "llm", [_llm(6, stream=["BOOL", [[True]]], **fields)]
    )["results"]
    assert streamed["final"]
    text, outputs = _joined(streamed)
    assert all("error" not in r for r in streamed["responses"])
    assert [o["finish_reason"][0][0] for o in outputs] == [""] * (len(outputs) - 1) + ["length"]
    assert streamed["responses"][-1]["final"] and len(outputs) >= 2
    assert [o["num_output_tokens"][0][0] for o in outputs][-1] == 6
    [unary] = _drive(streaming, tmp_path, triton_site, "llm", [_llm(6, **fields)])["results"]
    [response] = unary["responses"]
    assert response["outputs"]["text_output"][0][0] == PROMPT + text  # vLLM's default: prompt
    [plain_unary] = _drive(plain, tmp_path, triton_site, "llm", [_llm(6, **fields)])["results"]
    assert plain_unary["responses"][0]["outputs"] == response["outputs"]


@NEEDS_TRITON_VENV
def test_llm_refuses_what_it_cannot_serve_naming_the_field(plain, tmp_path, triton_site):  # noqa: F811
    cases = {
        "max_tokens: must be at least 1 (got 0)": _llm(0),
        "max_tokens: must be at least 1 (got -3)": _llm(-3),
        "max_tokens: the prompt's": _llm(100_000),
        "text_input: the prompt is empty": _llm(4, prompt=""),
        "temperature: must be 0 (greedy) or more": _llm(4, temperature=["FP32", [[-0.5]]]),
        "temperature: must be a finite number": _llm(4, temperature=["FP32", [[float("nan")]]]),
        "top_k: must be between 0 (no limit) and 1024": _llm(4, top_k=["INT32", [[1025]]]),
        "top_k: must be between 0 (no limit) and 1024, FasterTransformer's top-k limit (got -1)": (
            _llm(4, top_k=["INT32", [[-1]]])
        ),
        "top_p: must be between 0 and 1 (got 1.5)": _llm(4, top_p=["FP32", [[1.5]]]),
        "top_p: must be between 0 and 1 (got -0.25)": _llm(4, top_p=["FP32", [[-0.25]]]),
        "repetition_penalty: must be more than 0": _llm(4, repetition_penalty=["FP32", [[0.0]]]),
        "stop_words: holds an empty string": _llm(4, stop_words=["BYTES", [["x", ""]]]),
        "bad_words: holds an empty string": _llm(4, bad_words=["BYTES", [[""]]]),
        "stream: this repository generates each completion in one piece": _llm(
            4, stream=["BOOL", [[True]]]
        ),
    }
    report = _drive(plain, tmp_path, triton_site, "llm", list(cases.values()))
    for expected, result in zip(cases, report["results"], strict=True):
        [response] = result["responses"]
        assert response["final"]
        assert response.get("error", "").startswith(expected), (expected, response)


def _tokenizer(repository: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(repository / "llm" / "1" / "tokenizer" / "tokenizer.json"))


def _stop_word(tokenizer, prompt_ids: list[int], generated: list[int]) -> tuple[int, str]:
    """A generated token (not the first) that is a word of its own (it tokenizes back to itself)
    and appears nowhere before it: a stop word that ends the greedy text there."""
    for index in range(1, len(generated)):
        token = generated[index]
        word = tokenizer.decode([token])
        earlier = prompt_ids + generated[:index]
        if word and tokenizer.encode(word).ids == [token] and token not in earlier:
            return index, word
    raise AssertionError(f"no usable stop word in {generated}")


@NEEDS_TRITON_VENV
def test_stop_words_end_the_text_and_are_left_out(plain, tmp_path, triton_site):  # noqa: F811
    """A stop word taken from the greedy output itself: the text ends before it, the reason is
    ``stop``, and the stop word's token is counted (FasterTransformer generated it)."""
    greedy = {"top_k": ["INT32", [[1]]], "exclude_input_in_output": ["BOOL", [[True]]]}
    ensemble = _drive(
        plain,
        tmp_path,
        triton_site,
        "ensemble",
        [{"prompt": ["BYTES", [PROMPT]], "request_output_len": ["UINT32", [[12]]],
          "runtime_top_k": ["UINT32", [[1]]]}],
    )["results"][0]["outputs"]  # fmt: skip
    length = ensemble["sequence_length"][0][0]
    sequence = ensemble["output_ids"][0][0][:length]
    tokenizer = _tokenizer(plain)
    prompt_ids = tokenizer.encode(PROMPT).ids
    generated = sequence[len(prompt_ids) :]
    index, word = _stop_word(tokenizer, prompt_ids, generated)
    [stopped] = _drive(
        plain,
        tmp_path,
        triton_site,
        "llm",
        [_llm(12, stop_words=["BYTES", [["never-in-the-text", word]]], **greedy)],
    )["results"]
    [response] = stopped["responses"]
    out = response["outputs"]
    assert out["text_output"] == [[tokenizer.decode(generated[:index])]]
    assert out["finish_reason"] == [["stop"]]
    assert out["num_output_tokens"] == [[index + 1]]


@NEEDS_TRITON_VENV
def test_bad_words_are_never_generated(plain, tmp_path, triton_site):  # noqa: F811
    """A token of the greedy output banned: the text is the same up to it, then differs."""
    greedy = {"top_k": ["INT32", [[1]]], "exclude_input_in_output": ["BOOL", [[True]]]}
    [full] = _drive(plain, tmp_path, triton_site, "llm", [_llm(8, **greedy)])["results"]
    text = full["responses"][0]["outputs"]["text_output"][0][0]
    tokenizer = _tokenizer(plain)
    generated = tokenizer.encode(text).ids
    index, word = _stop_word(tokenizer, tokenizer.encode(PROMPT).ids, generated)
    [banned] = _drive(
        plain, tmp_path, triton_site, "llm", [_llm(8, bad_words=["BYTES", [[word]]], **greedy)]
    )["results"]
    out = banned["responses"][0]["outputs"]
    assert out["finish_reason"] == [["length"]] and out["num_output_tokens"] == [[8]]
    changed = out["text_output"][0][0]
    assert changed.startswith(tokenizer.decode(generated[:index]))
    assert not changed.startswith(tokenizer.decode(generated[: index + 1]))


@NEEDS_TRITON_VENV
def test_streamed_stop_words_are_held_back_until_decided(streaming, tmp_path, triton_site):  # noqa: F811
    """A two-token stop word whose first token is generated: that token is not streamed until
    the next one decides, and the stop word never reaches the client."""
    greedy = {"top_k": ["INT32", [[1]]], "stream": ["BOOL", [[True]]]}
    [full] = _drive(streaming, tmp_path, triton_site, "llm", [_llm(12, **greedy)])["results"]
    text, _ = _joined(full)
    tokenizer = _tokenizer(streaming)
    prompt_ids = tokenizer.encode(PROMPT).ids
    generated = tokenizer.encode(text).ids
    index, word = _stop_word(tokenizer, prompt_ids, generated)
    # The first token of the stop word, followed by a token the model does not generate next.
    other = next(t for t in range(5, 300) if t != generated[min(index + 1, len(generated) - 1)])
    tricky = word + tokenizer.decode([other])
    [stopped] = _drive(
        streaming,
        tmp_path,
        triton_site,
        "llm",
        [_llm(12, stop_words=["BYTES", [[word, tricky]]], **greedy)],
    )["results"]
    streamed, outputs = _joined(stopped)
    assert outputs[-1]["finish_reason"] == [["stop"]]
    assert streamed == tokenizer.decode(generated[:index])
    assert all(o["finish_reason"] == [[""]] for o in outputs[:-1])


# --- on the real CPU tritonserver ----------------------------------------------------------------

#: The users' request (bench/test.json) in the ensemble's names and in llm's.
SEED_REQUEST = {
    "prompt": ["<python>def is_even(na: int) ->"],
    "request_output_len": [16],
    "temperature": [0.2],
    "repetition_penalty": [1.0],
    "runtime_top_k": [0],
    "runtime_top_p": [0.98],
    "random_seed": [1594506369],
}
LLM_NAMES = {
    "prompt": "text_input",
    "request_output_len": "max_tokens",
    "runtime_top_k": "top_k",
    "runtime_top_p": "top_p",
    "random_seed": "seed",
}
LLM_DTYPES = {t.name: t.dtype for t in tensors.LLM_INPUTS}


def _as_llm(request: dict) -> dict:
    return {LLM_NAMES.get(name, name): values[0] for name, values in request.items()}


def _llm_inputs(module, fields: dict) -> list:
    """``InferInput`` objects for ``fields`` (name -> a value, or a list for the word lists)."""
    inputs = []
    for name, value in fields.items():
        dtype = LLM_DTYPES[name]
        if dtype == "BYTES":
            values = value if isinstance(value, list) else [value]
            array = np.empty((1, len(values)), dtype=np.object_)
            array[0, :] = [v.encode("utf-8") for v in values]
        else:
            from tritonclient.utils import triton_to_np_dtype

            array = np.array([[value]], dtype=triton_to_np_dtype(dtype))
        tensor = module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _call(server, fields: dict, *, timeout_s: float = 120.0) -> list[dict]:
    """One request to ``llm`` over gRPC streaming (the only way to a decoupled model over
    gRPC), read to the response whose ``finish_reason`` is not empty: the end as a Triton 23.05
    client sees it. Each response as ``{output: first value}``; an error raises."""
    import queue

    import tritonclient.grpc as grpcclient

    inbox: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: inbox.put((result, error)))
    responses = []
    try:
        client.async_stream_infer("llm", _llm_inputs(grpcclient, fields))
        while True:
            result, error = inbox.get(timeout=timeout_s)
            if error is not None:
                raise error
            response = {}
            for output in tensors.LLM_OUTPUTS:
                value = result.as_numpy(output.name).reshape(-1)[0]
                response[output.name] = value.decode() if isinstance(value, bytes) else value
            responses.append(response)
            if response["finish_reason"]:
                return responses
    finally:
        client.stop_stream()
        client.close()


@pytest.fixture(scope="module")
def streaming_server(streaming):
    from loader.serving import TritonServer

    with TritonServer(streaming) as server:
        yield server


@pytest.fixture(scope="module")
def plain_server(published_tiny_python_repository):
    from loader.serving import TritonServer

    with TritonServer(published_tiny_python_repository) as server:
        yield server


@pytest.mark.server
def test_clients_read_the_context_and_name_from_the_llm_config(plain_server):
    import tritonclient.grpc as grpcclient

    from loader.serving import restricted_protocols

    # The server runs the chart's arguments: model-config answers only with the admin header.
    headers = dict([restricted_protocols(plain_server.pod_args)["model-config"]])
    client = grpcclient.InferenceServerClient(plain_server.grpc_url)
    try:
        config = client.get_model_config("llm", as_json=True, headers=headers)["config"]
        assert client.is_model_ready("llm")
    finally:
        client.close()
    params = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert params["served_model_name"] == "codegen"
    assert int(params["max_model_len"]) > 0
    assert config["model_transaction_policy"]["decoupled"] is True


@pytest.mark.server
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_llm_gives_the_ensembles_tokens_for_the_same_request(plain_server, sampling):
    """The differential test on the real server: bench/test.json (seeded top-p sampling) and
    its greedy variant, through the ensemble and through ``llm``."""
    from loader.completion import complete

    request = dict(SEED_REQUEST)
    if sampling == "greedy":
        request = {k: v for k, v in request.items() if k not in ("runtime_top_p", "random_seed")}
    expected = complete(plain_server.grpc_url, "codegen", request, protocol="grpc")
    [answer] = _call(plain_server, {**_as_llm(request), "exclude_input_in_output": True})
    assert answer["text_output"] == expected.text
    assert answer["finish_reason"] == "length"
    assert answer["num_output_tokens"] == 16
    assert answer["num_input_tokens"] == expected.sequence_length - 16
    assert answer["cum_log_probs"] == np.float32(expected.cum_log_prob)
    [with_prompt] = _call(plain_server, _as_llm(request))  # vLLM's default when not streaming
    assert with_prompt["text_output"] == request["prompt"][0] + expected.text


@pytest.mark.server
def test_llm_streams_what_the_streaming_model_streams(streaming_server):
    """On a --streaming repository: one response per increment, ``finish_reason`` empty until
    the last, the increments joined are the unary text and the streaming model's text."""
    from loader.streaming import collect, stream_completion

    expected = collect(
        stream_completion(streaming_server.grpc_url, "codegen", SEED_REQUEST, timeout_s=120)
    )
    fields = _as_llm(SEED_REQUEST)
    streamed = _call(streaming_server, {**fields, "stream": True})
    assert len(streamed) >= 3
    assert [r["finish_reason"] for r in streamed] == [""] * (len(streamed) - 1) + ["length"]
    text = "".join(r["text_output"] for r in streamed)
    assert text == expected.text
    assert [r["num_output_tokens"] for r in streamed][-1] == 16
    [unary] = _call(streaming_server, {**fields, "exclude_input_in_output": True})
    assert unary["text_output"] == text
    [first, *_] = _call(
        streaming_server, {**fields, "stream": True, "exclude_input_in_output": False}
    )
    assert first["text_output"].startswith(SEED_REQUEST["prompt"][0])


@pytest.mark.server
def test_every_optional_input_is_accepted(streaming_server):
    fields = {
        "text_input": "def f(x):",
        "max_tokens": 6,
        "stream": True,
        "exclude_input_in_output": True,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
        "seed": 7,
        "stop_words": ["\n\n", "def "],
        "bad_words": ["import"],
    }
    responses = _call(streaming_server, fields)
    assert responses[-1]["finish_reason"] in ("length", "stop")
    assert 1 <= responses[-1]["num_output_tokens"] <= 6
    again = _call(streaming_server, fields)
    assert [r["text_output"] for r in again] == [r["text_output"] for r in responses]  # seeded
    greedy = _call(streaming_server, {**fields, "temperature": 0.0, "stream": False})
    top1 = _call(
        streaming_server, {**fields, "temperature": 1.0, "top_k": 1, "top_p": 0.0, "stream": False}
    )
    assert greedy[0]["text_output"] == top1[0]["text_output"]  # temperature 0: greedy


@pytest.mark.server
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: must be at least 1 (got 0)"),
        ({"max_tokens": 1_000_000}, "max_tokens: the prompt's"),
        ({"text_input": ""}, "text_input: the prompt is empty"),
        ({"temperature": -1.0}, "temperature: must be 0 (greedy) or more"),
        ({"top_k": 4096}, "top_k: must be between 0 (no limit) and 1024"),
        ({"top_k": -5}, "top_k: must be between 0 (no limit) and 1024"),
        ({"top_p": 2.0}, "top_p: must be between 0 and 1"),
        ({"repetition_penalty": -1.0}, "repetition_penalty: must be more than 0"),
        ({"stop_words": [""]}, "stop_words: holds an empty string"),
        ({"bad_words": ["ok", ""]}, "bad_words: holds an empty string"),
    ],
)
def test_bad_input_is_refused_naming_the_field(plain_server, fields, message):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        _call(plain_server, {"text_input": "def f(x):", "max_tokens": 4, **fields})
    assert caught.value.message().startswith(message), caught.value.message()


@pytest.mark.server
def test_streaming_is_refused_where_fastertransformer_is_not_decoupled(plain_server):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=r"^stream: this repository generates"):
        _call(plain_server, {"text_input": "def f(x):", "max_tokens": 4, "stream": True})


@pytest.mark.server
def test_beam_search_and_several_prompts_are_refused_naming_them(plain_server):
    """Inputs FasterTransformer's path here cannot serve do not exist on ``llm``: Triton itself
    answers with the field's name; a request of two prompts exceeds max_batch_size 1."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(plain_server.grpc_url)
    try:
        beam = grpcclient.InferInput("beam_width", [1, 1], "INT32")
        beam.set_data_from_numpy(np.array([[2]], dtype=np.int32))
        with pytest.raises(InferenceServerException, match="beam_width"):
            _call_inputs(
                client, [*_llm_inputs(grpcclient, {"text_input": "x", "max_tokens": 2}), beam]
            )
        two = grpcclient.InferInput("text_input", [2, 1], "BYTES")
        two.set_data_from_numpy(np.array([[b"a"], [b"b"]], dtype=np.object_))
        length = grpcclient.InferInput("max_tokens", [2, 1], "INT32")
        length.set_data_from_numpy(np.array([[2], [2]], dtype=np.int32))
        with pytest.raises(InferenceServerException, match="batch"):
            _call_inputs(client, [two, length])
    finally:
        client.close()


def _call_inputs(client, inputs: list) -> None:
    import queue

    inbox: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: inbox.put((result, error)))
    try:
        client.async_stream_infer("llm", inputs)
        _result, error = inbox.get(timeout=60)
        if error is not None:
            raise error
    finally:
        client.stop_stream()


@pytest.mark.server
def test_tritons_generate_endpoints_serve_llm(streaming_server):
    """Triton's HTTP generate extension (what GenAI-Perf and AIPerf's Triton paths, and curl,
    use): ``/generate`` answers with the whole text, ``/generate_stream`` streams server-sent
    events whose texts join into it."""
    import json
    import urllib.request

    body = {**_as_llm(SEED_REQUEST), "exclude_input_in_output": True}

    def post(path: str, fields: dict) -> bytes:
        request = urllib.request.Request(
            f"http://{streaming_server.http_url}/v2/models/llm/{path}",
            data=json.dumps(fields).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read()

    whole = json.loads(post("generate", body))
    assert whole["finish_reason"] == "length" and whole["num_output_tokens"] == 16
    events = [
        json.loads(line[len(b"data: ") :])
        for line in post("generate_stream", {**body, "stream": True}).splitlines()
        if line.startswith(b"data: ")
    ]
    assert len(events) >= 3 and events[-1]["finish_reason"] == "length"
    assert "".join(e["text_output"] for e in events) == whole["text_output"]


@pytest.mark.server
def test_a_cancelled_stream_leaves_llm_serving(streaming_server):
    """A client that goes away mid-stream (what the OpenAI service does when its client
    disconnects): the next request is answered in full."""
    import queue

    import tritonclient.grpc as grpcclient

    inbox: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(streaming_server.grpc_url)
    client.start_stream(callback=lambda result, error: inbox.put((result, error)))
    try:
        # most of the tiny model's context (n_positions 64): many steps after the first
        fields = {"text_input": "def f(x):", "max_tokens": 50, "stream": True, "top_k": 1}
        client.async_stream_infer("llm", _llm_inputs(grpcclient, fields))
        result, error = inbox.get(timeout=120)
        assert error is None and result.as_numpy("finish_reason").reshape(-1)[0] == b""
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    [answer] = _call(streaming_server, {**_as_llm(SEED_REQUEST), "exclude_input_in_output": True})
    assert answer["finish_reason"] == "length" and answer["num_output_tokens"] == 16


@pytest.mark.server
def test_concurrent_llm_streams_each_get_their_own_answer(streaming_server):
    """Requests in flight together share fastertransformer's batches (dynamic batching, the
    same input set); each stream still joins into the answer its request gets alone."""
    import concurrent.futures

    prompts = ["def f(x):", "import os\n\n\ndef main():", "class Stack:", "x = ["]
    alone = {}
    for prompt in prompts:
        [answer] = _call(streaming_server, {"text_input": prompt, "max_tokens": 12, "top_k": 1})
        alone[prompt] = answer["text_output"], answer["finish_reason"]

    def streamed(prompt: str) -> str:
        responses = _call(
            streaming_server,
            {"text_input": prompt, "max_tokens": 12, "top_k": 1, "stream": True,
             "exclude_input_in_output": False},
        )  # fmt: skip
        assert responses[-1]["finish_reason"] in ("length", "stop")  # the tiny end_id is 2
        return "".join(r["text_output"] for r in responses), responses[-1]["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = dict(zip(prompts, pool.map(streamed, prompts), strict=True))
    assert together == alone


@pytest.mark.server
def test_generate_answers_in_a_repository_that_does_not_stream(plain_server):
    """``/generate`` serves a repository published without ``--streaming``; asking it to
    stream is an HTTP error whose message names the field."""
    import json
    import urllib.error
    import urllib.request

    def post(fields: dict) -> dict:
        request = urllib.request.Request(
            f"http://{plain_server.http_url}/v2/models/llm/generate",
            data=json.dumps(fields).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    fields = {"text_input": "def f(x):", "max_tokens": 5, "top_k": 1}
    answer = post(fields)
    assert answer["text_output"].startswith("def f(x):")  # not streaming: the prompt first
    assert answer["finish_reason"] in ("length", "stop") and answer["num_output_tokens"] >= 1
    with pytest.raises(urllib.error.HTTPError) as refused:
        post({**fields, "stream": True})
    assert "stream: this repository generates each completion in one piece" in (
        refused.value.read().decode()
    )
