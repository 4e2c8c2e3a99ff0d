"""The completions service's parts without a server: the request checks, stop sequences, the
infill hook, the sampling mapping, the reading of the model's errors and configuration, API
keys, the bounded queue, the command line, and that the package never imports the loader."""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from completions_service.admission import Admission
from completions_service.app import create_app
from completions_service.auth import ApiKeys, KeyFileError
from completions_service.cli import env_name, parser, settings_of, triton_address
from completions_service.errors import (
    BackendError,
    InvalidRequest,
    QueueFull,
    Unauthorized,
    Unavailable,
)
from completions_service.infill import infill_prompt
from completions_service.protocol import parse_request
from completions_service.sampling import sampling_of
from completions_service.settings import Settings
from completions_service.stops import StopMatcher
from completions_service.triton import (
    ModelInfo,
    Piece,
    Triton,
    model_error,
    model_info,
    piece_of,
)

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"model": "m", "prompt": "def f("}


def refused(body, **kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(body, **kwargs)
    return caught.value


# --- the request ------------------------------------------------------------------------------


def test_a_minimal_request_gets_openais_defaults():
    r = parse_request(GOOD)
    assert (r.max_tokens, r.temperature, r.top_p, r.stream, r.echo, r.stop) == (
        None, 1.0, 1.0, False, False, ()
    )  # fmt: skip
    assert parse_request({**GOOD, "prompt": ["x"]}).prompt == "x"
    assert parse_request({**GOOD, "stop": "\n"}).stop == ("\n",)
    assert parse_request({**GOOD, "stop": ["a", "b", "a"]}).stop == ("a", "b")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"prompt": None}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": 0}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": 3}, "stop"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"echo": 1}, "echo"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"suffix": 3}, "suffix"),
        ({"user": 3}, "user"),
        ({"model": 3}, "model"),
        ({"top_k": 40}, "top_k"),
    ],
)
def test_a_wrong_field_is_refused_naming_it(change, param):
    body = {**GOOD, **change}
    if change.get("prompt", 0) is None:
        del body["prompt"]
    error = refused(body)
    assert error.param == param
    assert error.message.startswith(param) or param in error.message
    assert error.body()["error"]["param"] == param


def test_the_logprobs_refusal_says_why():
    assert "no per-token log-probabilities" in refused({**GOOD, "logprobs": 2}).message


@pytest.mark.parametrize("change", [{"prompt": "a\ud800"}, {"prompt": ["\udfff"]},
                                    {"stop": ["x", "\ud83d"]}, {"suffix": "\udc00 }"}])  # fmt: skip
def test_text_with_a_lone_surrogate_is_refused_naming_its_field(change):
    """JSON's ``"\\ud800"`` decodes to a string no encoding writes: the prompt, a stop or a
    suffix holding one failed to encode for Triton, a 500 whose streamed form kept its slot in
    the queue for good."""
    (param,) = change
    error = refused({**GOOD, **change})
    assert error.param == param and "lone surrogate" in error.message
    error.message.encode()  # the answer itself can be sent


def test_the_engine_path_names_the_model():
    assert parse_request({"prompt": "x"}, model="m").model == "m"
    assert refused({"prompt": "x", "model": "other"}, model="m").param == "model"
    assert refused({"prompt": "x"}).param == "model"
    assert refused(["not", "an", "object"]).param is None


# --- stop sequences ---------------------------------------------------------------------------


def feed_all(stops, pieces):
    matcher = StopMatcher(tuple(stops))
    sent = [matcher.feed(p) for p in pieces]
    return sent, matcher.flush(), matcher.stopped


def test_text_before_a_stop_is_sent_and_the_stop_is_not():
    sent, rest, stopped = feed_all(["\n\n"], ["def f", "():\n", "\n    x"])
    assert "".join(sent) + rest == "def f():"
    assert stopped


def test_a_possible_start_of_a_stop_is_held_back_until_it_is_known():
    sent, rest, stopped = feed_all(["END"], ["a E", "N", "D b"])
    assert sent == ["a ", "", ""] and not rest and stopped
    sent, rest, stopped = feed_all(["END"], ["a E", "N", "x"])
    assert sent == ["a ", "", "ENx"] and rest == "" and not stopped
    sent, rest, stopped = feed_all(["END"], ["a EN"])
    assert sent == ["a "] and rest == "EN" and not stopped


def test_the_earliest_of_several_stops_wins():
    sent, _, _ = feed_all(["c", "ab"], ["xabc"])
    assert sent == ["x"]


