"""The completions service with the real ``openai`` client, in front of a real CPU Triton.

Triton serves the ``llm`` stand-in (``tests/completions_standin.py``: the ``llm`` model's
contract with a text the tests can predict and tokens that come slowly enough to leave a
stream in the middle); the service runs as users run it (``python -m completions_service``,
``tests/completions_harness.py``). Each test says which status or behaviour it checks.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
from pathlib import Path

import openai
import pytest

from loader.serving import TritonServer
from tests.completions_harness import CompletionsService
from tests.completions_standin import activity, make_standin_repository
from tests.procs import signal_masks
from tests.servers import free_port

pytestmark = pytest.mark.server  # starts real servers (see markers in pyproject.toml)

MODEL = "standin-7b"
CONTEXT = 256
#: Seconds the stand-in waits before each token: a 200-token stream takes seconds.
TOKEN_DELAY_S = 0.03


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("standin") / "models"
    return make_standin_repository(
        root, name=MODEL, max_model_len=CONTEXT, token_delay_s=TOKEN_DELAY_S
    )


@pytest.fixture(scope="module")
def triton(repository):
    with TritonServer(repository) as server:
        yield server


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text("key-one\nkey-two\n")
    return path


@pytest.fixture(scope="module")
def service(triton, keys, tmp_path_factory):
    log = tmp_path_factory.mktemp("service") / "service.log"
    extra = ["--api-keys-file", str(keys), "--max-body-bytes", "20000"]
    with CompletionsService(triton, log=log, extra=extra) as svc:
        yield svc


def client(service: CompletionsService, key: str | None = "key-one") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key=key or "", max_retries=0)


def complete(service, **kwargs):
    args = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8, **kwargs}
    return client(service).completions.create(**args)


def call(service, method, path, body=None, headers=None) -> tuple[int, dict, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
    data = (
        None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    connection.request(
        method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    response = connection.getresponse()
    raw = response.read()
    connection.close()
    return response.status, dict(response.getheaders()), json.loads(raw) if raw else {}


AUTH = {"Authorization": "Bearer key-two"}


# --- answers ------------------------------------------------------------------------------------


def test_unary_completion_has_openais_shape_and_the_models_text(service, repository):
    answer = complete(service, temperature=0, max_tokens=6, user="editor-1")
    choice = answer.choices[0]
    assert answer.object == "text_completion" and answer.model == MODEL
    assert choice.finish_reason == "length" and choice.index == 0
    assert len(choice.text.split()) + choice.text.count("\n") == 6  # six words or newlines
    assert answer.usage.completion_tokens == 6
    assert answer.usage.prompt_tokens == 3 and answer.usage.total_tokens == 9
    # greedy: the same text every time
    assert complete(service, temperature=0, max_tokens=6).choices[0].text == choice.text
    echoed = complete(service, temperature=0, max_tokens=6, echo=True).choices[0].text
    assert echoed == "def add(a, b):" + choice.text


def test_a_prompt_as_a_list_of_one_and_the_legacy_engine_path(service):
    listed = complete(service, prompt=["def add(a, b):"], temperature=0).choices[0].text
    status, _, body = call(
        service, "POST", f"/v1/engines/{MODEL}/completions",
        {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}, AUTH,
    )  # fmt: skip
    assert status == 200 and body["choices"][0]["text"] == listed


def test_streaming_sends_each_increment_as_it_comes_then_done(service, repository):
    stream = complete(service, prompt="stream me", max_tokens=40, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    # The first increment arrived while the model was still generating (its line in the
    # activity log is written when it ends): nothing was buffered until the end.
    assert not [a for a in activity(repository) if a["prompt"] == "stream me"]
    rest = list(chunks)
    texts = [c.choices[0].text for c in [first, *rest]]
    reasons = [c.choices[0].finish_reason for c in [first, *rest]]
    assert len(texts) == 40 and all(texts)  # one event per token, not one event
    assert reasons == [None] * 39 + ["length"]
    unary = complete(service, prompt="stream me", max_tokens=40, temperature=0)
    assert "".join(texts) == unary.choices[0].text
    # the raw stream ends in data: [DONE]
    connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {**AUTH, "Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.getheader("Content-Type").startswith("text/event-stream")
    events = [e for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_stop_strings_end_the_text_before_them_unary_and_streamed(service):
    whole = complete(service, prompt="stops", temperature=0, max_tokens=30).choices[0].text
    stop = whole.split()[3]  # the fourth word
    cut = complete(service, prompt="stops", temperature=0, max_tokens=30, stop=[stop, "zzz"])
    assert cut.choices[0].text == whole[: whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = complete(
        service, prompt="stops", temperature=0, max_tokens=30, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == whole[: whole.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that straddles two tokens ("a" + "\n" ...) is found on the text too
    newline = complete(service, prompt="stops", temperature=0, max_tokens=30, stop="\n")
    assert newline.choices[0].text == whole.split("\n")[0]


def test_a_stop_inside_a_token_is_cut_and_ends_a_streamed_triton_request(service, repository):
    """The model stops only where its tokens spell a stop word (as FasterTransformer); a stop
    inside a token is found by the service. Streamed, the service closes the Triton stream
    there; unary, the model's one response is cut (a non-streamed request cannot be stopped
    early, and on Triton 23.05 a closed stream does not stop the generation anyway)."""
    for stream in (False, True):
        prompt = f"mid-token {stream}"
        whole = complete(service, prompt=prompt, temperature=0, max_tokens=60).choices[0].text
        at = whole.index("a\n")  # the end of a word, then the newline token
        answer = complete(
            service, prompt=prompt, temperature=0, max_tokens=200, stop="a\n", stream=stream
        )
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == whole[:at]
        assert chunks[-1].choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 30
    done = []
    while not done and time.monotonic() < deadline:
        time.sleep(0.1)
        done = [
            a for a in activity(repository) if a["prompt"] == "mid-token True" and a["cancelled"]
        ]
    assert done and done[0]["tokens"] < 200


def test_a_seed_reproduces_a_sampled_completion_and_unseeded_ones_differ(service):
    def sampled(**kwargs) -> str:
        return (
            complete(service, prompt="seeded", temperature=0.8, max_tokens=20, **kwargs)
            .choices[0]
            .text
        )

    assert sampled(seed=1234) == sampled(seed=1234)
    assert sampled(seed=1234) != sampled(seed=4321)
    assert len({sampled() for _ in range(3)}) > 1  # no seed: a fresh one each time


# --- errors -------------------------------------------------------------------------------------


def test_400_names_the_field_for_the_services_checks_and_the_models(service):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(service, max_tokens=CONTEXT + 1)
    assert caught.value.body["param"] == "max_tokens" and "max_model_len" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:  # the model's own check
        complete(service, prompt="word " * 200, max_tokens=100)
    assert caught.value.body["param"] == "max_tokens"
    assert "context of 256" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        complete(service, suffix="\n    return a + b\n")
    assert (
        caught.value.body["param"] == "suffix"
        and "cannot fill in the middle" in caught.value.message
    )
    with pytest.raises(openai.BadRequestError) as caught:
        complete(service, logprobs=1)
    assert caught.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as caught:  # streamed too: the status, not a 200
        complete(service, prompt="word " * 200, max_tokens=100, stream=True)
    assert caught.value.status_code == 400
    status, _, body = call(service, "POST", "/v1/completions", b"{not json", AUTH)
    assert status == 400 and "not valid JSON" in body["error"]["message"]


def test_401_for_a_missing_or_wrong_key(service):
    status, _, body = call(service, "POST", "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 401 and "missing API key" in body["error"]["message"]
    with pytest.raises(openai.AuthenticationError) as caught:
        client(service, "wrong").completions.create(model=MODEL, prompt="x")
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(service, "wrong").models.list()
    status, _, _ = call(service, "GET", "/health/live")
    assert status == 200  # probes need no key


def test_404_for_an_unknown_model_or_route(service):
    with pytest.raises(openai.NotFoundError) as caught:
        complete(service, model="gpt-3.5-turbo-instruct")
    assert MODEL in caught.value.message
    with pytest.raises(openai.NotFoundError):
        client(service).models.retrieve("other")
    status, _, _ = call(service, "POST", "/v1/engines/other/completions", {"prompt": "x"}, AUTH)
    assert status == 404
    status, _, body = call(service, "GET", "/v2/nothing", None, AUTH)
    assert status == 404 and "error" in body


def test_models_list_the_served_name_with_its_context(service):
    models = client(service).models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == CONTEXT
    assert client(service).models.retrieve(MODEL).model_extra["max_model_len"] == CONTEXT


def test_413_for_an_oversized_body(service):
    with pytest.raises(openai.APIStatusError) as caught:
        complete(service, prompt="x" * 30000)
    assert caught.value.status_code == 413
    assert "20000 bytes" in caught.value.message


def test_metrics_count_requests_errors_tokens_and_time_to_first_token(service):
    def metric(name: str, labels: str = "") -> float:
        return service.metric(name, labels)

    ok = 'route="/v1/completions",status="200"'
    unauthorized = 'code="invalid_api_key",type="authentication_error"'
    before = {
        "tokens": metric("completions_completion_tokens_total"),
        "prompt": metric("completions_prompt_tokens_total"),
        "ttft": metric("completions_time_to_first_token_seconds_count"),
        "ok": metric("completions_requests_total", ok),
        "401": metric("completions_errors_total", unauthorized),
        "latency": metric("completions_request_duration_seconds_count", 'stream="false"'),
    }
    complete(service, max_tokens=5, temperature=0)
    list(complete(service, max_tokens=4, temperature=0, stream=True))
    with pytest.raises(openai.AuthenticationError):
        client(service, "wrong").completions.create(model=MODEL, prompt="x")
    assert metric("completions_completion_tokens_total") == before["tokens"] + 9
    assert metric("completions_prompt_tokens_total") == before["prompt"] + 2 * 3
    assert metric("completions_time_to_first_token_seconds_count") == before["ttft"] + 1
    assert metric("completions_requests_total", ok) == before["ok"] + 2
    assert metric("completions_errors_total", unauthorized) == before["401"] + 1
    assert (
        metric("completions_request_duration_seconds_count", 'stream="false"')
        == before["latency"] + 1
    )
    assert metric("completions_in_flight") == 0 and metric("completions_queued") == 0


# --- load, disconnects, Triton away -------------------------------------------------------------


def test_429_when_the_queue_is_full(triton, tmp_path):
    extra = ["--max-concurrency", "1", "--max-queue", "0"]
    with CompletionsService(triton, log=tmp_path / "svc.log", extra=extra) as svc:
        slow = client(svc).completions.create(
            model=MODEL, prompt="busy", max_tokens=100, stream=True
        )
        next(iter(slow))  # holds the only slot
        with pytest.raises(openai.RateLimitError) as caught:
            client(svc).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert caught.value.response.headers["retry-after"] == "1"
        slow.close()
        deadline = time.monotonic() + 30
        while svc.metric("completions_in_flight") and time.monotonic() < deadline:
            time.sleep(0.05)
        answer = client(svc).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert answer.choices[0].finish_reason == "length"


def test_504_when_the_model_takes_longer_than_the_request_timeout(triton, tmp_path):
    extra = ["--request-timeout-s", "0.5"]
    with CompletionsService(triton, log=tmp_path / "svc.log", extra=extra) as svc:
        with pytest.raises(openai.APIStatusError) as caught:
            client(svc).completions.create(model=MODEL, prompt="slow", max_tokens=150)
        assert caught.value.status_code == 504
        assert caught.value.body["code"] == "timeout"
        assert complete(svc, max_tokens=2).choices[0].finish_reason == "length"


def test_a_client_leaving_mid_stream_closes_its_triton_stream(service, repository):
    stream = complete(service, prompt="leave early", max_tokens=200, stream=True, temperature=0)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    cancelled = service.metric("completions_cancelled_total")
    stream.close()  # the HTTP connection closes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = [a for a in activity(repository) if a["prompt"] == "leave early"]
        if done:
            break
        time.sleep(0.1)
    # Triton saw the request cancelled (the local Triton has request cancellation; 23.05 has
    # none: docs/completions.md) and the model stopped long before its 200 tokens.
    assert done and done[0]["cancelled"] and done[0]["tokens"] < 200
    assert service.metric("completions_cancelled_total") == cancelled + 1
    assert service.metric("completions_in_flight") == 0
    assert complete(service, max_tokens=2).choices[0].finish_reason == "length"


def test_a_client_leaving_a_unary_request_closes_its_triton_stream_too(service, repository):
    cancelled = service.metric("completions_cancelled_total")
    with pytest.raises(openai.APITimeoutError):
        client(service).with_options(timeout=1.0).completions.create(
            model=MODEL, prompt="unary leaver", max_tokens=200, temperature=0
        )
    deadline = time.monotonic() + 30
    done = []
    while not done and time.monotonic() < deadline:
        done = [a for a in activity(repository) if a["prompt"] == "unary leaver"]
        time.sleep(0.1)
    assert done and done[0]["cancelled"] and done[0]["tokens"] < 200
    assert service.metric("completions_cancelled_total") == cancelled + 1


def test_413_for_a_chunked_body_that_grows_too_large(service):
    """No Content-Length to trust: the body is counted as it arrives."""
    connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
    pieces = [b'{"model": "standin-7b", "prompt": "', *([b"x" * 5000] * 5), b'"}']
    connection.request(
        "POST", "/v1/completions", body=iter(pieces), encode_chunked=True,
        headers={**AUTH, "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
    )  # fmt: skip
    response = connection.getresponse()
    assert response.status == 413
    assert json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()


def test_503_while_triton_is_away_then_recovery_without_a_restart(repository, tmp_path):
    ports = {"grpc_port": free_port(), "http_port": free_port(), "metrics_port": free_port()}
    first = TritonServer(repository, **ports).start()
    try:
        with CompletionsService(first, log=tmp_path / "svc.log") as svc:
            assert complete(svc, max_tokens=1).choices[0].finish_reason == "length"
            first.stop()
            for attempt in (
                lambda: complete(svc, max_tokens=1),
                lambda: list(complete(svc, max_tokens=1, stream=True)),
                lambda: client(svc).models.list(),
            ):
                with pytest.raises(openai.InternalServerError) as caught:
                    attempt()
                assert caught.value.status_code == 503
                assert caught.value.body["code"] == "backend_unavailable"
            status, headers, _ = call(svc, "GET", "/health/ready")
            assert status == 503 and headers["retry-after"] == "1"
            # A restarted pod: the same arguments, the same admin Secret's token.
            second = TritonServer(repository, pod_args=first.pod_args, **ports).start()
            try:
                deadline = time.monotonic() + 60
                while call(svc, "GET", "/health/ready")[0] != 200:
                    assert time.monotonic() < deadline, "the service never saw Triton again"
                    time.sleep(0.2)
                assert complete(svc, max_tokens=2).usage.completion_tokens == 2
                assert svc.proc.poll() is None  # the same process throughout
            finally:
                second.stop()
                second.cleanup()
    finally:
        first.stop()
        first.cleanup()


def test_503_when_triton_was_never_there(tmp_path):
    with CompletionsService(f"127.0.0.1:{free_port()}", log=tmp_path / "svc.log") as svc:
        with pytest.raises(openai.InternalServerError) as caught:
            complete(svc)
        assert caught.value.status_code == 503
        assert call(svc, "GET", "/health/ready")[0] == 503
        assert call(svc, "GET", "/health/live")[0] == 200


def test_a_restricted_model_config_protocol_needs_the_header_and_says_so(repository, tmp_path):
    """The chart restricts Triton's model-config protocol by default (its admin header): the
    service is not ready, and says which flags give the header, until it has them."""
    header, token = "triton-grpc-protocol-admin-key", "s3cret-token"
    restricted = [f"--grpc-restricted-protocol=model-config:admin-key={token}"]
    with TritonServer(repository, pod_args=restricted) as triton:
        with CompletionsService(triton.grpc_url, log=tmp_path / "bare.log") as svc:
            status, _, body = call(svc, "GET", "/health/ready")
            assert status == 503 and "--triton-protocol-header" in body["error"]["message"]
            with pytest.raises(openai.InternalServerError) as caught:
                complete(svc, max_tokens=1)
            assert "restricts its model-config protocol" in caught.value.message
        token_file = tmp_path / "token"
        token_file.write_text(token + "\n")
        extra = [
            "--triton-protocol-header",
            header,
            "--triton-protocol-token-file",
            str(token_file),
        ]
        with CompletionsService(triton.grpc_url, log=tmp_path / "svc.log", extra=extra) as svc:
            assert call(svc, "GET", "/health/ready")[0] == 200
            assert complete(svc, max_tokens=2).usage.completion_tokens == 2


def test_a_finished_completion_closes_its_triton_stream_without_cancelling_it(
    repository, keys, tmp_path
):
    """The service half-closes the gRPC stream of a completion that finished and reads its
    end; it cancels only a stream it leaves early. Cancelling finished streams made Triton 24.10
    (the local server) keep the model referenced now and then, so that at SIGTERM it waited its
    whole --exit-timeout-secs for it to unload. Triton runs with --log-verbose=1, which the
    chart does not render: it logs each stream cancellation it notices only at that level."""
    said = "Cancellation notification received for ModelStreamInferHandler"
    triton = TritonServer(repository, log_verbose=1)
    with triton:

        def cancellations() -> int:
            return sum(said in line for line in triton.log_text().splitlines())

        extra = ["--api-keys-file", str(keys)]
        with CompletionsService(triton, log=tmp_path / "service.log", extra=extra) as svc:
            for stream in (False, True, False, True):
                answer = complete(svc, prompt=f"finished {stream}", max_tokens=3, stream=stream)
                chunks = list(answer) if stream else [answer]
                assert chunks[-1].choices[0].finish_reason == "length"
            time.sleep(0.5)  # a cancellation would be logged by now
            assert cancellations() == 0
            stream = complete(svc, prompt="leave", max_tokens=200, stream=True, temperature=0)
            next(iter(stream))
            stream.close()
            deadline = time.monotonic() + 30
            while not cancellations() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cancellations() == 1


# --- stopping -----------------------------------------------------------------------------------


def test_the_stop_signals_a_parent_left_blocked_are_taken(tmp_path):
    """A signal mask is inherited across exec: started by a parent's thread that blocked them,
    the service never took SIGTERM (a pod's stop) or Ctrl-C and served on until SIGKILL. Each
    of its threads takes them now, and SIGTERM stops it."""
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    triton = f"127.0.0.1:{free_port()}"
    with CompletionsService(triton, log=tmp_path / "svc.log", blocked=stops) as svc:
        masks = signal_masks(svc.proc.pid)
        assert masks and not any(mask & (1 << (s - 1)) for mask in masks.values() for s in stops)
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(timeout=60) == -signal.SIGTERM


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_lets_a_stream_in_flight_finish_then_ends_the_service(
    triton, tmp_path, signum
):
    """SIGTERM and SIGHUP shut the service down with its requests in flight answered, then it
    dies of the signal. uvicorn handles SIGTERM only: SIGHUP (a closed terminal, a process
    manager's stop) killed it at once, each stream in flight cut off. Started as a shell starts
    it: under ``nohup`` (SIGHUP ignored, and an ignored signal stays ignored across exec) the
    service rightly goes on. (It runs with PYTHONFAULTHANDLER=1, which changes nothing until a
    fatal signal: one that does not end is sent SIGABRT, and its threads' stacks are shown.)"""
    import subprocess

    log = tmp_path / "svc.log"
    with CompletionsService(
        triton, log=log, env={"PYTHONFAULTHANDLER": "1"}, as_a_shell=True
    ) as svc:
        stream = iter(client(svc).completions.create(model=MODEL, prompt="stop", max_tokens=40,
                                                     stream=True, temperature=0))  # fmt: skip
        next(stream)
        svc.proc.send_signal(signum)
        assert [*stream][-1].choices[0].finish_reason == "length"
        try:
            code = svc.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            svc.proc.send_signal(signal.SIGABRT)
            svc.proc.wait(timeout=30)
            pytest.fail(f"the service did not end within 60 s of {signum.name}:\n{log.read_text()}")
        assert code == -signum, log.read_text()
