"""loader.checkpoint: every weight layout reads back the exact tensors; broken input is a typed error."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loader.checkpoint import open_checkpoint, read_hf_config
from loader.errors import CheckpointError, CorruptFileError, DtypeError, FileContentError
from tests.tinymodels import make_tiny_checkpoint, read_state_dict

LAYOUTS = [
    ("safetensors", False, "model.safetensors"),
    ("safetensors", True, "model.safetensors.index.json"),
    ("bin", False, "pytorch_model.bin"),
    ("bin", True, "pytorch_model.bin.index.json"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        (fmt, sharded): make_tiny_checkpoint(
            root / f"{fmt}-{sharded}", fmt=fmt, sharded=sharded, dtype="fp16", seed=3
        )
        for fmt, sharded, _ in LAYOUTS
    }


@pytest.mark.parametrize(("fmt", "sharded", "marker"), LAYOUTS)
def test_every_layout_reads_back_the_exact_tensors(checkpoints, fmt, sharded, marker):
    path = checkpoints[(fmt, sharded)]
    assert (path / marker).is_file()
    expected = read_state_dict(path)
    with open_checkpoint(path) as ckpt:
        assert set(ckpt.names()) == set(expected)
        assert (len(ckpt.files) > 1) == sharded
        for name, array in ckpt.iter_tensors():
            info = ckpt.tensors[name]
            assert info.dtype == "fp16"
            assert info.shape == tuple(expected[name].shape)
            np.testing.assert_array_equal(array, expected[name].numpy())


def test_tensors_are_views_of_the_file_not_copies(checkpoints):
    with open_checkpoint(checkpoints[("safetensors", False)]) as ckpt:
        wte = ckpt.get("transformer.wte.weight")
        assert not wte.flags.owndata
        assert not wte.flags.writeable


def test_read_hf_config_returns_config_json(checkpoints):
    config = read_hf_config(checkpoints[("bin", False)])
    assert config["model_type"] == "gptj"
    assert config["n_embd"] == 256


def test_missing_config_json_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        read_hf_config(tmp_path)


def test_a_directory_without_weights_lists_what_it_looked_for(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gptj"}))
    with pytest.raises(CheckpointError, match=r"holds no weights: looked for model\.safetensors"):
        open_checkpoint(tmp_path)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_safetensors_file_cut_short_names_the_file(checkpoints, tmp_path):
    path = _copy(checkpoints[("safetensors", True)], tmp_path / "ck")
    shard = sorted(path.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    assert shard.name in str(info.value)
    assert "truncated or corrupt" in str(info.value)


def test_a_safetensors_header_cut_short_names_the_file(checkpoints, tmp_path):
    path = _copy(checkpoints[("safetensors", False)], tmp_path / "ck")
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated or corrupt"):
        open_checkpoint(path)


def test_a_safetensors_header_that_is_not_json_names_the_file(checkpoints, tmp_path):
    path = _copy(checkpoints[("safetensors", False)], tmp_path / "ck")
    shard = path / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors .*header is not valid JSON"):
        open_checkpoint(path)


def test_a_bin_file_cut_short_names_the_file(checkpoints, tmp_path):
    path = _copy(checkpoints[("bin", False)], tmp_path / "ck")
    shard = path / "pytorch_model.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin is truncated or corrupt"):
        open_checkpoint(path)


def test_a_storage_named_twice_must_fit_its_record_each_time(tmp_path):
    """torch.load views a storage key at the size it is first named with; a pickle naming
    key 0 with 1000 elements, then with 2, over a record of 8 bytes is refused (the size it
    is last named with fits)."""
    import io
    import pickle
    import zipfile

    from loader.checkpoint import _check_records

    class Named:
        def __init__(self, numel: int) -> None:
            self.numel = numel

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Named):
                return ("storage", torch.FloatStorage, "0", "cpu", obj.numel)
            return None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump({"a": Named(1000), "b": Named(2)})
    path = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data.getvalue())
        archive.writestr("archive/data/0", bytes(8))
    with pytest.raises(CheckpointError, match="holds 8 bytes, fewer than the 4000"):
        _check_records(path)


def _archive(path: Path, records: list[tuple[str, bytes]], **storages: int) -> Path:
    """A zip archive of ``records`` (name, bytes), in that order, each ``data.pkl`` in them a
    pickle naming storage ``KEY`` with ``storages[KEY]`` float elements (``_0`` for ``0``)."""
    import io
    import pickle
    import warnings
    import zipfile

    class Named:
        def __init__(self, key: str, numel: object) -> None:
            self.key, self.numel = key, numel

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Named):
                return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
            return None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump({k: Named(k.lstrip("_"), n) for k, n in storages.items()})
    with zipfile.ZipFile(path, "w") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": some tests write one
        for name, body in records:
            archive.writestr(name, data.getvalue() if body is None else body)
    return path


def _records_check(path: Path) -> str:
    import warnings

    from loader.checkpoint import _check_records

    with pytest.raises(CheckpointError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile: "Duplicate name"
        _check_records(path)
    return info.value.message


@pytest.mark.parametrize(
    "second", ["archive/data/data.pkl", "archive/x/data.pkl"], ids=["in data", "in a folder"]
)
def test_a_second_tensor_list_in_the_archive_hides_no_short_record(tmp_path, second):
    """torch.load reads ``data.pkl`` in the folder of the first record. Before: another record
    named ``data.pkl`` turned the check off, and torch.load viewed storage 0's 4000 bytes
    across the records after its 8."""
    path = _archive(
        tmp_path / "pytorch_model.bin",
        [("archive/data.pkl", None), ("archive/data/0", bytes(8)),
         ("archive/data/1", bytes(4096)), ("archive/version", b"3\n"), (second, b"")],
        _0=1000,
    )  # fmt: skip
    assert "record 0 holds 8 bytes, fewer than the 4000" in _records_check(path)


def test_a_record_name_written_twice_is_refused(tmp_path):
    """zipfile reads the last of two records of one name, PyTorch's reader the first: the
    8 bytes of the first would be viewed as 4000."""
    path = _archive(
        tmp_path / "pytorch_model.bin",
        [("archive/data.pkl", None), ("archive/data/0", bytes(8)),
         ("archive/data/1", bytes(4096)), ("archive/data/0", bytes(4000))],
        _0=1000,
    )  # fmt: skip
    assert "record name(s) twice, archive/data/0 first" in _records_check(path)


@pytest.mark.parametrize(
    ("records", "numel", "said"),
    [
        ([("archive/data/0", bytes(4 * 10 - 1))], 10, "holds 39 bytes, fewer than the 40"),
        ([], 10, "tensor record 0 is missing"),
        ([("archive/data/0", bytes(8))], True, "has True elements"),
        ([("archive/data/0", bytes(8))], -1, "has -1 elements"),
        ([("archive/data/0", bytes(8))], 2.0, "has 2.0 elements"),
    ],
    ids=["one byte short", "missing", "bool", "negative", "float"],
)
def test_a_storage_record_the_tensor_list_cannot_view_is_refused(tmp_path, records, numel, said):
    path = _archive(
        tmp_path / "pytorch_model.bin", [("archive/data.pkl", None), *records], _0=numel
    )
    assert said in _records_check(path)


def test_a_tensor_list_that_does_not_read_or_is_too_large_is_refused(tmp_path, monkeypatch):
    from loader import checkpoint

    path = _archive(tmp_path / "a.bin", [("archive/data.pkl", b"\x80\x02garbage")])
    assert "its tensor list does not read" in _records_check(path)
    path = _archive(
        tmp_path / "b.bin", [("archive/data.pkl", None), ("archive/data/0", bytes(8))], _0=2
    )
    monkeypatch.setattr(checkpoint, "_MAX_PICKLE", 16)
    assert "its tensor list is larger than" in _records_check(path)


def test_a_tensor_list_larger_than_a_state_dicts_is_refused_before_it_is_unpickled(tmp_path):
    """A 5 MiB pickle of empty dicts (a byte each) was within the limit (64 MiB): the check
    built a dict for each byte, and torch.load did again, in Python (64 MiB of them: about
    5 GB in the check, then minutes in torch.load; empty sets, about 14 GB in the check)."""
    listing = b"\x80\x02" + b"}" * (5 * 2**20) + b"."
    path = _archive(tmp_path / "pytorch_model.bin", [("archive/data.pkl", listing)])
    assert "its tensor list is larger than 4 MiB" in _records_check(path)


def test_a_tensor_list_naming_one_class_again_and_again_is_checked_in_little_memory(tmp_path):
    """Every naming of a class (5 bytes: ``GLOBAL 'm n'``) made a class of its own, about 2 kB:
    100 000 namings in a 0.5 MB pickle held about 200 MB (a 64 MiB one, which the size limit
    lets through, tens of GB and minutes of CPU)."""
    import tracemalloc
    import warnings

    from loader.checkpoint import _check_records

    listing = b"\x80\x02" + b"cm\nn\n" * 100_000 + b"}."  # then an empty state dict
    path = _archive(tmp_path / "pytorch_model.bin", [("archive/data.pkl", listing)])
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _check_records(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20


def test_a_tensor_list_naming_more_classes_than_a_state_dict_is_refused(tmp_path):
    """256 classes are read; one more is refused (not a few more)."""
    import warnings

    from loader.checkpoint import _check_records

    def naming(classes: int) -> Path:
        listing = b"\x80\x02" + b"".join(b"cm\nn%d\n0" % i for i in range(classes)) + b"}."
        return _archive(tmp_path / f"{classes}.bin", [("archive/data.pkl", listing)])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _check_records(naming(256))
    assert "its tensor list names more than 256 classes" in _records_check(naming(257))


def test_a_tensor_list_of_the_limits_size_is_read_one_byte_more_is_refused(tmp_path, monkeypatch):
    import warnings

    from loader import checkpoint

    listing = b"\x80\x02}."  # an empty state dict
    path = _archive(tmp_path / "pytorch_model.bin", [("archive/data.pkl", listing)])
    monkeypatch.setattr(checkpoint, "_MAX_PICKLE", len(listing))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint._check_records(path)
    monkeypatch.setattr(checkpoint, "_MAX_PICKLE", len(listing) - 1)
    assert "its tensor list is larger than" in _records_check(path)


def test_a_shard_missing_from_the_index_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints[("bin", True)], tmp_path / "ck")
    victim = sorted(path.glob("pytorch_model-*.bin"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"{victim.name} listed in .* is missing"):
        open_checkpoint(path)


def test_an_index_larger_than_a_large_models_is_refused_before_it_is_parsed(checkpoints, tmp_path):
    """Parsed, an index takes up to about 25 times its size, and a run reads it twice: one
    padded with empty lists to 64 MiB held about 1.7 GB and 35 s of CPU each time."""
    from loader.formats.jsondoc import MAX_CONFIG_BYTES

    path = _copy(checkpoints[("safetensors", True)], tmp_path / "ck")
    index = path / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    padded = json.dumps(document) + " " * MAX_CONFIG_BYTES
    index.write_text(padded)
    assert len(padded) <= 64 * 2**20  # within the limit there was
    with pytest.raises(FileContentError, match=r"index\.json is larger than 16 MiB: not an index"):
        open_checkpoint(path)


def test_an_index_naming_a_tensor_its_shard_lacks_is_an_error(checkpoints, tmp_path):
    path = _copy(checkpoints[("safetensors", True)], tmp_path / "ck")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["transformer.h.9.ln_1.weight"] = first_shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"transformer\.h\.9\.ln_1\.weight"):
        open_checkpoint(path)


def test_bfloat16_tensors_come_back_as_their_bits(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gptj"}))
    tensor = torch.randn(4, 6).to(torch.bfloat16)
    save_file({"x": tensor}, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.tensors["x"].dtype == "bf16"
        bits = ckpt.get("x")
    np.testing.assert_array_equal(bits, tensor.view(torch.int16).numpy().view(np.uint16))


def test_an_unsupported_safetensors_dtype_is_a_dtype_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gptj"}))
    header = json.dumps({"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + b"\0\0"
    )
    with pytest.raises(DtypeError, match="F8_E4M3"):
        open_checkpoint(tmp_path)


def _safetensors_dir(path: Path, header: dict, data: bytes, *, padding: int = 0) -> Path:
    """A checkpoint directory whose one weight file has ``header`` (then ``padding`` spaces,
    as the format allows) and ``data``."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gptj"}))
    raw = json.dumps(header).encode() + b" " * padding
    (path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


_ONE_TENSOR = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def test_a_safetensors_header_larger_than_a_checkpoints_is_refused_before_it_is_parsed(
    tmp_path,
):
    """Parsed, a header takes up to about 28 times its size: one padded to near the format's
    100 MB held GBs and most of a minute each time the file was opened."""
    from loader.checkpoint import MAX_READ_HEADER

    path = _safetensors_dir(tmp_path / "ck", _ONE_TENSOR, bytes(8), padding=MAX_READ_HEADER + 1)
    with pytest.raises(FileContentError, match=r"model\.safetensors has a header of \d+ bytes"):
        open_checkpoint(path)
    within = _safetensors_dir(tmp_path / "ok", _ONE_TENSOR, bytes(8), padding=2**20)
    with open_checkpoint(within) as ckpt:
        assert ckpt.names() == ["x"]


def test_a_safetensors_header_of_16_mib_is_read_and_one_byte_more_refused(tmp_path):
    """The header the loader reads is at most 16 MiB (a checkpoint's lists its tensors in
    about 100 bytes each): one of exactly that is read, one byte more is refused."""
    bare = len(json.dumps(_ONE_TENSOR))
    at = _safetensors_dir(tmp_path / "at", _ONE_TENSOR, bytes(8), padding=16 * 2**20 - bare)
    with open_checkpoint(at) as ckpt:
        assert ckpt.names() == ["x"]
    past = _safetensors_dir(tmp_path / "past", _ONE_TENSOR, bytes(8), padding=16 * 2**20 - bare + 1)
    with pytest.raises(FileContentError, match=f"has a header of {16 * 2**20 + 1} bytes"):
        open_checkpoint(past)


@pytest.mark.parametrize("metadata", [[], {"a": []}, {"a": 1}, "text", {"a": {"b": "c"}}])
def test_safetensors_metadata_of_anything_but_text_values_is_refused(tmp_path, metadata):
    """The safetensors library reads ``__metadata__`` as text to text and refuses the file
    otherwise."""
    header = {"__metadata__": metadata, **_ONE_TENSOR}
    path = _safetensors_dir(tmp_path / "ck", header, bytes(8))
    with pytest.raises(CorruptFileError, match="__metadata__ is not an object of text values"):
        open_checkpoint(path)


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt", "": ""}])
def test_safetensors_metadata_of_text_values_is_read_past(tmp_path, metadata):
    path = _safetensors_dir(tmp_path / "ck", {"__metadata__": metadata, **_ONE_TENSOR}, bytes(8))
    with open_checkpoint(path) as ckpt:
        assert ckpt.names() == ["x"]


def test_iter_tensors_yields_every_tensor_once(checkpoints):
    from loader.checkpoint import iter_tensors

    path = checkpoints[("bin", True)]
    seen = [name for name, _ in iter_tensors(path)]
    assert sorted(seen) == sorted(read_state_dict(path))


@pytest.mark.parametrize("target", ["elsewhere", "nowhere"])
def test_a_link_at_a_weight_file_below_a_confined_tree_is_refused_not_looked_through(
    tmp_path, target
):
    """A checkpoint downloaded below ROOT or the work directory is looked at one name at a
    time: a weight file replaced by a link (to a user's file outside, or leading nowhere) is a
    NotOursError naming it, not a file that is there (read through) nor one that is missing
    (looked through to its target)."""
    from loader import fs
    from loader.convert import convert_checkpoint
    from loader.errors import NotOursError

    root = tmp_path / "root"
    source = make_tiny_checkpoint(root / ".work" / "key" / "source")
    outside = tmp_path / "outside"
    outside.mkdir()
    weights = source / "model.safetensors"
    shutil.move(weights, outside / "elsewhere")
    before = (outside / "elsewhere").read_bytes()
    weights.symlink_to(outside / target)
    with fs.confined(root):
        with pytest.raises(NotOursError, match=str(weights)):
            open_checkpoint(source)
        with pytest.raises(NotOursError, match=str(weights)):
            convert_checkpoint(source, root / ".work" / "key" / "converted", tp_size=1)
    assert sorted(p.name for p in outside.iterdir()) == ["elsewhere"]
    assert (outside / "elsewhere").read_bytes() == before
    assert not (root / ".work" / "key" / "converted").exists()


@pytest.mark.parametrize(
    "records",
    [
        [("notes/readme.txt", b"x")],
        [("readme.txt", b"x")],
        [("notes/a", b""), ("other/data.pkl", None)],
    ],
    ids=["no tensor list", "no folder", "tensor list outside the first folder"],
)
def test_a_zip_archive_torch_load_would_not_read_is_left_to_it(tmp_path, records):
    """The check has nothing to judge (torch.load refuses such a file): it neither raises
    nor fails on a record it looked for."""
    from loader.checkpoint import _check_records

    _check_records(_archive(tmp_path / "pytorch_model.bin", records, _0=1000))


def test_a_bin_naming_a_class_in_the_words_of_a_failed_map_is_corrupt_not_transient(tmp_path):
    """torch.load failing to map a file for want of memory is transient; its message quoting
    a class the pickle names (here in the words of that failure) is the file's fault."""
    import zipfile

    from loader.checkpoint import TorchFile

    path = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02cCannot allocate memory (12)\nx\n)\x81.")
        archive.writestr("archive/version", b"3\n")
    with pytest.raises(CorruptFileError, match=r"torch\.load failed") as info:
        TorchFile(path)
    assert info.value.exit_code == 2


