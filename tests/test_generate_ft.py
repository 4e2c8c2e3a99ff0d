"""FasterTransformer's batch semantics in loader.reference.generate, rule by rule.

A table model (the logits depend only on the last token fed) keeps every number known, so each
test states what FT's kernel does (FT = FasterTransformer ``src/fastertransformer/`` at df4a753,
file and function in the test's docstring) and checks the reference does the same. Seeded
sampling is checked against a plain transcription of the kernels' draw-and-walk loops fed by the
published XORWOW algorithm (``test_curand.PlainXorwow``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_curand import PlainXorwow, plain_uniform

from loader.reference.generate import (
    BatchGeneration,
    GenerationRequest,
    SamplingConfig,
    generate,
    softmax,
)
from tests.tiers import examples

V = 64
#: An end_id the table model never produces (outside its vocabulary).
NEVER = V + 3


class TableLM:
    """Logits of the next token = ``TABLE[last token]``: batch-independent and known."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table.astype(np.float32)

    def forward(self, input_ids, *, position_ids, attention_mask, past=None, last_only=False):
        ids = np.asarray(input_ids)
        if last_only:
            ids = ids[:, -1:]
        return self.table[ids], None


def _table(seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return np.random.Generator(np.random.PCG64(seed)).normal(size=(V, V)) * scale


def _run(model, requests, **kwargs) -> BatchGeneration:
    generation = BatchGeneration(model, requests, vocab_size=V, **kwargs)
    for _ in generation:
        pass
    return generation


# --- sampling and random numbers -----------------------------------------------------------


def _plain_topk(probs: np.ndarray, k: int, p: float, u: float) -> int:
    """sampling_topk_kernels.cu, topk_stage2_sampling: subtract the k largest from u*p*sum."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))[:k]
    values = [np.float32(probs[i]) for i in order]
    total = np.float32(0)
    for v in values:
        total = np.float32(total + v)
    rand = np.float32(np.float32(np.float32(u) * np.float32(p)) * total)
    for i, v in enumerate(values):
        rand = np.float32(rand - v)
        if rand <= 0 or i == k - 1:
            return order[i]
    raise AssertionError("unreachable")


def _plain_topp(probs: np.ndarray, p: float, u: float) -> int:
    """sampling_topp_kernels.cu, topp_sampling: the first id whose running sum reaches u*p."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    rand = np.float32(np.float32(u) * np.float32(p))
    running = np.float32(0)
    for i in order:
        running = np.float32(running + np.float32(probs[i]))
        if rand <= running:
            return i
    return order[0]


def test_seeded_rows_sample_what_fts_kernels_sample_from_curand():
    """BaseSamplingLayer::setup: curand_init(seed, 0, 0) per row; one curand_uniform per row and
    step (topk_stage2_sampling, topp_sampling); greedy rows draw too (k = 1)."""
    model = TableLM(_table(1))
    rows = [
        (SamplingConfig(top_k=5, random_seed=11), (5, 1.0)),
        (SamplingConfig(top_p=0.8, random_seed=2**40 + 7), (0, 0.8)),
        (SamplingConfig(top_k=0, top_p=0.0, random_seed=3), (1, 1.0)),
        (SamplingConfig(top_k=8, top_p=0.5, random_seed=1594506369), (8, 0.5)),
        (SamplingConfig(top_p=1.0), (0, 1.0)),  # seed 0, FT's default
    ]
    prompts = [[3, 4], [5], [6, 7, 8], [9], [10, 11]]
    requests = [
        GenerationRequest(prompt, 12, end_id=NEVER, sampling=s)
        for prompt, (s, _) in zip(prompts, rows, strict=True)
    ]
    results = generate(model, requests, vocab_size=V)
    for request, (sampling, (k, p)), result in zip(requests, rows, results, strict=True):
        rng = PlainXorwow(sampling.random_seed)
        last, expected = request.input_ids[-1], []
        for _ in range(12):
            probs = softmax(model.table[last][None, :])[0]
            u = plain_uniform(rng.next())
            last = _plain_topk(probs, k, p, u) if k else _plain_topp(probs, p, u)
            expected.append(last)
        assert result.generated_ids.tolist() == expected


def test_a_finished_top_k_row_stops_drawing_and_a_top_p_row_draws_on():
    """topk_stage2_sampling returns for a finished row before curand_uniform; topp_sampling has
    no such check."""
    table = _table(2)
    first = int(np.argmax(table[1]))
    requests = [
        GenerationRequest([1], 5, end_id=first, sampling=SamplingConfig(top_k=1, random_seed=4)),
        GenerationRequest([1], 5, end_id=NEVER, sampling=SamplingConfig(top_p=1.0, random_seed=4)),
        GenerationRequest([1], 5, end_id=first, sampling=SamplingConfig(top_p=0.01, random_seed=4)),
    ]
    generation = _run(TableLM(table), requests)
    assert generation.num_generated.tolist() == [1, 5, 1]
    drawn = [PlainXorwow(4) for _ in range(3)]
    counts = [1, 5, 5]  # the finished top-p row drew at every step of the batch
    expected = [[rng.next() for _ in range(n)][-1] for rng, n in zip(drawn, counts, strict=True)]
    assert (generation.states.v[:, 4] + generation.states.d).tolist() == expected


# --- item: one token more for the shorter rows ---------------------------------------------


def test_a_shorter_row_samples_one_token_more_than_it_asked_for():
    """GptJ::forward, setSeqLimitLen: a row's limit is W + request_output_len;
    stop_criteria_kernels.cu, length_criterion: finished |= step >= limit, checked after the
    sampling, so a row below the batch's largest request samples at step W + len too."""
    model = TableLM(_table(3))
    short = GenerationRequest([2, 3], 3, end_id=NEVER, sampling=SamplingConfig(top_k=4))
    long_ = GenerationRequest([4, 5], 7, end_id=NEVER)
    alone = generate(model, [short], vocab_size=V)[0]
    batched = generate(model, [short, long_], vocab_size=V)
    assert alone.num_generated == 3 and alone.sequence_length == 2 + 3
    assert batched[0].num_generated == 4 and batched[0].sequence_length == 2 + 4
    assert batched[0].generated_ids[:3].tolist() == alone.generated_ids.tolist()
    assert batched[1].num_generated == 7  # the longest row stops with the loop
    # The extra token's log probability is in the row's cum_log_probs.
    extra = np.log(softmax(model.table[batched[0].generated_ids[2]][None, :])[0]).astype(np.float32)
    assert batched[0].cum_log_prob == pytest.approx(
        alone.cum_log_prob + float(extra[batched[0].generated_ids[3]]), abs=1e-5
    )


# --- item: output_log_probs in mixed batches -----------------------------------------------


def test_output_log_probs_take_the_first_rows_length_as_stride():
    """GptJ::setOutputTensors: invokeTransposeAxis01(out, buf, output_seq_len[0] - W, B, 1):
    row j step i lands at j * L0 + i of the [B, M] tensor; the rest is never written."""
    model = TableLM(_table(4))
    first = GenerationRequest([1, 2], 2, end_id=NEVER)
    second = GenerationRequest([3], 4, end_id=NEVER, sampling=SamplingConfig(top_p=0.9))
    generation = _run(model, [first, second])
    steps = generation.step_log_probs  # [M, B]: what each step wrote
    rows = [r.output_log_probs for r in generation.results()]
    assert rows[0].tolist() == [steps[0, 0], steps[1, 0], steps[0, 1], steps[1, 1]]
    assert np.isnan(rows[1]).all()  # positions 4..7: nothing was copied there
    # With the longest request first the layout is right.
    aligned = _run(model, [second, first])
    rows = [r.output_log_probs for r in aligned.results()]
    np.testing.assert_array_equal(rows[0], aligned.step_log_probs[:, 0])
    np.testing.assert_array_equal(rows[1][:3], aligned.step_log_probs[:3, 1])  # 2 + the extra


def test_steps_after_a_row_finished_hold_nothing_for_top_k_and_zero_for_top_p():
    """topk_stage2_sampling writes no log probability for a finished row (the GPU buffer keeps
    stale memory, NaN here); topp_sampling writes log of end_id's probability, 1/(1+1e-6)."""
    table = _table(5)
    stop = int(np.argmax(table[1]))
    greedy = GenerationRequest([1], 4, end_id=stop)
    nucleus = GenerationRequest([1], 4, end_id=stop, sampling=SamplingConfig(top_p=0.01))
    longer = GenerationRequest([1], 4, end_id=NEVER)
    generation = _run(TableLM(table), [longer, greedy, nucleus])
    steps = generation.step_log_probs
    assert np.isnan(steps[1:, 1]).all()
    np.testing.assert_allclose(steps[1:, 2], np.log(np.float32(1) / np.float32(1 + 1e-6)))


# --- item: edge cases ------------------------------------------------------------------------


def test_repetition_penalty_follows_the_batchs_step_not_the_rows_context():
    """BaseSamplingLayer::forward: the penalty applies when step > 1, step being the batch's
    position (W at the first step): a one-token prompt is penalised at its first step when
    batched with a longer prompt, not when alone."""
    table = _table(6)
    table[7, 7] = 50.0  # token 7 follows itself
    row = GenerationRequest([7], 1, end_id=NEVER, sampling=SamplingConfig(repetition_penalty=100))
    alone = generate(TableLM(table), [row], vocab_size=V)[0]
    assert alone.generated_ids.tolist() == [7]  # W = 1: step 1, no penalty
    batched = generate(
        TableLM(table), [row, GenerationRequest([1, 2, 3], 1, end_id=NEVER)], vocab_size=V
    )
    assert batched[0].generated_ids[0] != 7  # W = 3: penalised


def test_temperature_scales_every_row_once_any_row_asks():
    """BaseSamplingLayer::forward: batchApplyTemperaturePenalty runs for the whole batch unless
    ALL_OF its temperatures is 1, dividing by t + 1e-6 (t = 1 included)."""
    table = _table(7)
    greedy = GenerationRequest([1], 1, end_id=NEVER)
    warm = GenerationRequest(
        [2], 1, end_id=NEVER, sampling=SamplingConfig(top_k=3, temperature=0.5)
    )
    alone = generate(TableLM(table), [greedy], vocab_size=V)[0]
    batched = generate(TableLM(table), [greedy, warm], vocab_size=V)[0]
    token = int(alone.generated_ids[0])
    plain = np.log(softmax(table[1][None, :])[0][token])
    scaled = np.log(softmax(table[1][None, :] * (np.float32(1) / np.float32(1 + 1e-6)))[0][token])
    assert alone.cum_log_prob == pytest.approx(float(plain), rel=1e-6)
    assert batched.cum_log_prob == pytest.approx(float(scaled), rel=1e-6)
    assert batched.cum_log_prob != alone.cum_log_prob


def test_token_id_0_is_never_banned():
    """ban_bad_words.cu, ban_bad_words: ``if (0 < banned_token && ...)``."""
    table = _table(8)
    table[1, 0] = table[1, 5] = 40.0
    table[1, 0] += 1.0  # 0 first, 5 second
    ban_zero = GenerationRequest([1], 1, end_id=NEVER, bad_words=((0,),))
    ban_five = GenerationRequest([1], 1, end_id=NEVER, bad_words=((0,), (5,)))
    assert generate(TableLM(table), [ban_zero], vocab_size=V)[0].generated_ids.tolist() == [0]
    table[1, 0] -= 2.0  # now 5 first
    assert generate(TableLM(table), [ban_five], vocab_size=V)[0].generated_ids.tolist() != [5]


def test_word_checks_of_a_short_row_look_at_the_padding():
    """ban_bad_words and stop_words_criterion index the batch's id buffer by step: for a short
    row in a ragged batch the positions before W are its padding (0s), not its prompt."""
    table = _table(9)
    follow = int(np.argmax(table[4]))
    wide = GenerationRequest([1, 2, 3], 3, end_id=NEVER)
    bad = GenerationRequest([4], 3, end_id=NEVER, bad_words=((0, follow),))
    assert generate(TableLM(table), [bad], vocab_size=V)[0].generated_ids[0] == follow
    assert generate(TableLM(table), [bad, wide], vocab_size=V)[0].generated_ids[0] != follow
    stop = GenerationRequest([4], 3, end_id=NEVER, stop_words=((0, follow),))
    assert generate(TableLM(table), [stop], vocab_size=V)[0].num_generated == 3
    assert generate(TableLM(table), [stop, wide], vocab_size=V)[0].num_generated == 1


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data())
def test_sampling_from_the_sorted_prefix_equals_sampling_from_a_full_sort(data):
    """sample_tokens sorts only the most probable ids unless the walk needs more; for any rows
    (flat and peaked, ties, top-k beyond the prefix, top-p reaching past it) the picks are those
    of a full sort."""
    from loader.reference import generate as gen

    batch = data.draw(st.integers(1, 8))
    vocab = data.draw(st.sampled_from([8, 64, 65, 300, 512]))
    logits = data.draw(
        hnp.arrays(np.float32, (batch, vocab), elements=st.floats(-4, 4, width=32))
    ) * data.draw(st.sampled_from([0.1, 1.0, 8.0]))
    if data.draw(st.booleans()):  # ties, also across the prefix's end
        logits = np.round(logits, 1)
    probs = softmax(logits.astype(np.float32))
    effective = [
        SamplingConfig(top_k=int(k), top_p=float(p)).effective()
        for k, p in data.draw(
            st.lists(
                st.tuples(
                    st.sampled_from([0, 1, 3, 40, 63, 64, 65, 200, 1024]),
                    st.sampled_from([0.0, 0.3, 0.9, 0.999, 1.0]),
                ),
                min_size=batch,
                max_size=batch,
            )
        )
    ]
    k = np.array([e[0] for e in effective])
    p = np.array([e[1] for e in effective], dtype=np.float32)
    u = data.draw(hnp.arrays(np.float32, batch, elements=st.floats(2.0**-33, 1.0, width=32)))
    prefix = gen.sample_tokens(probs, k, p, u)
    saved = gen.SORTED_PREFIX
    gen.SORTED_PREFIX = vocab
    try:
        full = gen.sample_tokens(probs, k, p, u)
    finally:
        gen.SORTED_PREFIX = saved
    for a, b in zip(prefix, full, strict=True):
        np.testing.assert_array_equal(a, b)


