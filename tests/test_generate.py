"""Generation with FasterTransformer semantics (loader.reference.generate).

The sampling functions are checked on hand-made distributions; generation as a whole runs the
CPU reference GPT-J on a tiny converted checkpoint and is compared with Hugging Face
``transformers`` (greedy ids and their log probabilities).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinymodels import load_hf_model, make_tiny_checkpoint

from loader.convert import convert_checkpoint
from loader.errors import InvalidRequestError
from loader.reference import GptJ, load_ft_checkpoint
from loader.reference.generate import (
    TOP_K_MAX,
    BatchGeneration,
    GenerationRequest,
    SamplingConfig,
    apply_repetition_penalty,
    apply_temperature,
    generate,
    sample_tokens,
    words_from_ft_list,
)

pytestmark = (
    pytest.mark.slow
)  # transformers generation as the reference (see markers in pyproject.toml)

VOCAB = 320
#: An end_id the model never generates (outside its vocabulary, as FT allows).
NEVER = VOCAB + 7
PROBS = np.array([[0.5, 0.3, 0.15, 0.05]])


def _pick(top_k: int, top_p: float, u: float) -> tuple[int, float, float]:
    tokens, log_prob, out_log_prob, updated = sample_tokens(
        PROBS, np.array([top_k]), np.array([top_p]), np.array([u])
    )
    assert updated[0]
    return int(tokens[0]), float(log_prob[0]), float(out_log_prob[0])


# --- FT's rules and the samplers -----------------------------------------------------------


@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"),
    [
        (0, 0.0, (1, 1.0)),  # FT: k=0 and p=0 is greedy (k=1)
        (1, 0.0, (1, 1.0)),
        (5, 0.0, (5, 1.0)),  # plain top-k: p becomes 1
        (0, 0.9, (0, 0.9)),  # nucleus sampling
        (4, 0.5, (4, 0.5)),
        (5000, 1.5, (TOP_K_MAX, 1.0)),  # clipped like FT's kernels
        (0, -0.5, (0, 0.0)),  # not greedy by the rule, then clipped: the most probable id
    ],
)
def test_sampling_config_applies_fts_rules(top_k, top_p, expected):
    k, p = SamplingConfig(top_k=top_k, top_p=top_p).effective()
    assert k == expected[0]
    assert p == np.float32(expected[1])  # FT's top_p is a float


@pytest.mark.parametrize("u", [1e-6, 0.3, 0.99, 1.0])
def test_top_k_1_is_greedy_whatever_the_draw(u):
    token, log_prob, out_log_prob = _pick(1, 1.0, u)
    assert token == 0
    assert log_prob == pytest.approx(np.log(0.5))
    assert out_log_prob == pytest.approx(0.0)  # conditioned on the top-1 set


def test_top_k_walks_the_top_k_mass_scaled_by_the_draw():
    # k=2: candidates 0.5 and 0.3 (mass 0.8); the threshold is u * 0.8.
    assert _pick(2, 1.0, 0.6)[0] == 0  # 0.48 <= 0.5
    token, log_prob, out_log_prob = _pick(2, 1.0, 0.7)  # 0.56 > 0.5
    assert token == 1
    assert log_prob == pytest.approx(np.log(0.3))
    assert out_log_prob == pytest.approx(np.log(0.3) - np.log(0.8))
    assert {_pick(2, 1.0, u)[0] for u in np.linspace(1e-6, 1.0, 101)} == {0, 1}


def test_top_p_restricts_sampling_to_the_nucleus():
    assert {_pick(0, 0.6, u)[0] for u in np.linspace(1e-6, 1.0, 101)} == {0, 1}
    assert _pick(0, 0.6, 0.5)[0] == 0  # threshold 0.3
    token, log_prob, out_log_prob = _pick(0, 0.6, 1.0)  # threshold 0.6
    assert token == 1
    assert log_prob == pytest.approx(np.log(0.3)) == out_log_prob


def test_top_p_of_zero_picks_the_most_probable_id():
    assert {_pick(0, 0.0, u)[0] for u in np.linspace(1e-6, 1.0, 11)} == {0}


def test_top_k_with_top_p_keeps_the_top_p_share_of_the_top_k_mass():
    # k=3 mass 0.95, p=0.5: the threshold never exceeds 0.475 < 0.5, so token 0 always.
    assert {_pick(3, 0.5, u)[0] for u in np.linspace(1e-6, 1.0, 101)} == {0}


def test_sampled_frequencies_follow_the_renormalised_top_k_distribution():
    rng = np.random.Generator(np.random.PCG64(7))
    n = 20000
    probs = np.repeat(PROBS, n, axis=0)
    uniform = 1.0 - rng.random(n)
    tokens, _, _, _ = sample_tokens(probs, np.full(n, 3), np.ones(n), uniform)
    freq = np.bincount(tokens, minlength=4) / n
    np.testing.assert_allclose(freq[:3], PROBS[0, :3] / 0.95, atol=0.015)
    assert freq[3] == 0


def test_temperature_scales_every_row_once_any_rows_temperature_is_not_1():
    """BaseSamplingLayer::forward runs batchApplyTemperaturePenalty unless ALL_OF the batch's
    temperatures is 1; the kernel multiplies every row by 1 / (t + 1e-6)."""
    logits = np.array([[1.0, -2.0, 0.5], [1.0, -2.0, 0.5]], dtype=np.float32)
    out = apply_temperature(logits, np.array([0.5, 1.0], dtype=np.float32))
    np.testing.assert_allclose(out[0], logits[0] / (0.5 + 1e-6), rtol=1e-6)
    expected = logits[1] * (np.float32(1) / np.float32(1 + 1e-6))
    np.testing.assert_array_equal(out[1], expected)
    assert not np.array_equal(out[1], logits[1])  # the t=1 row is scaled too
    same = apply_temperature(logits, np.array([1.0, 1.0], dtype=np.float32))
    np.testing.assert_array_equal(same, logits)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = np.array([[2.0, -2.0, 1.0, -1.0]], dtype=np.float32)
    seen = np.array([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, np.array([2.0], dtype=np.float32))
    np.testing.assert_allclose(out, [[1.0, -4.0, 1.0, -1.0]])
    same = apply_repetition_penalty(logits, seen, np.array([1.0], dtype=np.float32))
    np.testing.assert_array_equal(same, logits)


# --- generation with the reference model ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint_with_tokenizer, tmp_path_factory):
    """The shared tiny GPT-J, its Hugging Face model and the FT reference model for T=1, 2."""
    root = tmp_path_factory.mktemp("generate")
    source = tiny_checkpoint_with_tokenizer
    hf = load_hf_model(source)
    models = {
        tp: GptJ(
            load_ft_checkpoint(convert_checkpoint(source, root / f"ft{tp}", tp_size=tp).output_path)
        )
        for tp in (1, 2)
    }
    return hf, models


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11]]


def _hf_greedy(hf, prompt: list[int], n: int) -> tuple[np.ndarray, float]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, len(prompt) :]
    log_probs = [
        torch.log_softmax(score[0].float(), dim=-1)[tok].item()
        for score, tok in zip(out.scores, new, strict=True)
    ]
    return out.sequences[0].numpy(), float(sum(log_probs))


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_batch_equals_hugging_face_generate(tiny, tp):
    hf, models = tiny
    requests = [
        GenerationRequest(p, 10, end_id=NEVER, sampling=SamplingConfig(top_k=1)) for p in PROMPTS
    ]
    results = generate(models[tp], requests, vocab_size=VOCAB)
    width = max(len(p) for p in PROMPTS)
    for prompt, result in zip(PROMPTS, results, strict=True):
        expected, cum_log_prob = _hf_greedy(hf, prompt, 10)
        np.testing.assert_array_equal(result.output_ids[: len(prompt) + 10], expected)
        assert result.num_generated == 10
        assert result.sequence_length == width + 10  # FT counts the batch's widest prompt
        assert result.cum_log_prob == pytest.approx(cum_log_prob, abs=1e-3)
        np.testing.assert_allclose(result.output_log_probs, 0.0, atol=1e-6)  # log P(top-1 | top-1)


def test_greedy_codegen_after_conversion_equals_hugging_face_generate(tmp_path):
    """CodeGen (the demo's architecture) goes through the fused-QKV permutation first."""
    source = make_tiny_checkpoint(tmp_path / "codegen", arch="codegen", vocab_size=VOCAB)
    hf = load_hf_model(source)
    model = GptJ(load_ft_checkpoint(convert_checkpoint(source, tmp_path, tp_size=2).output_path))
    requests = [GenerationRequest(p, 8, end_id=NEVER) for p in PROMPTS]
    for prompt, result in zip(PROMPTS, generate(model, requests, vocab_size=VOCAB), strict=True):
        expected, _ = _hf_greedy(hf, prompt, 8)
        np.testing.assert_array_equal(result.output_ids[: len(prompt) + 8], expected)


def test_a_request_gives_the_same_tokens_alone_or_in_a_batch(tiny):
    """Token ids never depend on the batch; a shorter row only gets one token more (FT's length
    check follows the sampling) and the numbers of its steps are its own."""
    _, models = tiny
    samplers = [
        SamplingConfig(top_k=1),
        SamplingConfig(top_k=8, temperature=1.5, random_seed=3),
        SamplingConfig(top_p=0.9, random_seed=11, repetition_penalty=1.3),
    ]
    # Different lengths, so rows finish at different steps; one end_id lies outside the vocabulary
    # (the users' request sends 50256 to models of any size).
    requests = [
        GenerationRequest(p, 6 + 3 * i, end_id=(NEVER, 50256, 7)[i], sampling=s)
        for i, (p, s) in enumerate(zip(PROMPTS, samplers, strict=True))
    ]
    batched = BatchGeneration(models[2], requests, vocab_size=VOCAB)
    for _ in batched:
        pass
    for row, (request, together) in enumerate(zip(requests, batched.results(), strict=True)):
        alone_run = BatchGeneration(models[2], [request], vocab_size=VOCAB)
        for _ in alone_run:
            pass
        alone = alone_run.results()[0]
        n = alone.num_generated
        assert n <= request.output_len
        assert together.num_generated in (n, n + 1)
        np.testing.assert_array_equal(alone.generated_ids, together.generated_ids[:n])
        # The per-step values FT keeps (before its output layout): equal within the temperature
        # rule's 1e-6 (the other rows' temperatures scale a t=1 row by 1 / (1 + 1e-6)).
        np.testing.assert_allclose(
            alone_run.step_log_probs[:n, 0], batched.step_log_probs[:n, row], atol=1e-4
        )


def test_a_ragged_batch_has_fts_layout(tiny):
    """FT pads the batch to its widest prompt W: every row is W + max(output_len) wide, its
    sequence_length counts W, and end_id fills the rest (gatherTree, DecodingInitialize); the
    shorter request samples one token more than it asked for (length_criterion)."""
    _, models = tiny
    short, long_ = PROMPTS[0][:3], PROMPTS[1]
    requests = [
        GenerationRequest(short, 4, end_id=NEVER),
        GenerationRequest(long_, 6, end_id=NEVER),
    ]
    width = len(long_)
    results = generate(models[1], requests, vocab_size=VOCAB, padded_input_length=width + 2)
    for request, result in zip(requests, results, strict=True):
        expected = request.output_len + (request.output_len < 6)
        assert result.output_ids.size == width + 2 + 6
        assert result.output_log_probs.size == 6
        assert result.num_generated == expected
        assert result.sequence_length == width + 2 + expected
        assert result.output_ids[: len(request.input_ids)].tolist() == list(request.input_ids)
        rest = result.output_ids[len(request.input_ids) + result.num_generated :]
        assert (rest == NEVER).all()


def test_temperature_shapes_sampling(tiny):
    """Through generation: a low temperature samples (almost) the greedy tokens whatever the
    seed, temperature 1 does not (a lost temperature makes both alike)."""
    _, models = tiny
    greedy = generate(
        models[1], [GenerationRequest(PROMPTS[0], 8, end_id=NEVER)], vocab_size=VOCAB
    )[0].generated_ids.tolist()

    def sampled(temperature: float) -> list[list[int]]:
        requests = [
            GenerationRequest(
                PROMPTS[0],
                8,
                end_id=NEVER,
                sampling=SamplingConfig(top_p=1.0, temperature=temperature, random_seed=seed),
            )
            for seed in range(12)
        ]
        return [r.generated_ids.tolist() for r in generate(models[1], requests, vocab_size=VOCAB)]

    cold, warm = sampled(0.01), sampled(1.0)
    assert sum(seq == greedy for seq in cold) >= 11
    assert sum(seq == greedy for seq in warm) <= 2
    assert len({tuple(seq) for seq in warm}) >= 6


def test_random_seed_makes_sampling_reproducible_per_request(tiny):
    _, models = tiny

    def sample(seed: int) -> np.ndarray:
        sampling = SamplingConfig(top_p=1.0, temperature=2.0, random_seed=seed)
        request = GenerationRequest(PROMPTS[0], 16, end_id=NEVER, sampling=sampling)
        return generate(models[1], [request], vocab_size=VOCAB)[0].generated_ids

    np.testing.assert_array_equal(sample(1594506369), sample(1594506369))
    assert not np.array_equal(sample(1), sample(2))


def test_generation_stops_at_end_id_and_pads_with_it(tiny):
    _, models = tiny
    greedy = generate(
        models[1], [GenerationRequest(PROMPTS[1], 8, end_id=NEVER)], vocab_size=VOCAB
    )[0]
    end_id = int(greedy.generated_ids[3])
    assert end_id not in greedy.generated_ids[:3].tolist()
    stopped = generate(
        models[1], [GenerationRequest(PROMPTS[1], 8, end_id=end_id)], vocab_size=VOCAB
    )[0]
    assert stopped.sequence_length == len(PROMPTS[1]) + 4  # the end token counts, as in FT
    np.testing.assert_array_equal(stopped.generated_ids, greedy.generated_ids[:4])
    assert stopped.output_ids.size == len(PROMPTS[1]) + 8
    assert (stopped.output_ids[stopped.sequence_length :] == end_id).all()


def test_steps_are_yielded_one_token_at_a_time(tiny):
    _, models = tiny
    requests = [
        GenerationRequest(p, n, end_id=NEVER) for p, n in zip(PROMPTS, (2, 5, 3), strict=True)
    ]
    generation = BatchGeneration(models[1], requests, vocab_size=VOCAB)
    steps = list(generation)
    assert [s.index for s in steps] == list(range(5))
    assert [s.last for s in steps] == [False] * 4 + [True]
    # Rows asking 2 and 3 of 5 sample a third and a fourth token (length_criterion).
    assert [s.sampled.tolist() for s in steps][2:] == [
        [True, True, True],
        [False, True, True],
        [False, True, False],
    ]
    final = generation.results()
    for n, result in enumerate(final):
        produced = [int(s.tokens[n]) for s in steps if s.sampled[n]]
        assert produced == result.generated_ids.tolist()


def test_ft_word_lists_are_read_as_words():
    words_list = np.array([[5, 6, 7, 0, 0], [2, 3, -1, -1, -1]], dtype=np.int32)
    assert words_from_ft_list(words_list) == ((5, 6), (7,))
    assert words_from_ft_list(np.array([[0], [-1]])) == ()
    # An entry ending where the previous one ended (or before) is empty, as FT's kernels read it
    # (item_size = offsets[i] - offsets[i - 1]); FT's sample_request_single.json sends one.
    assert words_from_ft_list(np.array([[5, 6, 7], [0, 2, 2]])) == ((), (5, 6), ())
    assert words_from_ft_list(np.array([[5, 6, 7], [2, 1, 3]])) == ((5, 6), (), (6, 7))
    with pytest.raises(InvalidRequestError, match="offsets"):
        words_from_ft_list(np.array([[5, 6], [3, -1]]))


def test_stop_words_end_generation_and_stay_in_the_output(tiny):
    _, models = tiny
    greedy = generate(
        models[1], [GenerationRequest(PROMPTS[0], 10, end_id=NEVER)], vocab_size=VOCAB
    )[0].generated_ids.tolist()
    stop = tuple(greedy[3:5])
    first = next(i for i in range(len(greedy) - 1) if tuple(greedy[i : i + 2]) == stop)
    request = GenerationRequest(PROMPTS[0], 10, end_id=NEVER, stop_words=((1000,), stop))
    result = generate(models[1], [request], vocab_size=VOCAB)[0]
    assert result.generated_ids.tolist() == greedy[: first + 2]


def test_bad_words_are_never_generated_after_their_prefix(tiny):
    _, models = tiny
    base = GenerationRequest(PROMPTS[0], 10, end_id=NEVER)
    greedy = generate(models[1], [base], vocab_size=VOCAB)[0].generated_ids.tolist()
    banned = GenerationRequest(PROMPTS[0], 10, end_id=NEVER, bad_words=((greedy[0],),))
    result = generate(models[1], [banned], vocab_size=VOCAB)[0].generated_ids.tolist()
    assert greedy[0] not in result
    # A two-token entry only bans its last token right after its first one.
    pair = (PROMPTS[0][-1], greedy[0])
    after_prefix = GenerationRequest(PROMPTS[0], 10, end_id=NEVER, bad_words=(pair,))
    first = generate(models[1], [after_prefix], vocab_size=VOCAB)[0].generated_ids.tolist()
    assert first[0] != greedy[0]
    unrelated = GenerationRequest(PROMPTS[0], 10, end_id=NEVER, bad_words=((1, greedy[0]),))
    assert generate(models[1], [unrelated], vocab_size=VOCAB)[0].generated_ids.tolist() == greedy


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GenerationRequest([], 4, end_id=0), "no tokens"),
        (GenerationRequest([VOCAB], 4, end_id=0), "outside the model's vocabulary"),
        (GenerationRequest([1, 2], -1, end_id=0), "request_output_len must not be negative"),
        (
            GenerationRequest([1], 2, end_id=0, sampling=SamplingConfig(temperature=0.0)),
            "temperature",
        ),
        (
            GenerationRequest([1], 2, end_id=0, sampling=SamplingConfig(temperature=np.nan)),
            "temperature",
        ),
        (
            GenerationRequest([1], 2, end_id=0, sampling=SamplingConfig(repetition_penalty=np.inf)),
            "repetition_penalty",
        ),
        (
            GenerationRequest([1], 2, end_id=0, sampling=SamplingConfig(top_p=np.nan)),
            "runtime_top_p",
        ),
    ],
)
def test_invalid_requests_are_typed_errors(tiny, request_, message):
    _, models = tiny
    with pytest.raises(InvalidRequestError, match=message):
        generate(models[1], [request_], vocab_size=VOCAB)
