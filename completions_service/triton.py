"""Triton's ``llm`` model over gRPC streaming (``tritonclient.grpc.aio``).

One gRPC stream per completion on one shared channel. The ``llm`` model is decoupled: it
answers a streamed request with one response per text increment and a non-streamed one with a
single response. Triton 23.05 does not tell a gRPC client which response is the last, so the
end is read from the data: every response but the last has ``finish_reason`` "" (empty), the
last "length" or "stop". Then the stream is closed.

A finished stream is half-closed and its end read (:func:`end_stream`), never cancelled:
Triton 24.10 (the CPU server the tests run) kept a model whose finished gRPC stream a client
had cancelled referenced, and at SIGTERM waited its whole ``--exit-timeout-secs`` for it to
unload. Closing the stream early (the HTTP client left, a stop sequence was seen, the deadline
passed) cancels the gRPC call. What Triton does with the model's work then depends on its version
(``docs/completions.md``): 23.05 has no request cancellation, so the model generates on, up to
``max_tokens``, and Triton drops the responses.

Failures map to the HTTP statuses of :mod:`completions_service.errors`: Triton unreachable or
its model not loaded or not ready -> 503; an error the model answers a request with, whose
message starts with the field's name (``max_tokens: must be at least 1``) -> 400 naming the
OpenAI field; the deadline -> 504; anything else -> 500 with Triton's words.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import InferInput
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from completions_service.auth import read_header_value
from completions_service.errors import (
    ApiError,
    BackendError,
    InvalidRequest,
    Timeout,
    Unavailable,
)
from completions_service.infill import TEMPLATE_PARAMETER, check_template
from completions_service.sampling import Sampling

#: gRPC channel options: the largest messages Triton's client allows, and a short reconnect
#: backoff so the service finds a restarted Triton within seconds (gRPC's default backoff grows
#: to two minutes while the server is away).
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 30000),
    ("grpc.keepalive_timeout_ms", 10000),
]
#: Seconds Triton may take to end a stream whose last response has arrived.
STREAM_END_S = 5.0
#: Seconds a readiness or metadata call may take.
PROBE_TIMEOUT_S = 2.0
#: The ``llm`` model's inputs that carry an OpenAI field, by the field's name in an error.
FIELD_OF_INPUT = {
    "text_input": "prompt",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "temperature",  # set from temperature / top_p (greedy)
    "seed": "seed",
    "stop_words": "stop",
    "stream": "stream",  # a repository published without --streaming cannot stream
}
_FIELD_ERROR = re.compile(r"(?:^|message: |: )(?P<field>[a-z_]+): (?P<text>.+)", re.S)
#: Triton's words for a model it cannot run now (unknown, unloaded, not ready).
_NOT_SERVING = re.compile(r"unknown model|is not found|not ready|unavailable|unloaded", re.I)


@dataclass(frozen=True)
class ModelInfo:
    """What the service reads from the ``llm`` model's configuration."""

    name: str  # served_model_name: what clients call the model
    max_model_len: int  # the context length, prompt included, in tokens
    batched: bool  # max_batch_size > 0: every input has a leading batch dimension
    infill_template: str | None


@dataclass(frozen=True)
class Piece:
    """One response of the model: a text increment (or the whole text), and at the end the
    finish reason and token counts."""

    text: str
    finish_reason: str | None  # None before the last response
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass(frozen=True)
class Generation:
    """One request to the ``llm`` model."""

    prompt: str
    max_tokens: int
    stream: bool
    sampling: Sampling
    stop: tuple[str, ...]


def model_info(config: dict, triton_model: str) -> ModelInfo:
    """The :class:`ModelInfo` of a ``get_model_config`` answer (JSON form)."""
    config = config.get("config", config)
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    raw = params.get("max_model_len", "")
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise BackendError(
            f"Triton's model {triton_model!r} declares no usable max_model_len parameter "
            f"(got {raw!r}); serve a repository the loader published with the llm model"
        )
    template = params.get(TEMPLATE_PARAMETER) or None
    if template is not None:
        try:
            check_template(template)
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
    return ModelInfo(
        name=params.get("served_model_name") or triton_model,
        max_model_len=int(raw),
        batched=int(config.get("max_batch_size", 0) or 0) > 0,
        infill_template=template,
    )


