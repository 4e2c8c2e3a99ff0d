"""`make staging-deploy` against a recording kubectl and helm: what it asks the cluster, in what
order, and what it never does (the dry runs without a cluster are in test_chart.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the whole deploy script (see markers in pyproject.toml)

ROOT = Path(__file__).resolve().parents[1]
HELM = ROOT / ".tools" / "bin" / "helm4"


def _recorder(path: Path, log: Path, body: str) -> Path:
    """A command that appends its arguments to ``log``, then runs ``body`` (bash)."""
    path.write_text(f'#!/usr/bin/env bash\nset -euo pipefail\necho "$*" >> {log}\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def cluster(tmp_path):
    """A kubectl that answers like a cluster where the Deployment runs an older key and the
    load Job succeeds at once, and a helm that renders with the real one and records the rest."""
    log = tmp_path / "calls"
    kubectl = _recorder(
        tmp_path / "kubectl",
        log,
        """case "$*" in
  "config current-context") echo staging ;;
  *"get deployment"*) echo "codegen@older/tp2-pp1-i1-00000000" ;;
  *"get job"*succeeded*) echo 1 ;;
  *"create job"*"--dry-run=client -o json"*) echo '{"kind": "Job", "spec": {"ttlSecondsAfterFinished": 0}}' ;;
  "-n "*" create -f -") cat > "$(dirname "$0")/job.json" ;;
  *) ;;
esac""",
    )
    helm = _recorder(
        tmp_path / "helm",
        log,
        f"""case "$1" in
  template|lint) exec {HELM} "$@" ;;
  *) ;;
esac""",
    )
    return kubectl, helm, log


def test_staging_deploy_loads_the_model_then_waits_for_the_rollout_it_never_restarts(cluster):
    """Pods of a new key already wait for its `.ready`: the script waits for the rollout, and a
    restart (which would start the waiting pods over) never happens."""
    kubectl, helm, log = cluster
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "staging-deploy.sh")],
        env={**os.environ, "YES": "1", "KUBECTL": str(kubectl), "HELM": str(helm)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    kinds = [
        next((k for k in ("upgrade", "create job", "rollout status", "test") if k in c), None)
        for c in calls
    ]
    steps = [k for k in kinds if k is not None]
    assert steps == ["upgrade", "create job", "rollout status", "test"], calls
    assert not any("restart" in c or "delete" in c for c in calls), calls
    assert "new model key (was codegen@older/" in proc.stdout
    # the Job created keeps its record long enough for the script to read how it ended
    job = json.loads((kubectl.parent / "job.json").read_text())
    assert job["spec"]["ttlSecondsAfterFinished"] == 3600
