"""Token generation with FasterTransformer's sampling semantics, batched, in NumPy.

Given a causal LM with a KV cache (the CPU reference :class:`loader.reference.gptj.GptJ`, or
anything with the same ``forward``), :func:`generate` completes a batch of requests the way the
FasterTransformer GPT-J runtime does (``DynamicDecodeLayer``, ``BaseSamplingLayer``,
``TopKSamplingLayer``/``TopPSamplingLayer`` and their kernels, FT 5.x):

- **Which sampler.** ``top_k == 0 and top_p == 0`` means greedy (FT turns it into ``top_k = 1``);
  ``top_k > 0 and top_p == 0`` means plain top-k (FT sets ``top_p = 1``); ``top_k > 0`` with
  ``top_p > 0`` samples from the top-k tokens restricted to the ``top_p`` fraction of their
  mass; ``top_k == 0`` with ``top_p > 0`` is nucleus (top-p) sampling. ``top_k`` is clipped to
  1024 and ``top_p`` to [0, 1], as FT does. Defaults when a request omits them: top_k 0,
  top_p 0 (greedy), temperature 1, no repetition penalty, random seed 0.
- **Logit processing, in FT's order.** Temperature first (``logits * 1 / (t + 1e-6)``), then
  the multiplicative repetition penalty over every distinct token of the context (prompt and
  tokens generated so far; FT skips it while the context has a single token): a positive
  logit is divided by the penalty, a negative one multiplied.
- **Drawing.** FT draws ``u`` uniform in (0, 1] per row and step and walks the candidates in
  descending probability, picking the first whose running sum reaches
  ``u * top_p * (sum of the top-k probabilities)`` (top-k) or ``u * top_p`` (top-p). We do the
  same with a per-request ``numpy`` PCG64 generator seeded with ``random_seed``, so a request's
  tokens depend only on its own seed, not on what else is in the batch (FT seeds one curand
  state per row, too; the numbers themselves differ from curand's).
- **Log probabilities.** Computed from the softmax of the processed logits. ``cum_log_probs``
  adds ``log p(token)``. ``output_log_probs`` holds ``log p(token)`` for top-p rows and
  ``log p(token) - log(sum of the top-k probabilities)`` for top-k rows (FT's
  ``topk_stage2_sampling``: the probability conditioned on the top-k set; 0 for greedy).
- **Stopping.** A row stops after ``output_len`` new tokens or when it emits ``end_id``; the
  ``end_id`` token counts in ``sequence_length`` (FT increments the length, then marks the row
  finished). A finished row's later positions hold ``end_id``. A row also stops once its context
  ends with one of its ``stop_words`` (kept in the output, as FT does).
- **Bad words.** Before anything else, FT bans the last token of each ``bad_words`` entry whose
  other tokens end the context (a one-token entry is always banned): its logit becomes -inf.
  :func:`words_from_ft_list` reads FT's ``[2, L]`` list format (ids; end offsets, -1 padded).
- **Output layout** (one batch, as the FasterTransformer backend returns it; the wire contract
  in ``loader/repository/models/README.md``). The batch is ``W`` tokens wide, the longest prompt of the
  batch (``input_ids.shape[1]`` once the backend has padded the prompts of a ragged batch with
  0s; FT ``GptJTritonModelInstance::forward`` and BE ``ModelInstanceState::SetInputTensors``).
  Every row's ``output_ids`` is ``W + max(output_len)`` wide: its prompt (its real length),
  its generated tokens, then ``end_id`` (FT ``invokeGatherTree`` removes the padding).
  ``sequence_length`` is ``W + generated tokens``: FT starts every row's length at ``W``
  (``invokeDecodingInitialize`` with ``max_input_length``), so a short prompt in a ragged batch
  reports the batch's width, not its own length; the generated tokens of a row are therefore
  ``output_ids[input_length : input_length + generated]`` (:attr:`GenerationResult.generated_ids`),
  and what follows them up to ``sequence_length`` is ``end_id``. ``output_log_probs`` is
  ``max(output_len)`` wide. The token ids themselves never depend on the batch.

"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from loader.errors import InvalidRequestError

#: FT's top-k kernels support k up to this value and clip larger ones.
TOP_K_MAX = 1024
#: FT's temperature kernel divides by ``temperature + TEMPERATURE_EPS``.
TEMPERATURE_EPS = 1e-6


class CausalLM(Protocol):
    """What generation needs from a model (the reference GPT-J implements it)."""

    def forward(
        self,
        input_ids: np.ndarray,
        *,
        position_ids: np.ndarray,
        attention_mask: np.ndarray,
        past: Any = None,
    ) -> tuple[np.ndarray, Any]: ...


@dataclass(frozen=True)
class SamplingConfig:
    """Per-request sampling settings, with FT's defaults."""

    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    random_seed: int = 0

    def effective(self) -> tuple[int, float]:
        """``(top_k, top_p)`` after FT's rules (``setup_topk_runtime_args``)."""
        k, p = int(self.top_k), float(self.top_p)
        if k == 0 and p == 0.0:
            k = 1
        if k > 0 and p == 0.0:
            p = 1.0
        return min(k, TOP_K_MAX), min(max(p, 0.0), 1.0)


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to complete: prompt ids, how many new tokens, when to stop, how to sample."""

    input_ids: Sequence[int]
    output_len: int
    end_id: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    bad_words: tuple[tuple[int, ...], ...] = ()
    stop_words: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class GenerationStep:
    """What one decoding step produced, per row of the batch."""

    index: int  # 0-based position among the generated tokens
    tokens: np.ndarray  # (B,) int64; end_id for rows that were already finished
    produced: np.ndarray  # (B,) bool: the row generated ``tokens[i]`` at this step
    log_probs: np.ndarray  # (B,) float32 (output_log_probs entry; 0 where not produced)
    finished: np.ndarray  # (B,) bool after this step


@dataclass(frozen=True)
class GenerationResult:
    """One row's output, in FT's layout (see the module docstring)."""

    output_ids: np.ndarray  # (W + max output_len of the batch,) int64
    sequence_length: int  # W + num_generated, as FT reports it
    cum_log_prob: float
    output_log_probs: np.ndarray  # (max output_len of the batch,) float32
    input_length: int
    num_generated: int  # the end_id that stopped a row counts, as in FT

    @property
    def generated_ids(self) -> np.ndarray:
        return self.output_ids[self.input_length : self.input_length + self.num_generated]


def words_from_ft_list(words_list: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """FT's ``[2, L]`` word list (row 0: concatenated ids, row 1: end offsets, -1 padded)."""
    words_list = np.asarray(words_list).reshape(2, -1)
    ids, offsets = words_list[0], words_list[1]
    words, start = [], 0
    for end in offsets.tolist():
        if end < 0:
            break
        if end <= start or end > ids.size:
            raise InvalidRequestError(
                f"word list offsets {offsets.tolist()} do not fit its {ids.size} ids",
                "Send [[ids...], [end offsets..., -1 padding]] as FasterTransformer expects.",
            )
        words.append(tuple(int(t) for t in ids[start:end]))
        start = end
    return tuple(words)


