"""The HTTP application (Starlette, served by uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/engines/{engine}/completions`` (the legacy path),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health/live``, ``GET /health/ready``,
``GET /metrics``. The ``/v1`` routes need an API key when a keys file is given; the health and
metrics routes never do (probes and Prometheus call them).

A streamed completion's HTTP status is decided by Triton's first response: the service waits
for it before answering, so a request the model refuses or a Triton that is away gets its
4xx/5xx, never a 200 followed by an error. After that, each response of the model becomes one
server-sent event as it arrives; an error then is sent as an ``error`` event (OpenAI's way), and
a client that leaves closes the Triton stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from completions_service.admission import Admission
from completions_service.auth import ApiKeys
from completions_service.errors import (
    ApiError,
    BodyTooLarge,
    InvalidRequest,
    NotFound,
    Unavailable,
)
from completions_service.infill import infill_prompt
from completions_service.metrics import Metrics
from completions_service.protocol import (
    DEFAULT_MAX_TOKENS,
    CompletionRequest,
    completion,
    completion_id,
    model_card,
    parse_request,
    usage,
)
from completions_service.sampling import sampling_of
from completions_service.settings import Settings
from completions_service.stops import StopMatcher
from completions_service.triton import Generation, ModelInfo, Piece, Triton

log = logging.getLogger("completions_service")

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class Disconnected(Exception):
    """The HTTP client closed its connection."""


async def _disconnect(receive: Receive) -> None:
    """Returns when the client has closed its connection (the request's body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """``await work()``, cancelled (raising :class:`Disconnected`) if the client leaves first.
    Called once the request's body is read: the next ASGI message is the disconnect. What
    ``work`` raises is raised as it is. (Plain asyncio tasks: a library below may turn the
    cancellation into a CancelledError of its own, which a cancel scope would not absorb.)"""
    job = asyncio.ensure_future(work())
    watch = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel(job, watch)
        raise
    if not job.done():
        await _cancel(job, watch)
        raise Disconnected
    await _cancel(watch)
    return job.result()


class EventStream(Response):
    """A ``text/event-stream`` answer whose events come from ``events``; ``on_close(left)``
    runs whatever happens (``left``: the client disconnected first)."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[bytes], on_close: Callable[[bool], Awaitable[None]]
    ) -> None:
        self.status_code = 200
        self.background = None
        # No Content-Length: the body's end is the connection's (chunked transfer).
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            *((k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()),
        ]
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        sending = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_disconnect(receive))
        left = False
        try:
            await asyncio.wait({sending, watch}, return_when=asyncio.FIRST_COMPLETED)
            left = not sending.done()
        finally:
            left = left or not sending.done()
            await _cancel(sending, watch)
            await self.on_close(left)
        if not left:
            sending.result()  # raises what the stream raised


