"""``completions-service``: the command line (each flag also from ``COMPLETIONS_<FLAG>``).

Exit codes: 0 after a clean shutdown (Ctrl-C; SIGTERM and SIGHUP end the process by that
signal once it shut down cleanly), 2 for a bad flag, keys file or token file, an address it
cannot listen on or an open-file limit too low (the message says which), 3 when the server did
not start.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import resource
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from completions_service.auth import KeyFileError, read_header_value, read_keys
from completions_service.settings import (
    DEFAULT_LISTEN,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MODEL,
    DEFAULT_REQUEST_TIMEOUT_S,
    Settings,
)

if TYPE_CHECKING:
    import uvicorn

ENV_PREFIX = "COMPLETIONS_"
#: The longest --request-timeout-s: the chart's bound for ``openai.requestTimeoutSeconds``.
MAX_REQUEST_TIMEOUT_S = 86400
#: The chart's bounds for ``openai.maxConcurrency`` and ``maxQueue``, and ``maxBodyBytes``.
MAX_COUNT = 1_000_000
MIN_BODY_BYTES, MAX_BODY_BYTES = 1024, 1 << 30


def env_name(flag: str) -> str:
    """``--max-queue`` -> ``COMPLETIONS_MAX_QUEUE``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _digits(text: str) -> bool:
    """Whether ``text`` is a number in ASCII digits (``str.isdigit`` takes ``８`` and ``²``)."""
    return text.isascii() and text.isdigit()


def _ascii(value: str) -> str:
    """``value``, which ``int`` or ``float`` reads next: ValueError unless it is ASCII (they read
    the digits of every script: ``８`` was 8)."""
    if not value.isascii():
        raise ValueError(value)
    return value


def triton_address(value: str) -> str:
    """``grpc://HOST:PORT`` (or ``HOST:PORT``) -> ``HOST:PORT``."""
    address = value.removeprefix("grpc://")
    if "://" in address:
        raise argparse.ArgumentTypeError(
            f"{value!r}: Triton is called over gRPC; give grpc://HOST:PORT (its gRPC port, "
            "8001 by default), not an HTTP address"
        )
    host, _, port = address.rpartition(":")
    if not host or not _digits(port) or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r}: expected grpc://HOST:PORT")
    return address


def header_name(value: str) -> str:
    """A gRPC header's name the service can send with a text value: lowercase letters, digits,
    ``-``, ``_`` and ``.``, not a reserved one (``grpc-``), not a binary one (``-bin``). gRPC
    failed each call to Triton with another name, the request a bare 500."""
    if (
        not re.fullmatch(r"[0-9a-z_.-]+", value)
        or value.startswith("grpc-")
        or value.endswith("-bin")
    ):
        raise argparse.ArgumentTypeError(
            f"{value!r} is no gRPC header name the service can send: lowercase letters, "
            "digits, '-', '_' and '.', e.g. triton-grpc-protocol-admin-key"
        )
    return value


def listen_address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not _digits(port) or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r}: expected HOST:PORT, e.g. 0.0.0.0:8080")
    host = host.strip("[]")
    try:  # a name no address stands for fails here, not inside the server after start-up
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(
            f"{value!r}: {host} is no address of this machine ({exc}); give an IP address to "
            "listen on, e.g. 0.0.0.0:8080"
        ) from None
    return host, int(port)


def _within(low: int, high: int):
    """An integer from ``low`` to ``high``: the chart's bounds for the same setting
    (``values.schema.json``), so the service takes what a release may set and nothing else."""

    def parse(value: str) -> int:
        try:
            number = int(_ascii(value))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"must be at least {low} (got {number})")
        if number > high:
            raise argparse.ArgumentTypeError(f"must be at most {high} (got {number})")
        return number

    return parse


def _seconds(value: str) -> float:
    try:
        number = float(_ascii(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 (got {value})")
    if number > MAX_REQUEST_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_REQUEST_TIMEOUT_S} s, a day (got {value}): the chart's bound "
            "for openai.requestTimeoutSeconds"
        )
    return number


