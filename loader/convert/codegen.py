"""CodeGen (``model_type: codegen``), converted straight to the FT GPT-J layout in one pass.

CodeGen is GPT-J with one fused ``attn.qkv_proj.weight`` [3h, h] laid out as 4 groups
(``mp_num = 4``), each holding a Q, a V and a K block of h/4 rows (``docs/fastertransformer.md``, "Files", CodeGen):
viewed as [4, 3, h/4, h], Q = W[:, 0], V = W[:, 1], K = W[:, 2]. Heads keep their order, so the
logical Q/K/V projections are just row selections of the fused tensor; everything else is named
exactly as in GPT-J.

The two-step public route (CodeGen -> an fp16 GPT-J checkpoint -> FT files) rounds every weight
to fp16 on the way; converting in one pass keeps the source precision, so for an fp16 source the
files are the same bytes and for an fp32 source they are the GPT-J converter's output for the
permuted fp32 weights.
"""

from __future__ import annotations

import numpy as np

from loader.errors import CheckpointError
from loader.formats.fastertransformer import FTConfig

from .gptj import GptJArchitecture
from .registry import register
from .splits import RowsOf

MP_NUM = 4
#: Position of each projection inside a group of the fused tensor.
GROUP_ORDER = {"q": 0, "v": 1, "k": 2}


def fused_rows(hidden: int, which: str) -> np.ndarray:
    """Rows of the fused [3h, h] qkv_proj that form the logical [h, h] projection ``which``."""
    local = hidden // MP_NUM
    groups = np.arange(MP_NUM)[:, None] * 3 * local
    return (groups + GROUP_ORDER[which] * local + np.arange(local)[None, :]).reshape(-1)


class CodeGenArchitecture(GptJArchitecture):
    model_type = "codegen"

    def check_heads(self, heads: int, hidden: int) -> None:
        if heads % MP_NUM or hidden % MP_NUM:
            raise CheckpointError(
                f"CodeGen's fused qkv_proj holds {MP_NUM} groups of whole heads, but n_head "
                f"{heads} / n_embd {hidden} is not divisible by {MP_NUM}.",
                "This is not a valid CodeGen checkpoint; check config.json.",
            )

    def attention_sources(self, layer: int, cfg: FTConfig) -> dict[str, tuple[int, ...]]:
        h = cfg.hidden_size
        return {f"transformer.h.{layer}.attn.qkv_proj.weight": (3 * h, h)}

    def qkv(self, layer: int, cfg: FTConfig) -> tuple[RowsOf, RowsOf, RowsOf]:
        name = f"transformer.h.{layer}.attn.qkv_proj.weight"
        h = cfg.hidden_size
        return (
            RowsOf(name, fused_rows(h, "q")),
            RowsOf(name, fused_rows(h, "k")),
            RowsOf(name, fused_rows(h, "v")),
        )


register("codegen")(CodeGenArchitecture)
