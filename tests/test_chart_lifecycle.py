"""The release through operations on a live release, on the local control plane (tests/kube):
the loader hook through rollback and through an upgrade that creates its ServiceAccount, its
NetworkPolicy before a pre-install load, what `helm uninstall` takes with it, changes a live
claim cannot take (refused before anything is applied), a rename, the same release name in two
namespaces; and offline, the values that render but could not work.
"""

from __future__ import annotations

import shutil

import pytest
import yaml

from tests import chart as rc
from tests.kube.kubelet import Context, Exit
from tests.test_chart_cluster import (
    CLAIM,
    CRONJOB,
    HOOK,
    KEY,
    PlayedLoader,
    chart,
    key_of,
    rolled_out,
    staging_nodes,
)

server = pytest.mark.server  # the local control plane (see markers in pyproject.toml)


def hook_jobs_ran(played: PlayedLoader) -> list[str]:
    return [key for key, _ in played.published]


# --------------------------------------------------------------------------- the loader hook


@server
@pytest.mark.parametrize("helm", ["helm3", "helm4"])
def test_a_rollback_to_a_pruned_key_loads_it_first(sandbox, helm):
    """prune removed the key a rollback returns to: the pre-rollback hook of that revision
    loads it again before any pod moves to it, so the rollout completes."""
    staging_nodes(sandbox)
    played = PlayedLoader(sandbox)
    sandbox.rule(played)
    sandbox.helm(helm, "install", "codegen", *chart(sandbox, *HOOK), "--timeout", "120s")
    first = key_of(sandbox)
    rolled_out(sandbox)
    sandbox.helm(
        helm, "upgrade", "codegen", *chart(sandbox, *HOOK, "model.revision=v2"), "--timeout", "120s"
    )
    rolled_out(sandbox)
    shutil.rmtree(sandbox.claim_dir(CLAIM) / first)  # what prune leaves of an old key
    sandbox.helm(helm, "rollback", "codegen", "1", "--timeout", "120s")
    assert key_of(sandbox) == first
    assert hook_jobs_ran(played)[-1] == first
    rolled_out(sandbox)
    assert (sandbox.claim_dir(CLAIM) / first / ".ready").exists()


@server
def test_an_upgrade_that_creates_the_loaders_service_account_runs_the_hook_after(sandbox):
    """The release ran the loader as `default`; the upgrade that creates its own ServiceAccount
    creates it after pre-upgrade hooks, so the chart makes the hook post-upgrade for it: the
    upgrade finishes well within --timeout and the key is loaded."""
    staging_nodes(sandbox)
    own = ("loader.serviceAccount.create=false",)
    sandbox.helm("helm4", "install", "codegen", *chart(sandbox, *own))
    sandbox.publish(CLAIM, key_of(sandbox))
    rolled_out(sandbox)
    played = PlayedLoader(sandbox)
    sandbox.rule(played)
    sandbox.helm(
        "helm4",
        "upgrade",
        "codegen",
        *chart(sandbox, *HOOK, "model.revision=v2"),
        "--timeout",
        "90s",
    )
    assert hook_jobs_ran(played) == [key_of(sandbox)]
    rolled_out(sandbox)


@server
def test_a_pre_install_load_is_fenced_by_the_loaders_network_policy(sandbox):
    """pre-install runs before Helm creates the release's resources: the hook's own copy of
    the loader's NetworkPolicy exists while the loader runs, and is gone afterwards (the
    release's own policy fences later loads)."""
    staging_nodes(sandbox)
    sandbox.api.create(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": sandbox.namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
    )
    sandbox.kubectl("create", "serviceaccount", "loader")
    seen: list[list[dict]] = []

    def loader(ctx: Context):
        if ctx.name != "loader":
            return None
        seen.append(sandbox.api.list("networking.k8s.io/v1", "NetworkPolicy", sandbox.namespace))
        key = ctx.pod["metadata"]["annotations"][KEY]
        (ctx.volume("models") / key).mkdir(parents=True, exist_ok=True)
        (ctx.volume("models") / key / ".ready").write_text("")
        return Exit(0)

    sandbox.rule(loader)
    existing = (
        *HOOK,
        "modelRepository.persistence.existingClaim=models",
        "loader.serviceAccount.create=false",
        "loader.serviceAccount.name=loader",
    )
    sandbox.helm("helm4", "install", "codegen", *chart(sandbox, *existing), "--timeout", "90s")
    [policies] = seen
    fences = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].get(
        "app.kubernetes.io/component") == "loader"]  # fmt: skip
    assert [p["metadata"]["name"] for p in fences] == [f"{CRONJOB}-hook"]
    assert fences[0]["spec"]["policyTypes"] == ["Ingress", "Egress"]
    after = sandbox.api.list("networking.k8s.io/v1", "NetworkPolicy", sandbox.namespace)
    assert sorted(p["metadata"]["name"] for p in after if "loader" in p["metadata"]["name"]) == [
        CRONJOB
    ]


