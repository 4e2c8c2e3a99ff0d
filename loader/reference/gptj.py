"""A batched NumPy GPT-J forward pass computed from FasterTransformer files, with a KV cache.

This is the CPU reference of what FasterTransformer computes from a ``<T>-gpu`` directory:

* each TP rank computes its own heads (its ``[h, 3, h/T]`` QKV slice), its attention output
  projection rows and its MLP slice; the rank partial results are summed (FT's all-reduce), then
  the replicated ``dense_4h_to_h`` bias and the residual are added once;
* GPT-J's parallel block: ``x + attn(ln_1(x)) + mlp(ln_1(x))``, one LayerNorm per layer, with
  FasterTransformer's fixed epsilon (:data:`~loader.formats.fastertransformer.LAYERNORM_EPS`,
  1e-6, whatever the checkpoint was trained with);
* interleaved ("rotate every two") rotary embedding on the first ``rotary_embedding`` dims of
  every query and key head, with the explicit ``position_ids``;
* the causal mask combined with a 0/1 ``attention_mask`` over past and new tokens, so left- or
  right-padded batches work;
* logits = ``ln_f(x) @ lm_head.T + lm_head_bias`` in float32.

Usage::

    model = GptJ(load_ft_checkpoint("out/2-gpu"))
    logits, cache = model.forward(ids, position_ids=pos, attention_mask=mask)   # prompt
    logits, cache = model.forward(next_ids, position_ids=pos + n, attention_mask=mask2, past=cache)

The cache (``past``/``present``) is ``present[layer][rank] = (key, value)``, each of shape
``(B, local_heads, past + S, size_per_head)``, keys already rotated. ``past=None`` means an empty
cache. :meth:`GptJ.select` keeps or reorders batch rows of a cache (finished requests, beams).
"""

from __future__ import annotations

import numpy as np

from loader.formats.fastertransformer import LAYERNORM_EPS

from .weights import FTCheckpoint

Cache = list[list[tuple[np.ndarray, np.ndarray]]]

_GELU_C = np.float32(np.sqrt(2.0 / np.pi))


def gelu_new(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (HF ``gelu_new``; what FasterTransformer's GPT-J computes)."""
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + np.float32(0.044715) * (x * x * x))))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(var + np.float32(eps)) * weight + bias


def softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


