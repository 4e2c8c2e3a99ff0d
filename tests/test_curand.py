"""loader.reference.curand: cuRAND's XORWOW and curand_uniform, against the published algorithm.

Three independent sources: a plain Python transcription of Marsaglia's xorwow (J. Stat. Soft.
8(14), 2003, p. 5) and of ``_curand_init_inplace`` / ``curand_uniform`` as ``curand_kernel.h`` and
``curand_uniform.h`` publish them, written here without NumPy; the first outputs of Marsaglia's
generator from its published initial values; and the first ten numbers cuRAND's host API
returns for XORWOW with seed 0, which are the first draws of ``curand_init(0, k, 0)`` for
subsequences k = 0..9, so they also check ``skipahead_sequence``. The last two were posted in
NVIDIA's developer forum ("XORWOW Generator Understanding in CURAND",
https://forums.developer.nvidia.com/t/xorwow-generator-understanding-in-curand/44909).
``scripts/check-curand-on-gpu.py`` compares with the real cuRAND where a GPU is at hand.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from loader.reference.curand import XorwowStates, uniform_from_uint32

M32 = 0xFFFFFFFF

#: Marsaglia's xorwow from x=123456789, y=362436069, z=521288629, w=88675123, v=5783321,
#: d=6615241: its first outputs as posted. The poster's program kept the words in 64 bits, so
#: from the eighth output on, bits above 32 (of ``v << 4``, then ``x >> 2``) change its numbers;
#: the first seven are the 32-bit algorithm's.
MARSAGLIA_FIRST_OUTPUTS = [
    246875399, 3690007200, 1264581005, 3906711041, 1866187943, 2481925219, 2464530826,
]  # fmt: skip
#: cuRAND host API, CURAND_RNG_PSEUDO_XORWOW, seed 0: its first ten outputs.
CURAND_HOST_SEED0 = [
    3179217846, 3955638199, 167591721, 4161663997, 3973448494,
    1917059131, 2866113984, 472148682, 2019573489, 2204150021,
]  # fmt: skip


class PlainXorwow:
    """The published algorithm, one state, Python integers only."""

    def __init__(self, seed: int | None = None) -> None:
        if seed is None:  # Marsaglia's own initial values
            self.x, self.y, self.z, self.w, self.v = (
                123456789, 362436069, 521288629, 88675123, 5783321,
            )  # fmt: skip
            self.d = 6615241
            return
        s0 = (seed & M32) ^ 0xAAD26B49
        s1 = ((seed >> 32) & M32) ^ 0xF7DCEFDD
        t0 = (1099087573 * s0) & M32
        t1 = (2591861531 * s1) & M32
        self.d = (6615241 + t1 + t0) & M32
        self.x = (123456789 + t0) & M32
        self.y = 362436069 ^ t0
        self.z = (521288629 + t1) & M32
        self.w = 88675123 ^ t1
        self.v = (5783321 + t0) & M32

    def next(self) -> int:
        t = self.x ^ (self.x >> 2)
        self.x, self.y, self.z, self.w = self.y, self.z, self.w, self.v
        self.v = (self.v ^ ((self.v << 4) & M32)) ^ (t ^ ((t << 1) & M32))
        self.d = (self.d + 362437) & M32
        return (self.v + self.d) & M32


def _as_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def plain_uniform(x: int) -> float:
    """``x * 2^-32 + 2^-33`` in single precision, ``x`` rounded to a float first."""
    return _as_float32(_as_float32(float(x)) * 2.0**-32 + 2.0**-33)


def test_marsaglias_published_outputs():
    states = XorwowStates.from_words(6615241, [123456789, 362436069, 521288629, 88675123, 5783321])
    ours = [int(states.next_uint32()[0]) for _ in range(7)]
    plain = PlainXorwow()
    assert ours == [plain.next() for _ in range(7)] == MARSAGLIA_FIRST_OUTPUTS


def test_curand_host_api_outputs_are_the_first_draws_of_each_subsequence():
    firsts = [int(XorwowStates(0, subsequence=k).next_uint32()[0]) for k in range(10)]
    assert firsts == CURAND_HOST_SEED0


SEEDS = [0, 1, 2, 7, 1594506369, 2**32 - 1, 2**32, 2**40 + 12345, 2**63 + 5, 2**64 - 1]


def test_seeding_and_draws_equal_the_plain_transcription_for_many_seeds():
    states = XorwowStates(SEEDS)
    plains = [PlainXorwow(seed) for seed in SEEDS]
    for _ in range(200):
        assert states.next_uint32().tolist() == [p.next() for p in plains]


def test_rows_that_do_not_draw_keep_their_state():
    states = XorwowStates([5, 5, 5])
    plain = PlainXorwow(5)
    expected = [plain.next() for _ in range(3)]
    states.next_uint32(np.array([True, False, True]))
    states.next_uint32(np.array([False, False, True]))
    assert states.next_uint32().tolist() == [expected[1], expected[0], expected[2]]


@pytest.mark.parametrize("n", [0, 1, 2, 31, 32, 33, 257, 1000])
def test_skipahead_equals_drawing(n):
    skipped = XorwowStates([3, 2**50])
    skipped.skipahead(n)
    drawn = XorwowStates([3, 2**50])
    for _ in range(n):
        drawn.next_uint32()
    assert skipped.next_uint32().tolist() == drawn.next_uint32().tolist()
    assert XorwowStates(9, offset=n).next_uint32().tolist() == (_nth(PlainXorwow(9), n + 1))


def _nth(plain: PlainXorwow, n: int) -> list[int]:
    value = 0
    for _ in range(n):
        value = plain.next()
    return [value]


def test_uniform_is_curands_single_precision_conversion():
    edges = [0, 1, 2, 255, 2**24, 2**24 + 1, 2**31, 2**32 - 129, 2**32 - 128, 2**32 - 1]
    rng = np.random.Generator(np.random.PCG64(0))
    xs = np.concatenate([np.array(edges), rng.integers(0, 2**32, 2000)]).astype(np.uint32)
    ours = uniform_from_uint32(xs)
    assert ours.dtype == np.float32
    assert ours.tolist() == [plain_uniform(int(x)) for x in xs]
    assert float(ours[0]) == 2.0**-33  # never 0
    assert float(ours[len(edges) - 1]) == 1.0  # 1 included: (0, 1]
    assert ((ours > 0) & (ours <= 1)).all()


def test_curand_uniform_draws_from_the_rows_state():
    states = XorwowStates([1594506369, 0])
    plains = [PlainXorwow(1594506369), PlainXorwow(0)]
    for _ in range(50):
        assert states.uniform().tolist() == [plain_uniform(p.next()) for p in plains]


def test_the_gpu_check_script_compares_these_numbers_with_real_curand():
    """scripts/check-curand-on-gpu.py (for a machine with a GPU and CuPy): its CPU side is this
    module, and without CuPy it says what it needs instead of failing obscurely."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "check-curand-on-gpu.py"
    spec = importlib.util.spec_from_file_location("check_curand_on_gpu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.cases(10)
    raw, uniform = script.on_cpu(rows, 20)
    for (seed, subsequence, offset), got_raw, got_uniform in zip(rows, raw, uniform, strict=True):
        if subsequence == 0:
            plain = PlainXorwow(seed)
            for _ in range(offset):
                plain.next()
            draws = [plain.next() for _ in range(20)]
            assert got_raw.tolist() == draws
            assert got_uniform.tolist() == [plain_uniform(x) for x in draws]
    done = subprocess.run(
        [sys.executable, str(path), "--seeds", "8", "--draws", "10"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode == 2:  # no CuPy or no GPU here
        assert "CuPy" in done.stderr or "could not run" in done.stderr
    else:
        assert done.returncode == 0, done.stdout + done.stderr
