"""OpenAI's sampling fields mapped onto what FasterTransformer does.

FasterTransformer samples only when ``top_k`` or ``top_p`` is set: with neither (or
``top_k`` = 1) it decodes greedily and ``temperature`` alone changes nothing. OpenAI samples
whenever ``temperature`` > 0 (its default is 1, with ``top_p`` 1). So:

============================  ===========================================================
OpenAI request                what the ``llm`` model is sent
============================  ===========================================================
``temperature`` = 0           ``top_k`` = 1: greedy (``top_p`` does not matter)
``top_p`` = 0                 ``top_k`` = 1: greedy (the limit of nucleus sampling)
``temperature`` > 0           ``temperature``, ``top_p`` (1 when absent: the whole
                              distribution) and a ``seed``
============================  ===========================================================

A sampled request without ``seed`` gets a random one: FasterTransformer's default seed is 0,
so every unseeded request would otherwise return the same "random" completion. A request with
``seed`` is reproducible on the same model and server (OpenAI's promise is best effort too).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from completions_service.protocol import MAX_SEED, CompletionRequest


@dataclass(frozen=True)
class Sampling:
    greedy: bool
    temperature: float | None  # None: not sent
    top_p: float | None
    top_k: int | None
    seed: int | None


def sampling_of(request: CompletionRequest) -> Sampling:
    if request.temperature == 0 or request.top_p == 0:
        return Sampling(greedy=True, temperature=None, top_p=None, top_k=1, seed=request.seed)
    seed = request.seed if request.seed is not None else secrets.randbelow(MAX_SEED + 1)
    return Sampling(
        greedy=False, temperature=request.temperature, top_p=request.top_p, top_k=None, seed=seed
    )