@server
def test_uninstall_takes_the_loader_jobs_created_from_the_cronjob(sandbox):
    """`kubectl create job --from=cronjob/...` makes the CronJob the Job's owner: `helm
    uninstall` deletes the CronJob and the garbage collector the Job (README says so). The
    claim stays (keep: true)."""
    staging_nodes(sandbox)
    sandbox.rule(lambda ctx: None)
    sandbox.helm("helm4", "install", "codegen", *chart(sandbox))
    sandbox.kubectl("create", "job", "load-1", f"--from=cronjob/{CRONJOB}")
    job = sandbox.api.get("batch/v1", "Job", sandbox.namespace, "load-1")
    assert [o["kind"] for o in job["metadata"]["ownerReferences"]] == ["CronJob"]
    sandbox.helm("helm4", "uninstall", "codegen", "--wait")
    sandbox.wait(
        "the Job collected",
        lambda: sandbox.api.find("batch/v1", "Job", sandbox.namespace, "load-1") is None,
    )
    assert sandbox.api.find("v1", "PersistentVolumeClaim", sandbox.namespace, CLAIM)


# --------------------------------------------------------------------------- a live claim


@server
@pytest.mark.parametrize("helm", ["helm3", "helm4"])
def test_changes_a_live_claim_cannot_take_are_refused_before_anything_moves(sandbox, helm):
    staging_nodes(sandbox)
    sandbox.helm(
        helm, "install", "codegen", *chart(sandbox, "modelRepository.persistence.keep=false")
    )
    key = key_of(sandbox)
    cases = {
        "modelRepository.persistence.storageClass": ("modelRepository.persistence.storageClass=fast",),
        "modelRepository.persistence.accessMode": ("modelRepository.persistence.accessMode=ReadWriteOnce",),
        "modelRepository.persistence.size": ("modelRepository.persistence.size=1Gi",),
        "renames the release's resources": ("fullnameOverride=serving",),
        "modelRepository.persistence.existingClaim": (
            "modelRepository.persistence.existingClaim=other", "modelRepository.persistence.keep=false"),
    }  # fmt: skip
    for named, sets in cases.items():
        proc = sandbox.helm(
            helm,
            "upgrade",
            "codegen",
            *chart(sandbox, "model.revision=v2", *sets),
            check=False,
        )
        assert proc.returncode != 0, sets
        assert f"model-triton: {named}" in proc.stderr or named in proc.stderr, proc.stderr
        # Refused before Helm applied anything: the Deployment still names the old key.
        assert key_of(sandbox) == key
    history = yaml.safe_load(sandbox.helm(helm, "history", "codegen", "-o", "yaml").stdout)
    assert [r["revision"] for r in history] == [1]


# --------------------------------------------------------------------------- two releases


@server
def test_one_release_name_in_two_namespaces_shares_a_monitoring_namespace(sandbox):
    other = f"{sandbox.namespace}-b"
    monitoring = f"{sandbox.namespace}-mon"
    for namespace in (other, monitoring):
        sandbox.api.create(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        )
    try:
        sets = (
            "metrics.serviceMonitor.enabled=true",
            f"metrics.serviceMonitor.namespace={monitoring}",
            "metrics.prometheusRule.enabled=true",
            f"metrics.prometheusRule.namespace={monitoring}",
        )
        sandbox.helm("helm4", "install", "codegen", *chart(sandbox, *sets))
        sandbox.run(
            str(rc.TOOLS_BIN / "helm4"),
            "install",
            "codegen",
            *chart(sandbox, *sets),
            "--namespace",
            other,
        )
        for kind in ("ServiceMonitor", "PrometheusRule"):
            names = sorted(
                d["metadata"]["name"]
                for d in sandbox.api.list("monitoring.coreos.com/v1", kind, monitoring)
            )
            assert names == sorted(
                [f"codegen-model-triton-{sandbox.namespace}", f"codegen-model-triton-{other}"]
            )
    finally:
        for namespace in (other, monitoring):
            sandbox.api.delete(f"/api/v1/namespaces/{namespace}")


