"""Both ways of converting follow one plan: a checkpoint gives the same files, or the same error.

The sequential conversion reads a complete checkpoint directory (:func:`convert_checkpoint`).
The overlapped one (:class:`OverlappedConversion`) is fed the same checkpoint the way a fetch
delivers it: the small files first, then each weight file admitted, copied in and announced,
in name order; files the conversion skips are not delivered. Every tiny model, and checkpoints
made hostile by one generated mutation each (a tensor moved, retyped, reshaped, dropped or
duplicated; a shard deleted, cut short or garbled; an index or config.json that lies), must
give byte-identical outputs or an error of the same class with the same words (the two
checkpoint directories named alike).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from loader.checkpoint import read_hf_config, read_inventory
from loader.convert import convert_checkpoint, plan_conversion
from loader.convert.overlapped import OverlappedConversion
from loader.errors import LoaderError
from loader.formats.huggingface import is_weight_file
from loader.parallel import Parallelism
from tests.tiers import examples
from tests.tinymodels import build_tiny_model

# Generated cases by the dozen, each rendering or running a command: in make test, not test-fast.
pytestmark = pytest.mark.slow

INDEX = "model.safetensors.index.json"
#: The base checkpoints: (architecture, stored dtype).
BASES = [("gptj", "fp32"), ("gptj", "fp16"), ("codegen", "fp16"), ("codegen", "fp32")]


class _NoProgress:
    def update(self, n: int) -> None:
        pass


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Each base model as about four safetensors shards, as save_pretrained writes them."""
    made = {}
    for arch, dtype in BASES:
        model = build_tiny_model(arch=arch, seed=7)
        model = model.half() if dtype == "fp16" else model
        path = tmp_path_factory.mktemp(f"{arch}-{dtype}") / "ckpt"
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(path, max_shard_size=total // 4)
        assert len(list(path.glob("model-*.safetensors"))) >= 3
        made[(arch, dtype)] = path
    return made


# --- the two strategies --------------------------------------------------------------------


def sequential(source: Path, out: Path, *, tp: int, dtype: str | None) -> dict[str, bytes]:
    result = convert_checkpoint(source, out, tp_size=tp, dtype=dtype, workers=2)
    return _files(result.output_path)


def overlapped(
    source: Path, work: Path, *, tp: int, dtype: str | None, settle: bool = False
) -> dict[str, bytes]:
    """Deliver ``source`` into ``work/ckpt`` as a fetch does, converting as files arrive (the
    strategy of ``model-loader run``: a plan whose dtype the tensors decide is converted after
    the download, sequentially). With ``settle``, every output the shards so far complete is
    written (and each shard nothing reads any more deleted) before the next shard arrives."""
    download = work / source.name
    download.mkdir(parents=True)
    for path in source.iterdir():
        if not is_weight_file(path.name):
            shutil.copy(path, download / path.name)
    plan = plan_conversion(
        read_hf_config(download),
        read_inventory(download),
        parallelism=Parallelism(tp=tp),
        dtype=dtype,
    )
    if plan.out_dtype is None:
        for path in source.iterdir():
            shutil.copy(path, download / path.name)
        return sequential(download, work / "out", tp=tp, dtype=dtype)
    out = work / "converted" / plan.output_dir_name
    with OverlappedConversion(
        plan, out, revision="r1", progress=_NoProgress(), workers=2, window=2
    ) as conversion:
        for path in sorted(p for p in source.iterdir() if is_weight_file(p.name)):
            if path.name in conversion.skip:
                continue
            while not conversion.admit(path.name):
                pass
            shutil.copy(path, download / path.name)
            conversion.arrived(path.name, download / path.name)
            while settle and conversion.schedule.writing:
                time.sleep(0.01)
        result = conversion.move_into(conversion.finish(), work / "out")
    assert result.digests.keys() == set(result.files)
    return _files(result.output_path)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def outcome(run: Callable[[], dict[str, bytes]], *dirs: Path) -> tuple[str, object]:
    """("files", their bytes) or ("error", its class and words with the directories named
    alike)."""
    try:
        return "files", run()
    except LoaderError as exc:
        text = str(exc)
        for folder in dirs:
            text = text.replace(str(folder), "<ckpt>")
        return "error", (type(exc).__name__, text)


def both(source: Path, *, tp: int = 2, dtype: str | None = None):
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        first = outcome(lambda: sequential(source, Path(a), tp=tp, dtype=dtype), source)
        second = outcome(
            lambda: overlapped(source, Path(b), tp=tp, dtype=dtype), Path(b) / source.name
        )
    return first, second


# --- every tiny model ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, "fp16", "fp32"])
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("base", BASES, ids=["-".join(b) for b in BASES])
def test_both_strategies_write_the_same_bytes_for_every_tiny_model(bases, base, tp, dtype):
    first, second = both(bases[base], tp=tp, dtype=dtype)
    assert first[0] == "files", first
    assert first == second


@pytest.mark.parametrize("dtype", [None, "fp16", "fp32"])
def test_sharded_pytorch_checkpoints_give_the_same_bytes_both_ways(
    tiny_sharded_bin_checkpoint, dtype
):
    """A .bin index is a plan too: with a dtype asked for (its config.json declares none), the
    overlapped strategy reads the shards as they arrive; without, both convert sequentially."""
    first, second = both(tiny_sharded_bin_checkpoint, tp=2, dtype=dtype)
    assert first[0] == "files", first
    assert first == second


@pytest.mark.parametrize("arch", ["gptj", "codegen"])
def test_a_tied_checkpoint_gives_the_same_bytes_both_ways_its_output_embedding_the_input_one(
    tmp_path, arch
):
    """save_pretrained writes the tied embedding once (no lm_head.weight): the overlapped
    conversion keeps the input embedding's shard until model.lm_head.weight is written too."""
    model = build_tiny_model(arch=arch, seed=7, tie_word_embeddings=True).half()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path / "ckpt", max_shard_size=total // 4)
    first, second = both(tmp_path / "ckpt", tp=2)
    assert first[0] == "files", first
    assert first == second
    files = first[1]
    assert files["model.lm_head.weight.bin"] == files["model.wte.bin"]


def test_fp32_weights_under_a_config_declaring_float16_are_written_in_fp16_by_both(bases, tmp_path):
    """config.json's declared dtype decides, as transformers' torch_dtype="auto" reads it."""
    source = shutil.copytree(bases[("gptj", "fp32")], tmp_path / "ckpt")
    _edit_config(source, dtype="float16")
    first, second = both(source)
    assert first == second
    assert b"weight_data_type = fp16" in first[1]["config.ini"]
    reference = load_file(source / _shard_of(source, "transformer.wte.weight"))
    assert first[1]["model.wte.bin"] == reference["transformer.wte.weight"].half().numpy().tobytes()


def test_a_buffer_stored_twice_gives_the_same_bytes_after_its_first_file_was_deleted(
    bases, tmp_path
):
    """The overlapped conversion deletes a shard once converted; a tensor the plan does not
    read (a causal-mask buffer), stored in it and in a later shard, is allowed by both
    strategies alike, whatever the writers' pace: here every output is written and every
    released shard deleted before the next shard arrives."""
    source = shutil.copytree(bases[("codegen", "fp32")], tmp_path / "ckpt")
    _buffer(source, 0)
    _buffer(source, len(_shards(source)) - 1)
    expected = outcome(lambda: sequential(source, tmp_path / "a", tp=1, dtype=None), source)
    assert expected[0] == "files", expected
    work = tmp_path / "b"
    got = outcome(
        lambda: overlapped(source, work, tp=1, dtype=None, settle=True), work / source.name
    )
    assert got == expected


def test_a_non_float_weight_is_the_same_dtype_error_with_a_hint_in_both(bases, tmp_path):
    source = shutil.copytree(bases[("gptj", "fp16")], tmp_path / "ckpt")
    _retype(source, "transformer.h.1.mlp.fc_in.bias", torch.int32)
    first, second = both(source)
    assert first == second
    assert first[0] == "error"
    assert first[1][0] == "DtypeError"
    assert "stored as int32" in first[1][1] and "Use a floating-point checkpoint" in first[1][1]


# --- hostile checkpoints, generated ---------------------------------------------------------


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _index(path: Path) -> dict:
    return json.loads((path / INDEX).read_text())


def _write_index(path: Path, index: dict) -> None:
    (path / INDEX).write_text(json.dumps(index))


def _shard_of(path: Path, tensor: str) -> str:
    return _index(path)["weight_map"][tensor]


def _edit_shard(path: Path, shard: str, edit: Callable[[dict], None]) -> None:
    state = load_file(path / shard)
    edit(state)
    save_file(state, path / shard, metadata={"format": "pt"})


def _retype(path: Path, tensor: str, dtype: torch.dtype) -> None:
    _edit_shard(path, _shard_of(path, tensor), lambda s: s.update({tensor: s[tensor].to(dtype)}))


def _tensors(path: Path) -> list[str]:
    return sorted(_index(path)["weight_map"])


def _shards(path: Path) -> list[str]:
    return sorted(set(_index(path)["weight_map"].values()))


def _move(path: Path, tensor: str, k: int) -> None:
    """Move ``tensor`` into another shard; the index still names the old one."""
    home = _shard_of(path, tensor)
    other = [s for s in _shards(path) if s != home][k % (len(_shards(path)) - 1)]
    moved = load_file(path / home)[tensor]
    _edit_shard(path, home, lambda s: s.pop(tensor))
    _edit_shard(path, other, lambda s: s.update({tensor: moved}))


def _duplicate(path: Path, tensor: str, k: int) -> None:
    home = _shard_of(path, tensor)
    other = [s for s in _shards(path) if s != home][k % (len(_shards(path)) - 1)]
    copy = load_file(path / home)[tensor]
    _edit_shard(path, other, lambda s: s.update({tensor: copy}))


def _drop_from_index(path: Path, tensor: str) -> None:
    index = _index(path)
    del index["weight_map"][tensor]
    _write_index(path, index)


def _rename(path: Path, tensor: str) -> None:
    index = _index(path)
    shard = index["weight_map"].pop(tensor)
    index["weight_map"][tensor + "_extra"] = shard
    _write_index(path, index)
    _edit_shard(path, shard, lambda s: s.update({tensor + "_extra": s.pop(tensor)}))


def _escape(path: Path, tensor: str) -> None:
    index = _index(path)
    index["weight_map"][tensor] = "../" + index["weight_map"][tensor]
    _write_index(path, index)


def _buffer(path: Path, k: int) -> None:
    """A causal-mask buffer (not a weight) in a shard, not in the index: allowed."""
    shard = _shards(path)[k % len(_shards(path))]
    mask = torch.ones(4, 4, dtype=torch.bool)
    _edit_shard(path, shard, lambda s: s.update({"transformer.h.0.attn.bias": mask}))


def _truncate(path: Path, shard: str, cut: int) -> None:
    data = (path / shard).read_bytes()
    (path / shard).write_bytes(data[: max(0, len(data) - cut)])


def _garble_header(path: Path, shard: str) -> None:
    data = bytearray((path / shard).read_bytes())
    data[9:13] = b"\xff\xfe{{"
    (path / shard).write_bytes(bytes(data))


def _reshape(path: Path, tensor: str) -> None:
    def edit(state: dict) -> None:
        value = state[tensor]
        state[tensor] = value.reshape(-1)[: max(1, value.numel() // 2)].clone()

    _edit_shard(path, _shard_of(path, tensor), edit)


MUTATIONS = {
    "declared fp16": lambda p, t, k: _edit_config(p, dtype="float16"),
    "declared fp32": lambda p, t, k: _edit_config(p, dtype="float32"),
    "declared bf16": lambda p, t, k: _edit_config(p, dtype="bfloat16"),
    "declared nothing": lambda p, t, k: _edit_config(p, dtype=None, torch_dtype=None),
    "retyped to int": lambda p, t, k: _retype(p, t, torch.int32),
    "retyped to another float": lambda p, t, k: _retype(
        p, t, (torch.float16, torch.bfloat16)[k % 2]
    ),
    "reshaped": lambda p, t, k: _reshape(p, t),
    "moved to another shard": _move,
    "duplicated in another shard": _duplicate,
    "dropped from its shard": lambda p, t, k: _edit_shard(p, _shard_of(p, t), lambda s: s.pop(t)),
    "dropped from the index": lambda p, t, k: _drop_from_index(p, t),
    "renamed": lambda p, t, k: _rename(p, t),
    "index escapes the directory": lambda p, t, k: _escape(p, t),
    "mask buffer beside the weights": lambda p, t, k: _buffer(p, k),
    "mask buffer in two shards": lambda p, t, k: (_buffer(p, k), _buffer(p, k + 1)),
    "shard deleted": lambda p, t, k: (p / _shard_of(p, t)).unlink(),
    "shard cut short": lambda p, t, k: _truncate(p, _shard_of(p, t), 1 + k * 37),
    "shard header garbled": lambda p, t, k: _garble_header(p, _shard_of(p, t)),
    "vocab_size differs": lambda p, t, k: _edit_config(p, vocab_size=300),
    "n_layer beyond the tensors": lambda p, t, k: _edit_config(p, n_layer=10**9),
    "n_layer one less": lambda p, t, k: _edit_config(p, n_layer=1),
}


@settings(
    max_examples=examples(60),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    base=st.sampled_from(BASES),
    mutations=st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=2),
    which=st.integers(min_value=0, max_value=10**6),
    tp=st.sampled_from([1, 2]),
    dtype=st.sampled_from([None, None, "fp16", "fp32"]),
)
def test_hostile_checkpoints_give_the_same_error_or_the_same_bytes_both_ways(
    bases, base, mutations, which, tp, dtype
):
    with tempfile.TemporaryDirectory() as tmp:
        source = shutil.copytree(bases[base], Path(tmp) / "ckpt")
        for k, name in enumerate(mutations):
            tensors = _tensors(source)
            if not tensors or not (source / INDEX).is_file():
                break
            tensor = tensors[(which + k) % len(tensors)]
            if not (source / _shard_of(source, tensor)).is_file():
                break  # a shard this mutation list deleted already
            try:
                MUTATIONS[name](source, tensor, which + k)
            except Exception:  # the one before left nothing this one can edit (a cut shard)
                break
        first, second = both(source, tp=tp, dtype=dtype)
    assert first == second, (mutations, first if first[0] == "error" else second)
