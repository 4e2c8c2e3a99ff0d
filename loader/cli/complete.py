"""`model-loader complete`: send one prompt to a served model and print the completion.

The client of the chart's ``helm test`` Pod (the loader image ships it): ``--check-ready``
first checks that the server and the model are ready. Non-streaming requests go over HTTP or
gRPC (:func:`loader.completion.complete`), streaming ones over gRPC
(:mod:`loader.streaming`), printing the text as it arrives. The request is the users' own
format (``--request bench/test.json``) with the flags overriding its fields.

Output: ``server ready`` and ``model NAME ready`` lines with ``--check-ready``, then the
completion. Exit 2 when the server, the model or the completion is not as expected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loader.cli import limit_argument
from loader.errors import EndpointError, InvalidRequestError, ResourceExhaustedError
from loader.limits import COMPLETION_TIMEOUT_S

#: Flag -> request field.
OPTION_FIELDS: dict[str, str] = {
    "max_tokens": "request_output_len",
    "temperature": "temperature",
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "seed": "random_seed",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "complete",
        help="send one prompt to a served model and print the completion",
        description="Send PROMPT (or --request FILE) to MODEL at --url and print the "
        "completion; --stream prints it token by token over gRPC. The chart's `helm test` "
        "runs this with --check-ready.",
    )
    p.add_argument("prompt", nargs="?", help="the prompt; '-' reads it from standard input")
    p.add_argument(
        "--request",
        type=Path,
        metavar="JSON",
        help="a request in perf_analyzer's input format (its first entry; e.g. bench/test.json)",
    )
    p.add_argument(
        "--url",
        default=None,
        help="HOST:PORT (gRPC), grpc://HOST:PORT or http://HOST:PORT (default 127.0.0.1:8001, "
        "gRPC; 127.0.0.1:8000 with --protocol http)",
    )
    p.add_argument(
        "--protocol",
        choices=("grpc", "http"),
        default=None,
        help="the protocol of a --url without a scheme (default grpc)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the model to call (default: the one the server serves, its repository's steps "
        "left out)",
    )
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="stream the completion token by token (gRPC; the repository must stream; default off)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default 32)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature; it applies only when sampling, with --top-k or --top-p: "
        "alone it changes nothing (FasterTransformer decodes greedily without top-k and top-p)",
    )
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling probability mass")
    p.add_argument("--seed", type=int, default=None, help="random seed of the sampler")
    p.add_argument(
        "--check-ready",
        action="store_true",
        help="first check that the server and the model are ready (what `helm test` runs)",
    )
    limit_argument(
        p,
        "--timeout",
        COMPLETION_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds to wait for each answer: the readiness checks', the model list's, the "
        "completion's",
    )
    p.set_defaults(func=run)


def read_stdin() -> str:
    """The prompt on standard input: at most the size of a request file (``< /dev/zero``
    would fill the memory); bytes that are not UTF-8 kept for the prompt's own check."""
    from loader.completion import REQUEST_FILE_LIMIT

    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        raise InvalidRequestError(
            "'-' reads the prompt from standard input, which is closed",
            "Pass the prompt as an argument, or give the command a standard input.",
        )
    raw = stream.read(REQUEST_FILE_LIMIT + 1)
    if len(raw) > REQUEST_FILE_LIMIT:
        raise InvalidRequestError(
            f"the prompt on standard input is longer than {REQUEST_FILE_LIMIT} bytes",
            "Pass a shorter prompt (is standard input a device or a stream that never ends?).",
        )
    return raw.decode("utf-8", "surrogateescape")


def build_request(args: argparse.Namespace) -> dict[str, list[Any]]:
    from loader.completion import load_request

    request = load_request(args.request) if args.request else {}
    if args.prompt is not None:
        request["prompt"] = [read_stdin() if args.prompt == "-" else args.prompt]
    if not request.get("prompt") or not request["prompt"][0]:
        raise InvalidRequestError(
            "no prompt", "Pass the prompt as an argument, '-' to read standard input, or --request."
        )
    request.setdefault("request_output_len", [32])
    for option, field in OPTION_FIELDS.items():
        value = getattr(args, option)
        if value is not None:
            request[field] = [value]
    from loader.completion import check_inputs

    check_inputs(request)
    if int(request["request_output_len"][0]) < 1:
        raise InvalidRequestError("--max-tokens must be at least 1", "Pass --max-tokens 1 or more.")
    return request


