"""The stage timer: off by default and free of effect, on it sums wall, CPU, calls and bytes
per stage, and ``MODEL_LOADER_PROFILE`` makes a conversion write them as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader import stages

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _off_afterwards():
    yield
    stages.disable()


def test_a_stage_records_nothing_while_profiling_is_off():
    with stages.stage("write", 10):
        pass
    assert stages.snapshot()["stages"] == {}


def test_a_stage_sums_wall_cpu_calls_and_bytes_when_on():
    stages.enable()
    for _ in range(2):
        with stages.stage("sleep", 5):
            time.sleep(0.02)
    row = stages.snapshot()["stages"]["sleep"]
    assert row["calls"] == 2 and row["bytes"] == 10
    assert row["wall_s"] >= 0.04
    assert row["cpu_s"] < row["wall_s"]  # sleeping is waiting, not CPU


def test_convert_writes_its_stages_to_the_file_profile_names(tmp_path, sharded_fp16_checkpoint):
    out = tmp_path / "profile.json"
    subprocess.run(
        [sys.executable, "-m", "loader", "-q", "convert", str(sharded_fp16_checkpoint),
         str(tmp_path / "out"), "--tp-size", "1"],
        check=True, cwd=ROOT, env={**os.environ, "MODEL_LOADER_PROFILE": str(out)},
    )  # fmt: skip
    found = json.loads(out.read_text())
    assert {"open + map + check headers", "rename into place"} <= set(found["stages"])
    assert found["process"]["wall_s"] > 0
