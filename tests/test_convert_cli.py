"""`model-loader convert`: bad input is a typed error, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from loader.cli import main
from tests.tinymodels import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-J: 8 heads, n_inner 100 (divisible by 4, not by 8), 2 layers."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("good") / "ckpt", n_inner=100)


@pytest.fixture(scope="module")
def good_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("good-bin") / "ckpt", fmt="bin")


def variant(good: Path, tmp_path: Path) -> Path:
    path = tmp_path / "src"
    shutil.copytree(good, path)
    return path


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path: Path, edit) -> None:
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["convert", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_refused(capsys, out_dir: Path, argv: list[str], *fragments: str) -> str:
    rc, stdout, err = run_cli(capsys, *argv)
    assert rc == 2, err
    assert stdout == ""
    assert "Traceback" not in err
    assert err.startswith("error: ") or "\nerror: " in err
    assert "\nhint: " in err
    for fragment in fragments:
        assert fragment in err, err
    assert not out_dir.exists() or list(out_dir.iterdir()) == []  # no <T>-gpu, no temp dir
    return err


def test_heads_not_divisible_by_tp(good, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(good), str(out), "--tp-size", "3"],
        "The attention head count (8) is not divisible by the tensor-parallel size 3",
        "Choose a --tp-size that divides 8",
    )  # fmt: skip


def test_inter_size_not_divisible_by_tp(good, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(good), str(out), "--tp-size", "8"],
        "The MLP width (n_inner) (100) is not divisible by the tensor-parallel size 8",
    )  # fmt: skip


def test_layers_not_divisible_by_pp(good, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(good), str(out), "--tp-size", "2", "--pp-size", "3"],
        "n_layer (2) is not divisible by the pipeline-parallel size 3",
    )  # fmt: skip


def test_tp_size_zero(good, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(capsys, out, [str(good), str(out), "--tp-size", "0"], "tensor-parallel size")


def test_unknown_tensor(good, tmp_path, capsys):
    src = variant(good, tmp_path)
    edit_tensors(
        src, lambda s: s.update({"transformer.h.0.attn.rogue.weight": s["lm_head.bias"].clone()})
    )
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "2"],
        "1 tensor(s) a gptj model does not have: transformer.h.0.attn.rogue.weight",
    )  # fmt: skip


def test_missing_tensor(good, tmp_path, capsys):
    src = variant(good, tmp_path)
    edit_tensors(src, lambda s: s.pop("transformer.h.1.mlp.fc_out.bias"))
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "1"],
        "lacks 1 tensor(s) a gptj model with this config.json needs: transformer.h.1.mlp.fc_out.bias",
    )  # fmt: skip


def test_tensor_shape_that_contradicts_config_json(good, tmp_path, capsys):
    src = variant(good, tmp_path)
    edit_config(src, vocab_size=300)
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "1"],
        "Tensor transformer.wte.weight in model.safetensors has shape [320, 256], but config.json "
        "implies [300, 256]",
    )  # fmt: skip


def test_truncated_safetensors_shard(good, tmp_path, capsys):
    src = variant(good, tmp_path)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:-1000])
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "1"],
        f"{src / 'model.safetensors'} is truncated or corrupt",
    )  # fmt: skip


def test_truncated_bin_shard(good_bin, tmp_path, capsys):
    src = variant(good_bin, tmp_path)
    data = (src / "pytorch_model.bin").read_bytes()
    (src / "pytorch_model.bin").write_bytes(data[: len(data) - 5000])
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "1"],
        f"{src / 'pytorch_model.bin'} is truncated or corrupt",
    )  # fmt: skip


def _shorten_a_record(path: Path, keep: float) -> None:
    """Rewrite the zip archive at ``path`` with its largest tensor record cut to ``keep`` of
    its bytes (the archive itself whole and valid)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        members = [(info, archive.read(info.filename)) for info in archive.infolist()]
    largest = max((info for info, _ in members if "/data/" in info.filename),
                  key=lambda info: info.file_size)  # fmt: skip
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for info, data in members:
            archive.writestr(info, data[: int(len(data) * keep)] if info is largest else data)


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_bin_whose_tensor_record_is_shorter_than_its_tensors_is_refused(
    good_bin, tmp_path, capsys, keep
):
    """Before: torch.load(mmap=True) views each storage at its record's offset for as many
    bytes as the pickle says, whatever the record holds: a record cut short inside a valid
    zip archive converted without an error, the missing bytes read from the records after
    it, and run published them as weights."""
    src = variant(good_bin, tmp_path)
    _shorten_a_record(src / "pytorch_model.bin", keep)
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "1"],
        f"{src / 'pytorch_model.bin'} is truncated or corrupt", "bytes",
    )  # fmt: skip


def test_unknown_dtype(good, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(good), str(out), "--tp-size", "1", "--dtype", "int8"],
        "Unknown dtype 'int8'; supported: fp32, fp16", "Use --dtype fp16 or --dtype fp32",
    )  # fmt: skip