def validate_requests(requests: Sequence[GenerationRequest], vocab_size: int) -> None:
    if not requests:
        raise InvalidRequestError("no requests to generate for")
    for n, req in enumerate(requests):
        ids = np.asarray(req.input_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidRequestError(f"request {n}: the prompt has no tokens")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise InvalidRequestError(
                f"request {n}: prompt token id {int(ids.max())} is outside the model's "
                f"vocabulary of {vocab_size}",
                "Tokenize with the checkpoint's own tokenizer.",
            )
        if req.output_len < 1:
            raise InvalidRequestError(f"request {n}: request_output_len must be at least 1")
        s = req.sampling
        if s.temperature <= 0:
            raise InvalidRequestError(f"request {n}: temperature must be positive")
        if s.repetition_penalty <= 0:
            raise InvalidRequestError(f"request {n}: repetition_penalty must be positive")
        if s.top_k < 0:
            raise InvalidRequestError(f"request {n}: runtime_top_k must not be negative")


def apply_temperature(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """``logits * 1 / (t + 1e-6)`` per row; rows with ``t == 1`` are left as they are."""
    scale = np.where(temperature == 1.0, 1.0, 1.0 / (temperature + TEMPERATURE_EPS))
    return logits * scale[:, None].astype(logits.dtype)


def apply_repetition_penalty(
    logits: np.ndarray, seen: np.ndarray, penalty: np.ndarray
) -> np.ndarray:
    """FT's multiplicative penalty on every token in ``seen`` (B, V) bool, once per token."""
    p = penalty[:, None].astype(logits.dtype)
    penalised = np.where(logits < 0, logits * p, logits / p)
    apply = seen & (penalty != 1.0)[:, None]
    return np.where(apply, penalised, logits)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted.astype(np.float64))
    return exp / exp.sum(axis=-1, keepdims=True)


def sample_tokens(
    probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, uniform: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pick one token per row as FT's top-k / top-p kernels do.

    ``probs`` (B, V) float64; ``top_k`` (B,) int, 0 = top-p row; ``top_p`` (B,) in [0, 1];
    ``uniform`` (B,) in (0, 1]. Returns ``(tokens, log_prob, output_log_prob)``.
    """
    batch, vocab = probs.shape
    order = np.argsort(-probs, axis=1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, axis=1)
    ranks = np.arange(vocab)[None, :]
    is_topk = top_k > 0
    limit = np.where(is_topk, np.minimum(top_k, vocab), vocab)
    candidates = ranks < limit[:, None]
    weights = np.where(candidates, sorted_p, 0.0)
    mass = np.where(is_topk, weights.sum(axis=1), 1.0)
    threshold = uniform * top_p * mass
    reached = (np.cumsum(weights, axis=1) >= threshold[:, None]) & candidates
    # No candidate reached the threshold (rounding): top-k takes its last candidate,
    # top-p its first (the kernels' fallbacks).
    fallback = np.where(is_topk, limit - 1, 0)
    pick = np.where(reached.any(axis=1), reached.argmax(axis=1), fallback)
    rows = np.arange(batch)
    tokens = order[rows, pick]
    chosen = sorted_p[rows, pick]
    with np.errstate(divide="ignore"):
        log_prob = np.log(chosen)
        output_log_prob = np.where(is_topk, log_prob - np.log(mass), log_prob)
    return tokens.astype(np.int64), log_prob, output_log_prob


class BatchGeneration:
    """One batch of requests being generated; iterate to run it step by step."""

    def __init__(
        self,
        model: CausalLM,
        requests: Sequence[GenerationRequest],
        *,
        vocab_size: int,
        padded_input_length: int = 0,
    ) -> None:
        """``padded_input_length``: the width of the batch's ``input_ids`` as the backend would
        hand it to FT (at least the longest prompt; a request may pad its rows further)."""
        validate_requests(requests, vocab_size)
        self.model = model
        self.requests = list(requests)
        self.vocab_size = vocab_size
        n = len(self.requests)
        self.input_lengths = np.array([len(r.input_ids) for r in self.requests], dtype=np.int64)
        self.padded_input_length = max(int(padded_input_length), int(self.input_lengths.max()))
        self.output_lens = np.array([r.output_len for r in self.requests], dtype=np.int64)
        self.end_ids = np.array([r.end_id for r in self.requests], dtype=np.int64)
        effective = [r.sampling.effective() for r in self.requests]
        self.top_k = np.array([k for k, _ in effective], dtype=np.int64)
        self.top_p = np.array([p for _, p in effective], dtype=np.float64)
        self.temperature = np.array(
            [r.sampling.temperature for r in self.requests], dtype=np.float32
        )
        self.penalty = np.array(
            [r.sampling.repetition_penalty for r in self.requests], dtype=np.float32
        )
        self.rngs = [
            np.random.Generator(np.random.PCG64(int(r.sampling.random_seed))) for r in self.requests
        ]
        max_out = int(self.output_lens.max())
        self.generated = np.zeros((n, max_out), dtype=np.int64)
        self.output_log_probs = np.zeros((n, max_out), dtype=np.float32)
        self.cum_log_probs = np.zeros(n, dtype=np.float64)
        self.num_generated = np.zeros(n, dtype=np.int64)
        self.finished = np.zeros(n, dtype=bool)
        self.seen = np.zeros((n, vocab_size), dtype=bool)
        for i, r in enumerate(self.requests):
            self.seen[i, np.asarray(r.input_ids, dtype=np.int64)] = True
        self.context = [[int(t) for t in r.input_ids] for r in self.requests]

    def _prompt_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Left-padded prompts, their attention mask and position ids."""
        n, width = len(self.requests), int(self.input_lengths.max())
        ids = np.zeros((n, width), dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        for i, r in enumerate(self.requests):
            length = int(self.input_lengths[i])
            ids[i, width - length :] = np.asarray(r.input_ids, dtype=np.int64)
            mask[i, width - length :] = 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        return ids, mask, positions

    def __iter__(self) -> Iterator[GenerationStep]:
        ids, mask, positions = self._prompt_batch()
        logits, past = self.model.forward(ids, position_ids=positions, attention_mask=mask)
        max_steps = int(self.output_lens.max())
        for step in range(max_steps):
            produced = ~self.finished & (self.num_generated < self.output_lens)
            if not produced.any():
                return
            tokens, log_probs = self._decode(
                np.asarray(logits[:, -1, :], dtype=np.float32), produced
            )
            yield GenerationStep(step, tokens, produced, log_probs, self.finished.copy())
            if not (~self.finished & (self.num_generated < self.output_lens)).any():
                return
            mask = np.concatenate([mask, np.ones((len(tokens), 1), dtype=mask.dtype)], axis=1)
            next_positions = (self.input_lengths + step)[:, None]
            # Rows that are done feed a placeholder (their end_id may lie outside the vocabulary).
            feed = np.where(tokens < self.vocab_size, tokens, 0)
            logits, past = self.model.forward(
                feed[:, None], position_ids=next_positions, attention_mask=mask, past=past
            )

    def _decode(self, logits: np.ndarray, produced: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Process the last position's logits, draw one token per row, update the state."""
        self._ban_bad_words(logits)
        logits = apply_temperature(logits, self.temperature)
        context = self.input_lengths + self.num_generated
        penalty = np.where(context > 1, self.penalty, 1.0).astype(np.float32)
        logits = apply_repetition_penalty(logits, self.seen, penalty)
        probs = softmax(logits)
        uniform = np.ones(len(self.requests))
        for i in np.flatnonzero(produced):
            uniform[i] = 1.0 - self.rngs[i].random()  # (0, 1], like curand_uniform
        tokens, log_prob, out_log_prob = sample_tokens(probs, self.top_k, self.top_p, uniform)
        tokens = np.where(produced, tokens, self.end_ids)
        out_log_prob = np.where(produced, out_log_prob, 0.0).astype(np.float32)
        rows = np.flatnonzero(produced)
        cols = self.num_generated[rows]
        self.generated[rows, cols] = tokens[rows]
        self.output_log_probs[rows, cols] = out_log_prob[rows]
        self.cum_log_probs[rows] += log_prob[rows]
        self.num_generated[rows] += 1
        self.seen[rows, tokens[rows]] = True
        self.finished |= produced & (tokens == self.end_ids)
        for i in rows:
            self.context[i].append(int(tokens[i]))
            if _ends_with_any(self.context[i], self.requests[i].stop_words):
                self.finished[i] = True
        return tokens, out_log_prob

    def _ban_bad_words(self, logits: np.ndarray) -> None:
        for i, request in enumerate(self.requests):
            for word in request.bad_words:
                if (
                    word
                    and 0 <= word[-1] < logits.shape[1]
                    and _ends_with(self.context[i], word[:-1])
                ):
                    logits[i, word[-1]] = -np.inf

    def results(self) -> list[GenerationResult]:
        """Each row's output so far (complete once iteration has ended), in FT's layout."""
        width = self.padded_input_length + int(self.output_lens.max())
        out = []
        for i, r in enumerate(self.requests):
            length, n_gen = int(self.input_lengths[i]), int(self.num_generated[i])
            ids = np.full(width, self.end_ids[i], dtype=np.int64)
            ids[:length] = np.asarray(r.input_ids, dtype=np.int64)
            ids[length : length + n_gen] = self.generated[i, :n_gen]
            out.append(
                GenerationResult(
                    output_ids=ids,
                    sequence_length=self.padded_input_length + n_gen,
                    cum_log_prob=float(self.cum_log_probs[i]),
                    output_log_probs=self.output_log_probs[i].copy(),
                    input_length=length,
                    num_generated=n_gen,
                )
            )
        return out


def _ends_with(context: list[int], word: Sequence[int]) -> bool:
    return not word or (len(context) >= len(word) and context[-len(word) :] == list(word))


def _ends_with_any(context: list[int], words: Sequence[Sequence[int]]) -> bool:
    return any(word and _ends_with(context, word) for word in words)


def generate(
    model: CausalLM,
    requests: Sequence[GenerationRequest],
    *,
    vocab_size: int,
    padded_input_length: int = 0,
) -> list[GenerationResult]:
    """Complete every request in one batch (see the module docstring for the semantics)."""
    generation = BatchGeneration(
        model, requests, vocab_size=vocab_size, padded_input_length=padded_input_length
    )
    for _ in generation:
        pass
    return generation.results()
