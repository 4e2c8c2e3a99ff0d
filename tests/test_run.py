"""`model-loader run`: fetch -> convert -> write -> publish, idempotence, checks before writing."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from loader.repository import manifest, models
from loader.repository.config import read_config
from loader.repository.layout import TOKENIZER_FILES
from loader.repository.lock import LOCKS_DIR
from loader.repository.publish import STAGING_DIR
from tests.runs import cli, run_argv


def _args(source: Path, root: Path, *extra: str, tp: int = 2, count: int = 2) -> list[str]:
    return run_argv(source, root, *extra, tp=tp, count=count, backend=None)


@pytest.fixture(scope="module")
def published(tiny_checkpoint_with_tokenizer: Path, tmp_path_factory) -> tuple[Path, Path, str]:
    """One repository published with --backend python: (root, published path, stdout)."""
    root = tmp_path_factory.mktemp("repo")
    argv = _args(tiny_checkpoint_with_tokenizer, root, "--backend", "python",
                 "--preferred-batch-size", "2", "4")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "loader", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return root, Path(proc.stdout.splitlines()[-1]), proc.stdout


def test_run_prints_the_published_path_as_the_last_stdout_line(published):
    root, path, stdout = published
    assert path.is_absolute()
    assert path.parent.parent == root
    assert path.parent.name.startswith("tiny@src-")
    assert path.name.startswith("tp2-pp1-i2-")
    assert "INFO" not in stdout  # logs go to stderr


def test_published_repository_is_complete_and_verified(published):
    root, path, _ = published
    assert (path / ".ready").is_file()
    assert manifest.verify(path, key=str(path.relative_to(root))) == []
    data = manifest.read_manifest(path)
    assert data["parallelism"] == {"tp": 2, "pp": 1, "instance_count": 2}
    assert data["settings"]["backend"] == "python"
    assert data["data_type"] == "fp32"
    assert list((root / STAGING_DIR).iterdir()) == []
    assert list((root / LOCKS_DIR).iterdir()) == []


def test_repository_layout_holds_every_model_with_its_files(
    published, tiny_checkpoint_with_tokenizer
):
    _, path, _ = published
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == [
        "fastertransformer", "llm", "postprocessing", "preprocessing", "tiny",
    ]  # fmt: skip
    assert list((path / "tiny" / "1").iterdir()) == []
    for model in ("preprocessing", "postprocessing", "llm"):
        assert (path / model / "1" / "model.py").is_file()
        for name in TOKENIZER_FILES:
            source = tiny_checkpoint_with_tokenizer / name
            copied = path / model / "1" / "tokenizer" / name
            assert copied.exists() == source.exists(), name
            if source.exists():
                assert copied.read_bytes() == source.read_bytes()
    ft = path / "fastertransformer" / "1"
    assert (ft / "model.py").is_file()
    assert (ft / "loader" / "reference" / "gptj.py").is_file()
    assert (ft / "2-gpu" / "config.ini").is_file()


def test_fastertransformer_weights_sit_in_the_backends_default_directory(published):
    """No model_checkpoint_path: FT reads <model dir>/<version>/<tensor_para_size>-gpu."""
    _, path, _ = published
    config = read_config(path / "fastertransformer" / "config.pbtxt")
    assert "model_checkpoint_path" not in config.parameters
    assert (path / "fastertransformer" / "1" / "2-gpu" / "model.wte.bin").is_file()
    assert config.backend == "python"
    assert config.parameters["tensor_para_size"].string_value == "2"
    assert config.parameters["data_type"].string_value == "fp32"
    assert [(g.count, g.kind) for g in config.instance_group] == [
        (2, mc.ModelInstanceGroup.KIND_CPU)
    ]
    assert list(config.dynamic_batching.preferred_batch_size) == [2, 4]
    assert read_config(path / "tiny" / "config.pbtxt").platform == "ensemble"


def test_weights_are_written_once_only_into_the_published_repository(published):
    root, path, _ = published
    bins = sorted(p for p in root.rglob("*.bin"))
    assert bins
    assert all(p.parent == path / "fastertransformer" / "1" / "2-gpu" for p in bins)
    assert not (root / ".work").exists()


def test_rerun_with_the_same_key_does_nothing_and_says_so(published, capsys, caplog):
    caplog.set_level(logging.INFO, logger="loader")
    root, path, _ = published
    data = manifest.read_manifest(path)
    source = data["source"]
    before = (path / manifest.MANIFEST).stat().st_ino
    code, out, _ = cli(capsys, *_args(Path(source), root, "--backend", "python",
                                         "--preferred-batch-size", "2", "4"))  # fmt: skip
    assert code == 0
    assert out[-1] == str(path)
    assert "already published and verified; nothing to do" in caplog.text
    assert (path / manifest.MANIFEST).stat().st_ino == before


def test_a_key_published_with_other_model_code_is_published_again(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, caplog, monkeypatch
):
    """The Python models copied into a key are part of what it publishes: a loader whose model
    code differs never reports that key as already published."""
    caplog.set_level(logging.INFO, logger="loader")
    source = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint_with_tokenizer, source)
    argv = _args(source, tmp_path / "models", "--backend", "python")
    code, out, _ = cli(capsys, *argv)
    assert code == 0
    path = Path(out[-1])
    first = manifest.read_manifest(path)
    assert first["model_code"] == models.code_digest()
    before = (path / manifest.MANIFEST).stat().st_ino

    monkeypatch.setattr(models, "code_digest", lambda: "0" * 64)  # another loader's models
    caplog.clear()
    code, out, _ = cli(capsys, *argv)
    assert code == 0 and Path(out[-1]) == path
    assert caplog.text.count("other model code") == 1  # checked before and under the lock
    assert (path / manifest.MANIFEST).stat().st_ino != before

    caplog.clear()
    (path / "preprocessing" / "1" / "__pycache__").mkdir()  # what a Triton writes there
    code, out, _ = cli(capsys, *argv)
    assert code == 0 and Path(out[-1]) == path
    assert caplog.text.count("is not a complete repository") == 1, caplog.text
    assert not (path / "preprocessing" / "1" / "__pycache__").exists()
    assert manifest.read_manifest(path)["model_code"] == "0" * 64

    caplog.clear()
    code, _, _ = cli(capsys, *argv)  # the same code again: nothing to do
    assert code == 0
    assert "already published and verified; nothing to do" in caplog.text

    # A changed source is refused before the model code is looked at: new weights are never
    # published under the old key because the loader changed too.
    monkeypatch.setattr(models, "code_digest", lambda: "1" * 64)
    config = source / "config.json"
    config.write_text(config.read_text() + " ")
    before = (path / manifest.MANIFEST).stat().st_ino
    code, _, _ = cli(capsys, *argv)
    assert code == 2
    assert (path / manifest.MANIFEST).stat().st_ino == before
    assert manifest.read_manifest(path)["model_code"] == "0" * 64


def test_the_model_code_digest_covers_every_copied_file(monkeypatch):
    files = sorted({src for m in models.PYTHON_MODELS for src, _ in models.model_files(m)})
    assert len(files) > 5
    original = models.code_digest()
    read = Path.read_bytes
    for changed in files:
        monkeypatch.setattr(
            Path, "read_bytes", lambda self, c=changed: read(self) + (b"#" if self == c else b"")
        )
        assert models.code_digest() != original, changed
    monkeypatch.setattr(Path, "read_bytes", read)
    assert models.code_digest() == original


def test_fastertransformer_backend_gets_no_python_model(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, caplog
):
    argv = _args(tiny_checkpoint_with_tokenizer, tmp_path, "--dtype", "fp16",
                 "--no-dynamic-batching", tp=1, count=1)  # fmt: skip
    code, out, _ = cli(capsys, *argv)
    assert code == 0
    path = Path(out[-1])
    ft = path / "fastertransformer"
    assert sorted(p.name for p in (ft / "1").iterdir()) == ["1-gpu"]
    config = read_config(ft / "config.pbtxt")
    assert config.backend == "fastertransformer"
    assert config.parameters["data_type"].string_value == "fp16"
    assert not config.HasField("dynamic_batching")
    assert "weight_data_type = fp16" in (ft / "1" / "1-gpu" / "config.ini").read_text()

    # --force publishes a fresh copy; a damaged copy is republished without --force.
    old = (path / manifest.MANIFEST).stat().st_ino
    code, out, _ = cli(capsys, *argv, "--force")
    assert code == 0 and out[-1] == str(path)
    assert (path / manifest.MANIFEST).stat().st_ino != old
    (ft / "config.pbtxt").write_text("garbage")
    code, out, _ = cli(capsys, *argv)
    assert code == 0
    assert "not a complete repository" in caplog.text
    assert manifest.verify(path) == []


def _nothing_written(root: Path) -> bool:
    return not root.exists() or not any(p.name not in (LOCKS_DIR,) for p in root.iterdir())


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--gpus-per-replica", "3"], "--gpus-per-replica to a multiple of 2"),
        (["--gpus-per-replica", "8"], "--instance-count to 4"),
        (["--gpu-memory-gib", "0.001"], "--tp-size"),
    ],
)
def test_placement_errors_come_before_anything_is_written(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, extra, needle
):
    root = tmp_path / "root"
    code, out, err = cli(capsys, *_args(tiny_checkpoint_with_tokenizer, root, *extra))
    assert code == 2
    assert out == []
    assert needle in err
    assert "Traceback" not in err
    assert not root.exists()


@pytest.mark.parametrize(
    ("count", "extra", "needles"),
    [
        # Past the chart's bound before any memory estimate.
        (10**9, (), ("The instance count must be at most 16",)),
        (
            2,
            ("--max-batch-size", str(2**30)),
            ("the largest GPU any node has", "--instance-count", "--max-batch-size"),
        ),
    ],
    ids=["I", "batch"],
)
def test_an_instance_count_or_batch_no_gpu_can_hold_is_refused_without_gpu_memory_given(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, count, extra, needles
):
    # The planner's estimate against the largest GPU any node has (loader.plan.check_memory):
    # 10^9 instances or 2^30 rows per batch would otherwise be published for every pod.
    root = tmp_path / "root"
    code, out, err = cli(capsys, *_args(tiny_checkpoint_with_tokenizer, root, *extra, count=count))
    assert code == 2 and out == []
    for needle in needles:
        assert needle in err
    assert not root.exists()


def test_a_batch_past_a_kernels_32_bit_index_is_refused_though_memory_would_hold_it(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    # 8192 rows of 512 tokens at T = 2: 8192 x 512 x 1024 / 2 = 2**31 MLP activations per GPU,
    # past the int index of FasterTransformer's GELU kernel (loader.plan.check_index_range);
    # about 125 GiB per GPU, which the memory check alone lets through.
    root = tmp_path / "root"
    code, out, err = cli(
        capsys, *_args(tiny_checkpoint_with_tokenizer, root, "--max-batch-size", "8192")
    )
    assert code == 2 and out == []
    assert "MLP activations" in err and "at most 8191" in err
    assert "Traceback" not in err
    assert not root.exists()


def test_layers_not_divisible_by_pipeline_size_are_refused(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    root = tmp_path / "root"
    argv = _args(tiny_checkpoint_with_tokenizer, root, tp=1, count=1)
    argv[argv.index("--pp-size") + 1] = "4"  # the tiny model has 2 layers
    code, _, err = cli(capsys, *argv)
    assert code == 2
    assert "--pp-size" in err
    assert not root.exists()


def test_tensor_parallel_size_not_dividing_the_heads_is_refused_before_writing(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    root = tmp_path / "root"
    code, _, err = cli(capsys, *_args(tiny_checkpoint_with_tokenizer, root, tp=3, count=1))
    assert code == 2
    assert "head count (8)" in err
    assert not root.exists()


def test_checkpoint_without_a_tokenizer_is_refused_before_writing(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    source = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_checkpoint_with_tokenizer, source,
                    ignore=shutil.ignore_patterns(*TOKENIZER_FILES))  # fmt: skip
    root = tmp_path / "root"
    code, _, err = cli(capsys, *_args(source, root))
    assert code == 2
    assert "tokenizer" in err
    assert not root.exists()


def test_missing_source_is_a_user_error(tmp_path, capsys):
    code, _, err = cli(capsys, *_args(tmp_path / "nope", tmp_path / "root"))
    assert code == 2
    assert "does not exist" in err
    assert not (tmp_path / "root").exists()


@pytest.mark.slow
def test_concurrent_loaders_of_one_key_publish_once(tiny_checkpoint_with_tokenizer, tmp_path):
    argv = [sys.executable, "-m", "loader", *_args(tiny_checkpoint_with_tokenizer, tmp_path)]
    env = {**os.environ, "MODEL_LOADER_LOG_LEVEL": "INFO"}
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    paths = {out.splitlines()[-1] for out, _ in results}
    assert len(paths) == 1
    published = [err for _, err in results if "loader.run: published" in err]
    skipped = [err for _, err in results if "nothing to do" in err]
    assert len(skipped) == 1, [err[-2000:] for _, err in results]
    assert len(published) == 1
    assert manifest.verify(Path(paths.pop())) == []


@pytest.mark.parametrize("backend", ["fastertransformer", "python"])
def test_a_head_size_fastertransformer_cannot_generate_with_is_refused_before_writing(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, backend
):
    source = shutil.copytree(tiny_checkpoint_with_tokenizer, tmp_path / "heads16")
    config = json.loads((source / "config.json").read_text())
    config["n_head"] = config["n_embd"] // 16  # same tensors, heads of 16
    (source / "config.json").write_text(json.dumps(config))
    root = tmp_path / "root"
    code, out, err = cli(capsys, *_args(source, root, tp=1, count=1), "--backend", backend)
    assert code == 2
    assert out == []
    assert "heads of size 16" in err
    assert "32, 48, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256" in err
    assert "Traceback" not in err
    assert not root.exists()