def test_bf16_source_needs_an_explicit_dtype(good, tmp_path, capsys):
    src = variant(good, tmp_path)
    edit_tensors(src, lambda s: s.update({k: v.bfloat16() for k, v in s.items()}))
    edit_config(src, dtype="bfloat16")
    out = tmp_path / "out"
    assert_refused(capsys, out, [str(src), str(out), "--tp-size", "1"], "stored in bf16")
    rc, _, err = run_cli(capsys, str(src), str(out), "--tp-size", "1", "--dtype", "fp32")
    assert rc == 0, err
    assert "weight_data_type = fp32" in (out / "1-gpu" / "config.ini").read_text()
    wte = load_file(src / "model.safetensors")["transformer.wte.weight"]
    assert (out / "1-gpu" / "model.wte.bin").read_bytes() == wte.float().numpy().tobytes()


def test_missing_config_json(good, tmp_path, capsys):
    src = variant(good, tmp_path)
    (src / "config.json").unlink()
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "1"],
        f"{src / 'config.json'} is missing", "Point the loader at a complete Hugging Face checkpoint",
    )  # fmt: skip


def test_unsupported_architecture_lists_the_supported_ones(good, tmp_path, capsys):
    src = variant(good, tmp_path)
    edit_config(src, model_type="llama")
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "1"],
        "model_type 'llama' is not supported by the converter; supported: codegen, gptj",
    )  # fmt: skip


def test_existing_output_needs_force(good, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli(capsys, str(good), str(out), "--tp-size", "2")[0] == 0
    before = (out / "2-gpu" / "model.wte.bin").stat().st_mtime_ns
    rc, _, err = run_cli(capsys, str(good), str(out), "--tp-size", "2")
    assert rc == 2
    assert "2-gpu already exists" in err and "Pass --force" in err
    assert (out / "2-gpu" / "model.wte.bin").stat().st_mtime_ns == before
    rc, _, err = run_cli(capsys, str(good), str(out), "--tp-size", "2", "--force")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["2-gpu"]


def test_success_prints_the_output_path_last_and_logs_progress_and_a_summary(
    good, tmp_path, capsys, caplog
):
    out = tmp_path / "out"
    with caplog.at_level("INFO"):
        rc, stdout, err = run_cli(capsys, str(good), str(out), "--tp-size", "2", "--dtype", "fp16")
    assert rc == 0, err
    assert stdout.strip().splitlines()[-1] == str((out / "2-gpu").resolve())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "convert 2-gpu:" in logged and "(100%)" in logged  # the plain progress line (no TTY)
    assert "wrote 32 files" in logged
    assert "weight_data_type = fp16" in (out / "2-gpu" / "config.ini").read_text()


def test_the_real_command_exits_2_without_a_traceback(good, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "loader", "convert", str(good), str(tmp_path / "o"),
         "--tp-size", "3"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "error: The attention head count (8) is not divisible" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_head_size_fastertransformer_cannot_generate_with(good, tmp_path, capsys):
    source = variant(good, tmp_path)
    edit_config(source, n_head=16)  # 256 / 16: heads of 16, the tensors unchanged
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(source), str(out), "--tp-size", "1"],
        "heads of size 16", "supports only head sizes 32, 48, 64",
    )  # fmt: skip


def test_an_mlp_width_per_rank_fastertransformer_cannot_activate(good, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(good), str(out), "--tp-size", "4"],  # n_inner 100 / 4 = 25: odd
        "leaves each rank 25 MLP columns", "Choose a smaller --tp-size",
    )  # fmt: skip


def test_a_rotary_dimension_fastertransformer_applies_differently(good, tmp_path, capsys):
    source = variant(good, tmp_path)
    edit_config(source, rotary_dim=33)  # heads of 32: beyond the head, the tensors unchanged
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(source), str(out), "--tp-size", "1"],
        "rotary_dim 33 is not between 1 and the head size 32",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("tensor", "source"),
    [
        ("transformer.h.0.mlp.fc_in.weight", "float32"),  # transposed while cast
        ("lm_head.bias", "float32"),  # cast as it is
        ("transformer.h.1.attn.q_proj.weight", "bfloat16"),  # fused into QKV
    ],
)
def test_a_weight_beyond_fp16s_range_is_refused_not_written_as_infinity(
    good, tmp_path, capsys, tensor, source
):
    """A finite weight that fp16 cannot hold (beyond 65504) would be written as infinity:
    FasterTransformer loads the file and every sum through that weight is inf or NaN."""
    import torch

    src = variant(good, tmp_path)

    def enlarge(state):
        for name in state:
            state[name] = state[name].to(getattr(torch, source))
        state[tensor].view(-1)[3] = 1e5

    edit_tensors(src, enlarge)
    edit_config(src, torch_dtype=source)
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "2", "--dtype", "fp16"],
        tensor, "65504", "--dtype fp32",
    )  # fmt: skip
    rc, _, err = run_cli(capsys, str(src), str(out), "--tp-size", "2", "--dtype", "fp32")
    assert rc == 0, err