class GptJ:
    """GPT-J forward pass over the per-rank weights of an :class:`FTCheckpoint` (float32)."""

    def __init__(self, ckpt: FTCheckpoint) -> None:
        cfg = ckpt.config
        self.ckpt = ckpt
        self.config = cfg
        self.tp = ckpt.tensor_para_size
        self.head_dim = cfg.size_per_head
        self.local_heads = cfg.head_num // self.tp
        # 0 means no rotary embedding, as in FasterTransformer (`rotary_embedding_dim > 0`);
        # FTConfig.from_ini refuses a dimension beyond the head or not a multiple of the
        # kernels' vector width.
        self.rotary_dim = cfg.rotary_embedding
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_embedding must be even, got {cfg.rotary_embedding}")
        h = cfg.hidden_size
        # [h, 3, c] viewed as [h, 3c]: one matmul gives this rank's q|k|v.
        self._qkv = [[lw.qkv.reshape(h, -1) for lw in rank.layers] for rank in ckpt.ranks]
        self._inv_freq = 1.0 / (
            10000.0 ** (np.arange(0, self.rotary_dim, 2) / max(self.rotary_dim, 1))
        )
        self._scale = np.float32(1.0 / np.sqrt(self.head_dim))

    # -- cache helpers ---------------------------------------------------------------------

    @staticmethod
    def past_length(past: Cache | None) -> int:
        return 0 if not past else int(past[0][0][0].shape[2])

    @staticmethod
    def select(cache: Cache, index: np.ndarray | list[int]) -> Cache:
        """The cache restricted to (or reordered by) the batch rows ``index``."""
        idx = np.asarray(index)
        return [[(k[idx], v[idx]) for k, v in layer] for layer in cache]

    # -- forward ---------------------------------------------------------------------------

    def rotary_tables(self, position_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """sin and cos of shape (B, S, 1, rotary_dim), interleaved (each angle twice)."""
        angles = position_ids[..., None].astype(np.float64) * self._inv_freq
        sin = np.repeat(np.sin(angles), 2, axis=-1).astype(np.float32)[:, :, None, :]
        cos = np.repeat(np.cos(angles), 2, axis=-1).astype(np.float32)[:, :, None, :]
        return sin, cos

    def _rotate(self, x: np.ndarray, sin: np.ndarray, cos: np.ndarray) -> np.ndarray:
        """Apply rotary in place on the first rotary_dims of x (B, S, heads, d)."""
        rot = x[..., : self.rotary_dim]
        swapped = np.empty_like(rot)
        swapped[..., 0::2] = -rot[..., 1::2]
        swapped[..., 1::2] = rot[..., 0::2]
        x[..., : self.rotary_dim] = rot * cos + swapped * sin
        return x

    def attention_bias(self, attention_mask: np.ndarray, seq_len: int, past_len: int) -> np.ndarray:
        """Additive mask (B, 1, S, past+S): 0 where allowed, float32 min where masked."""
        total = past_len + seq_len
        query_pos = past_len + np.arange(seq_len)[:, None]
        causal = np.arange(total)[None, :] <= query_pos  # (S, total)
        allowed = causal[None, :, :] & (attention_mask[:, None, :] != 0)
        bias = np.where(allowed, np.float32(0.0), np.finfo(np.float32).min).astype(np.float32)
        return bias[:, None, :, :]

    def forward(
        self,
        input_ids: np.ndarray,
        *,
        position_ids: np.ndarray | None = None,
        attention_mask: np.ndarray | None = None,
        past: Cache | None = None,
        last_only: bool = False,
    ) -> tuple[np.ndarray, Cache]:
        """Logits (B, S, V) float32 for ``input_ids`` (B, S), and the updated cache.

        ``position_ids`` default to ``past_len .. past_len+S-1``; ``attention_mask`` (B, past+S)
        of 0/1 defaults to all ones. ``last_only``: logits of the last position only (B, 1, V),
        as FasterTransformer computes them after the context decoder.
        """
        input_ids = np.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {input_ids.shape}")
        batch, seq = input_ids.shape
        past_len = self.past_length(past)
        if position_ids is None:
            position_ids = np.broadcast_to(np.arange(past_len, past_len + seq), (batch, seq))
        position_ids = np.asarray(position_ids)
        if attention_mask is None:
            attention_mask = np.ones((batch, past_len + seq), dtype=np.int64)
        attention_mask = np.asarray(attention_mask)
        if position_ids.shape != (batch, seq):
            raise ValueError(f"position_ids must be {(batch, seq)}, got {position_ids.shape}")
        if attention_mask.shape != (batch, past_len + seq):
            raise ValueError(
                f"attention_mask must be {(batch, past_len + seq)}, got {attention_mask.shape}"
            )

        cfg, ckpt = self.config, self.ckpt
        sin, cos = self.rotary_tables(position_ids)
        bias = self.attention_bias(attention_mask, seq, past_len)
        x = ckpt.wte[input_ids].astype(np.float32)
        present: Cache = []
        for layer in range(cfg.num_layer):
            first = ckpt.ranks[0].layers[layer]
            normed = layer_norm(x, first.ln_weight, first.ln_bias, LAYERNORM_EPS)
            total = np.zeros_like(x)
            layer_cache = []
            for r, rank in enumerate(ckpt.ranks):
                w = rank.layers[layer]
                old = past[layer][r] if past else None
                attn, kv = self._attention(
                    normed, self._qkv[r][layer], w.dense, sin, cos, bias, old
                )
                layer_cache.append(kv)
                total += attn
                total += gelu_new(normed @ w.fc_in_weight + w.fc_in_bias) @ w.fc_out_weight
            x = x + total + first.fc_out_bias
            present.append(layer_cache)
        if last_only:
            x = x[:, -1:]
        x = layer_norm(x, ckpt.final_ln_weight, ckpt.final_ln_bias, LAYERNORM_EPS)
        logits = x @ ckpt.lm_head_weight.T + ckpt.lm_head_bias
        return logits.astype(np.float32, copy=False), present

    def _attention(
        self,
        normed: np.ndarray,
        qkv_weight: np.ndarray,
        dense: np.ndarray,
        sin: np.ndarray,
        cos: np.ndarray,
        bias: np.ndarray,
        old: tuple[np.ndarray, np.ndarray] | None,
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """One rank's attention partial output (B, S, h) and its (key, value) cache entry."""
        batch, seq, _ = normed.shape
        qkv = (normed @ qkv_weight).reshape(batch, seq, 3, self.local_heads, self.head_dim)
        q = self._rotate(qkv[:, :, 0], sin, cos).transpose(0, 2, 1, 3)
        k = self._rotate(qkv[:, :, 1], sin, cos).transpose(0, 2, 1, 3)
        v = qkv[:, :, 2].transpose(0, 2, 1, 3)
        if old is not None:
            k = np.concatenate([old[0], k], axis=2)
            v = np.concatenate([old[1], v], axis=2)
        else:
            k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        scores = (q @ k.transpose(0, 1, 3, 2)) * self._scale + bias
        out = softmax(scores) @ v  # (B, heads, S, d)
        out = out.transpose(0, 2, 1, 3).reshape(batch, seq, -1)
        return out @ dense, (k, v)