def _loadable(path: Path, records: list[tuple[str, bytes | None]], pid: tuple, **kw) -> Path:
    """An archive ``torch.load`` opens (it holds a ``version`` record): ``records`` (name,
    bytes; None: the pickle) in that order, the pickle a state dict of one float tensor
    ``w`` of 1000 elements over the storage ``pid`` names; ``kw``: ``compress`` (record
    names written deflated)."""
    import collections
    import io
    import pickle
    import zipfile

    class Storage:
        pass

    class Tensor:
        def __reduce__(self):
            args = (Storage(), 0, (1000,), (1,), False, collections.OrderedDict())
            return torch._utils._rebuild_tensor_v2, args

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return pid if isinstance(obj, Storage) else None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump({"w": Tensor()})
    deflated = set(kw.get("compress", ()))
    with zipfile.ZipFile(path, "w") as archive:
        for name, body in [*records, ("archive/version", b"3\n")]:
            method = zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED
            archive.writestr(name, data.getvalue() if body is None else body, method)
    return path


_FOLLOWING = ("archive/data/1", b"\x11" * 8000)  # what torch.load would read on into


@pytest.mark.parametrize(
    ("pid", "said"),
    [
        (("storage", torch.FloatTensor, "0", "cpu", 1000), "with type torch.FloatTensor, not a"),
        ((b"storage", torch.FloatStorage, "0", "cpu", 1000), "holds 8 bytes, fewer than the 4000"),
    ],
    ids=["a tensor type with a dtype", "type name as bytes"],
)
def test_a_storage_named_in_a_way_torch_load_takes_is_held_to_its_record(tmp_path, pid, said):
    """torch.load sizes a storage by its type's ``dtype`` and takes the word ``storage`` as
    text or bytes. Before: a type that is not a storage class (``torch.FloatTensor`` has a
    dtype too), or ``b"storage"``, skipped the check, and torch.load viewed 4000 bytes over
    a record of 8."""
    from loader.checkpoint import TorchFile

    path = _loadable(
        tmp_path / "pytorch_model.bin",
        [("archive/data.pkl", None), ("archive/data/0", bytes(8)), _FOLLOWING],
        pid,
    )
    with pytest.raises(CheckpointError, match=said):
        TorchFile(path)