@pytest.mark.parametrize(
    ("tensor", "source"),
    [
        ("transformer.h.0.mlp.fc_in.weight", "float32"),
        ("lm_head.bias", "float32"),
        ("transformer.h.1.attn.q_proj.weight", "bfloat16"),
    ],
)
def test_a_nan_the_source_holds_excuses_no_other_weight_beyond_fp16s_range(
    good, tmp_path, capsys, tensor, source
):
    """A finite weight beyond fp16's range is named as such, with the hint to convert to fp32,
    even where the same chunk, or another tensor fused with it, holds a NaN or an infinity."""
    import torch

    src = variant(good, tmp_path)

    def enlarge(state):
        for name in state:
            state[name] = state[name].to(getattr(torch, source))
        state[tensor].view(-1)[0] = float("nan")
        state[tensor].view(-1)[3] = 1e5
        if tensor.startswith("transformer.h.1.attn."):  # fused with it into one file
            state["transformer.h.1.attn.k_proj.weight"].view(-1)[1] = float("inf")

    edit_tensors(src, enlarge)
    edit_config(src, torch_dtype=source)
    out = tmp_path / "out"
    assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "2", "--dtype", "fp16"],
        tensor, "65504", "--dtype fp32",
    )  # fmt: skip


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("tensor", "source", "dtype", "value"),
    [
        ("transformer.ln_f.weight", "float16", "fp16", NAN),  # copied by the kernel
        ("transformer.h.0.ln_1.bias", "float32", "fp32", INF),  # kept in its dtype
        ("transformer.h.0.mlp.fc_in.weight", "float32", "fp32", -INF),  # transposed
        ("transformer.h.1.attn.k_proj.weight", "float32", "fp16", NAN),  # fused, narrowed
        ("transformer.wte.weight", "bfloat16", "fp16", INF),
        ("lm_head.bias", "float16", "fp32", -INF),  # widened
    ],
)
def test_a_nan_or_infinity_in_the_source_is_refused_naming_its_tensor(
    good, tmp_path, capsys, monkeypatch, tensor, source, dtype, value
):
    """FasterTransformer loads a file holding one and generates garbage: whatever path its
    bytes take (a kernel copy, a view written as it is, a cast or a transpose), refused."""
    import torch

    from loader.convert import writer

    spans = []
    real_span = writer._byte_span

    def byte_span(out, ckpt, out_dtype):
        found = real_span(out, ckpt, out_dtype)
        spans.append((out.sources, found is not None))
        return found

    monkeypatch.setattr(writer, "_byte_span", byte_span)
    src = variant(good, tmp_path)

    def damage(state):
        for name in state:
            state[name] = state[name].to(getattr(torch, source))
        state[tensor].view(-1)[5] = value

    edit_tensors(src, damage)
    edit_config(src, torch_dtype=source)
    out = tmp_path / "out"
    err = assert_refused(
        capsys, out, [str(src), str(out), "--tp-size", "2", "--dtype", dtype],
        f"{tensor} holds a NaN or an infinite weight", "use another checkpoint or revision",
    )  # fmt: skip
    assert "65504" not in err
    if tensor == "transformer.ln_f.weight":
        assert ((tensor,), True) in spans  # its bytes were on their way to the kernel copy


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("value", [INF, -INF, NAN])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_2_byte_weight_that_is_not_finite_is_found_in_any_row_of_a_large_tensor(
    kind, value, where
):
    """The check of 2-byte floats looks at a few rows at a time: an infinity (every exponent
    bit set, no mantissa bit: the smallest such pattern) or a NaN is found in the first row
    and in the last one of a tensor many steps long, and the largest finite weights, of
    either sign, are no such weight."""
    import numpy as np
    import torch

    from loader.convert import writer

    rows, cols = 4 * writer._CHECK_ELEMENTS // 1024 + 3, 1024
    dtype = torch.float16 if kind == "fp16" else torch.bfloat16
    top = float(torch.finfo(dtype).max)
    tensor = torch.full((rows, cols), top, dtype=dtype)
    tensor[1::2] = -top
    values = tensor.view(torch.int16).numpy().view(np.uint16)
    if kind == "fp16":
        values = values.view(np.float16)
    source = kind if kind == "bf16" else None
    assert not writer._any_not_finite(values, source)
    tensor[0 if where == "first" else -1, -1] = value
    values = tensor.view(torch.int16).numpy().view(np.uint16)
    if kind == "fp16":
        values = values.view(np.float16)
    assert writer._any_not_finite(values, source)
    assert writer._any_not_finite(values.reshape(rows * 2, cols // 2), source)


def test_run_refuses_a_nan_in_the_source_before_publishing(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """run computes every file's digest, so every byte passes through the check."""
    from tests.runs import checkpoint_copy, cli, run_argv

    src, weights = checkpoint_copy(tiny_checkpoint_with_tokenizer, tmp_path / "src")
    state = load_file(weights)
    state["transformer.ln_f.bias"].view(-1)[0] = NAN
    save_file(state, weights, metadata={"format": "pt"})
    root = tmp_path / "models"
    code, _, err = cli(capsys, *run_argv(src, root))
    assert code == 2, err
    assert "transformer.ln_f.bias holds a NaN or an infinite weight" in err, err
    assert not (root / "tiny").exists()