def test_without_stops_text_passes_at_once():
    assert feed_all([], ["a", "b"]) == (["a", "b"], "", False)


# --- suffix, sampling -------------------------------------------------------------------------


def test_a_suffix_is_refused_by_a_model_without_an_infill_template():
    with pytest.raises(InvalidRequest, match="cannot fill in the middle") as caught:
        infill_prompt("def f(", "    return x", None, "codegen")
    assert caught.value.param == "suffix"
    assert infill_prompt("p", None, None, "codegen") == "p"


def test_a_declared_infill_template_places_prompt_and_suffix_verbatim():
    fim = "<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"
    assert infill_prompt("a{suffix}", "b{prefix}", fim, "m") == (
        "<fim_prefix>a{suffix}<fim_suffix>b{prefix}<fim_middle>"
    )
    psm = "<S>{suffix}<P>{prefix}<M>"  # suffix first
    assert infill_prompt("a", "b", psm, "m") == "<S>b<P>a<M>"


def test_temperature_zero_or_top_p_zero_is_greedy_and_sampling_always_has_a_seed():
    greedy = sampling_of(parse_request({**GOOD, "temperature": 0, "top_p": 0.5}))
    assert greedy.greedy and greedy.top_k == 1 and greedy.temperature is None
    assert sampling_of(parse_request({**GOOD, "top_p": 0})).greedy
    sampled = sampling_of(parse_request({**GOOD, "temperature": 0.7}))
    assert not sampled.greedy and sampled.top_p == 1.0 and sampled.temperature == 0.7
    seeds = {sampling_of(parse_request(GOOD)).seed for _ in range(5)}
    assert None not in seeds and len(seeds) > 1  # a fresh random seed each time
    assert sampling_of(parse_request({**GOOD, "seed": 7})).seed == 7


# --- what Triton says -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("max_tokens: must be at least 1 (got 0)", "max_tokens"),
        ("text_input: the prompt's 3000 tokens exceed the context of 2048", "prompt"),
        ("stop_words: a stop word encodes to no token", "stop"),
        (
            "Failed to process the request(s) for model instance 'llm_0', message: "
            "temperature: must be above 0",
            "temperature",
        ),
    ],
)
def test_a_model_error_naming_a_field_becomes_a_400_naming_the_openai_field(message, param):
    error = model_error(message, "llm")
    assert isinstance(error, InvalidRequest)
    assert error.param == param and error.message.startswith(f"{param}: ")


def test_other_model_errors_are_server_errors():
    assert isinstance(
        model_error("Request for unknown model: 'llm' is not found", "llm"), Unavailable
    )
    assert isinstance(model_error("CUDA out of memory", "llm"), BackendError)


class Answer:
    """A response of the model as ``tritonclient`` gives it: its outputs by name."""

    def __init__(self, **outputs: np.ndarray) -> None:
        self.outputs = outputs

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.outputs.get(name)


@pytest.mark.parametrize("count", [np.array([b"7"], dtype=np.object_), np.array([-1], np.int32)])
def test_a_token_count_that_is_no_count_is_the_models_error(count):
    """A model that answers ``num_input_tokens`` as text or below 0 is not the ``llm`` model:
    a 500 in OpenAI's shape naming the output (it was a ValueError, Starlette's bare 500)."""
    text = np.array([b"x"], dtype=np.object_)
    answer = Answer(text_output=text, finish_reason=np.array([b"length"], dtype=np.object_),
                    num_input_tokens=count)  # fmt: skip
    with pytest.raises(BackendError, match="num_input_tokens"):
        piece_of(answer)
    assert piece_of(Answer(text_output=text, num_input_tokens=np.array([3], np.int32))) == Piece(
        "x", None, 3, None
    )


def test_the_model_config_gives_name_context_and_batching():
    config = {
        "config": {
            "max_batch_size": 8,
            "parameters": {
                "max_model_len": {"string_value": "2048"},
                "served_model_name": {"string_value": "codegen-350M-mono"},
            },
        }
    }
    info = model_info(config, "llm")
    assert (info.name, info.max_model_len, info.batched, info.infill_template) == (
        "codegen-350M-mono", 2048, True, None
    )  # fmt: skip
    with pytest.raises(BackendError, match="max_model_len"):
        model_info({"config": {"parameters": {}}}, "llm")
    bad = {"parameters": {"max_model_len": {"string_value": "8"},
                          "infill_template": {"string_value": "{prefix} only"}}}  # fmt: skip
    with pytest.raises(BackendError, match="infill_template"):
        model_info({"config": bad}, "llm")


# --- API keys, the queue ----------------------------------------------------------------------


