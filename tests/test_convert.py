"""The converter: exact shards for T in 1, 2, 4, byte-identical to the reference algorithm,
a complete config.ini, each file written once, and an atomic output directory."""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import loader.convert.sequential as sequential
import loader.convert.writer as writer
from loader import fs
from loader.convert import convert_checkpoint
from loader.errors import NotOursError, OutputExistsError
from tests.tinymodels import make_tiny_checkpoint, read_state_dict

NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}

#: (arch, source dtype, file format, sharded, n_inner): every axis of the matrix is covered.
CASES = {
    "gptj-fp32-safetensors": ("gptj", "fp32", "safetensors", False, None),
    "gptj-fp16-bin-sharded": ("gptj", "fp16", "bin", True, 96),
    "gptj-fp32-bin": ("gptj", "fp32", "bin", False, 96),
    "codegen-fp32-safetensors-sharded": ("codegen", "fp32", "safetensors", True, None),
    "codegen-fp16-safetensors": ("codegen", "fp16", "safetensors", False, 96),
    "codegen-fp32-bin-sharded": ("codegen", "fp32", "bin", True, 96),
}
TPS = (1, 2, 4)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {
        case: make_tiny_checkpoint(
            root / case, arch=arch, dtype=dtype, fmt=fmt, sharded=sharded, n_inner=n_inner, seed=i
        )
        for i, (case, (arch, dtype, fmt, sharded, n_inner)) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory: pytest.TempPathFactory):
    """(case, T, dtype) -> ConvertResult, dtype None = the source dtype; converted lazily once."""
    root = tmp_path_factory.mktemp("converted")
    cache = {}

    def get(case: str, tp: int, dtype: str | None = None):
        key = (case, tp, dtype)
        if key not in cache:
            out = root / f"{case}-{dtype or 'auto'}"
            cache[key] = convert_checkpoint(sources[case], out, tp_size=tp, dtype=dtype, workers=2)
        return cache[key]

    return get


# --- an independent reading of the FT files (docs/fastertransformer.md, "Files") --------------------------


