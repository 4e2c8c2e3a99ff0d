"""Token generation as FasterTransformer's GPT-J runs it, batched, in NumPy.

Given a causal LM with a KV cache (the CPU reference :class:`loader.reference.gptj.GptJ`, or
anything with the same ``forward``), :class:`BatchGeneration` runs one batch the way
FasterTransformer ``main`` (df4a753) does on the GPU, step for step, and :meth:`results` returns
what its Triton backend sends. FT = ``src/fastertransformer/``; each rule names the function it
comes from.

**The loop** (``models/gptj/GptJ.cc``, ``GptJ::forward``). The batch is ``W`` tokens wide: the
width of ``input_ids`` after the backend padded a ragged batch with 0s, at least its longest
prompt. Steps run from ``W`` to ``W + M - 1``, ``M`` the batch's largest ``request_output_len``;
after each step the loop ends when every row is finished (``should_stop``). ``M`` 0 runs no
step: every row's answer is its prompt (``sequence_length`` ``W``). FT keeps the ids in
one buffer per row: the prompt, 0s up to ``W`` (the padding), then one id per step.

**Each step** (``layers/DynamicDecodeLayer.cc``, ``DynamicDecodeLayer::forward``, in order):

1. *Bad words* (``kernels/ban_bad_words.cu``, ``ban_bad_words``): a one-token entry is always
   banned; a longer entry when the ids before ``step`` in the row's buffer end with its prefix,
   which for a short row in a ragged batch are the padding 0s at first. The banned logit becomes
   -inf, never for token id 0 nor an id outside the vocabulary (``0 < banned_token <
   vocab_size_padded``). An empty entry (its end offset not past the previous one's) bans
   nothing (``should_ban = item_size == 1``).
2. *Temperature* (``layers/sampling_layers/BaseSamplingLayer.cc``, ``BaseSamplingLayer::forward``;
   ``kernels/sampling_penalty_kernels.cu``, ``batchApplyTemperaturePenalty``): once any row's
   temperature is not 1, every row's logits are multiplied by ``1 / (t + 1e-6)`` (float32), the
   rows with ``t == 1`` included.
3. *Repetition penalty* (same function; ``batchApplyRepetitionPenalty``): when the batch's
   ``step > 1`` (so not at the first step of a batch whose prompts are all one token long,
   whatever a row's own length) and some row's penalty is not 1, each distinct id among the row's
   prompt and generated ids (the padding skipped) is penalised once: a positive logit divided by
   the penalty, a negative one multiplied.
4. *Sampling* (``TopKSamplingLayer::setup``, ``setup_topk_runtime_args``): ``top_k == 0 and
   top_p == 0`` is greedy (``top_k = 1``); ``top_k > 0 and top_p == 0`` becomes ``top_p = 1``;
   ``top_k`` is clipped to 1024 and ``top_p`` to [0, 1]. Rows with ``top_k > 0`` are sampled by
   the top-k kernel, the others by the top-p kernel, from the softmax of the processed logits
   (``addBiasSoftMax``: ``exp(x - max) / (sum + 1e-6)``, float32).

   - *Top-k* (``kernels/sampling_topk_kernels.cu``, ``topk_stage2_sampling``): a finished row
     writes ``end_id`` and draws nothing. Otherwise one ``curand_uniform`` ``u``; the candidates
     are the ``k`` most probable ids in descending order, and the first whose running sum reaches
     ``u * top_p * (sum of the k probabilities)`` is picked (the last candidate if none does).
     Log probability: ``log p``; ``output_log_probs`` holds ``log p - log(sum of the k)``.
   - *Top-p* (``kernels/sampling_topp_kernels.cu``, ``topp_sampling``): every row draws, finished
     or not; a finished row's distribution is all on ``end_id`` (``addBiasSoftMax``). The first id
     in descending order whose running sum reaches ``u * top_p`` is picked; if none does (the
     probabilities sum to slightly less than 1), the most probable id is written and the row's
     length, finished flag and log probabilities are left as they were. ``output_log_probs``
     holds ``log p``. After the step ``top_p`` becomes ``max(top_p, 1e-6)``
     (``computeToppDecay`` with its defaults).

   A row that samples grows its length by one (not when it was finished before the step) and is
   finished when it sampled ``end_id``.
5. *Stop words* (``kernels/stop_criteria_kernels.cu``, ``stop_words_criterion``): a row whose
   buffer ends, at ``step``, with an entry is finished (the padding counts here too). An empty
   entry matches at once (``step + 1 >= item_size`` and no token to compare): the row stops
   after its first generated token.
6. *Length* (``length_criterion``; ``GptJ::forward``, ``setSeqLimitLen``): a row is finished once
   ``step >= W + request_output_len``. The check follows the sampling, so a row whose
   ``request_output_len`` is below the batch's ``M`` samples one token more than it asked for
   (unless ``end_id`` or a stop word ended it earlier); the row with ``M`` tokens stops with the
   loop.

**Random numbers.** Every row gets its own cuRAND XORWOW state, ``curand_init(random_seed, 0,
0)`` (``BaseSamplingLayer::setup``; absent: seed 0), and draws one ``curand_uniform`` per step as
above (:mod:`loader.reference.curand`). With equal logits the reference samples what FT samples;
the sums are float32 like FT's, though not added in the GPU's order, so a draw that falls within
rounding of a boundary may pick the neighbouring id.

**What the backend sends** (:meth:`BatchGeneration.results`; FT ``GptJ::setOutputTensors``,
``kernels/decoding_kernels.cu``, ``gatherTree``; ``triton_backend/gptj/GptJTritonModelInstance.cc``,
``forward``): ``output_ids`` is ``W + M`` wide per row: the prompt (its own length), the
generated ids, then ``end_id``; ``sequence_length`` is ``W +`` generated ids (the extra token and
an ``end_id`` that stopped the row included); ``cum_log_probs`` sums the row's log
probabilities (the extra token's included); ``output_log_probs`` is copied out with
``transposeAxis01`` using the *first* row's ``request_output_len`` ``L0`` as the stride, so row
``j`` step ``i`` lands at flat position ``j * L0 + i`` of the ``[rows, M]`` tensor, and what FT
never wrote (positions past ``rows * L0``, steps of a finished top-k row) is whatever the buffer
held: NaN here. A client layer must not read per-token log probabilities from a batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from loader.errors import InvalidRequestError

from .curand import XorwowStates

#: FT's top-k kernels support k up to this value and clip larger ones.
TOP_K_MAX = 1024
#: ``batchApplyTemperaturePenalty`` divides by ``temperature + 1e-6``.
TEMPERATURE_EPS = np.float32(1e-6)
#: ``addBiasSoftMax`` divides by ``sum + 1e-6``.
SOFTMAX_EPS = np.float32(1e-6)
#: ``computeToppDecay``: ``runtime_top_p = max(runtime_top_p * 1, top_p_min)``, default 1e-6.
TOP_P_MIN = np.float32(1e-6)
_FLT_MAX = np.float32(np.finfo(np.float32).max)


class CausalLM(Protocol):
    """What generation needs from a model (the reference GPT-J implements it)."""

    def forward(
        self,
        input_ids: np.ndarray,
        *,
        position_ids: np.ndarray,
        attention_mask: np.ndarray,
        past: Any = None,
        last_only: bool = False,
    ) -> tuple[np.ndarray, Any]: ...


@dataclass(frozen=True)
class SamplingConfig:
    """Per-row sampling settings; the defaults are what FT uses when an input is absent."""

    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    random_seed: int = 0

    def effective(self) -> tuple[int, float]:
        """``(top_k, top_p)`` after FT's rules (``setup_topk_runtime_args``)."""
        k, p = int(self.top_k), float(np.float32(self.top_p))
        if k == 0 and p == 0.0:
            k = 1
        if k > 0 and p == 0.0:
            p = 1.0
        return min(k, TOP_K_MAX), min(max(p, 0.0), 1.0)


