"""What FasterTransformer's GPT-J would fail on or compute garbage with is refused before
converting (``loader.formats.fastertransformer.check_loadable``, from ``ft_config`` and from
``FTConfig.from_ini``): each rule of ``docs/fastertransformer.md``, "What the loader refuses
before converting", with a property test against an independent model of the kernel where a
range applies."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.convert import convert_checkpoint
from loader.convert.codegen import CodeGenArchitecture
from loader.convert.gptj import GptJArchitecture
from loader.errors import CheckpointError, LoaderError, ParallelismError, PlacementError
from loader.formats.fastertransformer import (
    INT32_MAX,
    LAYERNORM_EPS,
    LAYERNORM_EPS_MOST,
    SUPPORTED_HEAD_SIZES,
    FTConfig,
    UnloadableConfigError,
    UnloadableParallelismError,
    check_loadable,
)
from loader.parallel import Parallelism
from loader.plan import MODEL_PRESETS, check_index_range, check_memory, estimate_memory
from loader.reference import GptJ, load_ft_checkpoint
from tests.tiers import examples

GPTJ_6B = {
    "model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_layer": 28, "rotary_dim": 64,
    "vocab_size": 50400, "n_inner": None, "n_positions": 2048, "bos_token_id": 50256,
    "eos_token_id": 50256, "activation_function": "gelu_new",
}  # fmt: skip


def codegen(n_embd: int, n_head: int, n_layer: int, rotary_dim: int) -> dict:
    return {
        "model_type": "codegen", "n_embd": n_embd, "n_head": n_head, "n_layer": n_layer,
        "rotary_dim": rotary_dim, "vocab_size": 51200, "n_inner": None, "n_positions": 2048,
        "bos_token_id": 1, "eos_token_id": 50256, "activation_function": "gelu_new",
    }  # fmt: skip


#: Every published GPT-J and CodeGen (mono, multi and nl share their shapes) configuration.
#: CodeGen's rotary_dim is 32 for 350M and 64 for the larger ones; both are tried for each.
PUBLISHED = {
    "gpt-j-6b": GPTJ_6B,
    **{
        f"codegen-{size}-rotary{rotary}": codegen(n_embd, n_head, n_layer, rotary)
        for size, (n_embd, n_head, n_layer) in {
            "350m": (1024, 16, 20),
            "2b": (2560, 32, 32),
            "6b": (4096, 16, 33),
            "16b": (6144, 24, 34),
        }.items()
        for rotary in (32, 64)
    },
}


def ft_config(hf: dict, tp: int = 1):
    arch = CodeGenArchitecture() if hf["model_type"] == "codegen" else GptJArchitecture()
    return arch.ft_config(hf, parallelism=Parallelism(tp=tp), model_name="m")


@pytest.mark.parametrize("positions", [0, None, "absent"])
def test_a_model_of_no_positions_is_refused_and_an_absent_count_is_gptjs_own(positions):
    """``n_positions: 0`` was taken as 2048 (``or``), as if absent: refused now; absent or null
    is GPT-J's own default, 2048."""
    hf = dict(GPTJ_6B)
    if positions == "absent":
        del hf["n_positions"]
    else:
        hf["n_positions"] = positions
    if positions == 0:
        with pytest.raises(CheckpointError, match="n_positions is 0"):
            ft_config(hf)
    else:
        assert ft_config(hf).max_pos_seq_len == 2048


@pytest.mark.parametrize("inner", [0, None, "absent", 16384])
def test_an_mlp_of_no_width_is_refused_and_an_absent_one_is_four_times_the_hidden_size(inner):
    """``n_inner: 0`` was taken as 4 x n_embd (``or``), as if absent, and the 4 x n_embd weights
    converted (Hugging Face builds a layer 0 wide and refuses them): refused now."""
    hf = dict(GPTJ_6B)
    if inner == "absent":
        del hf["n_inner"]
    else:
        hf["n_inner"] = inner
    if inner == 0:
        with pytest.raises(CheckpointError, match="n_inner is 0"):
            ft_config(hf)
    else:
        assert ft_config(hf).inter_size == 16384


