"""A remote source's answers that the client libraries read whole (a listing page, an object's or a
revision's description, the Hub's file list) are read within bounds: at most
:data:`MAX_ANSWER_BYTES`, at the pace a download keeps (:class:`~loader.sources.transfer.Pace`).

Each read of a socket is bounded by the read timeout, but nothing bounded the answer: a server
(``STORAGE_EMULATOR_HOST``, ``HF_ENDPOINT``, a proxy in between) whose listing never ends held the
loader until the kernel killed it for its memory, and one that sent a byte now and then held it
for ever. A hook on each library's HTTP session (``requests`` for Cloud Storage, ``httpx`` for the
Hub) wraps the body of every answer read whole before it is read: one past the bound is a
:class:`~loader.errors.SourceError` (exit 2: no such answer comes from the real services), one that
slows below the pace is :class:`~loader.sources.transfer.Stalled`, retried as a cut connection
until the retry deadline (then 75). Downloads stream their bodies themselves, at the same pace,
and are not bounded in size here (their size is the listed one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from loader.errors import SourceError
from loader.sources.transfer import Pace

#: The largest answer read whole: a page of a listing holds 1000 objects (about 1 MiB of JSON).
MAX_ANSWER_BYTES = 64 * 1024 * 1024
#: The ``httpx`` request extension a download sets: its body is streamed by the loader itself.
STREAMED = "model-loader-streamed"


def _bounded(chunks: Iterator[bytes], url: str, setting: str) -> Iterator[bytes]:
    pace, got = Pace(f"the answer of {url}"), 0
    for chunk in chunks:
        got += len(chunk)
        if got > MAX_ANSWER_BYTES:
            raise SourceError(
                f"{url} answered with more than {MAX_ANSWER_BYTES // 2**20} MiB where a "
                "listing or a description is expected (the largest the services send is about "
                "1 MiB); nothing was downloaded.",
                f"Check {setting}, or the proxy in between: the server's answers are not the "
                "service's.",
            )
        pace.arrived(len(chunk))
        yield chunk


def _url(url: object) -> str:
    return str(url).split("?")[0]


class _BoundedRaw:
    """``requests``' view of a body (``response.raw``) whose ``stream`` is bounded; anything
    else is the body's own."""

    def __init__(self, raw: Any, url: str, setting: str) -> None:
        self._raw, self._url, self._setting = raw, url, setting

    def stream(self, amt: int = 2**16, decode_content: bool | None = None) -> Iterator[bytes]:
        return _bounded(self._pieces(amt, decode_content), self._url, self._setting)

    def _pieces(self, amt: int, decode_content: bool | None) -> Iterator[bytes]:
        """What each read of the socket brings (``read1``): ``stream`` waits until a piece of
        ``amt`` bytes is full, so a trickle would never be seen."""
        while piece := self._raw.read1(amt, decode_content=decode_content):
            yield piece

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def requests_hook(setting: str) -> Any:
    """A ``requests`` response hook bounding every answer not asked for as a stream (the library
    reads those whole, after its hooks); ``setting`` names where the server comes from."""

    def hook(response: Any, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("stream") and hasattr(response.raw, "stream"):
            response.raw = _BoundedRaw(response.raw, _url(response.url), setting)

    return hook


def httpx_hook(setting: str) -> Any:
    """An ``httpx`` response hook bounding every answer but the downloads the loader streams
    itself (their requests carry :data:`STREAMED`). The Hub library ships its own copy of
    ``httpx`` under another name: the body is wrapped in that package's own stream type."""
    import importlib

    def hook(response: Any) -> None:
        if response.request.extensions.get(STREAMED):
            return
        package = importlib.import_module(type(response).__module__.partition(".")[0])
        base = getattr(package, "SyncByteStream", None)
        if base is not None and isinstance(response.stream, base):
            response.stream = _bounded_stream(base)(
                response.stream, _url(response.request.url), setting
            )

    hook.bounds_answers = True  # type: ignore[attr-defined]  # (one per session: replaced)
    return hook


_STREAM_TYPES: dict[type, type] = {}


def _bounded_stream(base: type) -> type:
    """A subclass of ``base`` (an ``httpx`` package's ``SyncByteStream``) whose iteration is
    bounded (one per package)."""
    if base not in _STREAM_TYPES:

        class Bounded(base):  # type: ignore[misc, valid-type]
            def __init__(self, inner: Any, url: str, setting: str) -> None:
                self._inner, self._url, self._setting = inner, url, setting

            def __iter__(self) -> Iterator[bytes]:
                return _bounded(iter(self._inner), self._url, self._setting)

            def close(self) -> None:
                self._inner.close()

        _STREAM_TYPES[base] = Bounded
    return _STREAM_TYPES[base]
