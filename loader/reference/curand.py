"""cuRAND's XORWOW generator and ``curand_uniform``, in NumPy, one state per batch row.

FasterTransformer's samplers draw their random numbers from cuRAND's default device generator,
XORWOW (FT ``kernels/sampling_topk_kernels.cu``: ``curandInitialize`` and
``curandBatchInitialize`` call ``curand_init(seed, 0, 0, &state[i])``; ``topk_stage2_sampling``
and ``sampling_topp_kernels.cu::topp_sampling`` call ``curand_uniform`` once per row and step).
This module computes the same numbers from the published algorithm (``curand_kernel.h`` of the
CUDA toolkit; Marsaglia, "Xorshift RNGs", J. Stat. Soft. 8(14), 2003, p. 5):

* **Seeding** (``_curand_init_inplace``): the 64-bit seed's low and high words are salted
  (XOR with 0xaad26b49 and 0xf7dcefdd), multiplied by 1099087573 and 2591861531 (mod 2^32)
  into ``t0`` and ``t1``, and added to or XORed into Marsaglia's published initial values:
  ``d = 6615241 + t1 + t0``, ``v = (123456789 + t0, 362436069 ^ t0, 521288629 + t1,
  88675123 ^ t1, 5783321 + t0)``. Then ``skipahead_sequence(subsequence)`` and
  ``skipahead(offset)``; FasterTransformer passes 0 for both.
* **One draw** (``curand``): ``t = v0 ^ (v0 >> 2)``, the words shift down,
  ``v4 = (v4 ^ (v4 << 4)) ^ (t ^ (t << 1))``, ``d += 362437``; the result is ``v4 + d``.
* **Skipping** (``skipahead``, ``skipahead_sequence``): the update of ``v`` is linear over GF(2),
  so ``n`` draws are the 160x160 bit matrix of one draw raised to the ``n``-th power, and ``d``
  advances by ``362437 n``. A subsequence is 2^67 draws (the ``precalc_xorwow_matrix`` tables
  hold the powers of that matrix; we compute them).
* **``curand_uniform``** (``curand_uniform.h``, ``_curand_uniform``): ``x * 2^-32 + 2^-33`` in
  single precision, with ``x`` first rounded to a float: a value in (0, 1], 1 included.

Depends on NumPy only (the module is copied into CPU-reference repositories and runs in the
Triton image's Python 3.10).
"""

from __future__ import annotations

from functools import cache, lru_cache

import numpy as np

_MASK = 0xFFFFFFFF
_SALT = (0xAAD26B49, 0xF7DCEFDD)
_MIX = (1099087573, 2591861531)
#: Marsaglia's published initial values of ``v`` and ``d``.
_V0 = (123456789, 362436069, 521288629, 88675123, 5783321)
_D0 = 6615241
#: The Weyl sequence increment of ``d``.
WEYL = 362437
#: A subsequence is 2^67 draws long (``skipahead_sequence``).
SUBSEQUENCE_LOG2 = 67
#: ``CURAND_2POW32_INV`` (2^-32) and half of it, both exact in single precision.
_INV_2POW32 = 2.0**-32


def _uint32(value: object) -> np.ndarray:
    return np.asarray(value, dtype=np.uint64).astype(np.uint32)


def _step_words(v: np.ndarray) -> np.ndarray:
    """XORWOW's update of the five words ``v`` (rows of shape (n, 5), uint32), one draw."""
    t = v[:, 0] ^ (v[:, 0] >> np.uint32(2))
    last = v[:, 4]
    new = (last ^ (last << np.uint32(4))) ^ (t ^ (t << np.uint32(1)))
    return np.concatenate([v[:, 1:], new[:, None]], axis=1)


def _words_to_bits(v: np.ndarray) -> np.ndarray:
    """(n, 5) uint32 -> (n, 160) of 0/1, word 0 bit 0 first."""
    shifts = np.arange(32, dtype=np.uint32)
    return ((v[:, :, None] >> shifts) & np.uint32(1)).reshape(len(v), 160).astype(np.uint8)


def _bits_to_words(bits: np.ndarray) -> np.ndarray:
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
    words = (bits.reshape(len(bits), 5, 32).astype(np.uint64) * weights).sum(axis=2)
    return words.astype(np.uint32)