# -- LayerNorm epsilon ------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0, 1e-12, 1e-6, 1e-5, LAYERNORM_EPS_MOST, None, "absent"])
def test_a_layer_norm_epsilon_fastertransformers_fixed_one_stands_in_for_passes(epsilon):
    hf = {**GPTJ_6B, "layer_norm_epsilon": epsilon}
    if epsilon == "absent":
        del hf["layer_norm_epsilon"]
    ft_config(hf)


@pytest.mark.parametrize("epsilon", [LAYERNORM_EPS_MOST * 1.01, 1e-2, 1.0, math.inf])
def test_a_layer_norm_epsilon_fastertransformer_would_replace_by_its_own_is_refused(epsilon):
    """FasterTransformer's GPT-J normalises with 1e-6 whatever the checkpoint's epsilon; one it
    does not stand in for was published and served as another model."""
    with pytest.raises(UnloadableConfigError, match="layer_norm_epsilon") as caught:
        ft_config({**GPTJ_6B, "layer_norm_epsilon": epsilon})
    assert caught.value.remediation


@pytest.mark.parametrize("epsilon", ["1e-5", -1e-5, math.nan, True, [1e-5]])
def test_a_layer_norm_epsilon_that_is_no_epsilon_is_refused(epsilon):
    with pytest.raises(CheckpointError, match="layer_norm_epsilon must be a number"):
        ft_config({**GPTJ_6B, "layer_norm_epsilon": epsilon})


def test_within_the_epsilon_bound_a_normalised_value_moves_less_than_fp16_resolves():
    """The bound's reason: a unit-variance row normalised with the largest epsilon accepted or
    with FasterTransformer's differs by about a tenth of fp16's rounding error (2**-11); at
    twenty times the bound, by more than that rounding error."""
    x = np.random.default_rng(0).standard_normal(4096)
    x = (x - x.mean()) / x.std()

    def moved(epsilon: float) -> float:
        ours, theirs = (x / np.sqrt(x.var() + e) for e in (epsilon, LAYERNORM_EPS))
        return float(np.max(np.abs(ours - theirs) / np.abs(theirs)))

    assert moved(LAYERNORM_EPS_MOST) < 2**-11 / 8
    assert moved(LAYERNORM_EPS_MOST * 20) > 2**-11


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_published_model_passes_at_every_tp_its_heads_allow(name, tp):
    hf = PUBLISHED[name]
    if hf["n_head"] % tp:
        with pytest.raises(ParallelismError):
            ft_config(hf, tp)
        return
    config = ft_config(hf, tp)
    assert config.rotary_embedding == hf["rotary_dim"]
    check_loadable(config, where="x", tp=tp)


# -- rotary dimension ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rotary", "head", "fragment"),
    [
        (0, 256, "not between 1 and the head size 256"),  # was silently the whole head
        (320, 256, "not between 1 and the head size 256"),  # was silently clamped to 256
        (4, 256, "a multiple of 8"),  # FT fp16 rotates 8 dimensions at a time for heads of 256
        (30, 128, "a multiple of 4"),
        (63, 64, "a multiple of 2"),
    ],
)
def test_a_rotary_dimension_fastertransformer_applies_differently_is_refused(
    rotary, head, fragment
):
    hf = {**GPTJ_6B, "n_head": 4096 // head, "rotary_dim": rotary}
    with pytest.raises(UnloadableConfigError, match=fragment) as caught:
        ft_config(hf)
    assert caught.value.remediation


def test_a_missing_rotary_dimension_means_the_whole_head():
    assert ft_config({**GPTJ_6B, "rotary_dim": None}).rotary_embedding == 256


def hf_rotated(x: np.ndarray, rotary: int, position: int) -> np.ndarray:
    """Hugging Face GPT-J's rotary (``apply_rotary_pos_emb``, rotate every two) of one head."""
    out = x.copy()
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)
    for pair, freq in enumerate(inv_freq):
        c, s = np.cos(position * freq), np.sin(position * freq)
        a, b = x[2 * pair], x[2 * pair + 1]
        out[2 * pair], out[2 * pair + 1] = a * c - b * s, a * s + b * c
    return out