_PID = ("storage", torch.FloatStorage, "0", "cpu", 1000)


@pytest.mark.parametrize(
    "records",
    [
        [("archive/data.pkl", b"\x80\x02}q\x00."), ("archive/DATA.PKL", None),
         ("archive/data/0", bytes(8)), _FOLLOWING],
        [("archive/data.pkl", None), ("archive/Data/0", bytes(8)), _FOLLOWING,
         ("archive/data/0", bytes(4000))],
        [("archive/Data.pkl", None), ("archive/data/0", bytes(8)), _FOLLOWING],
    ],
    ids=["a second tensor list", "a second record", "the only tensor list"],
)  # fmt: skip
def test_record_names_are_compared_as_pytorchs_reader_finds_them(tmp_path, records):
    """PyTorch's reader finds a record whatever the case of its letters. Before: the check
    read ``data.pkl`` (an empty state dict) or ``data/0`` (4000 bytes) where torch.load read
    ``DATA.PKL`` or viewed the 8 bytes of ``Data/0``, or found no ``data.pkl`` at all and
    left the archive to torch.load, which read ``Data.pkl``."""
    from loader.checkpoint import TorchFile

    path = _loadable(tmp_path / "pytorch_model.bin", records, _PID)
    with pytest.raises(CheckpointError, match=r"record name\(s\) twice|holds 8 bytes, fewer"):
        TorchFile(path)