@dataclass(frozen=True)
class GenerationRequest:
    """One row to complete: prompt ids, how many new tokens, when to stop, how to sample."""

    input_ids: Sequence[int]
    output_len: int
    end_id: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    bad_words: tuple[tuple[int, ...], ...] = ()
    stop_words: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class GenerationStep:
    """One FT step, per row of the batch."""

    index: int  # 0-based: the step is W + index
    tokens: np.ndarray  # (B,) the id FT wrote into the row's buffer
    sampled: np.ndarray  # (B,) bool: the row's sequence_length grew
    finished: np.ndarray  # (B,) bool after the step
    last: bool  # the loop ends after this step (no streaming callback for it)


@dataclass(frozen=True)
class GenerationResult:
    """One row of the batch, as the backend sends it (see the module docstring)."""

    output_ids: np.ndarray  # (W + M,) int64
    sequence_length: int  # W + num_generated
    cum_log_prob: float
    output_log_probs: np.ndarray  # (M,) float32, FT's layout for this row (NaN: never written)
    input_length: int
    num_generated: int  # ids FT counts: the extra token and a stopping end_id included

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
        if end > ids.size:
            raise InvalidRequestError(
                f"word list offsets {offsets.tolist()} do not fit its {ids.size} ids",
                "Send [[ids...], [end offsets..., -1 padding]] as FasterTransformer expects.",
            )
        # An entry that ends where the previous one ended (or before) is empty, as in FT's
        # kernels (item_size = offsets[i] - offsets[i - 1] <= 0): a stop word that stops the
        # row at once, a bad word that bans nothing (see BatchGeneration._ban_bad_words,
        # _stop_words).
        words.append(tuple(int(t) for t in ids[start:end]) if end > start else ())
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
        if req.output_len < 0:
            raise InvalidRequestError(f"request {n}: request_output_len must not be negative")
        s = req.sampling
        if not (np.isfinite(s.temperature) and s.temperature > 0):
            raise InvalidRequestError(f"request {n}: temperature must be positive")
        if not (np.isfinite(s.repetition_penalty) and s.repetition_penalty > 0):
            raise InvalidRequestError(f"request {n}: repetition_penalty must be positive")
        if not np.isfinite(s.top_p):
            raise InvalidRequestError(f"request {n}: runtime_top_p must be a number")
        if s.top_k < 0:
            raise InvalidRequestError(f"request {n}: runtime_top_k must not be negative")


