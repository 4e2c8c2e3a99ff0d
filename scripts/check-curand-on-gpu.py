#!/usr/bin/env python3
"""Compare the CPU reference's cuRAND XORWOW (loader/reference/curand.py) with the real cuRAND.

For a machine with an NVIDIA GPU, CUDA and CuPy (``pip install numpy cupy-cuda12x``, or the
CuPy package matching the CUDA version); nothing else of this project is needed. From the
repository root:

    python3 scripts/check-curand-on-gpu.py            # 64 seeds x 2000 draws, a few skips
    python3 scripts/check-curand-on-gpu.py --draws 100000

A kernel compiled with NVRTC calls, per seed, what FasterTransformer's samplers call
(``curand_init(seed, 0, 0, &state)``, then ``curand`` and ``curand_uniform``; FT
``kernels/sampling_topk_kernels.cu``, ``curandBatchInitialize``), plus ``curand_init`` with
non-zero subsequences and offsets (``skipahead_sequence``, ``skipahead``). Every 32-bit draw and
every float must be identical. Exit status 0: all equal; 1: a difference (the first ones are
printed); 2: no GPU or no CuPy.

The project's own machines have no GPU, so the test suite checks the generator against the
published algorithm and cuRAND's published outputs instead (tests/test_curand.py); this script
is the check against the library itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loader.reference.curand import XorwowStates

KERNEL = r"""
#include <curand_kernel.h>
extern "C" __global__ void draw(const unsigned long long* seeds, const unsigned long long* subsequences,
                                const unsigned long long* offsets, int rows, int n,
                                unsigned int* raw, float* uniform) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows) return;
    curandState_t state;
    curand_init(seeds[i], subsequences[i], offsets[i], &state);
    for (int j = 0; j < n; ++j) raw[(size_t)i * n + j] = curand(&state);
    curand_init(seeds[i], subsequences[i], offsets[i], &state);
    for (int j = 0; j < n; ++j) uniform[(size_t)i * n + j] = curand_uniform(&state);
}
"""


def cases(count: int) -> list[tuple[int, int, int]]:
    """(seed, subsequence, offset): FT's (seed, 0, 0) for edge and random seeds, then skips."""
    rng = np.random.Generator(np.random.PCG64(2024))
    seeds = [0, 1, 7, 1594506369, 2**32 - 1, 2**32, 2**63 + 5, 2**64 - 1]
    seeds += [int(s) for s in rng.integers(0, 2**63, count - len(seeds), dtype=np.uint64)]
    skips = [(3, 1, 0), (3, 0, 1), (3, 2, 1000), (11, 5, 123456)]
    return [(s, 0, 0) for s in seeds] + skips


def on_gpu(rows: list[tuple[int, int, int]], draws: int) -> tuple[np.ndarray, np.ndarray]:
    import cupy as cp

    include = os.path.join(cp.cuda.get_cuda_path(), "include")
    kernel = cp.RawKernel(KERNEL, "draw", options=(f"-I{include}",))
    seeds, subsequences, offsets = (
        cp.asarray(np.array([r[i] for r in rows], dtype=np.uint64)) for i in range(3)
    )
    raw = cp.zeros((len(rows), draws), dtype=cp.uint32)
    uniform = cp.zeros((len(rows), draws), dtype=cp.float32)
    block = 64
    grid = (len(rows) + block - 1) // block
    kernel(
        (grid,), (block,),
        (seeds, subsequences, offsets, np.int32(len(rows)), np.int32(draws), raw, uniform),
    )  # fmt: skip
    return cp.asnumpy(raw), cp.asnumpy(uniform)


def on_cpu(rows: list[tuple[int, int, int]], draws: int) -> tuple[np.ndarray, np.ndarray]:
    raw = np.zeros((len(rows), draws), dtype=np.uint32)
    uniform = np.zeros((len(rows), draws), dtype=np.float32)
    for skip in sorted({(sub, off) for _, sub, off in rows}):
        index = [i for i, (_, sub, off) in enumerate(rows) if (sub, off) == skip]
        seeds = [rows[i][0] for i in index]
        states = XorwowStates(seeds, subsequence=skip[0], offset=skip[1])
        for j in range(draws):
            raw[index, j] = states.next_uint32()
        states = XorwowStates(seeds, subsequence=skip[0], offset=skip[1])
        for j in range(draws):
            uniform[index, j] = states.uniform()
    return raw, uniform


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=64, help="seeds with subsequence 0, offset 0")
    parser.add_argument("--draws", type=int, default=2000, help="draws per seed")
    args = parser.parse_args()
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("this check needs CuPy and an NVIDIA GPU: pip install cupy-cuda12x", file=sys.stderr)
        return 2
    rows = cases(args.seeds)
    try:
        gpu = on_gpu(rows, args.draws)
    except Exception as exc:  # no device, no driver, NVRTC cannot find curand_kernel.h
        print(f"cuRAND could not run on this machine: {exc}", file=sys.stderr)
        return 2
    cpu = on_cpu(rows, args.draws)
    differences = 0
    for what, got, want in (("curand", cpu[0], gpu[0]), ("curand_uniform", cpu[1], gpu[1])):
        bad = np.argwhere(got != want)
        differences += len(bad)
        for i, j in bad[:5]:
            seed, sub, off = rows[i]
            print(f"{what}: seed {seed} subsequence {sub} offset {off} draw {j}: "
                  f"reference {got[i, j]!r}, cuRAND {want[i, j]!r}")  # fmt: skip
    total = 2 * len(rows) * args.draws
    if differences:
        print(f"{differences} of {total} values differ")
        return 1
    print(f"all {total} values equal ({len(rows)} states x {args.draws} draws, raw and uniform)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