def test_a_compressed_tensor_record_is_refused(tmp_path):
    """torch.load maps a record's stored bytes; deflated, its 4000 zeros take a few bytes and
    the view ran on into the next record."""
    from loader.checkpoint import TorchFile

    path = _loadable(
        tmp_path / "pytorch_model.bin",
        [("archive/data.pkl", None), ("archive/data/0", bytes(4000)), _FOLLOWING],
        _PID,
        compress=["archive/data/0"],
    )
    with pytest.raises(CheckpointError, match="record 0 is compressed"):
        TorchFile(path)


@pytest.mark.parametrize("claimed", [4000, 9])
def test_a_record_whose_directory_entry_claims_more_bytes_than_it_holds_is_refused(
    tmp_path, claimed
):
    """The central directory says 4000 bytes (or 9: one byte into the next record's header)
    for a record of 8, the next record right after them: the size is held to where what
    follows starts (before, torch.load viewed 4000)."""
    import struct

    from loader.checkpoint import TorchFile

    path = _loadable(
        tmp_path / "pytorch_model.bin",
        [("archive/data.pkl", None), ("archive/data/0", bytes(8)), _FOLLOWING],
        _PID,
    )
    raw = bytearray(path.read_bytes())
    at = raw.index(b"PK\x01\x02")  # the central directory's first entry
    while True:
        name_len = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46 : at + 46 + name_len] == b"archive/data/0":
            struct.pack_into("<II", raw, at + 20, claimed, claimed)  # compressed, uncompressed
            break
        at = raw.index(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"says it holds {claimed} bytes, but what follows"):
        TorchFile(path)


