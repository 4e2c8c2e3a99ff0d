"""A Triton endpoint: ``host:port`` plus a protocol, parsed the same way by every client.

``model-loader complete``, ``scripts/bench`` (``--url``, ``--compare``, ``--ttft``) and
``model-loader tune`` read ``--url`` here; ``scripts/complete``, a client users copy without
this package, keeps its own copy of these rules and a test checks that both agree.

Accepted: ``host:port``, ``grpc://host:port`` and ``http://host:port`` (a trailing ``/`` is
allowed; ``host`` is a name, an IPv4 address or a bracketed IPv6 address). Without a scheme
the protocol is ``--protocol``, else gRPC (:data:`DEFAULT_PROTOCOL`): the port the chart
opens to clients (8001), and the only protocol that streams. Anything else (no port, a path,
``https://``, a scheme that disagrees with ``--protocol``) is an :class:`EndpointSyntaxError`
saying what to write instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loader.errors import EndpointSyntaxError

PROTOCOLS: tuple[str, ...] = ("grpc", "http")
#: The protocol of ``host:port`` without a scheme, in every client.
DEFAULT_PROTOCOL = "grpc"
#: Triton's default ports; ``--url`` left out means 127.0.0.1 on these.
DEFAULT_PORTS = {"http": 8000, "grpc": 8001}

_URL = re.compile(
    r"^(?:(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://)?"
    r"(?P<host>[A-Za-z0-9._-]+|\[[0-9a-fA-F:.]+\])"
    r"(?::(?P<port>[0-9]+))?(?P<path>/.*)?$"
)
_FORMS = "host:port (gRPC), grpc://host:port or http://host:port"
#: A user name and password before the host (``[scheme://]USER:PASSWORD@``): no endpoint takes
#: them, and an error quoting the URL shows them as ``***``.
_USERINFO = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*://)?)[^/@]*@")


def _shown(url: str) -> str:
    return _USERINFO.sub(r"\1***@", url)


@dataclass(frozen=True)
class Endpoint:
    address: str  # host:port, the form tritonclient and perf_analyzer take
    protocol: str = DEFAULT_PROTOCOL
    #: Headers every request carries (``(name, value)``; perf_analyzer's ``-H``, which it sends
    #: over HTTP and gRPC alike): the admin header of a restricted gRPC protocol.
    headers: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.protocol}://{self.address}"


def host_problem(host: str) -> str | None:
    """Why ``host`` is no name a resolver can look up (a label empty or over 63 characters:
    the resolver's IDNA encoding refuses it with a ``UnicodeError``); None when it is one."""
    try:
        host.encode("idna")
    except UnicodeError:
        return f"the host name {host[:80]!r} has a part that is empty or over 63 characters"
    return None


def parse_endpoint(url: str | None, *, protocol: str | None = None) -> Endpoint:
    """``host:port`` or ``scheme://host:port`` -> :class:`Endpoint`; ``None``: 127.0.0.1 on
    the protocol's default port. :class:`EndpointSyntaxError` if malformed."""
    if protocol is not None and protocol not in PROTOCOLS:
        raise EndpointSyntaxError(f"unknown protocol {protocol!r}", "Use grpc or http.")
    if url is None:
        chosen = protocol or DEFAULT_PROTOCOL
        return Endpoint(f"127.0.0.1:{DEFAULT_PORTS[chosen]}", chosen)
    text = url.strip()
    match = _URL.match(text)
    if not match:
        raise EndpointSyntaxError(
            f"not a Triton endpoint: {_shown(url)!r}", f"Pass --url as {_FORMS}."
        )
    scheme = match["scheme"].lower() if match["scheme"] else None
    if scheme is not None and scheme not in PROTOCOLS:
        secure = " (TLS is not supported: reach the server through a tunnel or port-forward)"
        raise EndpointSyntaxError(
            f"unknown scheme {scheme}:// in {_shown(url)!r}"
            + (secure if scheme in ("https", "grpcs") else ""),
            f"Pass --url as {_FORMS}.",
        )
    if scheme and protocol and scheme != protocol:
        raise EndpointSyntaxError(
            f"--url says {scheme} but --protocol says {protocol}",
            "Drop one of them or make them agree.",
        )
    chosen = scheme or protocol or DEFAULT_PROTOCOL
    host = match["host"]
    why = host_problem(host.strip("[]"))
    if why is not None:
        raise EndpointSyntaxError(f"{_shown(url)!r}: {why}", f"Pass --url as {_FORMS}.")
    if match["path"] not in (None, "/"):
        raise EndpointSyntaxError(
            f"{_shown(url)!r} has a path ({match['path']}); a Triton endpoint is a host and a port",
            f"Pass --url {chosen}://{host}:{match['port'] or DEFAULT_PORTS[chosen]}.",
        )
    if match["port"] is None:
        raise EndpointSyntaxError(
            f"{_shown(url)!r} names no port",
            f"Add it: --url {host}:{DEFAULT_PORTS['grpc']} (gRPC) or "
            f"http://{host}:{DEFAULT_PORTS['http']} (Triton's default ports).",
        )
    port = int(match["port"])
    if not 0 < port < 65536:
        raise EndpointSyntaxError(
            f"port {port} out of range in {_shown(url)!r}", "Use a port from 1 to 65535."
        )
    return Endpoint(address=f"{host}:{port}", protocol=chosen)
