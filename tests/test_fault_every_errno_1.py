"""The exhaustive fault-injection sweep, part 1 of 3 (files, so that parallel workers share
it): every call site of every local command fails with each of ENAMETOOLONG, EXDEV, EROFS in turn
(``tests/fault_sweep.py``; ``make test-faults``, not in ``make test``; the sampled sweep is
``tests/test_fault_injection.py``)."""

from __future__ import annotations

import errno

import pytest

from tests.fault_sweep import every_errno_of


@pytest.mark.exhaustive
@pytest.mark.slow
def test_every_call_site_with_every_errno(local, caplog):
    every_errno_of((errno.ENAMETOOLONG, errno.EXDEV, errno.EROFS), local, caplog)
