"""OpenAI's completions request, checked field by field, and the answers' JSON shapes.

:func:`parse_request` turns a decoded JSON body into a :class:`CompletionRequest` or raises
:class:`~completions_service.errors.InvalidRequest` naming the field (``param``). A field the
service cannot honour is refused, never ignored: an unknown field (OpenAI's own answer:
"Unrecognized request argument"), ``n`` or ``best_of`` above 1, ``logprobs`` (the model gives
no per-token log-probabilities, so no right value could be returned), non-zero
``presence_penalty``/``frequency_penalty`` and a non-empty ``logit_bias`` (FasterTransformer
has no such additive penalties or biases). ``suffix`` is checked later, against what the model
declares (:mod:`completions_service.infill`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from completions_service.errors import InvalidRequest

#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_MAX_TOKENS = 16
#: OpenAI's bounds of ``temperature`` and ``top_p``, and its defaults.
MAX_TEMPERATURE = 2.0
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
#: OpenAI accepts at most four stop sequences.
MAX_STOPS = 4
#: ``seed`` travels as Triton's UINT64.
MAX_SEED = 2**64 - 1
#: The fields a request may carry (OpenAI's completions API).
FIELDS = frozenset(
    {
        "model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "n", "stream",
        "stream_options", "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty",
        "best_of", "logit_bias", "user", "seed",
    }
)  # fmt: skip


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str
    max_tokens: int | None  # None: the default (DEFAULT_MAX_TOKENS)
    temperature: float
    top_p: float
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    echo: bool
    stop: tuple[str, ...]
    seed: int | None
    suffix: str | None
    user: str | None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name}: must be true or false (got {value!r})", param=name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise InvalidRequest(
            f"{name}: must be a number from {low:g} to {high:g} (got {value!r})", param=name
        )
    return float(value)


def _text(value: str, name: str) -> str:
    """``value`` if it is Unicode text the model can be sent (UTF-8): JSON's escapes let a
    string hold a lone surrogate (``"\\ud800"``), which no encoding writes."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{name}: holds {exc.object[exc.start : exc.end]!r} at {exc.start}, a lone "
            "surrogate (a \\ud800-\\udfff escape with no pair), which is no text; send "
            "the text as UTF-8",
            param=name,
        ) from None
    return value


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise InvalidRequest(
                f"prompt: a list must hold exactly one prompt (got {len(prompt)}); "
                "send one request per prompt",
                param="prompt",
            )
        prompt = prompt[0]
    if prompt is None:
        raise InvalidRequest("prompt: is required", param="prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest(
            "prompt: must be a string, or a list of one string (token ids are not accepted: "
            "send the text)",
            param="prompt",
        )
    if not prompt:
        raise InvalidRequest("prompt: must not be empty", param="prompt")
    return _text(prompt, "prompt")


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("stop: must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(
            f"stop: at most {MAX_STOPS} sequences (got {len(stops)})", param="stop"
        )
    if any(not s for s in stops):
        raise InvalidRequest("stop: a stop sequence must not be empty", param="stop")
    return tuple(dict.fromkeys(_text(s, "stop") for s in stops))


def _unsupported(body: dict) -> None:
    """Refuse, naming the field, what the service cannot honour."""
    if body.get("n") not in (None, 1):
        raise InvalidRequest(
            f"n: only 1 is supported (got {body['n']!r}); send n requests for n completions",
            param="n",
        )
    if body.get("best_of") not in (None, 1):
        raise InvalidRequest(
            f"best_of: only 1 is supported (got {body['best_of']!r})", param="best_of"
        )
    if body.get("logprobs") is not None:
        raise InvalidRequest(
            "logprobs: not available: the model returns no per-token log-probabilities, so "
            "no right value could be sent; leave logprobs out (or null)",
            param="logprobs",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (not _is_number(value) or value != 0):
            raise InvalidRequest(
                f"{name}: only 0 is supported (got {value!r}): FasterTransformer has no "
                "additive penalty of OpenAI's kind",
                param=name,
            )
    if body.get("logit_bias") not in (None, {}):
        raise InvalidRequest(
            "logit_bias: not supported: the model takes no per-token bias; leave it out",
            param="logit_bias",
        )


def parse_request(body: Any, *, model: str | None = None) -> CompletionRequest:
    """The checked request. ``model``: the model a legacy engine path names (the body's
    ``model``, if any, must then agree)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidRequest(
            f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0]
        )
    name = body.get("model", model)
    if name is None:
        raise InvalidRequest("model: is required (GET /v1/models lists it)", param="model")
    if not isinstance(name, str):
        raise InvalidRequest("model: must be a string", param="model")
    if model is not None and name != model:
        raise InvalidRequest(
            f"model: {name!r} differs from the engine {model!r} in the path", param="model"
        )
    _unsupported(body)
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise InvalidRequest(
            f"max_tokens: must be an integer of at least 1 (got {max_tokens!r})",
            param="max_tokens",
        )
    seed = body.get("seed")
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED
    ):
        raise InvalidRequest(
            f"seed: must be an integer from 0 to {MAX_SEED} (got {seed!r})", param="seed"
        )
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest("suffix: must be a string", param="suffix")
    if suffix:
        _text(suffix, "suffix")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("user: must be a string", param="user")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequest(
                "stream_options: only allowed when stream is true", param="stream_options"
            )
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise InvalidRequest(
                "stream_options: must be an object with at most include_usage",
                param="stream_options",
            )
        include_usage = _bool(options, "include_usage")
    return CompletionRequest(
        model=name,
        prompt=_prompt(body),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", DEFAULT_TOP_P, 0.0, 1.0),
        stream=stream,
        include_usage=include_usage,
        echo=_bool(body, "echo"),
        stop=_stops(body),
        seed=seed,
        suffix=suffix or None,
        user=user,
    )


# --- answers --------------------------------------------------------------------------------


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    ident: str, model: str, text: str, finish_reason: str | None, use: dict | None
) -> dict[str, Any]:
    """A ``text_completion`` object: the unary answer, or one chunk of a stream (``use``
    None: no ``usage`` key)."""
    answer: dict[str, Any] = {
        "id": ident,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }
    if use is not None:
        answer["usage"] = use
    return answer


def model_card(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    """One entry of ``GET /v1/models``; ``max_model_len`` is the context length (Continue
    reads it), in tokens."""
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "model-triton",
        "max_model_len": max_model_len,
    }
