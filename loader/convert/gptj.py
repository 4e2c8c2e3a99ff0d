"""GPT-J (``model_type: gptj``): Hugging Face tensor names -> FasterTransformer files.

Only the mapping lives here (``docs/fastertransformer.md``, "Files"); the split rules are the shared helpers
of :mod:`loader.convert.splits`. :class:`GptJArchitecture` is also the base of CodeGen, which
differs only in where Q, K and V come from.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from loader.errors import CheckpointError
from loader.formats.fastertransformer import (
    HF_LAYERNORM_EPS,
    LAYERNORM_EPS,
    LAYERNORM_EPS_MOST,
    FTConfig,
    UnloadableConfigError,
    check_head_size,
    check_loadable,
    check_token_ids,
)
from loader.parallel import Parallelism

from .registry import register
from .splits import (
    OutputFile,
    RowsOf,
    column_parallel_weight,
    fused_qkv,
    replicated,
    row_parallel_weight,
    split_vector,
)

#: Activations FasterTransformer's GPT-J computes (GELU, tanh approximation).
SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")

#: Non-persistent buffers some checkpoints carry; they are not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attn.causal_mask")

#: The input embedding, and the output one, which a checkpoint that ties the two
#: (``tie_word_embeddings``) may leave out: Hugging Face then uses the input one in its place
#: (``save_pretrained`` writes a tied tensor once).
INPUT_EMBEDDING = "transformer.wte.weight"
OUTPUT_EMBEDDING = "lm_head.weight"


def _int(hf: dict[str, Any], key: str) -> int | None:
    """An integer of config.json, ``None`` when absent or null."""
    value = hf.get(key)
    if isinstance(value, list):  # eos_token_id may be a list; FT takes one id
        value = value[0] if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"config.json {key!r} must be a whole number, got {value!r}.")
    return value


def _required(hf: dict[str, Any], key: str) -> int:
    """A positive integer config.json must have."""
    value = _int(hf, key)
    if not value:
        raise CheckpointError(
            f"config.json lacks a positive {key!r} (got {hf.get(key)!r}); the converter needs it.",
            "Use the checkpoint's original config.json.",
        )
    return value


def _check_epsilon(hf: dict[str, Any]) -> None:
    """config.json's ``layer_norm_epsilon`` is one FasterTransformer's fixed epsilon computes the
    same model with (``src/fastertransformer/models/gptj/GptJ.h``: ``layernorm_eps_ = 1e-6f``,
    in every LayerNorm; config.ini has no key for it)."""
    value = hf.get("layer_norm_epsilon")
    if value is None:  # absent or null: Hugging Face's own 1e-5
        value = HF_LAYERNORM_EPS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise CheckpointError(
            f"config.json layer_norm_epsilon must be a number of at least 0, got {value!r}.",
            "Use the checkpoint's original config.json (GPT-J's and CodeGen's is 1e-05).",
        )
    if value > LAYERNORM_EPS_MOST:
        raise UnloadableConfigError(
            f"config.json layer_norm_epsilon {value!r} is not what FasterTransformer's GPT-J "
            f"normalises with: it always adds {LAYERNORM_EPS:g} (GptJ.h, layernorm_eps_), "
            f"which computes the same model only for an epsilon up to {LAYERNORM_EPS_MOST:g}; "
            "served, every LayerNorm of the model would give other values than it was "
            "trained with.",
            "Such a model cannot be served by FasterTransformer's GPT-J; use the checkpoint's "
            "original config.json (GPT-J's and CodeGen's layer_norm_epsilon is 1e-05).",
        )


class GptJArchitecture:
    """Maps a GPT-J checkpoint onto the FT GPT-J layout."""

    model_type = "gptj"

    # -- hyper-parameters ------------------------------------------------------------------

    def ft_config(
        self, hf: dict[str, Any], *, parallelism: Parallelism, model_name: str
    ) -> FTConfig:
        """The ``[gptj]`` hyper-parameters; checks divisibility by T and P."""
        hidden = _required(hf, "n_embd")
        heads = _required(hf, "n_head")
        layers = _required(hf, "n_layer")
        vocab = _required(hf, "vocab_size")
        if hidden % heads:
            raise CheckpointError(
                f"config.json n_embd {hidden} is not divisible by n_head {heads}."
            )
        inter = _int(hf, "n_inner")
        if inter == 0:  # absent or null: 4 x n_embd, Hugging Face's own default
            raise CheckpointError(
                "config.json n_inner is 0: the model would have no MLP (Hugging Face builds "
                "its layers 0 wide and does not load these weights).",
                "Use the checkpoint's original config.json (n_inner is the MLP width, e.g. "
                "16384 for GPT-J 6B), or leave it null for 4 x n_embd.",
            )
        if inter is None:
            inter = 4 * hidden
        head_dim = hidden // heads
        check_head_size(head_dim, where=f"config.json (n_embd {hidden} / n_head {heads})")
        rotary = _int(hf, "rotary_dim")
        if rotary is None:
            rotary = head_dim
        elif not 0 < rotary <= head_dim:
            # Hugging Face's GPT-J and CodeGen attention (apply_rotary_pos_emb) fail on a
            # rotary_dim of 0 or beyond the head; FasterTransformer would run them with other
            # frequencies (a larger rotary dimension divides every one of them).
            raise UnloadableConfigError(
                f"config.json rotary_dim {rotary} is not between 1 and the head size "
                f"{head_dim} (n_embd {hidden} / n_head {heads}); the model does not run in "
                "Hugging Face's GPT-J or CodeGen either.",
                "Use the checkpoint's original config.json (rotary_dim is at most n_embd / "
                "n_head, or null for the whole head).",
            )
        activation = hf.get("activation_function", "gelu_new")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise CheckpointError(
                f"config.json activation_function {activation!r} is not computed by "
                f"FasterTransformer's GPT-J (it uses {SUPPORTED_ACTIVATIONS[0]}).",
                "Only GPT-J/CodeGen checkpoints with a tanh-approximated GELU can be served.",
            )
        _check_epsilon(hf)
        self.check_heads(heads, hidden)
        parallelism.split(heads, "The attention head count")
        parallelism.split(inter, "The MLP width (n_inner)")
        parallelism.check_layers(layers)
        positions = _int(hf, "n_positions")
        if positions == 0:  # absent or null: GPT-J's own default, 2048
            raise CheckpointError(
                "config.json n_positions is 0: the model would hold no position.",
                "Use the checkpoint's original config.json (n_positions is the longest sequence "
                "the model was trained on, e.g. 2048), or leave it out for GPT-J's 2048.",
            )
        eos = _int(hf, "eos_token_id")
        bos = _int(hf, "bos_token_id")
        end_id = eos if eos is not None else (bos if bos is not None else 0)
        start_id = bos if bos is not None else end_id
        config = FTConfig(
            head_num=heads,
            size_per_head=head_dim,
            inter_size=inter,
            num_layer=layers,
            rotary_embedding=rotary,
            vocab_size=vocab,
            start_id=start_id,
            end_id=end_id,
            tensor_para_size=parallelism.tp,
            model_name=model_name,
            max_pos_seq_len=2048 if positions is None else positions,
        )
        check_loadable(config, where="config.json", tp=parallelism.tp)
        check_token_ids(config)
        return config

    def check_heads(self, heads: int, hidden: int) -> None:
        """How the checkpoint stores its attention heads allows this many (GPT-J: any)."""

    # -- source tensors --------------------------------------------------------------------

    def attention_sources(self, layer: int, cfg: FTConfig) -> dict[str, tuple[int, ...]]:
        h = cfg.hidden_size
        p = f"transformer.h.{layer}.attn."
        return {
            p + "q_proj.weight": (h, h),
            p + "k_proj.weight": (h, h),
            p + "v_proj.weight": (h, h),
        }

    def qkv(self, layer: int, cfg: FTConfig) -> tuple[RowsOf, RowsOf, RowsOf]:
        p = f"transformer.h.{layer}.attn."
        return RowsOf(p + "q_proj.weight"), RowsOf(p + "k_proj.weight"), RowsOf(p + "v_proj.weight")

    def ties_embeddings(self, hf: dict[str, Any], names: Collection[str]) -> bool:
        """Whether the output embedding is the input one: config.json ties them and the
        checkpoint holds no output embedding of its own (one it holds is used, as Hugging Face
        does when the two differ)."""
        return hf.get("tie_word_embeddings") is True and OUTPUT_EMBEDDING not in names

    def expected_tensors(self, cfg: FTConfig, *, tied: bool = False) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its shape (``tied``: the output
        embedding is the input one, :meth:`ties_embeddings`)."""
        h, inter, vocab = cfg.hidden_size, cfg.inter_size, cfg.vocab_size
        expected: dict[str, tuple[int, ...]] = {
            INPUT_EMBEDDING: (vocab, h),
            "transformer.ln_f.weight": (h,),
            "transformer.ln_f.bias": (h,),
            OUTPUT_EMBEDDING: (vocab, h),
            "lm_head.bias": (vocab,),
        }
        if tied:
            del expected[OUTPUT_EMBEDDING]
        for layer in range(cfg.num_layer):
            p = f"transformer.h.{layer}."
            expected.update(
                {
                    p + "ln_1.weight": (h,),
                    p + "ln_1.bias": (h,),
                    **self.attention_sources(layer, cfg),
                    p + "attn.out_proj.weight": (h, h),
                    p + "mlp.fc_in.weight": (inter, h),
                    p + "mlp.fc_in.bias": (inter,),
                    p + "mlp.fc_out.weight": (h, inter),
                    p + "mlp.fc_out.bias": (h,),
                }
            )
        return expected

    def is_ignored(self, name: str) -> bool:
        """Tensors a checkpoint may carry that are not weights (causal-mask buffers)."""
        return name.endswith(IGNORED_SUFFIXES)

    # -- output files ----------------------------------------------------------------------

    def outputs(self, cfg: FTConfig, *, tp: int, tied: bool = False) -> list[OutputFile]:
        """Every FT file, in the order they are written (source order, layer by layer);
        ``tied``: ``model.lm_head.weight`` is the input embedding."""
        h, inter, vocab = cfg.hidden_size, cfg.inter_size, cfg.vocab_size
        files = [
            replicated("model.wte", INPUT_EMBEDDING, (vocab, h)),
        ]
        for layer in range(cfg.num_layer):
            src, dst = f"transformer.h.{layer}.", f"model.layers.{layer}."
            files += [
                replicated(dst + "input_layernorm.weight", src + "ln_1.weight", (h,)),
                replicated(dst + "input_layernorm.bias", src + "ln_1.bias", (h,)),
            ]
            q, k, v = self.qkv(layer, cfg)
            for r in range(tp):
                files += [
                    fused_qkv(
                        dst + "attention.query_key_value.weight", q, k, v, h, tp=tp, rank=r
                    ),
                    row_parallel_weight(
                        dst + "attention.dense.weight", src + "attn.out_proj.weight", h, h,
                        tp=tp, rank=r,
                    ),
                    column_parallel_weight(
                        dst + "mlp.dense_h_to_4h.weight", src + "mlp.fc_in.weight", inter, h,
                        tp=tp, rank=r,
                    ),
                    split_vector(
                        dst + "mlp.dense_h_to_4h.bias", src + "mlp.fc_in.bias", inter,
                        tp=tp, rank=r,
                    ),
                    row_parallel_weight(
                        dst + "mlp.dense_4h_to_h.weight", src + "mlp.fc_out.weight", h, inter,
                        tp=tp, rank=r,
                    ),
                ]  # fmt: skip
            files.append(replicated(dst + "mlp.dense_4h_to_h.bias", src + "mlp.fc_out.bias", (h,)))
        files += [
            replicated("model.final_layernorm.weight", "transformer.ln_f.weight", (h,)),
            replicated("model.final_layernorm.bias", "transformer.ln_f.bias", (h,)),
            replicated(
                "model.lm_head.weight", INPUT_EMBEDDING if tied else OUTPUT_EMBEDDING, (vocab, h)
            ),
            replicated("model.lm_head.bias", "lm_head.bias", (vocab,)),
        ]
        return files


register("gptj")(GptJArchitecture)