def _file(value: str) -> Path:
    """A file's path; an empty one is refused, never taken as the current directory
    (``Path("")`` is ``.``)."""
    if not value:
        raise argparse.ArgumentTypeError("empty: name the file, or leave the flag out")
    return Path(value)


#: The flags that name a file: set but empty in the environment, each is an error of its own.
FILE_FLAGS = ("--api-keys-file", "--triton-protocol-token-file")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="completions-service",
        description="OpenAI-compatible completions in front of Triton's llm model. Every flag "
        f"may also come from the environment: {ENV_PREFIX}<FLAG> (e.g. "
        f"{env_name('--triton-url')}).",
    )

    def add(flag: str, help: str, **kwargs) -> None:
        default = os.environ.get(env_name(flag), kwargs.pop("default", None))
        p.add_argument(flag, default=default, help=f"{help} [{env_name(flag)}]", **kwargs)

    add("--triton-url", "Triton's gRPC endpoint, grpc://HOST:PORT (required)", type=triton_address)
    add("--triton-model", f"the model to call (default {DEFAULT_MODEL})", default=DEFAULT_MODEL)
    add("--listen", f"HOST:PORT to serve HTTP on (default {DEFAULT_LISTEN})",
        default=DEFAULT_LISTEN, type=listen_address)  # fmt: skip
    add("--api-keys-file", "a file of API keys, one per line (default: no key needed)",
        type=_file)  # fmt: skip
    add("--max-concurrency", f"requests in flight to Triton (default {DEFAULT_MAX_CONCURRENCY})",
        default=DEFAULT_MAX_CONCURRENCY, type=_within(1, MAX_COUNT))  # fmt: skip
    add("--max-queue", f"requests waiting beyond that before a 429 (default {DEFAULT_MAX_QUEUE})",
        default=DEFAULT_MAX_QUEUE, type=_within(0, MAX_COUNT))  # fmt: skip
    add("--max-body-bytes", f"largest request body, else 413 (default {DEFAULT_MAX_BODY_BYTES})",
        default=DEFAULT_MAX_BODY_BYTES, type=_within(MIN_BODY_BYTES, MAX_BODY_BYTES))  # fmt: skip
    add("--request-timeout-s", "seconds one completion may take on Triton, else 504 "
        f"(default {DEFAULT_REQUEST_TIMEOUT_S:g})", default=DEFAULT_REQUEST_TIMEOUT_S,
        type=_seconds)  # fmt: skip
    add("--triton-protocol-header", "the gRPC header that admits to Triton's restricted "
        "protocols, e.g. triton-grpc-protocol-admin-key (the service reads model-config)",
        type=header_name)  # fmt: skip
    add("--triton-protocol-token-file", "a file holding that header's value", type=_file)
    add("--log-level", "debug, info, warning or error (default info)", default="info",
        choices=["debug", "info", "warning", "error"])  # fmt: skip
    return p