# --- the edges: nothing to generate, empty words --------------------------------------------


def test_request_output_len_0_runs_no_step_and_answers_the_prompt():
    """GptJ.cc, GptJ::forward: the loop runs ``for (step = max_input_length; step <
    max_output_seq_len; ...)`` with ``max_output_seq_len`` = W + 0 (GptJTritonModelInstance::
    convert_inputs adds the width): no step; setOutputTensors gathers the prompt, the rest of
    the row is end_id, sequence_length W (invokeDecodingInitialize's W - 1, plus the final step's
    1 in gatherTree)."""
    rows = [GenerationRequest([1, 2, 3], 0, end_id=9), GenerationRequest([4], 0, end_id=9)]
    generation = BatchGeneration(TableLM(_table()), rows, vocab_size=V)
    assert list(generation) == []
    first, second = generation.results()
    assert first.output_ids.tolist() == [1, 2, 3]
    assert second.output_ids.tolist() == [4, 9, 9]
    assert first.sequence_length == second.sequence_length == 3
    assert first.num_generated == second.num_generated == 0
    assert first.cum_log_prob == second.cum_log_prob == 0.0
    assert first.output_log_probs.shape == (0,)


def test_a_row_asking_0_tokens_in_a_batch_samples_one_as_any_shorter_row_does():
    """length_criterion follows the sampling: a row is finished once step >= W + its length,
    checked after the step's token, so with M > 0 a row asking 0 samples one token."""
    rows = [GenerationRequest([1], 3, end_id=NEVER), GenerationRequest([2], 0, end_id=NEVER)]
    longer, zero = generate(TableLM(_table(4)), rows, vocab_size=V)
    assert longer.num_generated == 3
    assert zero.num_generated == 1