def ft_rotated(x: np.ndarray, rotary: int, position: int, width: int) -> np.ndarray:
    """FasterTransformer's (``apply_rotary_embedding``: thread ``tid`` holds elements
    ``[width * tid, width * (tid + 1))`` and rotates all of them when ``width * tid < rot``,
    pair ``zid`` with ``t / 10000 ** (zid / rot)``)."""
    out = x.copy()
    for start in range(0, len(x), width):
        if start >= rotary:
            break
        for zid in range(start, min(start + width, len(x)), 2):
            angle = position / 10000 ** (zid / rotary)
            c, s = np.cos(angle), np.sin(angle)
            a, b = x[zid], x[zid + 1]
            out[zid], out[zid + 1] = a * c - b * s, a * s + b * c
    return out


#: fp16's vector width by the head's power-of-two bucket (Qk_vec_m_), independent of the module.
FP16_WIDTH = {32: 2, 64: 2, 128: 4, 256: 8}


@settings(deadline=None, derandomize=True, database=None, max_examples=examples(200))
@given(head=st.sampled_from(SUPPORTED_HEAD_SIZES), rotary=st.integers(1, 300))
def test_a_rotary_dimension_is_accepted_exactly_when_fastertransformer_rotates_as_the_model(
    head, rotary
):
    """Property: ft_config accepts rotary_dim iff FT's vectorised rotary (fp16 widths) equals
    Hugging Face's on a random head, at a position where every frequency matters (1000: the first wrongly rotated pair turns by
    0.1 radians)."""
    bucket = next(b for b in sorted(FP16_WIDTH) if b >= head)
    x = np.random.default_rng(rotary * 1000 + head).standard_normal(head)
    ft = ft_rotated(x, rotary, 1000, FP16_WIDTH[bucket])
    # Hugging Face fails on an odd rotary_dim or one beyond the head: nothing to match.
    hf = hf_rotated(x, rotary, 1000) if rotary <= head and rotary % 2 == 0 else None
    same = hf is not None and np.allclose(ft, hf, rtol=0, atol=1e-9)
    hf_config = {**GPTJ_6B, "n_embd": head * 4, "n_head": 4, "rotary_dim": rotary}
    if same:
        assert ft_config(hf_config).rotary_embedding == rotary
    else:
        with pytest.raises(UnloadableConfigError):
            ft_config(hf_config)


# -- 32-bit sizes of the weight buffers ----------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"vocab_size": 600_000}, "vocab_size x hidden size"),  # 600000 x 4096 > 2**31
        ({"n_embd": 26880, "n_head": 105, "vocab_size": 50400}, "3 x hidden size x hidden size"),
        ({"n_inner": 4096 * 140}, "hidden size x inter_size"),
    ],
)
def test_a_weight_buffer_beyond_a_32_bit_int_is_refused(changes, fragment):
    with pytest.raises(UnloadableConfigError, match=fragment):
        ft_config({**GPTJ_6B, **changes})


def test_the_largest_weight_buffers_within_a_32_bit_int_pass():
    vocab = INT32_MAX // 4096  # 524287 x 4096 = 2**31 - 4096
    assert ft_config({**GPTJ_6B, "vocab_size": vocab}).vocab_size == vocab


# -- the vocabulary FasterTransformer pads in float arithmetic ------------------------------------


def ft_padded(vocab: int, tp: int, half: bool) -> int:
    """``GptJ.cc``'s vocab_size_padded_ in NumPy float32, an oracle independent of the module."""
    local = int(np.ceil(np.float32(vocab) / np.float32(1.0) / np.float32(tp)))
    if half:
        local = int(np.ceil(np.float32(local) / np.float32(8.0))) * 8
    return local * tp


def tiny(vocab: int, tp: int = 1) -> FTConfig:
    return FTConfig(head_num=8, size_per_head=32, inter_size=64, num_layer=1,
                    rotary_embedding=32, vocab_size=vocab, start_id=0, end_id=0,
                    tensor_para_size=tp)  # fmt: skip


