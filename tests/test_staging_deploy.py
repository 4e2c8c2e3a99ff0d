"""`make staging-deploy` end to end against the local control plane (tests/kube).

scripts/staging-deploy.sh runs unchanged with values/staging.yaml: the real Helm installs the
release, the real kubectl creates the loader Job from the CronJob, and the fake kubelet runs
the Job's container command, `model-loader run ...`, as a local process with the claim's
directory at `/models`: the real loader fetches a tiny checkpoint from a GCS emulator (a
`gs://` source, `STORAGE_EMULATOR_HOST` set through `loader.extraEnv`, as a user would point
it at any endpoint), converts it for T = 2 and publishes the key. The Triton pods' init
container then sees `.ready`, the rollout completes, and `helm test` runs the test Pod. Not
real here: Triton itself (a FasterTransformer server needs GPUs; the kubelet reports the
container started and Ready) and so the test Pod's completion (it exits 0); the test Pod's
command is run for real against a CPU Triton by tests/test_chart_helm_test.py.

The chart's `loader.ttlSecondsAfterFinished` is 0 here: the real TTL controller would delete
the finished Job at once, so the script must (and does) keep it for at least an hour to read
how the load ended.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests import chart as rc
from tests.kube import nodes as fake
from tests.kube.controlplane import ROOT
from tests.kube.kubelet import Context, Exit
from tests.servers import GcsServer

# The local control plane: in make test, and alone with make test-e2e (markers in
# pyproject.toml). tests/test_staging_deploy_recorded.py checks the script's calls in the fast tier.
pytestmark = [pytest.mark.server, pytest.mark.e2e]

STAGING = rc.VALUES_DIR / "staging.yaml"
CLAIM = "codegen-model-triton-models"


@pytest.fixture
def gcs_checkpoint(tmp_path, tiny_checkpoint_with_tokenizer):
    server = GcsServer(tmp_path / "gcs").start()
    try:
        server.upload_dir("models", "codegen-tiny", tiny_checkpoint_with_tokenizer)
        yield server, "gs://models/codegen-tiny"
    finally:
        server.stop()


def test_staging_deploy_installs_loads_rolls_and_tests_on_the_local_cluster(
    sandbox, gcs_checkpoint
):
    server, source = gcs_checkpoint
    labels = yaml.safe_load(STAGING.read_text())["cluster"]["nodeSelector"]
    sandbox.register(fake.gpu_pool("gpu", 1, fake.STAGING_2GPU, labels))

    @sandbox.rule
    def helm_test_pod(ctx: Context):
        if ctx.labels.get("app.kubernetes.io/component") == "test":
            return Exit(0)
        return None

    sets = [
        f"model.source={source}",
        "loader.extraEnv[0].name=STORAGE_EMULATOR_HOST",
        f"loader.extraEnv[0].value={server.url}",
        "loader.ttlSecondsAfterFinished=0",
        *sandbox.chart_args()[1::2],
    ]
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "staging-deploy.sh")],
        env=sandbox.env(
            YES="1",
            NAMESPACE=sandbox.namespace,
            HELM="helm4",
            KUBECTL="kubectl",
            HELM_ARGS=" ".join(f"--set {s}" for s in sets),
            LOADER_TIMEOUT_S="300",
            ROLLOUT_TIMEOUT="3m",
            POLL_S="1",
        ),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{sandbox.kubelet.errors}"
    key = sandbox.deployment("codegen-model-triton")["metadata"]["annotations"][
        "model-triton/model-key"
    ]
    assert f"==> deployed {key} to local" in proc.stdout
    assert "completed" in proc.stdout
    # The Job made from the CronJob outlives the chart's ttl of 0, and it succeeded.
    [job] = sandbox.api.list("batch/v1", "Job", sandbox.namespace)
    assert f"job/{job['metadata']['name']} from cronjob/" in proc.stdout
    assert job["spec"]["ttlSecondsAfterFinished"] >= 3600
    assert job["status"].get("succeeded") == 1
    # Pods of the new key waited for its `.ready`: no restart (one ReplicaSet, one rollout).
    assert len(sandbox.api.list("apps/v1", "ReplicaSet", sandbox.namespace)) == 1
    # The real loader published a FasterTransformer repository for T = 2 under the key.
    published = sandbox.claim_dir(CLAIM) / key
    assert (published / ".ready").exists()
    config = (published / "fastertransformer" / "config.pbtxt").read_text()
    assert 'backend: "fastertransformer"' in config
    assert 'string_value: "2"' in config.split("tensor_para_size", 1)[1][:120]