def settings_of(args: argparse.Namespace) -> Settings:
    host, port = args.listen
    return Settings(
        triton_url=args.triton_url,
        triton_model=args.triton_model,
        host=host,
        port=port,
        api_keys_file=args.api_keys_file,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout_s,
        triton_protocol_header=args.triton_protocol_header,
        triton_protocol_token_file=args.triton_protocol_token_file,
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (the first address ``host`` stands for), before the server
    starts: an address that is not the machine's, a port taken or one below 1024 without the
    right is the user's to change, said as such (uvicorn logged the errno and exited 3)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _listen_error(listen: tuple[str, int], exc: OSError) -> str:
    host, port = listen
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        what = "another process listens on that port; stop it or give another port"
    elif exc.errno == errno.EADDRNOTAVAIL:
        what = "that is no address of this machine; give one of its addresses, or 0.0.0.0"
    elif exc.errno == errno.EACCES:
        what = "a port below 1024 needs the right to bind it; give a port from 1024 up"
    else:
        what = "give another --listen address"
    return f"cannot listen on {where} ({exc.strerror or exc}): {what}"


#: The least open-file limit the service starts with: its socket, the clients' connections and
#: gRPC's own descriptors. Below about 16, gRPC could not open what it starts with (its event
#: descriptors, /dev/urandom) at the first call to Triton and killed the process (SIGSEGV or
#: SIGABRT), the requests in flight with it.
MIN_OPEN_FILES = 64


def open_files_problem() -> str | None:
    """Why the process's open-file limit is too low for the service, or None."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft >= MIN_OPEN_FILES:
        return None
    return (
        f"the open-file limit is {soft} (ulimit -n); the service needs at least "
        f"{MIN_OPEN_FILES} (its socket, one per client, gRPC's to Triton): raise it"
    )


def hold_standard_descriptors() -> None:
    """Open ``/dev/null`` on each standard descriptor (0, 1, 2) the process started without
    (``>&-``), and make a missing standard stream one on it: uvicorn's logging asks whether
    standard output is a terminal, and failed on the missing stream (exit 1, a traceback);
    and the listening socket or a client's connection took the free number, so that what a
    library wrote to its standard output or error went to that socket. A closed standard
    output or error writes nowhere."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        if getattr(sys, name) is None:
            with contextlib.suppress(OSError):
                setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115


#: The signals that stop the service (uvicorn shuts down on SIGINT and SIGTERM; SIGHUP too).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def hang_up_stops(server: uvicorn.Server) -> Iterator[None]:
    """While the block runs, SIGHUP (a closed terminal, a process manager's stop) shuts the
    server down as SIGTERM does, its requests in flight answered; then the process ends by
    SIGHUP. uvicorn handles SIGINT and SIGTERM only: SIGHUP killed the service at once, each
    request in flight cut off. An ignored SIGHUP (``nohup``) stays ignored."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(
        signal.SIGHUP
    ) in (signal.SIG_IGN, None):
        yield
        return
    taken: list[int] = []

    def hang_up(signum: int, frame: FrameType | None) -> None:
        taken.append(signum)
        server.should_exit = True

    previous = signal.signal(signal.SIGHUP, hang_up)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)
    if taken:
        signal.raise_signal(signal.SIGHUP)


def main(argv: Sequence[str] | None = None) -> int:
    hold_standard_descriptors()
    if threading.current_thread() is threading.main_thread():
        # A signal mask is inherited across exec: started by a parent's thread that blocked
        # them, the service never took SIGTERM (a pod's stop) or Ctrl-C, and served on until
        # SIGKILL. The threads started later (gRPC's, the event loop's) inherit this one's.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    p = parser()
    for name in map(env_name, FILE_FLAGS):
        if os.environ.get(name) == "":
            p.error(f"{name} is set but empty: unset it, or set it to the file's path")
    args = p.parse_args(argv)  # argparse applies `type` to string defaults from the environment
    if not args.triton_url:
        p.error(f"--triton-url is required (or {env_name('--triton-url')})")
    if (args.triton_protocol_header is None) != (args.triton_protocol_token_file is None):
        p.error("--triton-protocol-header and --triton-protocol-token-file go together")
    too_few = open_files_problem()
    if too_few is not None:
        print(f"completions-service: error: {too_few}", file=sys.stderr)
        return 2
    if args.api_keys_file is not None:
        try:
            read_keys(args.api_keys_file)
        except KeyFileError as exc:
            print(f"completions-service: error: {exc}", file=sys.stderr)
            return 2
    if args.triton_protocol_token_file is not None:
        try:
            read_header_value(args.triton_protocol_token_file)
        except (OSError, ValueError) as exc:
            print(
                "completions-service: error: cannot read the Triton protocol token file "
                f"{args.triton_protocol_token_file}: {exc}",
                file=sys.stderr,
            )
            return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from completions_service.app import create_app

    settings = settings_of(args)
    try:
        sock = listening_socket(settings.host, settings.port)
    except OSError as exc:
        print(f"completions-service: error: {_listen_error(args.listen, exc)}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        create_app(settings),
        log_level=args.log_level,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    # Ctrl-C: the server shuts down, then passes the signal on (a KeyboardInterrupt here).
    with sock, contextlib.suppress(KeyboardInterrupt), hang_up_stops(server):
        logging.getLogger("completions_service").info("listening on %s:%d", *sock.getsockname()[:2])
        server.run(sockets=[sock])
    return 0 if server.started else 3