def test_a_vocabulary_float_arithmetic_pads_below_its_size_is_refused():
    vocab = 2**24 + 1  # a float holds 2**24, not 2**24 + 1: padded to 2**24 rows
    config = FTConfig(head_num=1, size_per_head=32, inter_size=64, num_layer=1,
                      rotary_embedding=32, vocab_size=vocab, start_id=0, end_id=0)  # fmt: skip
    with pytest.raises(UnloadableConfigError, match="pads to 16777216 rows"):
        check_loadable(config, where="config.json")


@settings(deadline=None, derandomize=True, database=None, max_examples=examples(300))
@given(
    vocab=st.integers(4, 2**26 - 1) | st.integers(2**24 - 64, 2**24 + 64),  # x 32 < 2**31
    tp=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_a_vocabulary_is_accepted_exactly_when_its_padding_holds_it(vocab, tp):
    config = FTConfig(head_num=1, size_per_head=32, inter_size=64 * tp, num_layer=1,
                      rotary_embedding=32, vocab_size=vocab, start_id=0, end_id=0,
                      tensor_para_size=tp)  # fmt: skip
    holds = all(ft_padded(vocab, tp, half) >= vocab for half in (False, True))
    if holds:
        check_loadable(config, where="config.json")
    else:
        with pytest.raises(UnloadableConfigError, match="pads to"):
            check_loadable(config, where="config.json")


def test_a_vocabulary_too_small_for_the_logits_kernel_is_refused():
    with pytest.raises(UnloadableConfigError, match="vocab_size 3 is below 4"):
        check_loadable(tiny(3), where="config.json")
    check_loadable(tiny(4), where="config.json")


# -- the MLP width per rank ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_inner", "tp", "fragment"),
    [(100, 4, "leaves each rank 25 MLP columns"), (12, 2, "leaves each rank 6 MLP columns")],
)
def test_an_mlp_width_per_rank_the_gelu_kernel_cannot_handle_is_refused(n_inner, tp, fragment):
    hf = {**GPTJ_6B, "n_embd": 256, "n_head": 8, "rotary_dim": 32, "n_inner": n_inner}
    with pytest.raises(UnloadableParallelismError, match=fragment) as caught:
        ft_config(hf, tp)
    assert caught.value.remediation.startswith("Choose a smaller --tp-size: 1")
    ft_config(hf, 1)  # the same model at T = 1 passes


@pytest.mark.parametrize("n_inner", [101, 6])
def test_an_mlp_width_no_tensor_parallel_size_helps_is_a_checkpoint_error(n_inner):
    hf = {**GPTJ_6B, "n_embd": 256, "n_head": 8, "rotary_dim": 32, "n_inner": n_inner}
    with pytest.raises(UnloadableConfigError, match=f"inter_size {n_inner} is not a width"):
        ft_config(hf, 1)


# -- config.ini as FasterTransformer reads it ----------------------------------------------------


def write_ini(tmp_path, config: FTConfig, **raw: str):
    text = config.to_ini()
    for key, value in raw.items():
        text = "\n".join(
            f"{key} = {value}" if line.startswith(f"{key} = ") else line
            for line in text.splitlines()
        )
    (tmp_path / "config.ini").write_text(text + "\n")
    return tmp_path


@pytest.mark.parametrize("value", ["010", "0x20", "3_2", "32abc"])
def test_a_config_ini_number_strtol_reads_otherwise_is_refused(tmp_path, value):
    """FasterTransformer reads "010" as 8 (octal), "0x20" as 32 and "3_2" as 3."""
    with pytest.raises(CheckpointError, match="size_per_head"):
        FTConfig.from_ini(write_ini(tmp_path, tiny(320), size_per_head=value))


def test_config_ini_gets_the_same_checks_on_read(tmp_path):
    """The CPU reference reads config.ini through the same checks (FasterTransformer reads the
    same numbers and would compute garbage with them)."""
    assert (
        FTConfig.from_ini(write_ini(tmp_path, tiny(320), rotary_embedding="6")).rotary_embedding
        == 6
    )
    for raw, error, fragment in (
        ({"rotary_embedding": "33"}, UnloadableConfigError, "rotary dimension 33"),
        ({"vocab_size": "2"}, UnloadableConfigError, "vocab_size 2 is below 4"),
        ({"inter_size": "76", "tensor_para_size": "4"}, ParallelismError, "19 MLP columns"),
    ):
        with pytest.raises(error, match=fragment):
            FTConfig.from_ini(write_ini(tmp_path, tiny(320), **raw))