def test_api_keys_admit_only_a_listed_bearer_key_and_follow_the_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team a\nsecret-1\n\n  secret-2  \n")
    auth = ApiKeys(keys)
    auth.check("Bearer secret-1")
    auth.check("bearer secret-2")
    for header in (None, "", "Bearer", "Bearer secret-3", "Basic secret-1", "secret-1"):
        with pytest.raises(Unauthorized):
            auth.check(header)
    ApiKeys(None).check(None)  # no file: no key needed
    keys.write_text("")
    with pytest.raises(KeyFileError, match="holds no key"):
        ApiKeys(keys)
    with pytest.raises(KeyFileError, match="cannot read"):
        ApiKeys(tmp_path / "missing")


def test_a_rotated_keys_file_is_read_again(tmp_path, monkeypatch):
    import completions_service.auth as auth_module

    monkeypatch.setattr(auth_module, "RELOAD_INTERVAL_S", 0.0)
    keys = tmp_path / "keys"
    keys.write_text("old\n")
    auth = ApiKeys(keys)
    keys.write_text("new\n")
    import os

    os.utime(keys, ns=(1, 1))  # a different modification time, whatever the clock says
    auth.check("Bearer new")
    with pytest.raises(Unauthorized):
        auth.check("Bearer old")


def test_the_queue_is_bounded_and_a_released_slot_goes_to_the_first_waiter():
    async def scenario() -> None:
        admission = Admission(max_concurrency=1, max_queue=1)
        await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        assert admission.waiting == 1
        with pytest.raises(QueueFull) as caught:
            await admission.acquire()
        assert caught.value.status == 429 and caught.value.headers() == {"Retry-After": "1"}
        admission.release()
        await waiter
        assert (admission.in_flight, admission.waiting) == (1, 0)

    asyncio.run(scenario())


# --- the application ---------------------------------------------------------------------------


class Described(Triton):
    """Triton's ``llm`` model with a known configuration; ``failure``: what its responses
    raise (nothing listens at the address, so an unfailing request gets a 503)."""

    failure: BaseException | None = None

    async def info(self) -> ModelInfo:
        return ModelInfo(name="m", max_model_len=64, batched=False, infill_template=None)

    async def generate(self, generation, info):
        if self.failure is not None:
            raise self.failure
        async for piece in super().generate(generation, info):
            yield piece


def posted(triton: Described, *bodies: bytes) -> list[httpx.Response]:
    """The answers of the service (one slot, no queue) to ``bodies`` posted in turn."""
    settings = Settings(triton_url="127.0.0.1:1", max_concurrency=1, max_queue=0)
    app = create_app(settings, triton)

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            return [await client.post("/v1/completions", content=body) for body in bodies]

    return asyncio.run(scenario())


def test_a_body_nested_too_deeply_is_a_400_in_openais_shape():
    """``[[[[...]]]]`` ran json.loads out of recursion: a bare 500 with a traceback logged."""
    deep = b"[" * 100_000 + b"]" * 100_000
    (answer,) = posted(Described("127.0.0.1:1", "llm", 5), deep)
    assert answer.status_code == 400, answer.text
    assert "nests" in answer.json()["error"]["message"]


def test_a_client_leaving_while_it_sends_its_body_is_no_error():
    """A client that closed its connection halfway through its body: Starlette's
    ClientDisconnect went up through the application, a traceback in the log ("Exception in
    ASGI application") and a 500 sent to no one. Now it is a client that left (499)."""
    app = create_app(Settings(triton_url="127.0.0.1:1"), Described("127.0.0.1:1", "llm", 5))
    arriving = [{"type": "http.request", "body": b'{"model": "m", "pro', "more_body": True}]
    sent: list[dict] = []

    async def receive() -> dict:
        return arriving.pop(0) if arriving else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499


def test_a_stream_that_fails_unforeseen_gives_its_slot_back():
    """A streamed request whose first response raised something other than an API error
    (a bug; a lone surrogate did) kept its slot: with one slot, every later request was 429."""
    triton = Described("127.0.0.1:1", "llm", 5)
    triton.failure = RuntimeError("unforeseen")
    body = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    first, second = posted(triton, body, body)
    assert (first.status_code, second.status_code) == (500, 500), second.text


# --- the command line -------------------------------------------------------------------------


