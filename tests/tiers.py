"""Which tier of the suite runs (see ``markers`` in pyproject.toml and tests/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TypeVar

import pytest

T = TypeVar("T")

#: ``MODEL_TRITON_TEST_TIER=fast`` (``make test-fast``): no server, nothing slow.
FAST_TIER = os.environ.get("MODEL_TRITON_TEST_TIER") == "fast"
#: ``MODEL_TRITON_TEST_TIER=faults`` (``make test-faults``): every sweep whole.
FAULTS_TIER = os.environ.get("MODEL_TRITON_TEST_TIER") == "faults"
#: ``make test`` runs one case in this many of a sampled sweep.
SAMPLE_EVERY = 3


def examples(full: int) -> int:
    """Hypothesis examples for a property test: ``full`` in ``make test``, a quarter (at least
    10) in the fast tier."""
    return max(10, full // 4) if FAST_TIER else full


def quartered(cases: Iterable[T]) -> list[T]:
    """The steps of a sweep that the fast tier runs: the first and then every fourth, as
    :func:`examples` keeps a quarter of a property test's; every step elsewhere."""
    return list(cases)[::4] if FAST_TIER else list(cases)


#: The marks of a test's exhaustive variant: ``make test-faults`` only (see pyproject.toml).
EXHAUSTIVE = [pytest.mark.exhaustive, pytest.mark.slow]


#: The mark of a test whose sweep ``make test`` samples (:func:`sampled`) and no exhaustive
#: variant covers: ``make test-faults`` runs it whole.
SAMPLED = pytest.mark.sampled


def sampled(cases: list[T]) -> list[T]:
    """The cases of a sweep that ``make test`` runs: the first and then every
    :data:`SAMPLE_EVERY`-th, so that each kind of case the sweep lists in turn still meets
    some; every case in ``make test-faults``."""
    return list(cases) if FAULTS_TIER else list(cases)[::SAMPLE_EVERY]