def apply_temperature(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """``logits * 1 / (t + 1e-6)`` for every row once any row's ``t`` is not 1 (float32)."""
    temperature = np.asarray(temperature, dtype=np.float32)
    if not (temperature != 1.0).any():
        return logits
    scale = np.float32(1.0) / (temperature + TEMPERATURE_EPS)
    return logits * scale[:, None]


def apply_repetition_penalty(
    logits: np.ndarray, seen: np.ndarray, penalty: np.ndarray
) -> np.ndarray:
    """FT's multiplicative penalty on every id in ``seen`` (B, V) bool, once per id."""
    penalty = np.asarray(penalty, dtype=np.float32)
    if not (penalty != 1.0).any():
        return logits
    p = penalty[:, None]
    penalised = np.where(logits < 0, logits * p, logits / p)
    return np.where(seen, penalised, logits)


def softmax(logits: np.ndarray) -> np.ndarray:
    """``addBiasSoftMax``: ``exp(x - max) / (sum + 1e-6)`` per row, float32."""
    logits = np.asarray(logits, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / (e.sum(axis=-1, keepdims=True) + SOFTMAX_EPS)


#: Candidates :func:`sample_tokens` sorts first; rows that need more get a full sort.
SORTED_PREFIX = 64


def _descending(probs: np.ndarray, prefix: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``prefix`` most probable ids of each row in descending order (ties: lower id first,
    as a stable sort of the whole row orders them) and their probabilities."""
    vocab = probs.shape[1]
    if prefix >= vocab:
        order = np.argsort(-probs, axis=1, kind="stable")
        return order, np.take_along_axis(probs, order, axis=1)
    part = np.argpartition(-probs, prefix - 1, axis=1)[:, :prefix]
    values = np.take_along_axis(probs, part, axis=1)
    inner = np.lexsort((part, -values), axis=1)
    return np.take_along_axis(part, inner, axis=1), np.take_along_axis(values, inner, axis=1)


def sample_tokens(
    probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, uniform: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pick one id per row as FT's top-k / top-p kernels do (see the module docstring).

    ``probs`` (B, V) float32; ``top_k`` (B,) after FT's rules, 0 for a top-p row; ``top_p`` (B,);
    ``uniform`` (B,) ``curand_uniform`` draws. Returns ``(ids, log_prob, output_log_prob,
    updated)``; ``updated`` is False where the top-p kernel found no id (it then writes the most
    probable id and changes nothing else). Only the :data:`SORTED_PREFIX` most probable ids of
    a row are sorted unless the walk needs more (the result is that of a full sort).
    """
    probs = np.asarray(probs, dtype=np.float32)
    batch, vocab = probs.shape
    top_k = np.asarray(top_k, dtype=np.int64)
    top_p = np.asarray(top_p, dtype=np.float32)
    uniform = np.asarray(uniform, dtype=np.float32)
    is_topk = top_k > 0
    limit = np.where(is_topk, np.minimum(top_k, vocab), vocab)
    order, sorted_p = _descending(probs, min(SORTED_PREFIX, vocab))
    running = np.cumsum(sorted_p, axis=1, dtype=np.float32)
    width = order.shape[1]
    if width < vocab:
        # A full sort where the prefix may not decide: a top-k row with k beyond it, a top-p
        # row whose threshold it does not reach, or a tie across its end.
        tied = (probs >= sorted_p[:, -1:]).sum(axis=1) > width
        short = np.where(is_topk, limit > width, running[:, -1] < uniform * top_p)
        full = tied | short
        if full.any():
            order = np.pad(order, ((0, 0), (0, vocab - width)))
            sorted_p = np.pad(sorted_p, ((0, 0), (0, vocab - width)))
            rows = np.flatnonzero(full)
            order[rows], sorted_p[rows] = _descending(probs[rows], vocab)
            running = np.cumsum(sorted_p, axis=1, dtype=np.float32)
            width = vocab
    rows = np.arange(batch)
    last = np.minimum(limit, width) - 1
    mass = np.where(is_topk, running[rows, last], np.float32(1.0)).astype(np.float32)
    threshold = np.where(is_topk, (uniform * top_p) * mass, uniform * top_p).astype(np.float32)
    reached = (running >= threshold[:, None]) & (np.arange(width)[None, :] < limit[:, None])
    found = reached.any(axis=1)
    pick = np.where(found, reached.argmax(axis=1), np.where(is_topk, last, 0))
    ids = order[rows, pick].astype(np.int64)
    with np.errstate(divide="ignore"):
        log_prob = np.log(sorted_p[rows, pick]).astype(np.float32)
        output_log_prob = np.where(is_topk, log_prob - np.log(mass), log_prob).astype(np.float32)
    return ids, log_prob, output_log_prob, found | is_topk


class BatchGeneration:
    """One batch as FT runs it; iterate to run it step by step, then read :meth:`results`."""

    def __init__(
        self,
        model: CausalLM,
        requests: Sequence[GenerationRequest],
        *,
        vocab_size: int,
        padded_input_length: int = 0,
    ) -> None:
        """``padded_input_length``: the width of the batch's ``input_ids`` as the backend hands
        it to FT (at least the longest prompt; a request may pad its rows further)."""
        validate_requests(requests, vocab_size)
        self.model = model
        self.requests = list(requests)
        self.vocab_size = vocab_size
        n = len(self.requests)
        self.input_lengths = np.array([len(r.input_ids) for r in self.requests], dtype=np.int64)
        self.width = max(int(padded_input_length), int(self.input_lengths.max()))
        self.output_lens = np.array([r.output_len for r in self.requests], dtype=np.int64)
        self.max_output_len = int(self.output_lens.max())
        self.end_ids = np.array([r.end_id for r in self.requests], dtype=np.int64)
        effective = [r.sampling.effective() for r in self.requests]
        self.top_k = np.array([k for k, _ in effective], dtype=np.int64)
        self.top_p = np.array([p for _, p in effective], dtype=np.float32)
        self.is_topk = self.top_k > 0
        self.temperature = np.array(
            [r.sampling.temperature for r in self.requests], dtype=np.float32
        )
        self.penalty = np.array(
            [r.sampling.repetition_penalty for r in self.requests], dtype=np.float32
        )
        self.states = XorwowStates([int(r.sampling.random_seed) for r in self.requests])
        # FT's output_ids buffer: prompt, 0s up to W, then one id per step.
        self.tokens = np.zeros((n, self.width + self.max_output_len), dtype=np.int64)
        self.seen = np.zeros((n, vocab_size), dtype=bool)
        for i, r in enumerate(self.requests):
            prompt = np.asarray(r.input_ids, dtype=np.int64)
            self.tokens[i, : prompt.size] = prompt
            self.seen[i, prompt] = True
        self.num_generated = np.zeros(n, dtype=np.int64)
        self.finished = np.zeros(n, dtype=bool)
        self.cum_log_probs = np.zeros(n, dtype=np.float32)
        # FT's output_log_probs_buf_ [M, B]; NaN where FT never writes (stale memory on a GPU).
        self.step_log_probs = np.full((self.max_output_len, n), np.nan, dtype=np.float32)
        self.steps = 0
        self._bad_rows = [i for i, r in enumerate(self.requests) if r.bad_words]
        self._stop_rows = [i for i, r in enumerate(self.requests) if r.stop_words]

    def _prompt_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Left-padded prompts, their attention mask and position ids (for the model only)."""
        n, longest = len(self.requests), int(self.input_lengths.max())
        ids = np.zeros((n, longest), dtype=np.int64)
        mask = np.zeros((n, longest), dtype=np.int64)
        for i, r in enumerate(self.requests):
            length = int(self.input_lengths[i])
            ids[i, longest - length :] = np.asarray(r.input_ids, dtype=np.int64)
            mask[i, longest - length :] = 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        return ids, mask, positions

    def __iter__(self) -> Iterator[GenerationStep]:
        if self.max_output_len == 0:
            # GptJ::forward's loop runs from W to W + M: no step; the results hold the prompts
            # (sequence_length W) and no log probability (output_log_probs [rows, 0]).
            return
        ids, mask, positions = self._prompt_batch()
        logits, past = self.model.forward(
            ids, position_ids=positions, attention_mask=mask, last_only=True
        )
        ones = np.ones((len(self.requests), 1), dtype=mask.dtype)
        for index in range(self.max_output_len):
            step = self.width + index
            tokens, sampled = self._decode(np.array(logits[:, -1, :], dtype=np.float32), step)
            self.steps = index + 1
            self._stop_words(step)
            self.finished |= index >= self.output_lens
            last = bool(self.finished.all()) or index == self.max_output_len - 1
            yield GenerationStep(index, tokens, sampled, self.finished.copy(), last)
            if last:
                return
            mask = np.concatenate([mask, ones], axis=1)
            # An id outside the vocabulary (a finished row's end_id) reads past the embedding
            # table on a GPU; the row is finished, so any id does here.
            feed = np.where(tokens < self.vocab_size, tokens, 0)
            logits, past = self.model.forward(
                feed[:, None],
                position_ids=(self.input_lengths + index)[:, None],
                attention_mask=mask,
                past=past,
            )

    def _decode(self, logits: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """One step of ``DynamicDecodeLayer::forward`` on the last position's logits."""
        index = step - self.width
        self._ban_bad_words(logits, step)
        logits = apply_temperature(logits, self.temperature)
        if step > 1:
            logits = apply_repetition_penalty(logits, self.seen, self.penalty)
        finished = self.finished
        skip = self.is_topk & finished  # the top-k kernel leaves finished rows alone
        masked = finished & ~self.is_topk  # addBiasSoftMax: all mass on end_id
        if masked.any():
            rows = np.flatnonzero(masked)
            logits[rows] = -_FLT_MAX
            ends = self.end_ids[rows]
            inside = ends < logits.shape[1]
            logits[rows[inside], ends[inside]] = _FLT_MAX
        uniform = np.ones(len(self.requests), dtype=np.float32)
        draws = ~skip
        if draws.any():
            uniform[draws] = self.states.uniform(draws)
        tokens, log_prob, output_log_prob, updated = sample_tokens(
            softmax(logits), self.top_k, self.top_p, uniform
        )
        tokens = np.where(skip, self.end_ids, tokens)
        updated &= ~skip
        sampled = updated & ~finished
        self.num_generated += sampled
        self.finished = np.where(updated, tokens == self.end_ids, finished)
        self.cum_log_probs[updated] += log_prob[updated]
        self.step_log_probs[index, updated] = output_log_prob[updated]
        self.top_p = np.where(self.is_topk, self.top_p, np.maximum(self.top_p, TOP_P_MIN))
        self.tokens[:, step] = tokens
        inside = tokens < self.vocab_size
        self.seen[np.flatnonzero(inside), tokens[inside]] = True
        return tokens, sampled

    def _ban_bad_words(self, logits: np.ndarray, step: int) -> None:
        for i in self._bad_rows:
            for word in self.requests[i].bad_words:
                size = len(word)
                if size == 0:  # ban_bad_words: should_ban = item_size == 1, or > 1 and matched
                    continue
                if size > 1 and not (
                    step >= size - 1
                    and self.tokens[i, step - size + 1 : step].tolist() == list(word[:-1])
                ):
                    continue
                banned = word[-1]
                if 0 < banned < logits.shape[1]:
                    logits[i, banned] = -np.inf

    def _stop_words(self, step: int) -> None:
        for i in self._stop_rows:
            for word in self.requests[i].stop_words:
                size = len(word)
                if step + 1 >= size and self.tokens[i, step - size + 1 : step + 1].tolist() == list(
                    word
                ):
                    self.finished[i] = True

    def output_log_probs(self) -> np.ndarray:
        """The ``[rows, M]`` tensor FT sends: ``transposeAxis01`` with the first row's
        ``request_output_len`` as the stride; NaN where FT wrote nothing."""
        rows, width = len(self.requests), self.max_output_len
        stride = int(self.output_lens[0])
        flat = np.full(rows * width, np.nan, dtype=np.float32)
        flat[: rows * stride] = self.step_log_probs[:stride].T.reshape(-1)
        return flat.reshape(rows, width)

    def results(self) -> list[GenerationResult]:
        """Each row as the backend sends it now (complete once iteration has ended)."""
        width, wide = self.width, self.width + self.max_output_len
        log_probs = self.output_log_probs()
        out = []
        for i, r in enumerate(self.requests):
            length, n_gen = int(self.input_lengths[i]), int(self.num_generated[i])
            end_id = int(self.end_ids[i])
            ids = np.full(wide, end_id, dtype=np.int64)
            ids[:length] = np.asarray(r.input_ids, dtype=np.int64)
            ids[length : length + n_gen] = self.tokens[i, width : width + n_gen]
            # gatherTree: from position W on, everything after an end_id becomes end_id.
            tail = ids[width : width + n_gen]
            stops = np.flatnonzero(tail == end_id)
            if stops.size:
                tail[stops[0] :] = end_id
            out.append(
                GenerationResult(
                    output_ids=ids,
                    sequence_length=width + n_gen,
                    cum_log_prob=float(self.cum_log_probs[i]),
                    output_log_probs=log_probs[i],
                    input_length=length,
                    num_generated=n_gen,
                )
            )
        return out


def generate(
    model: CausalLM,
    requests: Sequence[GenerationRequest],
    *,
    vocab_size: int,
    padded_input_length: int = 0,
) -> list[GenerationResult]:
    """Run one batch to its end (see the module docstring) and return what FT sends."""
    generation = BatchGeneration(
        model, requests, vocab_size=vocab_size, padded_input_length=padded_input_length
    )
    for _ in generation:
        pass
    return generation.results()