def test_every_flag_also_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPLETIONS_TRITON_URL", "grpc://triton:8001")
    monkeypatch.setenv("COMPLETIONS_MAX_QUEUE", "3")
    monkeypatch.setenv("COMPLETIONS_LISTEN", "127.0.0.1:9000")
    settings = settings_of(parser().parse_args([]))
    assert (settings.triton_url, settings.max_queue, settings.host, settings.port) == (
        "triton:8001", 3, "127.0.0.1", 9000
    )  # fmt: skip
    flags = [a.option_strings[0] for a in parser()._actions if a.option_strings[0] != "-h"]
    for flag in flags:
        assert env_name(flag) in parser().format_help().replace("\n", "").replace(" ", "")


def test_an_http_address_for_triton_is_refused_with_the_grpc_form():
    assert triton_address("grpc://h:8001") == "h:8001"
    with pytest.raises(argparse.ArgumentTypeError, match="gRPC"):
        triton_address("http://h:8000")
    with pytest.raises(argparse.ArgumentTypeError):
        triton_address("grpc://h")


@pytest.mark.parametrize("flag", ["--api-keys-file", "--triton-protocol-token-file"])
def test_a_file_setting_set_but_empty_says_so_and_what_to_do(monkeypatch, capsys, flag):
    """COMPLETIONS_API_KEYS_FILE="" (an unset variable in a manifest) was refused as the file
    ".", a directory: the error named a path nobody gave."""
    from completions_service.cli import main

    monkeypatch.setenv(env_name(flag), "")
    with pytest.raises(SystemExit) as exc:
        main(["--triton-url", "127.0.0.1:1", "--triton-protocol-header", "x-key"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{env_name(flag)} is set but empty" in err, err
    assert "unset it" in err and " .:" not in err
    monkeypatch.delenv(env_name(flag))
    with pytest.raises(SystemExit) as exc:
        main(["--triton-url", "127.0.0.1:1", flag, ""])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{flag}: empty" in err and " .:" not in err, err


@pytest.mark.parametrize("flag", ["--api-keys-file", "--triton-protocol-token-file"])
@pytest.mark.parametrize("kind", ["FIFO", "directory", "link to a FIFO", "huge file"])
def test_a_secret_file_that_is_no_small_regular_file_is_refused_at_start_never_read(
    tmp_path, capsys, flag, kind
):
    """A FIFO as the keys or token file blocked the service before it listened (it waited
    for a writer for ever); each is refused with exit 2 naming the file. A link to a regular
    file is read (a mounted Secret is one)."""
    import os

    from completions_service.cli import main

    path = tmp_path / "secret"
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link to a FIFO":
        os.mkfifo(tmp_path / "fifo")
        path.symlink_to(tmp_path / "fifo")
    else:
        path.write_bytes(b"k" * (2 << 20))
    argv = ["--triton-url", "127.0.0.1:1", "--listen", "127.0.0.1:0", flag, str(path)]
    if flag == "--triton-protocol-token-file":
        argv += ["--triton-protocol-header", "x-admin-key"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot read the" in err and str(path) in err, err


@pytest.mark.parametrize("header", ["Triton-Key", "admin key", ":authority", "x-admin-key-bin",
                                    "grpc-timeout"])  # fmt: skip
def test_a_header_name_grpc_cannot_send_is_refused_as_a_flag(header, capsys):
    """gRPC refuses such a header's name at each call (uppercase, a space, a pseudo-header, a
    binary or reserved one): every request the service made to Triton was a bare 500."""
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["--triton-url", "h:8001", "--triton-protocol-header", header])
    assert exited.value.code == 2
    assert "no gRPC header name" in capsys.readouterr().err


@pytest.mark.parametrize("token", ["two\nlines", "t\u00f6ken", "tab\there"])
def test_a_token_grpc_cannot_send_is_refused_at_start_and_once_rotated(tmp_path, token):
    """A token holding a line break, a tab or a character beyond ASCII, which gRPC refuses as
    a header's value: the service started, and each request to Triton was a bare 500. Now 2 at
    start, and a Secret rotated to one is a 503 naming the file."""
    path = tmp_path / "token"
    path.write_text(token + "\n")
    started = subprocess.run(
        [sys.executable, "-m", "completions_service", "--triton-url", "127.0.0.1:1",
         "--listen", "127.0.0.1:0", "--triton-protocol-header", "triton-grpc-protocol-admin-key",
         "--triton-protocol-token-file", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr
    assert "a gRPC header cannot carry" in started.stderr, started.stderr
    triton = Triton("127.0.0.1:1", "llm", 5, protocol_header="triton-grpc-protocol-admin-key",
                    protocol_token_file=path)  # fmt: skip
    with pytest.raises(Unavailable, match="a gRPC header cannot carry") as caught:
        asyncio.run(triton.info())
    assert str(path) in caught.value.message


def test_a_listen_host_with_no_address_or_a_timeout_past_a_day_is_refused_as_a_flag():
    """An unresolvable --listen host ended in the server's own start-up error (exit 3); a
    request timeout of 1e308 s was taken."""
    from completions_service.cli import listen_address

    assert listen_address("127.0.0.1:0") == ("127.0.0.1", 0)
    with pytest.raises(argparse.ArgumentTypeError, match="no address of this machine"):
        listen_address("nohost.invalid:8080")
    with pytest.raises(SystemExit):
        parser().parse_args(["--request-timeout-s", "1e308"])
    assert parser().parse_args(["--request-timeout-s", "86400"]).request_timeout_s == 86400
    # The chart's bounds for the counts and the body size (1e8 in flight was taken).
    for flag, bad in (("--max-concurrency", "1000001"), ("--max-queue", "1000001"),
                      ("--max-body-bytes", "1023"), ("--max-body-bytes", str((1 << 30) + 1))):  # fmt: skip
        with pytest.raises(SystemExit):
            parser().parse_args([flag, bad])


# --- the package stands alone -----------------------------------------------------------------


def test_the_service_never_imports_the_loader():
    """The service's image holds no loader (docs/architecture.md): no module of the package
    imports it, even lazily."""
    package = ROOT / "completions_service"
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("loader", "tests")]
    assert len(list(package.rglob("*.py"))) >= 10
    assert not found


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-queue", "\uff13"), ("--max-concurrency", "\u0662"), ("--request-timeout-s", "\uff19"),
     ("--listen", "127.0.0.1:\uff18\uff10\uff18\uff10"), ("--triton-url", "h:\uff18\uff10\uff10\uff11"),
     ("--triton-url", "h:\u00b2")],
)  # fmt: skip
def test_a_number_in_digits_other_than_ascii_is_refused_as_a_flag(flag, value, capsys):
    """``--max-queue ３`` was taken as 3, ``--listen 127.0.0.1:８０８０`` as port 8080."""
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["--triton-url", "h:8001", flag, value])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_max_model_len_in_digits_other_than_ascii_is_the_models_error():
    """``max_model_len: "²"`` (a digit to ``str.isdigit``, none to ``int``): ValueError, not
    the error that names the model's parameter."""
    from completions_service.triton import BackendError, model_info

    config = {"parameters": {"max_model_len": {"string_value": "\u00b2"}}}
    with pytest.raises(BackendError, match="max_model_len"):
        model_info(config, "llm")