def test_an_archive_pythons_zip_reader_cannot_read_is_refused_not_left_to_torch(tmp_path):
    """A central directory entry asking for zip version 12.0: Python's zipfile raised
    NotImplementedError (exit 1, a traceback), and had the check let it pass as "no zip
    archive", PyTorch's reader, which ignores that field, viewed 4000 bytes over a record of
    8. A file that does not start as a zip archive is still left to torch.load."""
    import struct

    from loader.checkpoint import TorchFile, _check_records

    path = _loadable(
        tmp_path / "pytorch_model.bin",
        [("archive/data.pkl", None), ("archive/data/0", bytes(8)), _FOLLOWING],
        _PID,
    )
    raw = bytearray(path.read_bytes())
    entry = raw.index(b"PK\x01\x02")  # the central directory's first entry
    struct.pack_into("<H", raw, entry + 6, 120)  # version needed to extract: 12.0
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="its zip directory does not read"):
        TorchFile(path)
    path.write_bytes(b"not a zip archive, nor anything torch.load reads")
    _check_records(path)


def test_a_bin_file_cut_short_while_its_records_are_checked_is_transient(
    checkpoints, tmp_path, monkeypatch
):
    """Cut short after it was opened (another process rewriting it), its zip directory no
    longer reads: the file shrank meanwhile (75, read again next run), not corrupt (2)."""
    from loader import checkpoint
    from loader.checkpoint import TorchFile
    from loader.errors import SourceShrankError

    path = _copy(checkpoints[("bin", False)], tmp_path / "ck") / "pytorch_model.bin"
    real = checkpoint._check_records

    def cut_then_check(at: Path, *opened) -> None:
        at.write_bytes(at.read_bytes()[:100])
        real(at, *opened)

    monkeypatch.setattr(checkpoint, "_check_records", cut_then_check)
    with pytest.raises(SourceShrankError):
        TorchFile(path)


