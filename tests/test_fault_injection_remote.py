"""The fault-injection sweep of the remote commands, against the GCS emulator and the olah Hub
mirror: `fetch` of a gs:// prefix or an hf:// repository and the overlapped `run` (the
conversion while the shards download, its journal, the move into staging). Every site they make
fails once, the errnos in rotation, but those ``tests/test_fault_injection.py`` fails (the same
site with the same callers: publishing, verifying), and the hf:// sweep leaves out those the
gs:// sweep fails (the conversion, its journal, the move into staging and the publishing reached
by the same callers whatever the source: four in five of the overlapped hf:// run's sites); what
must hold after each is ``tests/fault_sweep.py``'s.
"""

from __future__ import annotations

import logging

import pytest

from tests.fault_sweep import (
    HF_COMMANDS,
    LOCAL,
    REMOTE_COMMANDS,
    call_sites,
    catalog_of,
    hf_scenarios,
    remote_scenarios,
    rotation,
    sweep,
)
from tests.tiers import SAMPLED, sampled

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def failed_locally(local) -> frozenset:
    """The sites ``tests/test_fault_injection.py`` fails (publishing a repository, verifying,
    pruning: the same code with the same callers whatever the source): not failed again here."""
    _, catalog = local
    return frozenset(site for command in LOCAL for site in call_sites(catalog[command]))


@pytest.fixture(scope="module")
def remote(sharded, gs, failed_locally):
    found = remote_scenarios(sharded, gs)
    return found, catalog_of(found, REMOTE_COMMANDS, failed_elsewhere=failed_locally)


@pytest.mark.slow
@SAMPLED
@pytest.mark.parametrize("command", REMOTE_COMMANDS)
def test_every_file_system_call_site_of_a_gs_source_fails_typed(remote, command, caplog):
    _every_site_fails_typed(remote, command, caplog)


def _every_site_fails_typed(remote: tuple, command: str, caplog) -> None:
    """Each file-system call site ``command`` reaches, failed in turn: a typed error each time."""
    caplog.set_level(logging.INFO)
    scenarios, catalog = remote
    sites = catalog[command]
    assert len(sites) > 5
    sites = sampled(sites)
    failures = sweep(scenarios[command], sites, rotation, caplog)
    assert not failures, f"{len(failures)} of {len(sites)} sites:\n" + "\n".join(failures)


@pytest.fixture(scope="module")
def remote_hf(sharded, hf, failed_locally, remote):
    """The hf:// scenarios and their sites, less those the gs:// sweep fails (the same site with
    the same callers: what differs is the source's own code, ``loader/sources/hf.py``, and
    what it calls)."""
    found = hf_scenarios(sharded, hf)
    _, gs_catalog = remote
    failed = failed_locally | {site for sites in gs_catalog.values() for site in sites}
    return found, catalog_of(found, HF_COMMANDS, failed_elsewhere=failed)


@pytest.mark.slow
@SAMPLED
@pytest.mark.parametrize("command", HF_COMMANDS)
def test_every_file_system_call_site_of_an_hf_source_fails_typed(remote_hf, command, caplog):
    _every_site_fails_typed(remote_hf, command, caplog)
