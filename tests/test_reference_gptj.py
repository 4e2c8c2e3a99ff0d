"""loader.reference: the NumPy GPT-J computed from FT files matches Hugging Face's logits."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from loader.convert import convert_checkpoint
from loader.errors import CheckpointError
from loader.formats.fastertransformer import LAYERNORM_EPS, UnloadableConfigError
from loader.reference import FTConfig, GptJ, load_ft_checkpoint
from tests.tinymodels import load_hf_model, make_tiny_checkpoint, read_state_dict

pytestmark = (
    pytest.mark.slow
)  # transformers models as the reference (see markers in pyproject.toml)

TOLERANCE = 1e-4

# Left-padded batch: row 1 starts with two padding tokens.
IDS = np.array([[5, 17, 33, 2, 250, 101, 7, 64], [0, 0, 19, 44, 3, 300, 11, 90]])
MASK = np.array([[1] * 8, [0, 0, 1, 1, 1, 1, 1, 1]])
POSITIONS = np.clip(np.cumsum(MASK, axis=1) - 1, 0, None)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    """(arch, source dtype) -> (HF checkpoint dir, HF model in fp32), built once."""
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for arch, dtype, n_inner, seed in (
        ("gptj", "fp32", 96, 11),
        ("codegen", "fp32", None, 12),
        ("gptj", "fp16", None, 13),
    ):
        path = make_tiny_checkpoint(
            root / f"{arch}-{dtype}", arch=arch, dtype=dtype, n_inner=n_inner, seed=seed,
            n_layer=3, rotary_dim=6,
        )  # fmt: skip
        out[(arch, dtype)] = (path, load_hf_model(path))
    return out


def hf_logits(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return model(
            torch.tensor(IDS),
            attention_mask=torch.tensor(MASK),
            position_ids=torch.tensor(POSITIONS),
        ).logits.numpy()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "key", [("gptj", "fp32"), ("codegen", "fp32"), ("gptj", "fp16")], ids="-".join
)
def test_logits_match_hugging_face(models, tmp_path, key, tp):
    path, hf = models[key]
    result = convert_checkpoint(path, tmp_path, tp_size=tp)
    ckpt = load_ft_checkpoint(result.output_path)
    assert ckpt.tensor_para_size == tp
    logits, cache = GptJ(ckpt).forward(IDS, position_ids=POSITIONS, attention_mask=MASK)
    want = hf_logits(hf)
    real = MASK.astype(bool)  # logits at padding positions are not meaningful
    assert logits.shape == want.shape
    assert logits.dtype == np.float32
    diff = np.abs(logits - want)[real].max()
    assert diff <= TOLERANCE, f"max abs diff {diff}"
    assert np.abs(want).max() > 1.0  # the comparison is not between near-zero numbers
    assert len(cache) == 3 and len(cache[0]) == tp
    assert cache[0][0][0].shape == (2, 8 // tp, 8, 32)


@pytest.mark.parametrize("arch", ["gptj", "codegen"])
def test_a_checkpoint_whose_output_embedding_is_its_input_one_matches_hugging_face(tmp_path, arch):
    """``tie_word_embeddings``: ``save_pretrained`` writes the tied embedding once, without
    ``lm_head.weight``; such a checkpoint was refused as incomplete. FasterTransformer's
    ``model.lm_head.weight`` is then the input embedding."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, tie_word_embeddings=True, seed=7)
    assert "lm_head.weight" not in read_state_dict(path)
    result = convert_checkpoint(path, tmp_path / "out", tp_size=2)
    ckpt = load_ft_checkpoint(result.output_path)
    logits, _ = GptJ(ckpt).forward(IDS, position_ids=POSITIONS, attention_mask=MASK)
    want = hf_logits(load_hf_model(path))
    real = MASK.astype(bool)
    assert np.abs(logits - want)[real].max() <= TOLERANCE
    assert np.abs(want).max() > 1.0
    files = result.output_path
    assert (files / "model.lm_head.weight.bin").read_bytes() == (
        files / "model.wte.bin"
    ).read_bytes()