@pytest.mark.parametrize("key", [0, None, b"lm_head.bias", ("lm_head", "bias")], ids=repr)
def test_a_bin_tensor_named_by_anything_but_text_is_refused(checkpoints, tmp_path, capsys, key):
    """torch.save keeps any key; the plan reads names as text. Before: an AttributeError or
    TypeError from the name check (exit 1, "this is a bug")."""
    from loader.cli import main

    source = _copy(checkpoints[("bin", False)], tmp_path / "ck")
    weights = source / "pytorch_model.bin"
    state = torch.load(weights, weights_only=True)
    state[key] = torch.zeros(2)
    torch.save(state, weights)
    code = main(["convert", str(source), str(tmp_path / "out"), "--tp-size", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    assert f"it names a tensor by {key!r}, which is not a text name" in err, err


def _bin_with(source: Path, tensor: str, change) -> Path:
    weights = source / "pytorch_model.bin"
    state = torch.load(weights, weights_only=True)
    state[tensor] = change(state[tensor])
    torch.save(state, weights)
    return source


def _converted(source: Path, out: Path, capsys) -> tuple[int, str]:
    from loader.cli import main

    code = main(["convert", str(source), str(out), "--tp-size", "1"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "change",
    [torch.nn.Parameter, lambda t: t.clone().requires_grad_(True)],
    ids=["parameter", "grad"],
)
def test_a_bin_tensor_saved_as_a_parameter_converts_like_any_tensor(
    checkpoints, tmp_path, capsys, change
):
    """torch.save(dict(model.named_parameters())) keeps each tensor's requires_grad: its
    values were refused by NumPy ("Can't call numpy() on Tensor that requires grad"), exit 1."""
    plain = _copy(checkpoints[("bin", False)], tmp_path / "plain")
    assert _converted(plain, tmp_path / "a", capsys)[0] == 0
    source = _bin_with(_copy(plain, tmp_path / "ck"), "transformer.ln_f.weight", change)
    code, err = _converted(source, tmp_path / "b", capsys)
    assert code == 0, err
    for made in (tmp_path / "a").rglob("*.bin"):
        assert made.read_bytes() == (tmp_path / "b" / made.relative_to(tmp_path / "a")).read_bytes()


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda t: t.to_sparse(), "as a sparse_coo tensor"),
        (lambda t: t.to("meta"), "as a meta tensor (no values in the file)"),
        (lambda t: t._neg_view(), "as a negated or conjugated view"),
    ],
    ids=["sparse", "meta", "negated"],
)
def test_a_bin_tensor_that_is_no_plain_run_of_values_is_refused(
    checkpoints, tmp_path, capsys, change, said
):
    """Before: NumPy's TypeError or RuntimeError (exit 1, "this is a bug")."""
    source = _copy(checkpoints[("bin", False)], tmp_path / "ck")
    _bin_with(source, "transformer.ln_f.weight", change)
    code, err = _converted(source, tmp_path / "out", capsys)
    assert code == 2, err
    assert "Traceback" not in err, err
    assert f"holds tensor transformer.ln_f.weight {said}" in err, err
    assert "plain dense CPU tensors" in err, err


