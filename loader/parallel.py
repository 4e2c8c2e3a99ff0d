"""Parallelism: the one set of numbers (tensor-parallel, pipeline-parallel, instances).

A :class:`Parallelism` is a value object. It knows how many GPUs one Triton replica needs, which
layers a pipeline stage owns, and checks the divisibility rules a model must satisfy.
"""

from __future__ import annotations

from dataclasses import dataclass

from loader.errors import ParallelismError


@dataclass(frozen=True)
class Parallelism:
    """Tensor-parallel size ``tp``, pipeline-parallel size ``pp`` and instance count."""

    tp: int = 1
    pp: int = 1
    instance_count: int = 1

    def __post_init__(self) -> None:
        for name, value in (
            ("tensor-parallel size", self.tp),
            ("pipeline-parallel size", self.pp),
            ("instance count", self.instance_count),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelismError(
                    f"The {name} must be a whole number >= 1, got {value!r}.",
                    "Pass --tp-size, --pp-size and --instance-count as positive integers.",
                )

    @property
    def gpus_per_instance(self) -> int:
        """GPUs one FasterTransformer instance spans (T x P)."""
        return self.tp * self.pp

    @property
    def tp_ranks(self) -> range:
        return range(self.tp)

    def layers_of_stage(self, stage: int, n_layer: int) -> range:
        """The decoder layers pipeline stage ``stage`` runs (FT splits layers evenly)."""
        self.check_layers(n_layer)
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage {stage} outside 0..{self.pp - 1}")
        per_stage = n_layer // self.pp
        return range(stage * per_stage, (stage + 1) * per_stage)

    def split(self, size: int, what: str) -> int:
        """The per-rank share of a dimension of ``size`` split ``tp`` ways; refuses remainders."""
        if size % self.tp:
            raise ParallelismError(
                f"{what} ({size}) is not divisible by the tensor-parallel size {self.tp}.",
                f"Choose a --tp-size that divides {size} (e.g. {_divisors_hint(size)}).",
            )
        return size // self.tp

    def check_layers(self, n_layer: int) -> None:
        """FasterTransformer needs n_layer divisible by the pipeline-parallel size."""
        if n_layer % self.pp:
            raise ParallelismError(
                f"n_layer ({n_layer}) is not divisible by the pipeline-parallel size {self.pp}.",
                f"Choose a --pp-size that divides {n_layer} (e.g. {_divisors_hint(n_layer)}).",
            )

    def key(self) -> str:
        """The parallelism part of a model key, e.g. ``tp2-pp1-i2``."""
        return f"tp{self.tp}-pp{self.pp}-i{self.instance_count}"


def _divisors_hint(n: int, limit: int = 8) -> str:
    divisors = [d for d in range(1, min(n, 64) + 1) if n % d == 0][:limit]
    return ", ".join(str(d) for d in divisors)