class Service:
    def __init__(self, settings: Settings, triton: Triton | None = None) -> None:
        self.settings = settings
        self.triton = triton or Triton(
            settings.triton_url,
            settings.triton_model,
            settings.request_timeout_s,
            protocol_header=settings.triton_protocol_header,
            protocol_token_file=settings.triton_protocol_token_file,
        )
        self.keys = ApiKeys(settings.api_keys_file)
        self.metrics = Metrics()
        self.admission: Admission | None = None  # made inside the event loop
        self.started = int(time.time())

    # --- plumbing -----------------------------------------------------------------------------

    def _admission(self) -> Admission:
        if self.admission is None:
            self.admission = Admission(self.settings.max_concurrency, self.settings.max_queue)
        return self.admission

    def error(self, exc: ApiError, route: str) -> JSONResponse:
        self.metrics.requests.labels(route, str(exc.status)).inc()
        self.metrics.errors.labels(exc.type, exc.code or "").inc()
        if exc.status >= 500:
            log.warning("%s: %d %s", route, exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    def ok(self, body: Any, route: str) -> JSONResponse:
        self.metrics.requests.labels(route, "200").inc()
        return JSONResponse(body)

    async def read_json(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_large = BodyTooLarge(
            f"the request body is larger than {limit} bytes (--max-body-bytes); send a "
            "shorter prompt"
        )
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
        except ClientDisconnect:
            raise Disconnected from None
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
        except RecursionError:
            raise InvalidRequest(
                "the request body nests arrays or objects deeper than JSON is read here; send "
                "a completion request (an object of OpenAI's fields)"
            ) from None

    async def _model(self) -> ModelInfo:
        return await self.triton.info()

    # --- routes -------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._completions(request, None, "/v1/completions")

    async def engine_completions(self, request: Request) -> Response:
        engine = request.path_params["engine"]
        return await self._completions(request, engine, "/v1/engines/{engine}/completions")

    async def _completions(self, request: Request, engine: str | None, route: str) -> Response:
        arrived = time.perf_counter()
        try:
            self.keys.check(request.headers.get("authorization"))
            parsed = parse_request(await self.read_json(request), model=engine)
            info = await self._model()
            if parsed.model != info.name:
                raise NotFound(
                    f"The model {parsed.model!r} does not exist; this service serves "
                    f"{info.name!r} (GET /v1/models)",
                    param="model",
                )
            generation = self._generation(parsed, info)
            admission = self._admission()
            await admission.acquire()
        except ApiError as exc:
            return self.error(exc, route)
        except Disconnected:  # while it sent its body: no one to answer
            self.metrics.cancelled.inc()
            self.metrics.requests.labels(route, "499").inc()
            return Response(status_code=499)
        self._gauges()
        if parsed.stream:
            return await self._stream(request, parsed, generation, info, route, arrived)
        try:
            return await self._unary(request, parsed, generation, info, route, arrived)
        finally:
            admission.release()
            self._gauges()

    def _generation(self, parsed: CompletionRequest, info: ModelInfo) -> Generation:
        max_tokens = parsed.max_tokens if parsed.max_tokens is not None else DEFAULT_MAX_TOKENS
        if max_tokens > info.max_model_len:
            raise InvalidRequest(
                f"max_tokens: {max_tokens} is more than the model's context of "
                f"{info.max_model_len} tokens (max_model_len), prompt included",
                param="max_tokens",
            )
        prompt = infill_prompt(parsed.prompt, parsed.suffix, info.infill_template, info.name)
        return Generation(
            prompt=prompt,
            max_tokens=max_tokens,
            stream=parsed.stream,
            sampling=sampling_of(parsed),
            stop=parsed.stop,
        )

    def _gauges(self) -> None:
        if self.admission is not None:
            self.metrics.in_flight.set(self.admission.in_flight)
            self.metrics.queued.set(self.admission.waiting)

    def _finished(self, last: Piece | None) -> dict[str, int]:
        prompt = last.prompt_tokens if last and last.prompt_tokens is not None else 0
        done = last.completion_tokens if last and last.completion_tokens is not None else 0
        self.metrics.prompt_tokens.inc(prompt)
        self.metrics.completion_tokens.inc(done)
        return usage(prompt, done)

    async def _unary(
        self,
        request: Request,
        parsed: CompletionRequest,
        generation: Generation,
        info: ModelInfo,
        route: str,
        arrived: float,
    ) -> Response:
        stops = StopMatcher(parsed.stop)

        async def run() -> tuple[str, str, Piece | None]:
            text, reason, last = [], "length", None
            async with contextlib.aclosing(self.triton.generate(generation, info)) as pieces:
                async for piece in pieces:
                    last = piece
                    text.append(stops.feed(piece.text))
                    if stops.stopped:
                        reason = "stop"
                        break
                    if piece.finish_reason is not None:
                        reason = piece.finish_reason
            text.append(stops.flush())
            return "".join(text), reason, last

        try:
            text, reason, last = await until_disconnect(request.receive, run)
        except Disconnected:
            self.metrics.cancelled.inc()
            self.metrics.requests.labels(route, "499").inc()
            return Response(status_code=499)
        except ApiError as exc:
            return self.error(exc, route)
        if parsed.echo:
            text = parsed.prompt + text
        answer = completion(completion_id(), info.name, text, reason, self._finished(last))
        self.metrics.latency.labels("false").observe(time.perf_counter() - arrived)
        return self.ok(answer, route)

    async def _stream(
        self,
        request: Request,
        parsed: CompletionRequest,
        generation: Generation,
        info: ModelInfo,
        route: str,
        arrived: float,
    ) -> Response:
        admission = self._admission()
        pieces = self.triton.generate(generation, info)
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                with contextlib.suppress(Exception):
                    await pieces.aclose()  # closes the Triton stream
                admission.release()
                self._gauges()

        try:
            first = await until_disconnect(request.receive, pieces.__anext__)
        except (Disconnected, StopAsyncIteration, ApiError) as exc:
            await release()
            if isinstance(exc, ApiError):
                return self.error(exc, route)
            if isinstance(exc, StopAsyncIteration):
                return self.error(Unavailable("Triton ended the stream without an answer"), route)
            self.metrics.cancelled.inc()
            self.metrics.requests.labels(route, "499").inc()
            return Response(status_code=499)
        except BaseException:
            await release()  # its slot, else taken for good: the service ends up refusing all
            raise

        ident = completion_id()
        stops = StopMatcher(parsed.stop)
        sent_first = False

        def chunk(text: str, reason: str | None) -> bytes:
            nonlocal sent_first
            if text and not sent_first:
                sent_first = True
                self.metrics.ttft.observe(time.perf_counter() - arrived)
            return sse(completion(ident, info.name, text, reason, None))

        async def events() -> AsyncIterator[bytes]:
            if parsed.echo:
                yield chunk(parsed.prompt, None)
            piece, last, reason = first, first, None
            try:
                while True:
                    last = piece
                    text = stops.feed(piece.text)
                    if stops.stopped:
                        reason = "stop"
                    elif piece.finish_reason is not None:
                        reason = piece.finish_reason
                        text += stops.flush()
                    if reason is not None:
                        break
                    if text:
                        yield chunk(text, None)
                    piece = await pieces.__anext__()
            except ApiError as exc:
                self.metrics.errors.labels(exc.type, exc.code or "").inc()
                log.warning("%s: stream ended by %d %s", route, exc.status, exc.message)
                yield sse(exc.body())
                return
            except StopAsyncIteration:
                yield sse(Unavailable("Triton ended the stream early").body())
                return
            await release()
            yield chunk(text, reason)
            use = self._finished(last)
            if parsed.include_usage:
                answer = completion(ident, info.name, "", None, use)
                answer["choices"] = []
                yield sse(answer)
            yield sse("[DONE]")

        async def on_close(left: bool) -> None:
            await release()
            if left:
                self.metrics.cancelled.inc()
            status = "499" if left else "200"
            self.metrics.requests.labels(route, status).inc()
            self.metrics.latency.labels("true").observe(time.perf_counter() - arrived)

        return EventStream(events(), on_close)

    async def models(self, request: Request) -> Response:
        route = "/v1/models"
        try:
            self.keys.check(request.headers.get("authorization"))
            info = await self._model()
        except ApiError as exc:
            return self.error(exc, route)
        card = model_card(info.name, info.max_model_len, self.started)
        return self.ok({"object": "list", "data": [card]}, route)

    async def model(self, request: Request) -> Response:
        route = "/v1/models/{id}"
        try:
            self.keys.check(request.headers.get("authorization"))
            info = await self._model()
            wanted = request.path_params["model"]
            if wanted != info.name:
                raise NotFound(
                    f"The model {wanted!r} does not exist; this service serves {info.name!r}",
                    param="model",
                )
        except ApiError as exc:
            return self.error(exc, route)
        return self.ok(model_card(info.name, info.max_model_len, self.started), route)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def ready(self, request: Request) -> Response:
        why = await self.triton.readiness()
        if why is None:
            return JSONResponse({"status": "ready"})
        exc = Unavailable(f"not ready: {why}", retry_after=1)
        return JSONResponse(exc.body(), status_code=503, headers=exc.headers())

    async def metrics_text(self, request: Request) -> Response:
        self._gauges()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    body = {
        "error": {
            "message": f"{request.method} {request.url.path}: {exc.detail}",
            "type": kind,
            "param": None,
            "code": None,
        }
    }
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def create_app(settings: Settings, triton: Triton | None = None) -> Starlette:
    service = Service(settings, triton)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await service.triton.close()

    routes = [
        Route("/v1/completions", service.completions, methods=["POST"]),
        Route("/v1/engines/{engine}/completions", service.engine_completions, methods=["POST"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        Route("/health/live", service.live, methods=["GET"]),
        Route("/health/ready", service.ready, methods=["GET"]),
        Route("/metrics", service.metrics_text, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error}
    )
    app.state.service = service
    return app