@pytest.mark.parametrize("kind", ["FIFO", "another archive"])
def test_a_bin_replaced_after_its_records_were_checked_is_not_what_torch_loads(
    checkpoints, tmp_path, monkeypatch, kind
):
    """``torch.load`` opened the file by its path again once its records were checked: a
    FIFO put there meanwhile held it for good (no writer ever comes), another archive was
    loaded unchecked (its records never looked at). The archive checked is the one loaded."""
    import os
    import threading

    from loader import checkpoint

    source = _copy(checkpoints[("bin", False)], tmp_path / "ck")
    path = source / "pytorch_model.bin"
    other = tmp_path / "other.bin"
    torch.save({"planted": torch.zeros(3)}, other)
    checked = checkpoint._check_records

    def then_replaced(*args, **kwargs):
        checked(*args, **kwargs)
        path.unlink()
        if kind == "FIFO":
            os.mkfifo(path)
        else:
            other.rename(path)

    monkeypatch.setattr(checkpoint, "_check_records", then_replaced)
    found: list[object] = []

    def read() -> None:
        try:
            found.append(set(checkpoint.TorchFile(path).infos()))
        except Exception as exc:  # what it raised is the finding
            found.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # let it go: a writer that closes at once ends its read
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(30)
        pytest.fail("torch.load waited on the FIFO put where the checked archive was")
    assert found == [set(read_state_dict(checkpoints[("bin", False)]))]


def _flipped_copy(path: Path, to: Path) -> None:
    """A file of ``path``'s size and header whose tensor bytes differ (the last 64 zeroed)."""
    data = bytearray(path.read_bytes())
    assert any(data[-64:])
    data[-64:] = bytes(64)
    to.write_bytes(bytes(data))


def test_a_safetensors_file_replaced_after_its_header_was_checked_is_not_what_is_read(
    checkpoints, tmp_path
):
    """Its tensors were read by opening the path again: another file put there meanwhile (the
    same size) was read with the first one's header, its bytes never checked."""
    from loader.checkpoint import SafetensorsFile

    source = _copy(checkpoints[("safetensors", False)], tmp_path / "ck")
    path = source / "model.safetensors"
    expected = read_state_dict(source)
    opened = SafetensorsFile(path)  # its header checked; no tensor read yet
    _flipped_copy(path, tmp_path / "planted")
    (tmp_path / "planted").rename(path)
    for name in opened.infos():
        np.testing.assert_array_equal(opened.get(name), expected[name].numpy())
    opened.close()