# --------------------------------------------------------------------------- offline


def names_of(release: str, *sets: str) -> set[tuple[str, str]]:
    docs = rc.documents(rc.render(release=release, set_values=sets))
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


@pytest.mark.slow  # thirty renders: every length across the names' truncation
def test_long_release_names_that_differ_late_never_share_a_resource_name():
    sets = ("metrics.serviceMonitor.enabled=true", "loader.hook.enabled=true")
    base = "a-very-long-release-name-for-the-codegen-model-"
    for length in range(39, 54):
        a = (base * 2)[: length - 1] + "a"
        b = (base * 2)[: length - 1] + "b"
        docs_a, docs_b = names_of(a, *sets), names_of(b, *sets)
        assert not docs_a & docs_b, (length, docs_a & docs_b)
        assert all(len(name) <= 63 for _, name in docs_a)
        assert all(len(name) <= 52 for kind, name in docs_a if kind == "CronJob")
    # Short names keep their documented form.
    assert ("CronJob", "codegen-model-loader") in names_of("codegen")


def refusal(*sets: str) -> str:
    with pytest.raises(rc.ChartError) as info:
        rc.render(set_values=sets)
    return str(info.value)


def test_values_that_render_but_cannot_work_get_a_clear_message():
    full = ("cluster.gpusPerNode=2", "model.tensorParallelSize=2")
    assert "T = P = 1 on shared GPUs" in refusal("cluster.gpuResourceName=nvidia.com/gpu.shared")
    assert "T = P = 1 on shared GPUs" in refusal(
        "cluster.nodeSelector.cloud\\.google\\.com/gke-gpu-sharing-strategy=time-sharing"
    )
    assert "maxUnavailable is 0 on a full pool" in refusal(
        *full, "triton.updateStrategy.maxUnavailable=0", "triton.updateStrategy.maxSurge=1"
    )
    assert "one ServiceAccount" in refusal(
        "serviceAccount.create=false", "loader.serviceAccount.create=false"
    )
    assert "no outside client could connect" in refusal("service.type=LoadBalancer")
    rc.render(
        set_values=(
            "service.type=LoadBalancer",
            "networkPolicy.allowedFrom[0].ipBlock.cidr=203.0.113.0/24",
        )
    )
    assert 'write "32Gi" or "32G"' in refusal("triton.resources.limits.memory=32GB")
    assert "put the tag in triton.image.tag" in refusal("triton.image.repository=triton:23.05")
    assert "above triton.resources.limits" not in refusal("triton.resources.limits.memory=32GB")


def test_pull_secrets_as_names_or_as_pod_spec_maps(tmp_path):
    values = tmp_path / "v.yaml"
    values.write_text("imagePullSecrets: [{name: regcred}, other]\n")
    docs = rc.documents(rc.render(values_files=(values,)))
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [
        {"name": "regcred"},
        {"name": "other"},
    ]


def test_own_tolerations_without_the_gpu_one_are_warned_about():
    notes = rc.notes(set_values=("cluster.tolerations[0].key=dedicated",
                                 "cluster.tolerations[0].operator=Exists"))  # fmt: skip
    assert "none of its entries tolerates the taint" in notes
    assert "tolerates the taint" not in rc.notes()


def test_a_one_node_volume_fits_the_loader_next_to_the_triton_pods():
    sets = ("modelRepository.persistence.accessMode=ReadWriteOnce",
            "cluster.nodeAllocatable.cpu=6", "cluster.nodeAllocatable.memory=100Gi")  # fmt: skip
    assert "the loader runs next to the Triton pods" in refusal(*sets)
    rc.render(set_values=(*sets, "loader.resources.requests.cpu=2"))
    rc.render(set_values=(*sets[1:],))  # ReadWriteMany: the loader runs anywhere
