"""A Triton endpoint as perf_analyzer addresses it: ``host:port`` plus a protocol.

``--url`` accepts ``host:port`` (protocol from ``--protocol``, HTTP by default) or
``http://host:port`` / ``grpc://host:port``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loader.errors import LoaderError

PROTOCOLS: tuple[str, ...] = ("http", "grpc")

_URL = re.compile(
    r"^(?:(?P<scheme>[a-z]+)://)?(?P<host>[A-Za-z0-9._-]+|\[[0-9a-fA-F:]+\]):(?P<port>\d+)/?$"
)


@dataclass(frozen=True)
class Endpoint:
    address: str  # host:port
    protocol: str = "http"
    #: Headers every request carries (``(name, value)``; perf_analyzer's ``-H``, which it sends
    #: over HTTP and gRPC alike): the admin header of a restricted gRPC protocol.
    headers: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.protocol}://{self.address}"


def parse_endpoint(url: str, *, protocol: str | None = None) -> Endpoint:
    """``host:port`` or ``scheme://host:port`` -> :class:`Endpoint` (typed error if malformed)."""
    match = _URL.match(url.strip())
    if not match:
        raise LoaderError(
            f"not a Triton endpoint: {url!r}",
            "Pass --url host:port (e.g. 127.0.0.1:8000), http://host:port or grpc://host:port.",
        )
    scheme = match["scheme"]
    if scheme and protocol and scheme != protocol:
        raise LoaderError(
            f"--url says {scheme} but --protocol says {protocol}",
            "Drop one of them or make them agree.",
        )
    chosen = scheme or protocol or "http"
    if chosen not in PROTOCOLS:
        raise LoaderError(
            f"unknown protocol {chosen!r} in {url!r}", "Use http:// or grpc:// (or --protocol)."
        )
    port = int(match["port"])
    if not 0 < port < 65536:
        raise LoaderError(f"port {port} out of range in {url!r}", "Use a port from 1 to 65535.")
    return Endpoint(address=f"{match['host']}:{port}", protocol=chosen)