def test_convert_copies_no_byte_of_a_file_put_where_the_checked_one_was(
    checkpoints, tmp_path, monkeypatch, capsys
):
    """An output kept in the source's dtype was copied in the kernel from the file opened by
    its path again, after the check for NaN had read the mapped one: a file put there
    meanwhile was copied unchecked. It is written from the file checked."""
    from loader import checkpoint
    from loader.cli import main

    source = _copy(checkpoints[("safetensors", False)], tmp_path / "ck")
    path = source / "model.safetensors"
    assert main(["convert", str(source), str(tmp_path / "clean"), "--tp-size", "1"]) == 0
    _flipped_copy(path, tmp_path / "planted")
    read = checkpoint.SafetensorsFile.get

    def replaced_first(self, name):
        # As the first tensor is read: by the first of the writers' threads, which read at once.
        with contextlib.suppress(FileNotFoundError):
            (tmp_path / "planted").rename(path)
        return read(self, name)

    monkeypatch.setattr(checkpoint.SafetensorsFile, "get", replaced_first)
    assert main(["convert", str(source), str(tmp_path / "out"), "--tp-size", "1"]) == 0
    assert not (tmp_path / "planted").exists()  # it was put there
    capsys.readouterr()
    clean, out = tmp_path / "clean" / "1-gpu", tmp_path / "out" / "1-gpu"
    for name in sorted(p.name for p in clean.iterdir()):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name


def test_a_safetensors_file_cut_short_after_its_header_was_checked_is_transient(
    checkpoints, tmp_path
):
    """Cut short between the header's check and the first read (another process rewriting
    it): its tensors would be read past the end of the map (SIGBUS); it shrank meanwhile
    (75, read again next run)."""
    from loader.checkpoint import SafetensorsFile
    from loader.errors import SourceShrankError

    (path,) = _copy(checkpoints[("safetensors", False)], tmp_path / "ck").glob("*.safetensors")
    shard = SafetensorsFile(path)
    try:
        with path.open("r+b") as fh:
            fh.truncate(shard.size - 1)
        with pytest.raises(SourceShrankError):
            shard.get(next(iter(shard.infos())))
    finally:
        shard.close()


@pytest.mark.parametrize(("fmt", "opener"), [("safetensors", "safetensors"), ("bin", "pytorch")])
def test_a_weight_file_is_compared_with_the_file_its_download_verified(
    checkpoints, tmp_path, fmt, opener
):
    """Opened with the stamp of the file a download verified: one that is not it is refused
    before a byte of it is read (not judged corrupt), and one written in place after it was
    opened is found not to be it once its tensors were read (both 75, naming it)."""
    from loader import fs
    from loader.checkpoint import OPENERS
    from loader.errors import ReplacedDownloadError

    (path,) = _copy(checkpoints[(fmt, False)], tmp_path / "ck").glob(f"*.{fmt}")
    verified = fs.stamp(path.stat())
    shard = OPENERS[opener](path, verified)
    shard.as_checked()  # still the file verified
    before = path.stat()
    with path.open("r+b") as fh:  # written in place, its size kept
        fh.seek(before.st_size - 8)
        fh.write(bytes(8))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    try:
        with pytest.raises(ReplacedDownloadError, match=path.name):
            shard.as_checked()
    finally:
        shard.close()
    path.write_bytes(b"\xff" * 64)  # no weight file at all: never parsed
    with pytest.raises(ReplacedDownloadError, match=path.name):
        OPENERS[opener](path, verified)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_an_index_or_shard_changed_since_its_download_was_verified_is_never_read(
    checkpoints, tmp_path, fmt
):
    """The index and each shard of a download are read only while each is the file its
    download verified (its stamp then): the very files, unchanged, read; an index written in
    place since (its modification time moved on), or a shard whose modification time moved
    (the same inode and size: written in place), is a :class:`ReplacedDownloadError` (the
    shard refused closed)."""
    from loader import fs
    from loader.checkpoint import read_inventory
    from loader.errors import ReplacedDownloadError

    directory = _copy(checkpoints[(fmt, True)], tmp_path / "source")
    (index,) = directory.glob("*.index.json")
    checked = {p.name: fs.stamp(p.lstat()) for p in directory.iterdir()}
    inventory = read_inventory(directory, listed=set(checked), checked=checked)
    shard = inventory.files[0]
    inventory.open(shard, checked=checked[shard]).close()

    def moved_on(path: Path) -> None:
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    moved_on(directory / shard)
    opened = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ReplacedDownloadError, match=shard):
        inventory.open(shard, checked=checked[shard])
    assert len(os.listdir("/proc/self/fd")) == opened  # the file refused is closed
    moved_on(index)
    with pytest.raises(ReplacedDownloadError, match=index.name.replace(".", r"\.")):
        read_inventory(directory, listed=set(checked), checked=checked)
