"""Parallelism: the one set of numbers (tensor-parallel, pipeline-parallel, instances).

A :class:`Parallelism` is a value object. It knows how many GPUs one Triton replica needs and
checks the divisibility rules a model must satisfy.
"""

from __future__ import annotations

from dataclasses import dataclass

from loader.errors import ParallelismError, PlacementError
from loader.limits import INSTANCE_COUNT_MOST, PARALLEL_SIZE_MOST


@dataclass(frozen=True)
class Parallelism:
    """Tensor-parallel size ``tp``, pipeline-parallel size ``pp`` and instance count."""

    tp: int = 1
    pp: int = 1
    instance_count: int = 1

    def __post_init__(self) -> None:
        for name, flag, value, most in (
            ("tensor-parallel size", "--tp-size", self.tp, PARALLEL_SIZE_MOST),
            ("pipeline-parallel size", "--pp-size", self.pp, PARALLEL_SIZE_MOST),
            ("instance count", "--instance-count", self.instance_count, INSTANCE_COUNT_MOST),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelismError(  # names the one flag that set it (convert has no other)
                    f"The {name} must be a whole number >= 1, got {value!r}.",
                    f"Pass {flag} as a positive integer.",
                )
            if value > most:
                raise ParallelismError(
                    f"The {name} must be at most {most} (the chart's bound), got {value}.",
                    f"Pass a {name} from 1 to {most}.",
                )

    @property
    def gpus_per_instance(self) -> int:
        """GPUs one FasterTransformer instance spans (T x P)."""
        return self.tp * self.pp

    def split(self, size: int, what: str) -> int:
        """The per-rank share of a dimension of ``size`` split ``tp`` ways; refuses remainders."""
        if size % self.tp:
            raise ParallelismError(
                f"{what} ({size}) is not divisible by the tensor-parallel size {self.tp}.",
                f"Choose a --tp-size that divides {size} (e.g. {small_divisors(size)}).",
            )
        return size // self.tp

    def check_layers(self, n_layer: int) -> None:
        """FasterTransformer runs n_layer / P layers on each pipeline stage: n_layer must be
        divisible by P (a placement rule: :class:`~loader.errors.PlacementError`)."""
        if n_layer % self.pp:
            raise PlacementError(
                f"n_layer ({n_layer}) is not divisible by the pipeline-parallel size {self.pp}.",
                f"Change --pp-size to a divisor of {n_layer} (e.g. {small_divisors(n_layer)}).",
            )

    def key(self) -> str:
        """The parallelism part of a model key, e.g. ``tp2-pp1-i2``."""
        return f"tp{self.tp}-pp{self.pp}-i{self.instance_count}"


#: Candidates a divisor hint tries: sizes beyond this are not deployed anyway.
_HINT_LIMIT = 64


def small_divisors(n: int, count: int = 8) -> str:
    """The first ``count`` divisors of ``n`` up to :data:`_HINT_LIMIT`, for a hint (bounded
    work whatever ``n`` is)."""
    found = [d for d in range(1, min(n, _HINT_LIMIT) + 1) if n % d == 0]
    return ", ".join(str(d) for d in found[:count])
