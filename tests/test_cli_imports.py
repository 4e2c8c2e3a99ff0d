"""A command imports only what it uses: the libraries of the other commands (gRPC and the
Triton client, the cloud SDKs, the benchmark and plotting stack, torch) cost a loader Job CPU
seconds at every start and are never loaded where they are not needed.

Each command runs for real in a fresh interpreter, which then lists every module it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Imported by no command below: what other commands, or nothing, need.
NEVER = (
    "grpc",  # the gRPC client: `complete --protocol grpc` only
    "tritonclient.grpc",  # its package (config.pbtxt needs only the protobuf classes)
    "tritonclient.utils",
    "loader.bench",
    "matplotlib",
    "transformers",
    "torch",  # .bin checkpoints only
    "huggingface_hub",  # hf:// sources only
    "google.cloud",  # gs:// sources only
    "requests",
)


def _python(code: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter in ``cwd`` (with ``env`` added to the environment)."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def _imported(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> tuple[int, set[str]]:
    """Run ``model-loader ARGV`` in a fresh interpreter; its exit code and sys.modules."""
    proc = _python(
        "import json, sys\n"
        "from loader.cli import main\n"
        "try:\n"
        f"    rc = main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    rc = exc.code\n"
        "print('MODULES=' + json.dumps(sorted(sys.modules)))\n"
        "sys.stdout.flush()\n"
        "raise SystemExit(rc)\n",
        cwd,
        env,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MODULES="))
    return proc.returncode, set(json.loads(line.removeprefix("MODULES=")))


#: The one module of a NEVER package a command may load: Triton's config classes, loaded alone
#: (loader.repository.config.model_config_module).
CONFIG_CLASSES = "tritonclient.grpc.model_config_pb2"


def _offending(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    """The modules that are, or lie inside, one of ``prefixes``."""
    return sorted(
        m
        for m in modules - {CONFIG_CLASSES}
        if any(m == p or m.startswith(p + ".") for p in prefixes)
    )


def test_convert_loads_neither_protobuf_nor_a_digest_nor_another_commands_libraries(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    argv = ["-q", "convert", str(tiny_checkpoint_with_tokenizer), str(tmp_path / "out"),
            "--tp-size", "2"]  # fmt: skip
    code, modules = _imported(argv, tmp_path)
    assert code == 0
    assert (tmp_path / "out" / "2-gpu" / "config.ini").is_file()
    assert "loader.convert.sequential" in modules  # it did convert
    assert _offending(modules, (*NEVER, "google.protobuf", "tritonclient", "loader.run")) == []
    assert CONFIG_CLASSES not in modules


def test_run_loads_only_triton_s_config_classes_of_the_triton_client(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    argv = ["-q", "run", "--source", str(tiny_checkpoint_with_tokenizer), "--repository",
            str(tmp_path / "root"), "--model-name", "tiny", "--tp-size", "1", "--pp-size", "1",
            "--instance-count", "1"]  # fmt: skip
    code, modules = _imported(argv, tmp_path)
    assert code == 0
    assert list((tmp_path / "root").glob("tiny@*/*/.ready"))
    assert CONFIG_CLASSES in modules  # config.pbtxt was written with them
    assert _offending(modules, NEVER) == []


@pytest.mark.parametrize(
    ("argv", "loaded"),
    [
        (["--version"], ()),
        (["convert", "--help"], ("loader.convert", "numpy")),
        (["fetch", "--help"], ("loader.sources.gcs", "loader.sources.hf", "numpy")),
        (["plan", "--help"], ("loader.convert", "numpy")),
        (["prune", "--help"], ("loader.convert", "numpy")),
        (["run", "--help"], ()),
    ],
)
def test_a_command_s_help_loads_none_of_the_heavy_libraries(argv, loaded, tmp_path):
    code, modules = _imported(argv, tmp_path)
    assert code == 0
    assert _offending(modules, (*NEVER, *loaded)) == []


def test_fetch_refuses_a_credentials_setting_before_loading_the_storage_client(tmp_path):
    """The Cloud Storage client's libraries take about a second to import: a key file setting
    that names no file is refused before they are loaded."""
    (tmp_path / "key.json").mkdir()
    env = {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "key.json"),
           "CLOUDSDK_CONFIG": str(tmp_path / "gcloud")}  # fmt: skip
    argv = ["fetch", "gs://bucket/prefix", str(tmp_path / "dest"), "--retry-deadline", "5"]
    code, modules = _imported(argv, tmp_path, env)
    assert code == 2
    assert "loader.sources.gcs" in modules  # the command got as far as its source
    assert _offending(modules, ("google.cloud.storage",)) == []


def test_the_config_classes_loaded_alone_are_the_triton_client_s_own(tmp_path):
    proc = _python(
        "import sys\n"
        "from loader.repository.config import mc\n"
        "assert 'tritonclient.grpc' not in sys.modules\n"
        "import tritonclient.grpc\n"
        "assert tritonclient.grpc.model_config_pb2 is mc\n"
        "assert tritonclient.grpc.model_config_pb2.ModelConfig is mc.ModelConfig\n"
        "print('ok')\n",
        tmp_path,
    )
    assert proc.stdout.strip() == "ok", proc.stderr
