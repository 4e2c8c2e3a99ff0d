"""Stream one completion from a streaming repository over gRPC, token by token.

A repository published with ``model-loader run --streaming`` answers each request with several
responses (Triton's decoupled mode, gRPC streaming API only): one per generated token whose
``completion`` holds the new text only, then a final one (the rest of the text, often empty).
:func:`stream_completion` yields them as :class:`StreamEvent` values with their arrival time;
:func:`collect` reads a whole stream into a :class:`StreamedCompletion` with the client-side
timings the bench reports:

* **TTFT** (time to first token): from sending the request to the first response that carries
  a generated token;
* **TPOT** (time per output token): from that first token to the response that brought the
  last one, divided by the tokens after the first (``None`` for a one-token completion);
* **latency**: from sending the request to the response flagged final.

Token counts come from ``sequence_length`` (prompt + generated so far), not from the number of
responses, so they stay right when a server sends several tokens per response or repeats its
last state in the final one, as FasterTransformer does.

Leaving the iteration early (``break``, an exception, Ctrl-C) cancels the request on the server
(``stop_stream(cancel_requests=True)``). :class:`StreamingClient` keeps one connection for many
requests (the bench's load generator); :func:`stream_completion` opens one per request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from loader.completion import build_inputs
from loader.errors import EndpointError
from loader.waits import WAIT_STEP_S

log = logging.getLogger(__name__)

#: Seconds Triton may take to end a half-closed stream whose requests all finished; then it
#: is cancelled.
STREAM_END_S = 5.0
#: The response parameter Triton (after 23.05) sets on the last response of a stream.
FINAL_PARAMETER = "triton_final_response"
#: The output our streaming model sets on its last response (all a 23.05 client can see).
FINAL_OUTPUT = "is_final"


def is_final(result: Any) -> bool:
    """Whether ``result`` ends its stream: Triton's parameter says so, our streaming model's
    ``is_final`` output says so (Triton 23.05 sends no parameter), or it is the only response of
    a model that does not stream (outputs, but no ``is_final``)."""
    response = result.get_response()
    if FINAL_PARAMETER in response.parameters and response.parameters[FINAL_PARAMETER].bool_param:
        return True
    names = {output.name for output in response.outputs}
    if FINAL_OUTPUT in names:
        return bool(result.as_numpy(FINAL_OUTPUT).reshape(-1)[0])
    return bool(names)


@dataclass(frozen=True)
class StreamEvent:
    """One response of a stream (first row, first beam)."""

    text: str  # the new text (empty for an empty final response)
    seconds: float  # since the request was sent
    final: bool
    sequence_length: int | None  # prompt + tokens so far; None for an empty response
    output_ids: np.ndarray | None  # the ids so far (prompt included), as the server sent them


@dataclass(frozen=True)
class StreamedCompletion:
    """A whole stream and its client-side timings (see the module docstring)."""

    text: str
    events: tuple[StreamEvent, ...]
    ttft_s: float
    tpot_s: float | None
    latency_s: float
    output_tokens: int
    output_ids: np.ndarray

    @property
    def responses(self) -> int:
        return len(self.events)


def _event(result: Any, started: float) -> StreamEvent:
    now = time.perf_counter() - started
    response = result.get_response()
    final = is_final(result)
    if not response.outputs:
        return StreamEvent("", now, final, None, None)
    completion = result.as_numpy("completion").reshape(-1)[0]
    text = completion.decode("utf-8") if isinstance(completion, bytes) else str(completion)
    length = int(result.as_numpy("sequence_length").reshape(-1)[0])
    ids = result.as_numpy("output_ids")[0, 0].astype(np.int64)
    return StreamEvent(text, now, final, length, ids)


class StreamingClient:
    """One gRPC connection and stream to ``url`` (``host:port``), reused request after request.

    Requests go one at a time (:meth:`stream`); reusing the connection keeps its set-up out of
    the time to first token. A request abandoned before its final response, or one that
    failed, cancels what is in flight and the next request starts a fresh stream. Use as a
    context manager, or call :meth:`close`.
    """

    def __init__(self, url: str, *, timeout_s: float = 120.0) -> None:
        import tritonclient.grpc as grpcclient

        self.url = url
        self.timeout_s = timeout_s
        self._module = grpcclient
        self._client = grpcclient.InferenceServerClient(url)
        self._inbox: queue.Queue[tuple[Any, Any]] | None = None

    def _open(self) -> queue.Queue[tuple[Any, Any]]:
        if self._inbox is None:
            inbox: queue.Queue[tuple[Any, Any]] = queue.Queue()
            self._client.start_stream(callback=lambda result, error: inbox.put((result, error)))
            self._inbox = inbox
        return self._inbox

    def _reset(self, *, cancel: bool = True) -> None:
        if self._inbox is None:
            return
        self._inbox = None
        if cancel:
            self._client.stop_stream(cancel_requests=True)
            return
        # Half-close, and wait for Triton to end the stream (tritonclient waits without a
        # limit); a stream still open after STREAM_END_S (a server that went silent) is
        # cancelled, which ends the wait.
        closing = threading.Thread(
            target=self._client.stop_stream, name="stream-close", daemon=True
        )
        closing.start()
        closing.join(STREAM_END_S)
        if closing.is_alive():
            self._client.stop_stream(cancel_requests=True)
            closing.join()

    def stream(self, model: str, request: dict[str, list[Any]]) -> Iterator[StreamEvent]:
        """Send ``request`` (``name -> values``, as :func:`loader.completion.load_request`
        reads it) to ``model`` and yield its responses as they arrive.

        A response that does not arrive within ``timeout_s`` of the previous one, or an error
        from the server, raises :class:`~loader.errors.EndpointError`.
        """
        from tritonclient.utils import InferenceServerException

        where = f"grpc://{self.url} model {model!r}"
        done = False
        inbox = self._open()
        try:
            started = time.perf_counter()
            self._client.async_stream_infer(
                model,
                build_inputs(self._module, request),
                request_id=uuid.uuid4().hex,
                enable_empty_final_response=True,
            )
            while True:
                result, error = self._next(inbox, where)
                if error is not None:
                    message = error.message() if hasattr(error, "message") else str(error)
                    raise EndpointError(f"{where}: {message}")
                event = _event(result, started)
                yield event
                if event.final:
                    done = True
                    return
        except InferenceServerException as exc:
            # A broken stream reports its cause through the callback; prefer that message.
            cause = exc.message()
            while not inbox.empty():
                _, error = inbox.get_nowait()
                if error is not None:
                    cause = str(error)
                    break
            raise EndpointError(f"{where}: {cause}") from exc
        finally:
            if not done:
                # The caller stopped reading, or it failed: the server stops this request.
                self._reset()

    def _next(self, inbox: queue.Queue[tuple[Any, Any]], where: str) -> tuple[Any, Any]:
        """The next response (or error) in ``inbox``, waiting up to ``timeout_s`` in steps of
        :data:`WAIT_STEP_S`: the kernel may hand SIGTERM or Ctrl-C to one of gRPC's threads,
        which does not wake a main thread blocked on a lock, and Python runs the handler only
        in the main thread, so one long wait held ``complete``'s stop until the server answered
        or the whole ``--timeout`` (10 minutes) passed."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return inbox.get(timeout=max(0.0, min(WAIT_STEP_S, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise EndpointError(
                        f"{where}: no response for {self.timeout_s:.0f} s",
                        "Check that the model streams (published with --streaming) and the "
                        "server is not overloaded; raise the timeout for long completions.",
                    ) from None

    def close(self) -> None:
        # Every request on the stream has its final response (an unfinished one was cancelled
        # when its iteration ended): half-close the stream and let Triton end it. Cancelling
        # it made Triton 24.10 keep the model referenced, and wait its whole
        # --exit-timeout-secs at SIGTERM for it to unload.
        self._reset(cancel=False)
        self._client.close()

    def __enter__(self) -> StreamingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def stream_completion(
    url: str,
    model: str,
    request: dict[str, list[Any]],
    *,
    timeout_s: float = 120.0,
) -> Iterator[StreamEvent]:
    """:meth:`StreamingClient.stream` on a connection of its own (closed at the end)."""
    with StreamingClient(url, timeout_s=timeout_s) as client:
        yield from client.stream(model, request)


def collect(events: Iterator[StreamEvent]) -> StreamedCompletion:
    """Read a whole stream; an :class:`EndpointError` if it carried no token."""
    received = tuple(events)
    tokens = [e for e in received if e.sequence_length is not None]
    if not tokens:
        raise EndpointError(
            "the stream ended without a generated token",
            "Check the server log; request at least one token (request_output_len >= 1).",
        )
    first, last_length = tokens[0], max(e.sequence_length for e in tokens)
    last = next(e for e in tokens if e.sequence_length == last_length)
    # The first token response holds the prompt and one generated token.
    output_tokens = last_length - first.sequence_length + 1
    tpot = (last.seconds - first.seconds) / (output_tokens - 1) if output_tokens > 1 else None
    return StreamedCompletion(
        text="".join(e.text for e in received),
        events=received,
        ttft_s=first.seconds,
        tpot_s=tpot,
        latency_s=received[-1].seconds,
        output_tokens=output_tokens,
        output_ids=last.output_ids[:last_length],
    )
