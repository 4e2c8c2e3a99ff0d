"""Which tier of the suite runs (see ``markers`` in pyproject.toml and tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

#: ``MODEL_TRITON_TEST_TIER=fast`` (``make test-fast``): no server, nothing slow.
FAST_TIER = os.environ.get("MODEL_TRITON_TEST_TIER") == "fast"


def examples(full: int) -> int:
    """Hypothesis examples for a property test: ``full`` in ``make test``, a quarter (at least
    10) in the fast tier."""
    return max(10, full // 4) if FAST_TIER else full


#: The marks of a test's exhaustive variant: ``make test-faults`` only (see pyproject.toml).
EXHAUSTIVE = [pytest.mark.exhaustive, pytest.mark.slow]
