"""Registry of converter architectures, keyed by ``config.json`` ``model_type``."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from loader.errors import UnsupportedArchitectureError

if TYPE_CHECKING:
    from loader.formats.fastertransformer import FTConfig
    from loader.parallel import Parallelism

    from .splits import OutputFile


@runtime_checkable
class Architecture(Protocol):
    """What a conversion plan needs from an architecture (see :mod:`loader.convert.gptj`):
    the hyper-parameters, the tensors a checkpoint must hold (whether its output embedding is
    its input one), which others it may carry, and the output files with the split rules that
    fill them."""

    model_type: str

    def ft_config(
        self, hf: dict[str, Any], *, parallelism: Parallelism, model_name: str
    ) -> FTConfig: ...

    def ties_embeddings(self, hf: dict[str, Any], names: Collection[str]) -> bool: ...

    def expected_tensors(
        self, cfg: FTConfig, *, tied: bool = False
    ) -> dict[str, tuple[int, ...]]: ...

    def is_ignored(self, name: str) -> bool: ...

    def outputs(self, cfg: FTConfig, *, tp: int, tied: bool = False) -> list[OutputFile]: ...


A = TypeVar("A")

ARCHITECTURES: dict[str, Architecture] = {}


def register(model_type: str) -> Callable[[type[A]], type[A]]:
    """Class decorator: instantiate the class and file it under ``model_type``.

    Refuses (``ValueError``) a ``model_type`` that is already registered, a class whose own
    ``model_type`` differs, and a class that lacks part of :class:`Architecture`.
    """

    def decorate(cls: type[A]) -> type[A]:
        if model_type in ARCHITECTURES:
            raise ValueError(
                f"model_type {model_type!r} is already registered "
                f"({type(ARCHITECTURES[model_type]).__name__})"
            )
        instance = cls()
        if getattr(instance, "model_type", None) != model_type:
            raise ValueError(f"{cls.__name__}.model_type is not {model_type!r}")
        if not isinstance(instance, Architecture):
            raise ValueError(f"{cls.__name__} does not implement every method of Architecture")
        ARCHITECTURES[model_type] = instance
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