#: The least open-file limit ``complete`` runs with: below 7, gRPC could not open its own
#: descriptors and killed the process (SIGABRT); below about 8, its connection's socket failed
#: ("Too many open files"), reported as a server that is not up.
MIN_OPEN_FILES = 16


def check_open_files() -> None:
    """A :class:`ResourceExhaustedError` when the open-file limit leaves gRPC too few."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        raise ResourceExhaustedError(
            f"The limit on open files ({soft}: ulimit -n) leaves the Triton client too few "
            f"(it needs {MIN_OPEN_FILES}: its connection and its own).",
            "Raise the limit on open files (ulimit -n, the container runtime's nofile limit), "
            "then run again.",
        )


def check_ready(url: str, protocol: str, model: str, timeout_s: float) -> None:
    """Print ``server ready`` and ``model NAME ready``; :class:`EndpointError` if either is not
    (or its answer took more than ``timeout_s``)."""
    import importlib

    from tritonclient.utils import InferenceServerException

    from loader.completion import waits_within

    module = importlib.import_module(f"tritonclient.{protocol}")
    made, call = waits_within(protocol, timeout_s)
    client = module.InferenceServerClient(url, **made)
    try:
        if not client.is_server_ready(**call):
            raise EndpointError(f"Triton at {protocol}://{url} is not ready")
        print("server ready", flush=True)
        if not client.is_model_ready(model, **call):
            raise EndpointError(
                f"model {model} is not ready at {protocol}://{url}",
                f"Check the model's name and that it loaded (curl <http url>/v2/models/{model}/ready; "
                "the Triton pod's log says why a model failed to load).",
            )
        print(f"model {model} ready", flush=True)
    except (InferenceServerException, OSError) as exc:
        from loader.completion import unreachable_hint

        raise EndpointError(
            f"cannot reach Triton at {protocol}://{url}: {exc}", unreachable_hint(protocol)
        ) from exc
    finally:
        client.close()


def run(args: argparse.Namespace) -> int:
    from loader.completion import warn_if_greedy_despite_temperature
    from loader.endpoint import parse_endpoint

    # gRPC took inf, nan, 0 and -1 for a deadline already past: each failed at once, blaming
    # the server ("Deadline Exceeded", check that it is up)
    COMPLETION_TIMEOUT_S.check(args.timeout)
    check_open_files()
    endpoint = parse_endpoint(args.url, protocol=args.protocol)
    url, protocol = endpoint.address, endpoint.protocol
    if args.stream and protocol != "grpc":
        raise EndpointError(
            f"streaming needs gRPC, and {endpoint} is HTTP",
            "Pass the gRPC port (--url HOST:8001), or --no-stream for HTTP.",
        )
    request = build_request(args)
    warn_if_greedy_despite_temperature(request)
    if args.model is None:
        from loader.completion import find_model

        args.model = find_model(url, protocol=protocol, timeout_s=args.timeout)
    if args.check_ready:
        check_ready(url, protocol, args.model, args.timeout)
    if args.stream:
        from loader.streaming import stream_completion

        pieces = []
        for event in stream_completion(url, args.model, request, timeout_s=args.timeout):
            pieces.append(event.text)
            print(event.text, end="", flush=True)
        text = "".join(pieces)
    else:
        from loader.completion import complete

        text = complete(url, args.model, request, protocol=protocol, timeout_s=args.timeout).text
        print(text, end="")
    print(flush=True)
    if not text:
        raise EndpointError(
            f"model {args.model} at {protocol}://{url} returned an empty completion",
            "Check the model's tokenizer and end_id, and the server log.",
        )
    return 0