def test_an_output_embedding_a_tied_checkpoint_holds_is_its_own(models, tmp_path):
    """One that ties its embeddings but holds an lm_head.weight of other values: Hugging Face
    then unties them and uses it, and so does the conversion."""
    path, _ = models[("gptj", "fp32")]
    source = tmp_path / "src"
    shutil.copytree(path, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    files = convert_checkpoint(source, tmp_path / "out", tp_size=1).output_path
    held = read_state_dict(source)["lm_head.weight"].numpy()
    assert not np.array_equal(held, read_state_dict(source)["transformer.wte.weight"].numpy())
    written = np.fromfile(files / "model.lm_head.weight.bin", dtype=np.float32)
    assert np.array_equal(written, held.reshape(-1))


def test_the_comparison_detects_a_wrong_rotary(models, tmp_path):
    """Guard: the interleaved rotary matters; a half-split (NeoX) rotary would not match."""
    path, hf = models[("gptj", "fp32")]
    result = convert_checkpoint(path, tmp_path, tp_size=1)
    model = GptJ(load_ft_checkpoint(result.output_path))

    def neox(x, sin, cos):
        rot = x[..., : model.rotary_dim]
        half = model.rotary_dim // 2
        swapped = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
        x[..., : model.rotary_dim] = rot * cos + swapped * sin
        return x

    model._rotate = neox
    logits, _ = model.forward(IDS, position_ids=POSITIONS, attention_mask=MASK)
    assert np.abs(logits - hf_logits(hf))[MASK.astype(bool)].max() > 10 * TOLERANCE


@pytest.mark.parametrize("tp", [1, 2])
def test_incremental_decoding_with_the_cache_equals_one_full_pass(models, tmp_path, tp):
    path, _ = models[("codegen", "fp32")]
    model = GptJ(load_ft_checkpoint(convert_checkpoint(path, tmp_path, tp_size=tp).output_path))
    full, _ = model.forward(IDS, position_ids=POSITIONS, attention_mask=MASK)
    steps = []
    logits, cache = model.forward(
        IDS[:, :5], position_ids=POSITIONS[:, :5], attention_mask=MASK[:, :5]
    )
    steps.append(logits)
    for t in range(5, IDS.shape[1]):
        logits, cache = model.forward(
            IDS[:, t : t + 1], position_ids=POSITIONS[:, t : t + 1],
            attention_mask=MASK[:, : t + 1], past=cache,
        )  # fmt: skip
        steps.append(logits)
    assert GptJ.past_length(cache) == IDS.shape[1]
    incremental = np.concatenate(steps, axis=1)
    real = MASK.astype(bool)
    np.testing.assert_allclose(incremental[real], full[real], atol=1e-5, rtol=0)


def test_a_padded_row_gives_the_same_logits_as_the_row_alone(models, tmp_path):
    path, _ = models[("gptj", "fp32")]
    model = GptJ(load_ft_checkpoint(convert_checkpoint(path, tmp_path, tp_size=2).output_path))
    batched, _ = model.forward(IDS, position_ids=POSITIONS, attention_mask=MASK)
    alone, _ = model.forward(IDS[1:, 2:])
    np.testing.assert_allclose(batched[1, 2:], alone[0], atol=1e-5, rtol=0)


def test_select_keeps_the_chosen_batch_rows_of_the_cache(models, tmp_path):
    path, _ = models[("gptj", "fp32")]
    model = GptJ(load_ft_checkpoint(convert_checkpoint(path, tmp_path, tp_size=2).output_path))
    _, cache = model.forward(IDS, position_ids=POSITIONS, attention_mask=MASK)
    picked = GptJ.select(cache, [1])
    one, _ = model.forward(
        np.array([[42]]), position_ids=np.array([[6]]),
        attention_mask=np.concatenate([MASK[1:], [[1]]], axis=1), past=picked,
    )  # fmt: skip
    both, _ = model.forward(
        np.array([[42], [42]]), position_ids=np.array([[8], [6]]),
        attention_mask=np.concatenate([MASK, [[1], [1]]], axis=1), past=cache,
    )  # fmt: skip
    np.testing.assert_allclose(one[0], both[1], atol=1e-5, rtol=0)


def test_config_ini_round_trips(tmp_path):
    cfg = FTConfig(head_num=4, size_per_head=16, inter_size=96, num_layer=2, rotary_embedding=8,
                   vocab_size=100, start_id=1, end_id=2, tensor_para_size=2,
                   weight_data_type="fp16", model_name="tiny")  # fmt: skip
    (tmp_path / "config.ini").write_text(cfg.to_ini())
    assert FTConfig.from_ini(tmp_path) == cfg


def test_a_short_weight_file_is_a_checkpoint_error(models, tmp_path):
    path, _ = models[("gptj", "fp32")]
    out = convert_checkpoint(path, tmp_path, tp_size=2).output_path
    victim = out / "model.layers.1.mlp.dense_h_to_4h.weight.1.bin"
    victim.write_bytes(victim.read_bytes()[:-4])
    with pytest.raises(
        CheckpointError, match=r"dense_h_to_4h\.weight\.1\.bin has \d+ bytes, expected"
    ):
        load_ft_checkpoint(out)


def test_a_missing_weight_file_is_a_checkpoint_error(models, tmp_path):
    path, _ = models[("gptj", "fp32")]
    out = convert_checkpoint(path, tmp_path, tp_size=1).output_path
    (out / "model.lm_head.bias.bin").unlink()
    with pytest.raises(CheckpointError, match=r"model\.lm_head\.bias\.bin is missing"):
        load_ft_checkpoint(out)


def test_a_config_ini_without_required_keys_is_a_checkpoint_error(tmp_path):
    (tmp_path / "1-gpu").mkdir()
    (tmp_path / "1-gpu" / "config.ini").write_text("[gptj]\nhead_num = 4\n")
    with pytest.raises(CheckpointError, match="lacks model_name, size_per_head"):
        load_ft_checkpoint(tmp_path / "1-gpu")


def test_layernorm_epsilon_is_fastertransformers_constant_not_the_checkpoints(tmp_path):
    """FT's GPT-J ignores the checkpoint's layer_norm_epsilon (GptJ.h: 1e-6); so does the
    reference: it matches Hugging Face run with 1e-6, not with what the checkpoint says. (The
    converter refuses an epsilon as far from FT's as this one; the weights are converted under
    one it accepts.)"""
    path = make_tiny_checkpoint(tmp_path / "eps", layer_norm_epsilon=0.5, seed=5)
    as_trained = hf_logits(load_hf_model(path))
    with pytest.raises(UnloadableConfigError, match=r"layer_norm_epsilon 0\.5"):
        convert_checkpoint(path, tmp_path, tp_size=1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-5}))
    ckpt = load_ft_checkpoint(convert_checkpoint(path, tmp_path, tp_size=1).output_path)
    logits, _ = GptJ(ckpt).forward(IDS, position_ids=POSITIONS, attention_mask=MASK)
    real = MASK.astype(bool)
    as_ft = load_hf_model(path)
    for module in as_ft.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = LAYERNORM_EPS
    assert np.abs(logits - hf_logits(as_ft))[real].max() <= TOLERANCE
    assert np.abs(logits - as_trained)[real].max() > 100 * TOLERANCE
