"""Policy scan of the rendered chart and the loader Dockerfile with the real checkov (pinned in .tools/, `make install`).

Everything the chart can render (defaults, every values file, every optional resource) is
scanned once per session; the only accepted findings are the checks listed, each with its
reason, in charts/model-triton/.checkov.yaml.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import chart as rc

pytestmark = (
    pytest.mark.slow
)  # a policy scanner over every rendered manifest (see markers in pyproject.toml)

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "charts" / "model-triton" / ".checkov.yaml"
INSTALL = "run `make install` (or `TOOLS_DIR=.tools bash scripts/tools/install-checkov.sh`)"
CHECKOV_VERSION = "3.3.30"

ALL_OPTIONAL = (
    "metrics.serviceMonitor.enabled=true",
    "loader.hook.enabled=true",
    "modelRepository.persistence.existingClaim=models",
    "serviceAccount.create=false",
    "serviceAccount.name=loader",
    "loader.hfTokenSecret.name=hf",
    "loader.gcsCredentialsSecret.name=gcs",
    "metrics.prometheusRule.enabled=true",
    "autoscaling.enabled=true",
    "triton.priorityClassName=serving",
    "imagePullSecrets={registry}",
)
#: The other autoscaler (one kind at a time).
KEDA = ("autoscaling.enabled=true", "autoscaling.kind=keda")
#: The OpenAI-compatible service with everything it can render (scanned under every values file).
OPENAI = (
    "openai.enabled=true",
    "openai.autoscaling.enabled=true",
    "openai.apiKeys.existingSecret=editor-keys",
    "networkPolicy.tritonFrom=openai",
)


def checkov() -> Path:
    path = rc.TOOLS_BIN / "checkov"
    assert path.exists(), f"{path} is missing: {INSTALL}"
    return path


def scan(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(checkov()),
            "--config-file",
            str(CONFIG),
            "-d",
            str(directory),
            "--skip-download",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def _summary(proc: subprocess.CompletedProcess) -> dict:
    import json

    report = json.loads(proc.stdout)
    reports = report if isinstance(report, list) else [report]
    return {
        "passed": sum(r["summary"]["passed"] for r in reports),
        "failed": [
            c["check_id"] + " " + c["resource"]
            for r in reports
            for c in r["results"]["failed_checks"]
        ],
    }


WEAK = ("containerSecurityContext.allowPrivilegeEscalation=true",)
#: The NetworkPolicies turned off: every pod unfenced.
UNFENCED = ("networkPolicy.enabled=false",)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """One checkov run over everything the chart renders, plus one deliberately weakened file
    (proves the scan bites); returns the failed checks per file and the passed count."""
    out = tmp_path_factory.mktemp("rendered")
    (out / "defaults.yaml").write_text(rc.render())
    (out / "optional.yaml").write_text(rc.render(set_values=ALL_OPTIONAL))
    (out / "keda.yaml").write_text(rc.render(set_values=KEDA))
    (out / "openai.yaml").write_text(rc.render(set_values=OPENAI))
    for values in sorted(rc.VALUES_DIR.glob("*.yaml")):
        (out / values.name).write_text(rc.render(values_files=[values]))
        (out / f"openai-{values.name}").write_text(
            rc.render(values_files=[values], set_values=OPENAI)
        )
    (out / "weakened.yaml").write_text(rc.render(set_values=WEAK))
    (out / "Dockerfile").write_text((ROOT / "loader" / "Dockerfile").read_text())
    proc = subprocess.run(
        [
            str(checkov()),
            "--config-file",
            str(CONFIG),
            "-d",
            str(out),
            "--skip-download",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed: dict[str, list[str]] = {}
    for r in reports:
        for c in r["results"]["failed_checks"]:
            failed.setdefault(Path(c["file_path"]).name, []).append(c["check_id"])
    scanned = {Path(c["file_path"]).name for r in reports for c in r["results"]["passed_checks"]}
    return {
        "failed": failed,
        "scanned": scanned,
        "passed": sum(r["summary"]["passed"] for r in reports),
        "rc": proc.returncode,
    }


def test_checkov_is_installed_pinned():
    out = subprocess.run(
        [str(checkov()), "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == CHECKOV_VERSION


def test_rendered_chart_passes_checkov_with_only_the_listed_exceptions(report):
    assert {
        "defaults.yaml",
        "optional.yaml",
        "keda.yaml",
        "staging.yaml",
        "production.yaml",
        "local.yaml",
        "openai.yaml",
        *(f"openai-{v.name}" for v in rc.VALUES_DIR.glob("*.yaml")),
    } <= report["scanned"]
    assert {f: c for f, c in report["failed"].items() if f != "weakened.yaml"} == {}
    assert report["passed"] > 500


def test_checkov_catches_a_weakened_security_context(report):
    assert report["rc"] != 0
    assert "CKV_K8S_20" in report["failed"]["weakened.yaml"]  # allowPrivilegeEscalation


@pytest.mark.parametrize(
    ("sets", "unfenced"),
    [((), 2), (("openai.enabled=true",), 3)],
    ids=["triton-and-test", "with-openai"],
)
def test_checkov_catches_pods_without_a_network_policy(tmp_path, sets, unfenced):
    # Every rendering the report scans fences its pods (the check is not skipped there); this
    # one turns the policies off and must fail. CKV2_K8S_6 matches pods to policies across all
    # scanned files, so it is scanned alone.
    (tmp_path / "chart.yaml").write_text(rc.render(set_values=(*UNFENCED, *sets)))
    proc = subprocess.run(
        [
            str(checkov()),
            *("-d", str(tmp_path), "--framework", "kubernetes", "--check", "CKV2_K8S_6"),
            *("--skip-download", "--output", "json"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    summary = json.loads(proc.stdout)["summary"]
    # the Triton and test pods, and the OpenAI-compatible service's
    assert (summary["passed"], summary["failed"]) == (0, unfenced)


def test_every_exception_is_justified_next_to_it():
    lines = CONFIG.read_text().splitlines()
    skipped = yaml.safe_load(CONFIG.read_text())["skip-check"]
    assert skipped, "the exceptions file lists no check"
    for check in skipped:
        i = next(n for n, line in enumerate(lines) if line.strip() == f"- {check}")
        comments = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith(("#", "- CKV")):
            if lines[j].strip().startswith("#"):
                comments.append(lines[j])
            j -= 1
        assert any(re.search(check, c) for c in comments), f"{check} has no justification"
        assert sum(len(c) for c in comments) > 80, f"{check}: justification too short"


def test_the_test_pod_carries_its_own_probe_exceptions(report):
    """CKV_K8S_8/9 (probes) are waived on the one-shot `helm test` Pod only, inline, with a
    reason; the Triton container must still pass them chart-wide."""
    skipped = yaml.safe_load(CONFIG.read_text())["skip-check"]
    assert "CKV_K8S_8" not in skipped and "CKV_K8S_9" not in skipped
    [pod] = [d for d in rc.documents(rc.render()) if d["kind"] == "Pod"]
    annotations = pod["metadata"]["annotations"]
    waived = sorted(v.split("=", 1)[0] for k, v in annotations.items() if k.startswith("checkov"))
    assert waived == ["CKV_K8S_8", "CKV_K8S_9"]
    assert all(len(v.split("=", 1)[1]) > 20 for k, v in annotations.items() if "checkov" in k)
