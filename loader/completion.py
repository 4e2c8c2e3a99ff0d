"""Send one completion request to a published ensemble with ``tritonclient`` (HTTP or gRPC).

The request is the one our users send, in perf_analyzer's ``--input-data`` format (the seed's
``test.json``: ``{"data": [{"prompt": {"content": [...], "shape": [1]}, "temperature": [0.2],
...}]}``). :func:`load_request` reads its first entry, :func:`complete` turns it into Triton
inputs typed by the ensemble's contract (:data:`loader.repository.tensors.ENSEMBLE_INPUTS`) and
returns a :class:`Completion`. The protocol picks the client module from :data:`CLIENTS`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loader import fs
from loader.errors import EndpointError, InvalidRequestError, ModelNotFoundError, shown
from loader.formats import jsondoc
from loader.repository.tensors import ENSEMBLE_INPUTS

log = logging.getLogger(__name__)

#: The steps of a published repository and its ``llm`` model (Triton's LLM convention, other
#: names); this client calls the model beside them.
STEP_MODELS = frozenset({"preprocessing", "fastertransformer", "postprocessing", "llm"})


def quiet_interrupts() -> None:
    """``tritonclient.http`` waits on gevent, whose hub prints ``KeyboardInterrupt`` and a
    timestamp when Ctrl-C lands during a request; the interrupt still reaches the caller (it
    is one of the hub's ``SYSTEM_ERROR``), only the print goes (``NOT_ERROR``)."""
    try:
        import gevent
    except ImportError:
        return
    hub = gevent.get_hub()
    if not issubclass(KeyboardInterrupt, hub.NOT_ERROR):
        hub.NOT_ERROR = (*hub.NOT_ERROR, KeyboardInterrupt)


def _infer_http(module: Any, url: str, model: str, inputs: list[Any], timeout_s: float) -> Any:
    quiet_interrupts()
    client = module.InferenceServerClient(url, network_timeout=timeout_s)
    try:
        return client.infer(model, inputs)
    finally:
        client.close()


def _infer_grpc(module: Any, url: str, model: str, inputs: list[Any], timeout_s: float) -> Any:
    client = module.InferenceServerClient(url)
    try:
        return client.infer(model, inputs, client_timeout=timeout_s)
    finally:
        client.close()


#: Protocol -> (tritonclient module, how to send one request with it).
CLIENTS: dict[str, tuple[str, Callable[..., Any]]] = {
    "http": ("tritonclient.http", _infer_http),
    "grpc": ("tritonclient.grpc", _infer_grpc),
}

_DTYPES = {t.name: t.dtype for t in ENSEMBLE_INPUTS}


@dataclass(frozen=True)
class Completion:
    """The ensemble's outputs for one prompt (first row, first beam). ``cum_log_prob`` is NaN
    when FasterTransformer's sum holds a token the request did not ask for (models README)."""

    text: str
    output_ids: np.ndarray
    sequence_length: int
    cum_log_prob: float


#: The largest request file read (bench/test.json is a few kB): a larger one is a mistake.
REQUEST_FILE_LIMIT = 16 * 1024 * 1024


def load_request(path: Path | str) -> dict[str, list[Any]]:
    """The first request of a perf_analyzer input-data file, as ``name -> values``. Only a
    regular file of at most :data:`REQUEST_FILE_LIMIT` bytes is read (a FIFO blocked forever,
    /dev/zero filled the memory)."""
    try:
        raw = fs.read_file(Path(path), limit=REQUEST_FILE_LIMIT)
        document = jsondoc.loads(raw.decode("utf-8"))
        entry = document["data"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise InvalidRequestError(
            f"{path} is not a perf_analyzer input file with a data entry: {exc}",
            'Use the format {"data": [{"prompt": {"content": ["..."], "shape": [1]}, ...}]}.',
        ) from exc
    fix = 'Write each input as {"content": [...], "shape": [...]} or as a list of values.'
    if not isinstance(entry, dict):
        raise InvalidRequestError(
            f"{path}: the first data entry is {type(entry).__name__}, not an object of inputs", fix
        )
    request = {}
    for name, value in entry.items():
        content = value.get("content") if isinstance(value, dict) else value
        if not isinstance(content, list):
            raise InvalidRequestError(
                f"{path}: the input {name!r} holds no list of values ({shown(value)[:80]})", fix
            )
        request[name] = content
    return request


def _numpy(name: str, values: list[Any]) -> tuple[np.ndarray, str]:
    from tritonclient.utils import triton_to_np_dtype

    try:
        dtype = _DTYPES[name]
    except KeyError as exc:
        raise InvalidRequestError(
            f"the ensemble has no input named {name!r}",
            f"Use only these inputs: {', '.join(_DTYPES)}.",
        ) from exc
    if dtype == "BYTES":
        array = np.array([[_text(name, v)] for v in values], dtype=np.object_)
    else:
        np_dtype = np.dtype(triton_to_np_dtype(dtype))
        array = np.array([[_value(name, dtype, np_dtype, v)] for v in values], dtype=np_dtype)
    return array, dtype


def _text(name: str, value: Any) -> bytes:
    """``value`` of the text input ``name`` as UTF-8 bytes; a lone surrogate (a JSON
    ``"\\ud800"``, bytes of a command line that are not UTF-8) is refused."""
    try:
        return str(value).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"the input {name} holds {shown(value)[:80]}, which is not UTF-8 text ({exc.reason})",
            f"Pass {name} as UTF-8 text.",
        ) from None


def _value(name: str, dtype: str, np_dtype: np.dtype, value: Any) -> Any:
    """``value`` as the input ``name`` of ``dtype`` holds it: a number of that kind and range
    (a JSON string, a fraction for an integer, or a number past the type is refused, never
    wrapped or rounded into another value). What the numbers mean is the server's to check."""
    if np_dtype.kind == "b":
        if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
            return bool(value)
        raise InvalidRequestError(
            f"the input {name} ({dtype}) must be true or false, got {value!r}",
            f"Pass {name} as true or false.",
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(
            f"the input {name} ({dtype}) must be a number, got {value!r}",
            f"Pass {name} as a JSON number.",
        )
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        if isinstance(value, float) and not value.is_integer():
            raise InvalidRequestError(
                f"the input {name} ({dtype}) must be a whole number, got {value!r}",
                f"Pass {name} as a whole number from {info.min} to {info.max}.",
            )
        if not info.min <= value <= info.max:
            raise InvalidRequestError(
                f"the input {name} ({dtype}) must be from {info.min} to {info.max}, got {value!r}",
                f"Pass {name} within the range of {dtype}.",
            )
        return int(value)
    largest = float(np.finfo(np_dtype).max)
    if abs(value) > largest:  # NaN passes: the server decides what it means
        raise InvalidRequestError(
            f"the input {name} ({dtype}) must be at most {largest:g} in size, got {value!r}",
            f"Pass {name} within the range of {dtype}.",
        )
    return value


def check_inputs(request: dict[str, list[Any]]) -> None:
    """Refuse a request whose inputs the ensemble does not have or whose values its types
    cannot hold (:class:`InvalidRequestError`), before anything is sent."""
    for name, values in request.items():
        _numpy(name, values)


def build_inputs(client_module: Any, request: dict[str, list[Any]]) -> list[Any]:
    """``InferInput`` objects of ``client_module`` (tritonclient.http or .grpc) for ``request``."""
    inputs = []
    for name, values in request.items():
        array, dtype = _numpy(name, values)
        tensor = client_module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _first(request: dict[str, list[Any]], field: str, default: float) -> float:
    values = request.get(field)
    return float(values[0]) if values else default


def greedy_despite_temperature(request: dict[str, list[Any]]) -> bool:
    """Whether ``request`` sets a temperature that cannot change its tokens: FasterTransformer
    decodes greedily when ``runtime_top_k`` is 1, or when top-k and top-p are both 0 (their
    defaults; ``TopKSamplingLayer::setup``), and scaling the logits does not move the argmax."""
    temperature = _first(request, "temperature", 1.0)
    top_k, top_p = _first(request, "runtime_top_k", 0), _first(request, "runtime_top_p", 0.0)
    return temperature != 1.0 and (top_k == 1 or (top_k == 0 and top_p == 0))


def warn_if_greedy_despite_temperature(request: dict[str, list[Any]]) -> None:
    if greedy_despite_temperature(request):
        log.warning(
            "temperature %g without top-k or top-p is greedy decoding: the temperature changes "
            "nothing. To sample, add --top-p (e.g. 0.95) or --top-k (e.g. 40).",
            _first(request, "temperature", 1.0),
        )


def complete(
    url: str,
    model: str,
    request: dict[str, list[Any]],
    *,
    protocol: str = "http",
    timeout_s: float = 120.0,
) -> Completion:
    """Send ``request`` to ``model`` at ``url`` (``host:port``) and return the first completion."""
    try:
        module_name, infer = CLIENTS[protocol]
    except KeyError as exc:
        raise EndpointError(f"unknown protocol {protocol!r}", "Use http or grpc.") from exc
    module = importlib.import_module(module_name)
    from tritonclient.utils import InferenceServerException

    try:
        result = infer(module, url, model, build_inputs(module, request), timeout_s)
    except InferenceServerException as exc:
        raise _served_error(exc, url, model, protocol) from exc
    except OSError as exc:  # refused, reset, unreachable, timed out (HTTP)
        raise EndpointError(
            f"{protocol}://{url} is unreachable: {exc}", unreachable_hint(protocol)
        ) from exc
    text = result.as_numpy("completion").reshape(-1)[0]
    return Completion(
        text=text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text),
        output_ids=result.as_numpy("output_ids")[0, 0].astype(np.int64),
        sequence_length=int(result.as_numpy("sequence_length").reshape(-1)[0]),
        cum_log_prob=float(result.as_numpy("cum_log_probs").reshape(-1)[0]),
    )


def unreachable_hint(protocol: str) -> str:
    """What to check when Triton does not answer at a --url."""
    hint = EndpointError.default_remediation
    if protocol == "grpc":
        hint += (
            " A --url without a scheme is gRPC (Triton's port 8001): for the HTTP port write "
            "http://HOST:PORT."
        )
    return hint


def _served_error(exc: Any, url: str, model: str, protocol: str) -> EndpointError:
    """What an error the server answered with means for the user."""
    message = exc.message() or str(exc)
    if "decoupled" in message:
        host = url.rsplit(":", 1)[0]
        return EndpointError(
            f"{protocol}://{url}: model {model!r} streams its completion (a repository "
            f"published with --streaming); {message}",
            f"Stream it over gRPC: model-loader complete --stream --url {host}:<grpc port, "
            "8001 by default> ...",
        )
    if "unknown model" in message or "is not found" in message or "is not ready" in message:
        names = served_models(url, protocol=protocol, strict=False)
        listed = f"; it serves {', '.join(names)}" if names else ""
        return ModelNotFoundError(
            f"{protocol}://{url} does not serve a ready model {model!r}{listed}",
            "Pass --model with one of them (or leave --model out to use the only one)."
            if names
            else ModelNotFoundError.default_remediation,
        )
    return EndpointError(f"{protocol}://{url} model {model!r}: {message}")


def waits_within(protocol: str, timeout_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """The keyword arguments of a Triton client (``protocol``'s) and of each of its calls that
    end a wait for the server after ``timeout_s`` seconds: a gRPC call has no deadline of its
    own, and one to a server that took it and never answered waited for good."""
    if protocol == "http":
        return {"connection_timeout": timeout_s, "network_timeout": timeout_s}, {}
    return {}, {"client_timeout": timeout_s}


def served_models(
    url: str, *, protocol: str = "http", strict: bool = True, timeout_s: float = 120.0
) -> list[str]:
    """The ready models at ``url`` that clients call (a repository's steps left out), sorted,
    waiting at most ``timeout_s`` for the answer. With ``strict`` false, an unreachable server
    gives an empty list instead of an error."""
    module = importlib.import_module(CLIENTS[protocol][0])
    from tritonclient.utils import InferenceServerException

    made, call = waits_within(protocol, timeout_s)
    client = module.InferenceServerClient(url, **made)
    try:
        index = client.get_model_repository_index(**call)
    except (InferenceServerException, OSError) as exc:
        if not strict:
            return []
        if "restricted" in str(exc):  # the chart keeps model-repository behind the header
            raise ModelNotFoundError(
                f"Triton at {protocol}://{url} keeps its model list for callers with its admin "
                f"header: {exc}",
                "Pass --model NAME (the chart's model.name, e.g. codegen).",
            ) from exc
        raise EndpointError(
            f"cannot reach Triton at {protocol}://{url}: {exc}", unreachable_hint(protocol)
        ) from exc
    finally:
        client.close()
    entries = index if isinstance(index, list) else [
        {"name": m.name, "state": m.state} for m in index.models
    ]  # fmt: skip
    ready = {e["name"] for e in entries if e.get("state") == "READY"}
    return sorted(ready - STEP_MODELS)


def find_model(url: str, *, protocol: str = "http", timeout_s: float = 120.0) -> str:
    """The one model the server at ``url`` offers clients (asked for at most ``timeout_s``); a
    typed error naming them if there is none or more than one."""
    names = served_models(url, protocol=protocol, timeout_s=timeout_s)
    if len(names) == 1:
        return names[0]
    if not names:
        raise ModelNotFoundError(f"{protocol}://{url} serves no ready model")
    raise ModelNotFoundError(
        f"{protocol}://{url} serves several models: {', '.join(names)}",
        "Pass --model with the one to call.",
    )
