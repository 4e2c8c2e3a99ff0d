"""Every file-system call site of `run`, `run --force`, `run --verify full`, `prune`, `convert`
and `fetch --copy` (and the publish lock in them) fails in turn, each with one errno of
``loader.errors.ERRNO_CLASSES`` (in rotation, so each errno meets dozens of sites; a site is
the operation and the loader's frame that makes it): each ends
typed (exit 2 or 75 with an error and a hint, or 0 where the failure does not matter), never
with a traceback, never with a half-published key, never with a lock left that the next loader
could not take over. The sites are recorded from clean runs (``tests/fault_sweep.py``); the
exhaustive sweep (every errno at every call site) is in ``tests/test_fault_every_errno_*.py``,
the gs:// commands in ``tests/test_fault_injection_remote.py``.
"""

from __future__ import annotations

import logging

import pytest

from tests.fault_sweep import (
    LOCAL,
    call_sites,
    rotation,
    sweep,
)
from tests.tiers import sampled

# Generated cases by the dozen, each rendering or running a command: in make test, not test-fast.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command", LOCAL)
def test_every_file_system_call_site_fails_typed_and_loses_nothing(local, command, caplog):
    caplog.set_level(logging.INFO)
    scenarios, catalog = local
    sites = call_sites(catalog[command])
    assert len(sites) > 5  # the seam sees the command's file-system work
    sites = sampled(sites)  # every site, with every errno: tests/test_fault_every_errno_*.py
    failures = sweep(scenarios[command], sites, rotation, caplog)
    assert not failures, f"{len(failures)} of {len(sites)} sites:\n" + "\n".join(failures)
