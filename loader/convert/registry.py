"""Registry of converter architectures, keyed by ``config.json`` ``model_type``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from loader.errors import UnsupportedArchitectureError

if TYPE_CHECKING:
    from loader.formats.fastertransformer import FTConfig
    from loader.parallel import Parallelism

    from .splits import OutputFile


class Architecture(Protocol):
    """What the pipeline needs from an architecture module (see :mod:`loader.convert.gptj`)."""

    model_type: str

    def ft_config(
        self,
        hf: dict[str, Any],
        *,
        parallelism: Parallelism,
        weight_data_type: str,
        model_name: str,
    ) -> FTConfig: ...

    def expected_tensors(self, cfg: FTConfig) -> dict[str, tuple[int, ...]]: ...

    def is_ignored(self, name: str) -> bool: ...

    def outputs(self, cfg: FTConfig, *, tp: int) -> list[OutputFile]: ...


A = TypeVar("A")

ARCHITECTURES: dict[str, Architecture] = {}


def register(model_type: str) -> Callable[[type[A]], type[A]]:
    """Class decorator: instantiate the class and file it under ``model_type``."""

    def decorate(cls: type[A]) -> type[A]:
        ARCHITECTURES[model_type] = cls()  # type: ignore[assignment]
        return cls

    return decorate


def get_architecture(model_type: object) -> Architecture:
    """The converter for ``model_type``; a clear error listing what is supported otherwise."""
    supported = ", ".join(sorted(ARCHITECTURES))
    if not model_type:
        raise UnsupportedArchitectureError(
            "config.json has no model_type.",
            f"Use a checkpoint of a supported architecture ({supported}) with a complete config.json.",
        )
    try:
        return ARCHITECTURES[str(model_type)]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported by the converter; supported: {supported}.",
            f"Use a checkpoint of a supported architecture ({supported}).",
        ) from None