def test_an_empty_stop_word_stops_the_row_after_its_first_token():
    """stop_criteria_kernels.cu, stop_words_criterion: item_size 0 -> ``step + 1 >= item_size``
    and the compare loop runs no iteration: should_stop stays true after the first step."""
    table = _table(5)
    alone = GenerationRequest([1], 5, end_id=NEVER)
    stopped = GenerationRequest([1], 5, end_id=NEVER, stop_words=((),))
    full, cut = generate(TableLM(table), [alone, stopped], vocab_size=V)
    assert full.num_generated == 5
    assert cut.num_generated == 1
    assert cut.generated_ids.tolist() == full.generated_ids.tolist()[:1]


def test_an_empty_bad_word_bans_nothing():
    """ban_bad_words.cu, ban_bad_words: ``should_ban = item_size == 1``, and the multi-token
    branch needs item_size > 1: an empty entry is skipped; the entries after it still count."""
    table = _table(6)
    plain = generate(TableLM(table), [GenerationRequest([1], 4, end_id=NEVER)], vocab_size=V)[0]
    empty = GenerationRequest([1], 4, end_id=NEVER, bad_words=((),))
    assert generate(TableLM(table), [empty], vocab_size=V)[0].generated_ids.tolist() == (
        plain.generated_ids.tolist()
    )
    first = int(plain.generated_ids[0])
    then_ban = GenerationRequest([1], 4, end_id=NEVER, bad_words=((), (first,)))
    banned = generate(TableLM(table), [then_ban], vocab_size=V)[0]
    assert first not in banned.generated_ids.tolist()