def _rpc_error(exc: grpc.aio.AioRpcError, url: str) -> ApiError:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Timeout("the model did not finish within the request timeout", retry_after=1)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return Unavailable(
            f"Triton at {url} is unreachable ({code.name}: {exc.details()}); try again shortly",
            retry_after=1,
        )
    return BackendError(f"Triton answered {code.name}: {exc.details()}")


def model_error(message: str, triton_model: str) -> ApiError:
    """The HTTP error for an error the model (or Triton) answered a request with."""
    found = _FIELD_ERROR.search(message)
    if found and found["field"] in FIELD_OF_INPUT:
        field = FIELD_OF_INPUT[found["field"]]
        return InvalidRequest(f"{field}: {found['text'].strip()}", param=field)
    if _NOT_SERVING.search(message):
        return Unavailable(
            f"Triton's model {triton_model!r} is not ready: {message}", retry_after=1
        )
    return BackendError(f"the model failed: {message}")


def _tensor(name: str, value: np.ndarray, batched: bool) -> InferInput:
    array = value[np.newaxis, ...] if batched else value
    dtype = {np.bool_: "BOOL", np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64"}
    kind = "BYTES" if array.dtype == np.object_ else dtype[array.dtype.type]
    tensor = InferInput(name, list(array.shape), kind)
    tensor.set_data_from_numpy(array)
    return tensor


def build_inputs(generation: Generation, batched: bool) -> list[InferInput]:
    s = generation.sampling
    values: dict[str, np.ndarray] = {
        "text_input": np.array([generation.prompt.encode()], dtype=np.object_),
        "max_tokens": np.array([generation.max_tokens], dtype=np.int32),
        "stream": np.array([generation.stream], dtype=np.bool_),
        "exclude_input_in_output": np.array([True], dtype=np.bool_),
    }
    if s.top_k is not None:
        values["top_k"] = np.array([s.top_k], dtype=np.int32)
    if s.temperature is not None:
        values["temperature"] = np.array([s.temperature], dtype=np.float32)
    if s.top_p is not None:
        values["top_p"] = np.array([s.top_p], dtype=np.float32)
    if s.seed is not None:
        values["seed"] = np.array([s.seed], dtype=np.uint64)
    if generation.stop:
        values["stop_words"] = np.array([w.encode() for w in generation.stop], dtype=np.object_)
    return [_tensor(name, value, batched) for name, value in values.items()]


def _text(result, name: str) -> str:
    array = result.as_numpy(name)
    if array is None:
        return ""
    return "".join(
        x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in array.reshape(-1)
    )


def _count(result, name: str) -> int | None:
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    if not isinstance(value, np.integer) or value < 0:
        raise BackendError(
            f"the model answered {name} {value!r}, not a count of tokens; serve a repository "
            "the loader published with the llm model"
        )
    return int(value)


def piece_of(result) -> Piece:
    reason = _text(result, "finish_reason") or None
    return Piece(
        text=_text(result, "text_output"),
        finish_reason=reason,
        prompt_tokens=_count(result, "num_input_tokens"),
        completion_tokens=_count(result, "num_output_tokens"),
    )


class Triton:
    """The ``llm`` model of one Triton server."""

    def __init__(
        self,
        url: str,
        model: str,
        timeout_s: float,
        *,
        protocol_header: str | None = None,
        protocol_token_file: Path | None = None,
    ) -> None:
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        #: The gRPC metadata that admits the service to Triton's restricted protocols
        #: (``model-config`` is restricted by the chart's defaults); the token is read from its
        #: file on every read of the configuration, so a rotated Secret is followed.
        self.protocol_header = protocol_header
        self.protocol_token_file = protocol_token_file
        self._client: InferenceServerClient | None = None
        self._info: ModelInfo | None = None

    @property
    def client(self) -> InferenceServerClient:
        # Made on first use, inside the running event loop (grpc.aio binds to it).
        if self._client is None:
            self._client = InferenceServerClient(self.url, channel_args=CHANNEL_OPTIONS)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _headers(self) -> dict[str, str] | None:
        if self.protocol_header is None or self.protocol_token_file is None:
            return None
        try:
            token = read_header_value(self.protocol_token_file)
        except (OSError, ValueError) as exc:
            raise Unavailable(
                f"cannot read the Triton protocol token file {self.protocol_token_file}: {exc}"
            ) from exc
        return {self.protocol_header: token}

    async def readiness(self) -> str | None:
        """``None`` when Triton answers, its model is ready and its configuration can be read
        (a fresh look every call: a service that could answer nothing is not ready); else
        why not."""
        try:
            ready = await self.client.is_model_ready(self.model, client_timeout=PROBE_TIMEOUT_S)
        except (InferenceServerException, grpc.aio.AioRpcError) as exc:
            self._info = None  # a restarted Triton may serve another model: read it again
            return f"Triton at {self.url} is unreachable ({exc})"
        if not ready:
            self._info = None
            return f"Triton's model {self.model!r} is not ready"
        try:
            await self.info()
        except ApiError as exc:
            return exc.message
        return None

    async def info(self) -> ModelInfo:
        """The model's configuration, read once and again after Triton was away (503 while
        it cannot be read)."""
        if self._info is None:
            try:
                config = await self.client.get_model_config(
                    self.model,
                    as_json=True,
                    headers=self._headers(),
                    client_timeout=PROBE_TIMEOUT_S,
                )
            except InferenceServerException as exc:
                if "restricted" in (exc.message() or ""):
                    raise Unavailable(
                        f"Triton at {self.url} restricts its model-config protocol, which the "
                        "service needs to read the model's name and context: give the "
                        "protocol's header and token (--triton-protocol-header, "
                        "--triton-protocol-token-file) or leave model-config unrestricted "
                        f"({exc.message()})",
                        retry_after=1,
                    ) from exc
                raise Unavailable(
                    f"Triton at {self.url} cannot describe its model {self.model!r} "
                    f"({exc.message()}); it is unreachable or the model is not loaded",
                    retry_after=1,
                ) from exc
            self._info = model_info(config, self.model)
        return self._info

    def forget(self) -> None:
        """Read the model's configuration again next time (Triton went away)."""
        self._info = None

    async def generate(self, generation: Generation, info: ModelInfo) -> AsyncIterator[Piece]:
        """The model's responses, until the one with a finish reason. Leaving the iteration
        early (``aclose()``, cancellation) cancels the gRPC call."""
        inputs = build_inputs(generation, info.batched)
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": inputs}
            await done.wait()  # the stream stays open for the responses

        responses = self.client.stream_infer(requests(), stream_timeout=self.timeout_s)
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    failure = model_error(error.message(), self.model)
                    if isinstance(failure, Unavailable):
                        self.forget()
                    raise failure
                piece = piece_of(result)
                finished = piece.finish_reason is not None
                yield piece
                if finished:
                    return
            raise Unavailable(
                f"Triton at {self.url} closed the stream before the model finished",
                retry_after=1,
            )
        except grpc.aio.AioRpcError as exc:
            failure = _rpc_error(exc, self.url)
            if isinstance(failure, Unavailable):
                self.forget()
            raise failure from exc
        finally:
            done.set()
            await end_stream(responses, finished=finished)


async def end_stream(responses: object, *, finished: bool, timeout_s: float = STREAM_END_S) -> None:
    """End a gRPC stream whose request iterator has returned (the client has half-closed it).
    A ``finished`` one (its last response has arrived) is read until Triton closes it, and
    cancelled only if that takes longer than ``timeout_s`` or fails (a response after the last
    one is dropped); one left early is cancelled at once."""

    async def drained() -> None:
        async for _ in responses:
            pass

    if finished:
        try:
            await asyncio.wait_for(drained(), timeout_s)
            return
        except (TimeoutError, grpc.aio.AioRpcError, InferenceServerException):
            pass
    with contextlib.suppress(Exception):
        responses.cancel()
