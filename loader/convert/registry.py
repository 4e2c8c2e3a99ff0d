"""Registry of converter architectures, keyed by ``config.json`` ``model_type``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from loader.errors import UnsupportedArchitectureError

T = TypeVar("T")

ARCHITECTURES: dict[str, object] = {}


def register(model_type: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: instantiate the class and file it under ``model_type``."""

    def decorate(cls: type[T]) -> type[T]:
        ARCHITECTURES[model_type] = cls()
        return cls

    return decorate


def get_architecture(model_type: object):  # -> Architecture (see loader.convert.gptj)
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