def _read(path: Path, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    data = np.fromfile(path, dtype=NP_DTYPES[dtype])
    assert data.size == int(np.prod(shape)), f"{path.name}: {data.size} elements, shape {shape}"
    return data.reshape(shape)


def reassemble(ckpt_dir: Path, dtype: str, cfg: dict) -> dict[str, np.ndarray]:
    """Concatenate the rank files back into Hugging Face (GPT-J named) tensors."""
    tp = int(ckpt_dir.name.split("-")[0])
    h, inter, vocab = cfg["n_embd"], cfg["n_inner"] or 4 * cfg["n_embd"], cfg["vocab_size"]
    c, i = h // tp, inter // tp
    out = {
        "transformer.wte.weight": _read(ckpt_dir / "model.wte.bin", dtype, (vocab, h)),
        "transformer.ln_f.weight": _read(
            ckpt_dir / "model.final_layernorm.weight.bin", dtype, (h,)
        ),
        "transformer.ln_f.bias": _read(ckpt_dir / "model.final_layernorm.bias.bin", dtype, (h,)),
        "lm_head.weight": _read(ckpt_dir / "model.lm_head.weight.bin", dtype, (vocab, h)),
        "lm_head.bias": _read(ckpt_dir / "model.lm_head.bias.bin", dtype, (vocab,)),
    }
    for layer in range(cfg["n_layer"]):
        src, ft = f"transformer.h.{layer}.", ckpt_dir / f"model.layers.{layer}."

        def ranks(name: str, shape: tuple[int, ...], axis: int, ft=ft) -> np.ndarray:
            parts = [_read(Path(f"{ft}{name}.{r}.bin"), dtype, shape) for r in range(tp)]
            return np.concatenate(parts, axis=axis)

        qkv = ranks("attention.query_key_value.weight", (h, 3, c), axis=-1)  # [h_in, 3, h_out]
        out.update(
            {
                src + "ln_1.weight": _read(Path(f"{ft}input_layernorm.weight.bin"), dtype, (h,)),
                src + "ln_1.bias": _read(Path(f"{ft}input_layernorm.bias.bin"), dtype, (h,)),
                src + "attn.q_proj.weight": qkv[:, 0, :].T,
                src + "attn.k_proj.weight": qkv[:, 1, :].T,
                src + "attn.v_proj.weight": qkv[:, 2, :].T,
                src + "attn.out_proj.weight": ranks("attention.dense.weight", (c, h), axis=0).T,
                src + "mlp.fc_in.weight": ranks("mlp.dense_h_to_4h.weight", (h, i), axis=-1).T,
                src + "mlp.fc_in.bias": ranks("mlp.dense_h_to_4h.bias", (i,), axis=0),
                src + "mlp.fc_out.weight": ranks("mlp.dense_4h_to_h.weight", (i, h), axis=0).T,
                src + "mlp.fc_out.bias": _read(
                    Path(f"{ft}mlp.dense_4h_to_h.bias.bin"), dtype, (h,)
                ),
            }
        )
    return out


def hf_as_gptj(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """CodeGen's fused qkv_proj viewed as [4, 3, h/4, h] -> Q = [:,0], V = [:,1], K = [:,2]."""
    if cfg["model_type"] != "codegen":
        return dict(state)
    h = cfg["n_embd"]
    out = {}
    for name, tensor in state.items():
        if name.endswith("attn.qkv_proj.weight"):
            groups = tensor.view(4, 3, h // 4, h)
            base = name.removesuffix("qkv_proj.weight")
            out[base + "q_proj.weight"] = groups[:, 0].reshape(h, h)
            out[base + "v_proj.weight"] = groups[:, 1].reshape(h, h)
            out[base + "k_proj.weight"] = groups[:, 2].reshape(h, h)
        else:
            out[name] = tensor
    return out


def reference_files(state: dict[str, torch.Tensor], cfg: dict, tp: int, dtype: str) -> dict:
    """What the public reference converters write, computed the way they do it: whole tensors,
    torch stack/permute for QKV, NumPy ``astype`` to the file dtype, ``.T``, ``np.split``."""
    np_dtype = NP_DTYPES[dtype]
    w = hf_as_gptj(state, cfg)

    def arr(name: str) -> np.ndarray:
        return w[name].detach().cpu().numpy().astype(np_dtype)

    files = {
        "model.wte.bin": arr("transformer.wte.weight"),
        "model.final_layernorm.weight.bin": arr("transformer.ln_f.weight"),
        "model.final_layernorm.bias.bin": arr("transformer.ln_f.bias"),
        "model.lm_head.weight.bin": arr("lm_head.weight"),
        "model.lm_head.bias.bin": arr("lm_head.bias"),
    }
    for layer in range(cfg["n_layer"]):
        p, ft = f"transformer.h.{layer}.", f"model.layers.{layer}."
        qkv = torch.stack([w[p + "attn.q_proj.weight"], w[p + "attn.k_proj.weight"],
                           w[p + "attn.v_proj.weight"]]).permute(2, 0, 1)  # fmt: skip
        split = {
            "attention.query_key_value.weight": (qkv.numpy().astype(np_dtype), -1),
            "attention.dense.weight": (arr(p + "attn.out_proj.weight").T, 0),
            "mlp.dense_h_to_4h.weight": (arr(p + "mlp.fc_in.weight").T, -1),
            "mlp.dense_h_to_4h.bias": (arr(p + "mlp.fc_in.bias"), -1),
            "mlp.dense_4h_to_h.weight": (arr(p + "mlp.fc_out.weight").T, 0),
        }
        for name, (value, axis) in split.items():
            for r, piece in enumerate(np.split(value, tp, axis=axis)):
                files[f"{ft}{name}.{r}.bin"] = piece
        files[ft + "input_layernorm.weight.bin"] = arr(p + "ln_1.weight")
        files[ft + "input_layernorm.bias.bin"] = arr(p + "ln_1.bias")
        files[ft + "mlp.dense_4h_to_h.bias.bin"] = arr(p + "mlp.fc_out.bias")
    return {name: np.ascontiguousarray(value).tobytes() for name, value in files.items()}


# --- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("case", CASES)
def test_shards_reassemble_to_the_source_tensors_exactly(sources, converted, case, tp):
    result = converted(case, tp)
    cfg = json.loads((sources[case] / "config.json").read_text())
    source_dtype = CASES[case][1]
    assert result.dtype == source_dtype  # the default keeps the source dtype
    expected = hf_as_gptj(read_state_dict(sources[case]), cfg)
    got = reassemble(result.output_path, result.dtype, cfg)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        want = tensor.numpy()
        assert got[name].dtype == want.dtype, name
        assert got[name].tobytes() == np.ascontiguousarray(want).tobytes(), name


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_files_are_byte_identical_to_the_reference_converters(sources, converted, case, dtype, tp):
    result = converted(case, tp, dtype)
    cfg = json.loads((sources[case] / "config.json").read_text())
    expected = reference_files(read_state_dict(sources[case]), cfg, tp, dtype)
    written = {p.name for p in result.output_path.iterdir()}
    assert written == {"config.ini", *expected}
    assert set(result.files) == written
    for name, data in expected.items():
        assert (result.output_path / name).read_bytes() == data, name
    assert result.bytes_written == sum(len(d) for d in expected.values())


def test_fp32_to_fp16_rounds_like_torch_half(tmp_path):
    """Round to nearest even, subnormals kept, up to the largest value that rounds to a finite
    one: exactly torch's ``.half()`` (a weight it would make infinite is refused: see
    ``test_a_weight_beyond_fp16s_range_is_refused_not_written_as_infinity``)."""
    src = make_tiny_checkpoint(tmp_path / "src", dtype="fp32")
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    wte = state["transformer.wte.weight"]
    tricky = torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-11, 65519.0, -65519.0, 3e-6, -1e-8, 65504.0])
    wte.view(-1)[: tricky.numel()] = tricky
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    result = convert_checkpoint(src, tmp_path / "out", tp_size=1, dtype="fp16")
    assert (result.output_path / "model.wte.bin").read_bytes() == wte.half().numpy().tobytes()


@pytest.mark.parametrize("case", ["gptj-fp32-safetensors", "gptj-fp16-bin-sharded",
                                  "codegen-fp32-safetensors-sharded"])  # fmt: skip
def test_config_ini_has_a_complete_gptj_section(sources, converted, case):
    result = converted(case, 2)
    hf = json.loads((sources[case] / "config.json").read_text())
    ini = configparser.ConfigParser()
    ini.read(result.output_path / "config.ini")
    section = ini["gptj"]
    h = hf["n_embd"]
    assert int(section["head_num"]) == hf["n_head"]
    assert int(section["size_per_head"]) == h // hf["n_head"]
    assert int(section["inter_size"]) == (hf["n_inner"] or 4 * h)
    assert int(section["num_layer"]) == hf["n_layer"]
    assert section["rotary_embedding"] == str(hf["rotary_dim"])
    assert int(section["vocab_size"]) == hf["vocab_size"]
    assert int(section["start_id"]) == hf["bos_token_id"]
    assert int(section["end_id"]) == hf["eos_token_id"]
    assert section["weight_data_type"] == CASES[case][1]
    assert int(section["tensor_para_size"]) == 2
    assert section["model_name"]
    assert result.config.inter_size == int(section["inter_size"])


def test_n_inner_unset_means_four_times_n_embd(converted):
    assert converted("gptj-fp32-safetensors", 1).config.inter_size == 4 * 256
    assert converted("gptj-fp32-bin", 1).config.inter_size == 96


def test_every_output_file_is_opened_for_writing_exactly_once(sources, tmp_path, monkeypatch):
    opened: list[str] = []
    real_create = fs.Dir.create

    def counting_create(d, name):
        opened.append(name)
        return real_create(d, name)

    monkeypatch.setattr(fs.Dir, "create", counting_create)
    result = convert_checkpoint(
        sources["codegen-fp32-bin-sharded"], tmp_path, tp_size=2, workers=2, chunk_bytes=512
    )
    bins = [name for name in result.files if name.endswith(".bin")]
    assert sorted(opened) == sorted(bins)
    assert len(set(opened)) == len(opened)


def test_small_chunks_give_the_same_bytes_as_one_chunk(sources, converted, tmp_path):
    """Row-chunked writing (and the tiled transposes) must not depend on the chunk size."""
    whole = converted("codegen-fp16-safetensors", 2, "fp32")
    chunked = convert_checkpoint(
        sources["codegen-fp16-safetensors"], tmp_path, tp_size=2, dtype="fp32", chunk_bytes=300
    )
    for name in whole.files:
        assert (chunked.output_path / name).read_bytes() == (whole.output_path / name).read_bytes()


@pytest.mark.parametrize(("source", "target"), [("fp32", "fp16"), ("fp16", "fp32")])
def test_large_staged_transposes_are_exact(tmp_path, source, target):
    """Shapes bigger than one staging block (512, and not multiples of it) reassemble exactly."""
    src = make_tiny_checkpoint(
        tmp_path / "src", dtype=source, n_embd=576, n_head=4, n_inner=1100, n_layer=1,
        vocab_size=50, rotary_dim=16,  # heads of 144: FT rotates 8 dimensions at a time
    )  # fmt: skip
    cfg = json.loads((src / "config.json").read_text())
    result = convert_checkpoint(src, tmp_path / "out", tp_size=2, dtype=target)
    got = reassemble(result.output_path, target, cfg)
    torch_dtype = {"fp16": torch.float16, "fp32": torch.float32}[target]
    for name, tensor in read_state_dict(src).items():
        np.testing.assert_array_equal(got[name], tensor.to(torch_dtype).numpy(), err_msg=name)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_a_failure_while_writing_leaves_nothing_behind(sources, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = writer.copy_into

    def failing_cast(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "copy_into", failing_cast)
    out = tmp_path / "new" / "out"
    with pytest.raises(OSError, match="disk on fire"):
        convert_checkpoint(sources["gptj-fp32-safetensors"], out, tp_size=2, workers=2)
    assert calls["n"] >= 5
    assert not (tmp_path / "new").exists()  # the directories this run created are gone too


def test_an_interrupt_while_writing_leaves_no_partial_directory(sources, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "copy_into", interrupted)
    (tmp_path / "keep.txt").write_text("user file")
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(sources["gptj-fp32-safetensors"], tmp_path, tp_size=1, workers=1)
    assert _leftovers(tmp_path) == ["keep.txt"]


def test_an_existing_output_is_refused_then_replaced_with_force(sources, tmp_path):
    first = convert_checkpoint(sources["gptj-fp32-safetensors"], tmp_path, tp_size=1)
    with pytest.raises(OutputExistsError, match="1-gpu already exists"):
        convert_checkpoint(sources["gptj-fp32-safetensors"], tmp_path, tp_size=1, dtype="fp16")
    assert "weight_data_type = fp32" in (first.output_path / "config.ini").read_text()
    again = convert_checkpoint(
        sources["gptj-fp32-safetensors"], tmp_path, tp_size=1, dtype="fp16", overwrite=True
    )
    assert again.output_path == first.output_path
    assert "weight_data_type = fp16" in (again.output_path / "config.ini").read_text()
    assert _leftovers(tmp_path) == ["1-gpu"]


@pytest.mark.parametrize("planted", ["a user's file", "a subdirectory", "a link", "a file"])
def test_force_replaces_only_what_a_conversion_writes(sources, tmp_path, planted):
    """``overwrite`` (``convert --force``) replaces a ``<T>-gpu`` that holds only a conversion's
    files; one holding anything else, a link there or a file is the user's: refused before any
    work, and after (a directory that changed while converting), nothing of it lost."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("the user's\n")
    out = tmp_path / "out"
    first = convert_checkpoint(sources["gptj-fp32-safetensors"], out, tp_size=1)
    final = first.output_path
    if planted == "a user's file":
        (final / "notes.txt").write_text("the user's\n")
    elif planted == "a subdirectory":
        (final / "old").mkdir()
    else:
        shutil.rmtree(final)
        if planted == "a link":
            final.symlink_to(outside)
        else:
            final.write_text("the user's\n")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(NotOursError, match="to replace") as refused:
        convert_checkpoint(sources["gptj-fp32-safetensors"], out, tp_size=1, overwrite=True)
    assert "Move" in refused.value.remediation
    assert sorted(p.name for p in out.iterdir()) == before
    assert (outside / "keep.txt").read_text() == "the user's\n"
    if planted in ("a user's file", "a subdirectory"):
        # Planted while the conversion runs: the check before renaming refuses it too.
        (final / "notes.txt").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (final / "old").rmdir()
        real = writer.write_outputs

        def plant_then_write(*args, **kwargs):
            (final / "late.txt").write_text("the user's\n")
            return real(*args, **kwargs)

        with (
            pytest.MonkeyPatch.context() as patch,
            pytest.raises(NotOursError, match=r"late\.txt"),
        ):
            patch.setattr(writer, "write_outputs", plant_then_write)
            patch.setattr(sequential, "write_outputs", plant_then_write)
            convert_checkpoint(sources["gptj-fp32-safetensors"], out, tp_size=1, overwrite=True)
        assert (final / "late.txt").read_text() == "the user's\n"
        assert sorted(p.name for p in out.iterdir()) == ["1-gpu"]


def test_force_keeps_the_replaced_directory_when_something_lands_in_it_meanwhile(
    sources, tmp_path, caplog
):
    """A file planted in the old ``<T>-gpu`` after the last look, as the new one is renamed in:
    the old directory is kept under its ``.old-`` name (a warning names it), not removed."""
    out = tmp_path / "out"
    final = convert_checkpoint(sources["gptj-fp32-safetensors"], out, tp_size=1).output_path

    def hook(op: str, path: str) -> None:
        if op == "rename" and ".1-gpu.partial-" in path.split(" -> ")[0]:
            (old,) = out.glob(".1-gpu.old-*")
            (old / "late.txt").write_text("the user's\n")

    with fs.inject(hook), caplog.at_level("WARNING", logger="loader.convert.writer"):
        convert_checkpoint(sources["gptj-fp32-safetensors"], out, tp_size=1, overwrite=True)
    (old,) = out.glob(".1-gpu.old-*")
    assert (old / "late.txt").read_text() == "the user's\n"
    assert "late.txt" in caplog.text and (final / "config.ini").exists()


def test_a_directory_left_by_a_killed_run_is_reported_and_kept(sources, tmp_path, caplog):
    stale = tmp_path / ".1-gpu.partial-999999-abcd"
    stale.mkdir()
    with caplog.at_level("WARNING", logger="loader.convert.writer"):
        convert_checkpoint(sources["gptj-fp32-safetensors"], tmp_path, tp_size=1)
    assert any(stale.name in r.getMessage() for r in caplog.records)
    assert _leftovers(tmp_path) == [".1-gpu.partial-999999-abcd", "1-gpu"]
    shutil.rmtree(stale)


def test_a_directory_published_meanwhile_is_not_overwritten(sources, tmp_path, monkeypatch):
    """Two conversions racing for the same OUTPUT_DIR: the later rename refuses, keeps the first."""
    real_write = writer.write_outputs

    def write_then_lose_the_race(outputs, ckpt, directory, **kwargs):
        written = real_write(outputs, ckpt, directory, **kwargs)
        (tmp_path / "1-gpu").mkdir()
        (tmp_path / "1-gpu" / "config.ini").write_text("[gptj]\n")
        return written

    monkeypatch.setattr("loader.convert.sequential.write_outputs", write_then_lose_the_race)
    with pytest.raises(OutputExistsError, match="1-gpu already exists"):
        convert_checkpoint(sources["gptj-fp32-safetensors"], tmp_path, tp_size=1)
    assert _leftovers(tmp_path) == ["1-gpu"]
    assert (tmp_path / "1-gpu" / "config.ini").read_text() == "[gptj]\n"


def _tree(directory: Path) -> dict[str, str]:
    """Every entry below ``directory`` (not following links) and each file's text."""
    return {
        str(p.relative_to(directory)): p.read_text() if p.is_file() else "/"
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture
def outside(tmp_path) -> Path:
    """A user's directory outside ROOT that looks like each level of an output directory."""
    out = tmp_path / "outside"
    (out / "converted" / "1-gpu").mkdir(parents=True)
    (out / "converted" / "1-gpu" / "config.ini").write_text("the user's\n")
    (out / "1-gpu").mkdir()
    (out / "user.txt").write_text("the user's\n")
    return out


@pytest.mark.parametrize("level", ["work", "work/converted", "work/converted/1-gpu"])
def test_a_link_on_the_way_to_a_confined_output_is_refused_not_read_through(
    sources, tmp_path, outside, level
):
    """``run`` converts into its work directory, a confined tree: whether the output directory
    is there, what is in the way, and whether ``<T>-gpu`` exists are looked up one name at a
    time; a link at any level is a NotOursError naming it, never followed (a ``1-gpu`` beside
    the link's target would otherwise read as "already exists", or be written into)."""
    from loader.errors import NotOursError

    root = tmp_path / "root"
    planted = root / level
    planted.parent.mkdir(parents=True)
    planted.symlink_to(outside)
    before = _tree(outside)
    with fs.confined(root), pytest.raises(NotOursError, match=str(planted)):
        convert_checkpoint(sources["gptj-fp32-safetensors"], root / "work" / "converted", tp_size=1)
    assert _tree(outside) == before
    assert planted.is_symlink() and os.readlink(planted) == str(outside)


def test_the_free_space_probe_never_follows_a_link_in_a_confined_tree(tmp_path, outside):
    """The free-space check asks the deepest existing level through its descriptor: a link on
    the way to it (below ROOT) is refused, the disk it leads to never asked."""
    from loader.convert.sequential import _check_free_space
    from loader.errors import InsufficientDiskSpaceError, NotOursError

    root = tmp_path / "root"
    root.mkdir()
    (root / "work").symlink_to(outside)
    with fs.confined(root):
        with pytest.raises(NotOursError, match=str(root / "work")):
            _check_free_space(root / "work" / "converted", 1)
        (root / "work").unlink()
        (root / "work").mkdir()
        _check_free_space(root / "work" / "converted" / "missing", 1)
        with pytest.raises(InsufficientDiskSpaceError, match=f"{root / 'work'} has"):
            _check_free_space(root / "work" / "converted", 2**62)


def test_a_file_in_the_way_of_a_users_output_is_named(sources, tmp_path):
    """OUTPUT_DIR the user names is followed as given; a file (or a dangling link) where a
    directory belongs is an OutputPathError naming it."""
    from loader.errors import OutputPathError

    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match=f"{tmp_path / 'file'} is a file"):
        convert_checkpoint(sources["gptj-fp32-safetensors"], tmp_path / "file" / "out", tp_size=1)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(
        OutputPathError, match=f"{tmp_path / 'dangling'} is a dangling symbolic link, not a dir"
    ):
        convert_checkpoint(sources["gptj-fp32-safetensors"], tmp_path / "dangling", tp_size=1)
    assert not (tmp_path / "nowhere").exists()
    # Each is named for what it is: a FIFO, and a link to one, are not called files.
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    for name, what in (("fifo", "a FIFO"), ("to-fifo", "a symbolic link to a FIFO")):
        with pytest.raises(OutputPathError, match=f"{tmp_path / name} is {what}, not a dir"):
            convert_checkpoint(sources["gptj-fp32-safetensors"], tmp_path / name, tp_size=1)


def test_the_levels_an_output_directory_needs_are_looked_up_through_descriptors(tmp_path, outside):
    """Which levels of ``<T>-gpu``'s parent are missing (created, and removed again on failure)
    is asked through the seam one name at a time, before anything is made: a dangling link at a
    level below ROOT is refused (nothing made where it leads), never taken for a missing level."""
    from loader.errors import NotOursError

    root = tmp_path / "root"
    (root / "work").mkdir(parents=True)
    seen: list[tuple[str, str]] = []
    with (
        fs.confined(root),
        fs.inject(lambda op, path: seen.append((op, path))),
        pytest.raises(RuntimeError),
        writer.atomic_directory(root / "work/a/b/1-gpu"),
    ):
        raise RuntimeError("failed while writing")
    made = [(op, p) for op, p in seen if op == "mkdir"]
    assert made[0] == ("mkdir", str(root / "work/a"))
    assert seen.index(("stat", str(root / "work/a"))) < seen.index(made[0])
    assert os.listdir(root / "work") == []  # the levels this run made are gone, none other
    (root / "work" / "a").symlink_to(outside / "nowhere")
    with (
        fs.confined(root),
        pytest.raises(NotOursError, match=str(root / "work/a")),
        writer.atomic_directory(root / "work/a/b/1-gpu"),
    ):
        pass
    assert sorted(os.listdir(outside)) == ["1-gpu", "converted", "user.txt"]
    assert os.readlink(root / "work" / "a") == str(outside / "nowhere")