def test_the_cpu_reference_reads_a_rotary_dimension_of_0_as_none(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    """FasterTransformer applies no rotary embedding when rotary_embedding is 0
    (``rotary_embedding_dim > 0`` guards it in both attention kernels); nor does the CPU
    reference: a pair of tokens scores the same at positions (0, 1) and (0, 5)."""
    source = tiny_checkpoint_with_tokenizer
    out = convert_checkpoint(source, tmp_path / "out", tp_size=1).output_path
    ini = out / "config.ini"
    ini.write_text(
        "\n".join(
            "rotary_embedding = 0" if line.startswith("rotary_embedding = ") else line
            for line in ini.read_text().splitlines()
        )
        + "\n"
    )
    model = GptJ(load_ft_checkpoint(out))
    ids = np.array([[5, 17]])
    near, _ = model.forward(ids, position_ids=np.array([[0, 1]]))
    far, _ = model.forward(ids, position_ids=np.array([[0, 5]]))
    np.testing.assert_array_equal(near, far)


# -- 32-bit indices of a full batch ----------------------------------------------------------------


def test_a_full_batch_past_a_kernels_32_bit_index_is_refused_with_the_largest_batch_that_fits():
    """GPT-J 6B at T = 1: 64 rows of 2048 tokens are 64 x 2048 x 16384 = 2**31 MLP activations,
    past the int `m * n` of the GELU kernel, though 64 rows fit an H200's memory."""
    gptj = MODEL_PRESETS["gpt-j-6b"]
    check_index_range(gptj, Parallelism(tp=1), max_batch_size=63)
    with pytest.raises(PlacementError, match="MLP activations") as caught:
        check_index_range(gptj, Parallelism(tp=1), max_batch_size=64)
    assert "at most 63 or raise --tp-size" in caught.value.remediation
    check_index_range(gptj, Parallelism(tp=2), max_batch_size=64)
    estimate = estimate_memory(gptj, Parallelism(tp=1), dtype="fp16", max_batch_size=64)
    check_memory(estimate, 141.0)  # the memory plan alone would have let it through


def wraps(value: int, bits: int = 32, signed: bool = True) -> bool:
    """Whether ``value`` computed in a C integer of that kind differs from the true value."""
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return not low <= value <= high


@settings(deadline=None, derandomize=True, database=None, max_examples=examples(300))
@given(
    preset=st.sampled_from(sorted(MODEL_PRESETS)),
    tp=st.sampled_from([1, 2, 4, 8]),
    batch=st.integers(1, 4096),
    seq=st.sampled_from([128, 2048, 8192, 32768, 65536]),
)
def test_a_full_batch_passes_exactly_when_no_kernel_index_wraps(preset, tp, batch, seq):
    """Property: the largest index each kernel computes for a full batch (written out from the
    kernels, independently of loader.plan) wraps in its 32-bit type iff check_index_range
    refuses the batch (up to the one element the check keeps in reserve)."""
    shape = dataclasses.replace(MODEL_PRESETS[preset], n_positions=seq)
    if shape.n_head % tp or shape.n_inner % tp:
        return
    n = shape.n_embd // tp
    tokens = batch * seq
    padded = math.ceil(math.ceil(shape.vocab_size / tp) / 8) * 8 * tp  # GptJ.cc, fp16
    largest = {
        # add_fusedQKV_bias_transpose_kernel: src_v_idx of the last token and element
        "qkv": ((tokens - 1) * 3 * n + (n - 1) + 2 * n, True),
        # generic_activation / addBiasGeluV2: the loop bound m * n itself
        "mlp": (tokens * (shape.n_inner // tp), True),
        # buildDecoderAttentionMaskKernel: the last row's offset plus its last element
        "mask": ((batch - 1) * seq * seq + seq * seq - 1, False),
        # topk_stage1 / invokeTopKSampling: batch_size * vocab_size
        "logits": (batch * padded, True),
    }
    wrapped = [k for k, (v, signed) in largest.items() if wraps(v, signed=signed)]
    if wrapped:
        with pytest.raises(PlacementError):
            check_index_range(shape, Parallelism(tp=tp), max_batch_size=batch)
        return
    try:
        check_index_range(shape, Parallelism(tp=tp), max_batch_size=batch)
    except PlacementError:  # only at the boundary: one element more than the largest index
        at_edge = {k: wraps(v + 1, signed=s) for k, (v, s) in largest.items()}
        assert any(at_edge.values()), largest


def test_a_number_outside_the_32_bit_range_fastertransformer_reads_is_refused(tmp_path):
    with pytest.raises(UnloadableConfigError, match="end_id = 1099511627776 is outside"):
        ft_config({**GPTJ_6B, "eos_token_id": 2**40})  # written by convert before
    with pytest.raises(UnloadableConfigError, match="start_id = -1 is outside"):
        FTConfig.from_ini(write_ini(tmp_path, tiny(320), start_id="-1"))


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        ({"eos_token_id": 50400}, "eos_token_id gives end_id = 50400"),
        ({"eos_token_id": [50400, 0]}, "eos_token_id gives end_id = 50400"),
        ({"bos_token_id": 2**31 - 1}, "bos_token_id gives start_id = 2147483647"),
        ({"eos_token_id": None, "bos_token_id": 50400}, "bos_token_id gives start_id = 50400"),
    ],
)
def test_a_token_id_outside_the_vocabulary_is_refused_by_the_conversion(ids, fragment):
    """``convert`` wrote it into config.ini (only ``run`` refused it): FasterTransformer looks
    a finished row's end_id up in the embedding table, past its end."""
    with pytest.raises(CheckpointError, match=fragment):
        ft_config({**GPTJ_6B, **ids})


def test_the_last_token_of_the_vocabulary_is_an_id_the_conversion_takes():
    config = ft_config({**GPTJ_6B, "bos_token_id": 50399, "eos_token_id": 50399})
    assert (config.start_id, config.end_id) == (50399, 50399)


@pytest.mark.parametrize("key", ["tensor_para_size", "head_num", "num_layer", "vocab_size"])
def test_a_config_ini_size_of_0_is_a_typed_error(tmp_path, key):
    """Not a division by zero in the checks themselves."""
    with pytest.raises(UnloadableConfigError, match=f"{key} is 0"):
        FTConfig.from_ini(write_ini(tmp_path, tiny(320), **{key: "0"}))


_INI_INTS = ["head_num", "size_per_head", "inter_size", "num_layer", "rotary_embedding",
             "vocab_size", "start_id", "end_id", "tensor_para_size"]  # fmt: skip
_EDGES = [-1, 0, 1, 2, 3, 7, 8, 32, 256, INT32_MAX, INT32_MAX + 1, 2**24 + 1, 2**40]


def loads_or_typed_error(path) -> None:
    """from_ini returns a config that passes check_loadable, or raises a LoaderError."""
    try:
        config = FTConfig.from_ini(path)
    except LoaderError as exc:
        assert exc.remediation
        return
    check_loadable(config, where="x")


@pytest.mark.parametrize("value", _EDGES)
@pytest.mark.parametrize("key", _INI_INTS)
def test_every_edge_of_every_config_ini_number_loads_or_is_a_typed_error(tmp_path, key, value):
    loads_or_typed_error(write_ini(tmp_path, tiny(320), **{key: str(value)}))


@settings(deadline=None, derandomize=True, database=None, max_examples=examples(200))
@given(
    values=st.dictionaries(
        st.sampled_from(_INI_INTS),
        st.sampled_from(_EDGES) | st.integers(-(2**40), 2**40),
        min_size=2,
        max_size=3,
    )
)
def test_any_config_ini_numbers_load_or_are_a_typed_error(tmp_path_factory, values):
    """Property: the same for two or three numbers changed at once."""
    path = tmp_path_factory.mktemp("ini")
    loads_or_typed_error(write_ini(path, tiny(320), **{k: str(v) for k, v in values.items()}))