def test_an_open_file_limit_too_low_for_grpc_is_refused_at_start():
    """Under ``ulimit -n 12`` the service started, then gRPC could not open its descriptors
    at the first call to Triton and killed the process (SIGSEGV or SIGABRT): now exit 2 at
    start, naming the limit."""
    start = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (12, 12)); "
        "from completions_service.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", start, "--triton-url", "127.0.0.1:1", "--listen", "127.0.0.1:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "open-file limit is 12 (ulimit -n)" in done.stderr, done.stderr


def test_a_service_started_with_its_standard_streams_closed_serves(tmp_path):
    """``completions-service >&- 2>&-``: uvicorn's logging asked the missing standard output
    whether it was a terminal, and the service ended at start (exit 1, a traceback); the
    listening socket took the free descriptor 1. Each closed stream is /dev/null now."""
    import os
    import time
    import urllib.request

    from tests.servers import free_port

    port = free_port()
    closing = "import os, sys; os.close(1); os.close(2); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", closing, sys.executable, "-m", "completions_service",
         "--triton-url", "127.0.0.1:1", "--listen", f"127.0.0.1:{port}"],
        cwd=ROOT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/live", timeout=2):
                    break
            except OSError:
                time.sleep(0.1)
        assert proc.poll() is None, f"the service ended with {proc.returncode}"
        assert [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in (1, 2)] == [os.devnull] * 2
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("where", ["taken", "foreign"])
def test_an_address_it_cannot_listen_on_is_refused_with_exit_2_naming_it(capsys, where):
    """A --listen port another process holds, or an address that is not the machine's
    (192.0.2.1, TEST-NET-1), ended in uvicorn's logged errno and exit 3 after the app was
    made; each is exit 2 saying what to change, before anything starts."""
    import socket

    from completions_service.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}" if where == "taken" else "192.0.2.1:8080"
        assert main(["--triton-url", "127.0.0.1:1", "--listen", listen]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on {listen}" in err, err
    assert ("another process listens" if where == "taken" else "no address of this machine") in err
