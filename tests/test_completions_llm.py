"""The completions service end to end: the real ``openai`` client, the service, a real CPU
Triton serving the tiny checkpoint as ``model-loader run`` publishes it, and its real ``llm``
model (docs/llm.md). Each answer is checked against the ``llm`` model's own answer to the same
request sent directly over gRPC, so the service adds and loses nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from tritonclient.grpc.aio import InferenceServerClient

from completions_service.sampling import Sampling
from completions_service.triton import CHANNEL_OPTIONS, Generation, build_inputs, piece_of
from loader.serving import TritonServer
from tests.completions_harness import CompletionsService
from tests.test_python_backend_r2305 import _publish
from tests.tinymodels import SERVING_CONTEXT

pytestmark = pytest.mark.server  # starts real servers (see markers in pyproject.toml)

MODEL = "codegen"  # the repository's model name: the llm model's served_model_name
CONTEXT = SERVING_CONTEXT  # the published tiny checkpoint's n_positions
PROMPT = "def add(a, b):"
GREEDY = Sampling(greedy=True, temperature=None, top_p=None, top_k=1, seed=None)


@pytest.fixture(scope="module")
def streaming_repository(tiny_checkpoint_with_tokenizer, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("completions-llm") / "models"
    return _publish(tiny_checkpoint_with_tokenizer, root, streaming=True)


@pytest.fixture(scope="module")
def triton(streaming_repository):
    with TritonServer(streaming_repository) as server:
        yield server


@pytest.fixture(scope="module")
def service(triton, tmp_path_factory):
    log = tmp_path_factory.mktemp("service") / "service.log"
    with CompletionsService(triton, log=log) as svc:
        yield svc


def client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)


def direct(triton, generation: Generation) -> list:
    """The llm model's responses to ``generation``, over gRPC without the service."""

    async def ask() -> list:
        grpc = InferenceServerClient(triton.grpc_url, channel_args=CHANNEL_OPTIONS)
        done = asyncio.Event()

        async def requests():
            yield {"model_name": "llm", "inputs": build_inputs(generation, batched=True)}
            await done.wait()

        pieces = []
        try:
            async for result, error in grpc.stream_infer(requests()):
                assert error is None, error
                pieces.append(piece_of(result))
                if pieces[-1].finish_reason is not None:
                    break
        finally:
            done.set()
            await grpc.close()
        return pieces

    return asyncio.run(ask())


def test_the_model_is_listed_with_the_repositorys_name_and_context(service):
    (model,) = client(service).models.list().data
    assert model.id == MODEL and model.model_extra["max_model_len"] == CONTEXT


def test_a_unary_completion_is_the_llm_models_answer(service, triton):
    answer = client(service).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0
    )
    (piece,) = direct(triton, Generation(PROMPT, 12, False, GREEDY, ()))
    assert answer.choices[0].text == piece.text
    assert answer.choices[0].finish_reason == piece.finish_reason
    assert answer.usage.prompt_tokens == piece.prompt_tokens
    assert answer.usage.completion_tokens == piece.completion_tokens


def test_a_stream_is_the_llm_models_increments_one_event_each(service, triton):
    chunks = list(
        client(service).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
    )
    pieces = direct(triton, Generation(PROMPT, 12, True, GREEDY, ()))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == "".join(p.text for p in pieces)
    assert len([t for t in texts if t]) == len([p for p in pieces if p.text]) > 1
    assert chunks[-1].choices[0].finish_reason == pieces[-1].finish_reason
    unary = client(service).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert "".join(texts) == unary.choices[0].text


def test_a_stop_string_ends_the_text_before_it(service):
    whole = (
        client(service)
        .completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
        .choices[0]
        .text
    )
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
    assert stop.strip(), whole  # a visible stop, not only whitespace
    for stream in (False, True):
        answer = client(service).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop], stream=stream
        )
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == whole[: whole.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_completion(service):
    def sampled(seed: int) -> str:
        return (
            client(service)
            .completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sampled(7) == sampled(7)
    assert len({sampled(seed) for seed in (1, 2, 3, 4)}) > 1


def test_the_models_own_refusal_is_a_400_naming_the_field(service):
    with pytest.raises(openai.BadRequestError) as caught:
        client(service).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=CONTEXT, temperature=0
        )
    assert caught.value.body["param"] == "max_tokens"
    # The model's own words: the first step that sees the request bounds it by the context.
    assert f"model's context of {CONTEXT}" in caught.value.message


def test_a_repository_that_does_not_stream_refuses_stream_with_a_400(
    published_tiny_python_repository, tmp_path
):
    with (
        TritonServer(published_tiny_python_repository) as plain,
        CompletionsService(plain, log=tmp_path / "svc.log") as svc,
    ):
        answer = client(svc).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert answer.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError) as caught:
            list(
                client(svc).completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=4, stream=True
                )
            )
        assert caught.value.body["param"] == "stream"
        assert "--streaming" in caught.value.message