def _gf2_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ((a.astype(np.int64) @ b.astype(np.int64)) & 1).astype(np.uint8)


@lru_cache(maxsize=1)
def _one_draw_matrix() -> np.ndarray:
    """The 160x160 GF(2) matrix ``A`` with ``bits(v') = A @ bits(v)`` for one draw."""
    basis = np.zeros((160, 5), dtype=np.uint32)
    for i in range(160):
        basis[i, i // 32] = np.uint32(1) << np.uint32(i % 32)
    return _words_to_bits(_step_words(basis)).T.copy()


@cache
def _power_of_two_matrix(log2: int) -> np.ndarray:
    """``A^(2^log2)``: ``log2`` squarings of the one-draw matrix."""
    if log2 == 0:
        return _one_draw_matrix()
    half = _power_of_two_matrix(log2 - 1)
    return _gf2_matmul(half, half)


def _advance_words(v: np.ndarray, n: int, base_log2: int) -> np.ndarray:
    """``v`` after ``n * 2^base_log2`` draws (the words only)."""
    bits = _words_to_bits(v).T  # (160, rows)
    bit = 0
    while n:
        if n & 1:
            bits = _gf2_matmul(_power_of_two_matrix(base_log2 + bit), bits)
        n >>= 1
        bit += 1
    return _bits_to_words(bits.T)


class XorwowStates:
    """One ``curandStateXORWOW`` per row: ``curand_init(seeds[i], subsequence, offset)``."""

    def __init__(self, seeds: object, *, subsequence: int = 0, offset: int = 0) -> None:
        seeds = np.atleast_1d(np.asarray(seeds, dtype=np.uint64))
        low = _uint32(seeds & np.uint64(_MASK)) ^ np.uint32(_SALT[0])
        high = _uint32(seeds >> np.uint64(32)) ^ np.uint32(_SALT[1])
        t0 = low * np.uint32(_MIX[0])
        t1 = high * np.uint32(_MIX[1])
        self.d = np.uint32(_D0) + t1 + t0
        self.v = np.stack(
            [
                np.uint32(_V0[0]) + t0,
                np.uint32(_V0[1]) ^ t0,
                np.uint32(_V0[2]) + t1,
                np.uint32(_V0[3]) ^ t1,
                np.uint32(_V0[4]) + t0,
            ],
            axis=1,
        )
        if subsequence:
            self.skipahead_sequence(subsequence)
        if offset:
            self.skipahead(offset)

    @classmethod
    def from_words(cls, d: object, v: object) -> XorwowStates:
        """States with the given ``d`` (n,) and ``v`` (n, 5), e.g. Marsaglia's own values."""
        states = cls.__new__(cls)
        states.d = np.atleast_1d(_uint32(d))
        states.v = np.atleast_2d(_uint32(v))
        return states

    def __len__(self) -> int:
        return len(self.d)

    def skipahead(self, n: int) -> None:
        """Every row skips ``n`` draws (``skipahead``)."""
        self.v = _advance_words(self.v, int(n), 0)
        self.d = self.d + np.uint32((WEYL * int(n)) & _MASK)

    def skipahead_sequence(self, n: int) -> None:
        """Every row skips ``n`` subsequences of 2^67 draws (``d`` is unchanged: 362437 x 2^67
        is a multiple of 2^32)."""
        self.v = _advance_words(self.v, int(n), SUBSEQUENCE_LOG2)

    def next_uint32(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``curand``: one 32-bit draw for each row in ``rows`` (a bool mask or indices; all
        rows when None); the other rows' states do not move."""
        if rows is None:
            rows = slice(None)
        v = _step_words(self.v[rows])
        d = self.d[rows] + np.uint32(WEYL)
        self.v[rows] = v
        self.d[rows] = d
        return v[:, 4] + d

    def uniform(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``curand_uniform``: float32 in (0, 1] for each row in ``rows``."""
        return uniform_from_uint32(self.next_uint32(rows))


def uniform_from_uint32(x: np.ndarray) -> np.ndarray:
    """``_curand_uniform``: ``(float)x * 2^-32 + 2^-33`` rounded once to single precision (the
    product is exact, so a fused multiply-add gives the same float)."""
    as_float = np.asarray(x, dtype=np.uint32).astype(np.float32).astype(np.float64)
    return (as_float * _INV_2POW32 + _INV_2POW32 / 2).astype(np.float32)
