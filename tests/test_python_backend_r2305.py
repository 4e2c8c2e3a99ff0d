"""Every Python model a repository ships runs on the python_backend r23.05 API (Triton 23.05).

The models are loaded from a published repository by ``tests/r2305/driver.py`` in a ``python -S``
interpreter (only the files the repository holds, numpy and tokenizers), against
``tests/r2305/triton_python_backend_utils.py``: the r23.05 surface and nothing newer. Each is
initialised and answers one request, through the same BLS calls Triton would make; the
streaming model's last response carries data, so a 23.05 client sees the end of the stream.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from google.protobuf import json_format

from loader.parallel import Parallelism
from loader.repository.config import read_config
from loader.repository.key import ServingSettings
from loader.run import RunRequest, run

DRIVER = Path(__file__).resolve().parent / "r2305" / "driver.py"
PROMPT = "def add(a, b):"


def _publish(source: Path, root: Path, *, streaming: bool) -> Path:
    request = RunRequest(
        source=str(source),
        repository=root,
        model_name="codegen",
        parallelism=Parallelism(tp=1, pp=1, instance_count=1),
        settings=ServingSettings(backend="python", dynamic_batching=True, streaming=streaming),
    )
    return run(request).path


def _drive(published: Path, tmp_path: Path, *, streaming: str | None) -> dict:
    models = []
    for config_path in sorted(published.glob("*/config.pbtxt")):
        config = read_config(config_path)
        if config.backend != "python":
            continue
        models.append(
            {
                "name": config.name,
                "version_dir": str(config_path.parent / "1"),
                "model_config": json_format.MessageToDict(config, preserving_proto_field_name=True),
            }
        )
    spec = {
        "site": str(Path(tokenizers.__file__).resolve().parents[1]),
        "models": models,
        "streaming": streaming,
        "prompt": PROMPT,
    }
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-S", str(DRIVER), str(spec_path)],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def source(tiny_checkpoint_with_tokenizer: Path) -> Path:
    return tiny_checkpoint_with_tokenizer


def test_ensemble_models_answer_on_the_r2305_api(source, tmp_path):
    published = _publish(source, tmp_path / "models", streaming=False)
    report = _drive(published, tmp_path, streaming=None)
    assert report["dtypes"]["sequence_length"] == "int32"
    assert report["dtypes"]["output_ids"] == "uint32"
    assert set(report["dtypes"]) >= {"completion", "cum_log_probs", "output_log_probs"}
    assert report["completion"]


def test_the_streaming_model_streams_on_the_r2305_api(source, tmp_path):
    published = _publish(source, tmp_path / "models", streaming=True)
    report = _drive(published, tmp_path, streaming="codegen")
    assert report["errors"] == []
    assert report["final"] and report["final_has_data"]
    assert report["responses"] == 6 + 1  # one per generated token, then the final one
    reference = _drive(
        _publish(source, tmp_path / "plain", streaming=False), tmp_path, streaming=None
    )
    assert report["completion"] == reference["completion"]


def test_the_code_the_triton_image_runs_passes_vermin_for_python_3_10():
    """vermin over the paths ``make lint`` checks (the Makefile's TRITON_IMAGE_PYTHON)."""
    root = Path(__file__).resolve().parent.parent
    line = next(
        line
        for line in (root / "Makefile").read_text().splitlines()
        if line.startswith("TRITON_IMAGE_PYTHON :=")
    )
    paths = line.split(":=", 1)[1].split()
    assert "loader/repository/models" in paths and "loader/reference" in paths
    done = subprocess.run(
        [str(Path(sys.executable).parent / "vermin"), "-q", "-t=3.10-", "--no-tips", "--violations",
         "--eval-annotations", *paths],
        capture_output=True, text=True, timeout=120, check=False, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
