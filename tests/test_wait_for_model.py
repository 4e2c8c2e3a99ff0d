"""The Triton pods' `wait-for-model` init container, as the chart renders it: it waits quietly
(a sleep between looks, one log line per look), ends when `.ready` appears, fails with the
loader's command after its deadline, and ends at once, rather than spinning, when its image
lacks `sleep` or `date`. On the local control plane, the fake kubelet runs it with the image's
`PATH` and nothing of the test process's environment (tests/kube/kubelet.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests import chart as rc
from tests.kube import nodes as fake
from tests.kube.kubelet import IMAGE_PATH, container_environment, rotate_log

SH = "/bin/sh"


def _wait_container(sets: tuple[str, ...] = ()) -> dict:
    docs = rc.documents(rc.render(helm="helm4", values_files=(), set_values=sets))
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    [wait] = [
        c
        for c in deployment["spec"]["template"]["spec"]["initContainers"]
        if c["name"] == "wait-for-model"
    ]
    return wait


def _run_script(models: Path, path: str, *, timeout: float, interval: int = 1, limit: int = 600):
    wait = _wait_container()
    assert wait["command"][:2] == ["sh", "-c"]
    env = {e["name"]: e["value"] for e in wait["env"]}
    env["MODEL_PATH"] = str(models)
    env["WAIT_INTERVAL_SECONDS"] = str(interval)
    env["WAIT_TIMEOUT_SECONDS"] = str(limit)
    return subprocess.Popen(
        [SH, "-c", wait["command"][2]],
        env={**env, "PATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and of the children it has waited for (utime, stime, cutime,
    cstime of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("path", ["/nonexistent", ""], ids=["no-tools", "empty"])
def test_without_sleep_or_date_the_wait_ends_instead_of_spinning(tmp_path, path):
    proc = _run_script(tmp_path, path, timeout=10)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 1
    # It gave up at its first look: no stream of "waiting" lines.
    assert out.count("waiting for") <= 1, out[:500]


def test_the_wait_sleeps_between_looks_and_ends_when_the_model_is_published(tmp_path):
    proc = _run_script(tmp_path, IMAGE_PATH, timeout=30)
    try:
        start_cpu, start = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(3)
        used = _cpu_seconds(proc.pid) - start_cpu
        waited = time.monotonic() - start
        (tmp_path / ".ready").write_text("")
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"model {tmp_path} is published" in out
    # One look a second: a few lines, and the shell mostly asleep (a spinning loop uses a
    # whole core and writes millions of lines).
    assert out.count("waiting for") <= waited + 2, out[:500]
    assert used / waited < 0.05, f"{used:.3f} CPU-s in {waited:.1f} s"


def test_past_its_deadline_the_wait_fails_naming_the_loader_command(tmp_path):
    proc = _run_script(tmp_path, IMAGE_PATH, timeout=20, interval=1, limit=1)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 1
    assert "not published after 1s" in out
    assert "kubectl create job load-" in out and "--from=cronjob/" in out


# --------------------------------------------------------------------------- the fake kubelet


def test_a_container_gets_the_image_environment_and_nothing_of_the_test_process(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MODEL_TRITON_LEAK", "1")
    env = container_environment("busybox:1.37.0", "pod-a", {"A": "1"}, [], tmp_path / "home")
    assert env == {
        "PATH": IMAGE_PATH,
        "HOME": str(tmp_path / "home"),
        "HOSTNAME": "pod-a",
        "A": "1",
    }
    loader = container_environment(
        "registry.example/model-triton-loader:0.1.0",
        "load-1",
        {},
        [("/tmp", tmp_path / "scratch")],
        tmp_path / "home",
    )
    # loader/Dockerfile: ENV PATH=/opt/venv/bin:$PATH, PYTHONUNBUFFERED, PYTHONDONTWRITEBYTECODE,
    # HOME=/tmp (an emptyDir in the chart's loader pod).
    assert loader["PATH"].endswith(f":{IMAGE_PATH}")
    assert loader["HOME"] == str(tmp_path / "scratch")
    assert loader["PYTHONDONTWRITEBYTECODE"] == "1" and loader["PYTHONUNBUFFERED"] == "1"
    assert "MODEL_TRITON_LEAK" not in env and "MODEL_TRITON_LEAK" not in loader


def test_container_logs_rotate_at_their_cap_keeping_a_bounded_number_of_files(tmp_path):
    log = tmp_path / "ns_pod_c.log"
    with log.open("ab") as writer:  # the container's descriptor, kept open across rotations
        for round_ in range(8):
            writer.write(b"x" * 150 + f" {round_}\n".encode())
            writer.flush()
            rotate_log(log, max_bytes=100, max_files=3)
        writer.write(b"last\n")
        writer.flush()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["ns_pod_c.log", "ns_pod_c.log.1", "ns_pod_c.log.2"]
    # The writer's next line starts the truncated file, the newest rotated one holds round 7.
    assert log.read_bytes() == b"last\n"
    assert (tmp_path / "ns_pod_c.log.1").read_bytes().endswith(b" 7\n")
    assert (tmp_path / "ns_pod_c.log.2").read_bytes().endswith(b" 6\n")


@pytest.mark.server
def test_a_waiting_pod_on_the_local_cluster_sleeps_and_logs_little(sandbox):
    """The chart installed by the real Helm; the fake kubelet runs the rendered init container
    as a local `sh` with the busybox image's PATH. It waits (no `.ready`), using a small
    fraction of a core and writing a line a second."""
    staging = rc.VALUES_DIR / "staging.yaml"
    labels = yaml.safe_load(staging.read_text())["cluster"]["nodeSelector"]
    sandbox.register(fake.gpu_pool("gpu", 1, fake.STAGING_2GPU, labels))
    sandbox.helm("helm4", "install", "codegen", str(rc.CHART), *sandbox.chart_args([staging]))
    procs = sandbox.wait(
        "the wait-for-model process runs",
        lambda: [
            p
            for (_, c), p in sandbox.kubelet.processes(sandbox.namespace).items()
            if c == "wait-for-model"
        ],
    )
    proc = procs[0]
    start_cpu, start = _cpu_seconds(proc.pid), time.monotonic()
    time.sleep(5)
    used, waited = _cpu_seconds(proc.pid) - start_cpu, time.monotonic() - start
    assert proc.poll() is None, "the init container ended instead of waiting"
    assert used / waited < 0.02, f"{used:.3f} CPU-s in {waited:.1f} s: the wait spins"
    [log] = [p for p in sandbox.cluster.logs.glob(f"{sandbox.namespace}_*_wait-for-model.log")]
    lines = log.read_text().splitlines()
    assert 1 <= sum("waiting for" in line for line in lines) <= waited + 8, lines[-5:]
    assert not any("not found" in line for line in lines), lines[:5]
