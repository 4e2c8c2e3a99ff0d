"""Generated input, one property: `model-loader` exits 0 with a repository that loads, or 2/75
with an error and a hint; never a traceback, never a repository Triton could not load.

Hypothesis generates model names, revisions and source URIs (scheme case, percent-encoding,
empty parts), ``config.json`` fields of every JSON type, safetensors headers, and the numbers of
the command line at and beyond their limits. "Loads" is read back the way Triton's parts read
it: every ``config.pbtxt`` parsed into Triton's ``ModelConfig``, ``config.ini`` as
FasterTransformer reads it (32-bit integers, ids below ``vocab_size``), the tokenizer by the
repository's own ``load_tokenizer``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.checkpoint import SafetensorsFile
from loader.cli import build_parser, main
from loader.cli.run import request_from_args
from loader.errors import LoaderError
from loader.formats.fastertransformer import FTConfig
from loader.repository import manifest
from loader.repository.config import read_config
from loader.repository.key import key_filename
from loader.repository.models.tokenization import load_tokenizer
from loader.sources import parse_uri
from tests.tiers import examples

SETTINGS = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
INT32_MAX = 2**31 - 1
#: A path component a key may hold: what check_model_name and resolve_revision let through.
_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _run_argv(source: str, root: Path, *extra: str) -> list[str]:
    return ["run", "--source", source, "--repository", str(root), "--model-name", "tiny",
            "--tp-size", "1", "--pp-size", "1", "--instance-count", "1", *extra]  # fmt: skip


def _typed(code: int, err: str) -> None:
    assert code in (0, 2, 75), err[-2000:]
    assert "Traceback" not in err and "this is a bug" not in err, err[-2000:]
    if code:
        assert "error:" in err and "hint:" in err, err[-2000:]


def loads(published: Path, key: str) -> None:
    """What Triton loads of ``published`` loads (see the module docstring)."""
    assert manifest.verify(published, key=key) == []
    for config in published.glob("*/config.pbtxt"):
        read_config(config)
    (weights,) = published.glob("fastertransformer/1/*-gpu")
    ft = FTConfig.from_ini(weights)
    for name in ("head_num", "size_per_head", "inter_size", "num_layer", "vocab_size"):
        assert 0 < getattr(ft, name) <= INT32_MAX, name
    assert 0 <= ft.start_id < ft.vocab_size and 0 <= ft.end_id < ft.vocab_size
    tokenizer = load_tokenizer(published / "preprocessing" / "1" / "tokenizer")
    assert max(tokenizer.get_vocab(with_added_tokens=True).values()) < ft.vocab_size


def run_and_check(capsys, argv: list[str]) -> int:
    code = main(argv)
    out, err = capsys.readouterr()
    _typed(code, err)
    if code == 0:
        published = Path(out.splitlines()[-1])
        loads(published, "/".join(published.parts[-2:]))
    return code


# --- names, revisions, URIs ------------------------------------------------------------------

_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80
) | st.sampled_from(["", ".", "..", "a/b", "../x", "x" * 300, "a\nb", "é", "a b", "-a", "_a"])


@settings(SETTINGS)
@given(name=_text, revision=st.none() | _text)
def test_a_key_is_two_safe_names_under_root_or_a_typed_error(name, revision, tmp_path):
    argv = _run_argv("/nonexistent/ckpt", tmp_path, f"--model-name={name}")
    if revision is not None:
        argv.append(f"--revision={revision}")
    try:
        key = request_from_args(build_parser().parse_args(argv)).key
    except LoaderError:
        return
    parent, variant = key.split("/")
    name_part, _, rev_part = parent.partition("@")
    for part in (name_part, rev_part, variant):
        assert _COMPONENT.fullmatch(part) and part not in (".", ".."), key
    assert len(key_filename(key).encode()) + len(".lock.stale-0123456789abcdef") <= 255


_schemes = st.sampled_from(["gs", "GS", "Gs", "hf", "HF", "file", "FILE", "s3", ""])
_parts = st.lists(
    st.sampled_from(["", "a", "b", "%20", "%2F", "..", ".", "x y", "é", "@", "@r", "a@b"]),
    max_size=5,
)


@settings(SETTINGS)
@given(scheme=_schemes, parts=_parts, slash=st.booleans())
def test_a_uri_parses_to_one_canonical_spelling_or_a_typed_error(scheme, parts, slash):
    uri = f"{scheme}://{'/'.join(parts)}{'/' if slash else ''}" if scheme else "/".join(parts)
    try:
        parsed = parse_uri(uri)
    except LoaderError:
        return
    canonical = parsed.canonical
    if parsed.scheme == "file" and "%" in parsed.location:
        return  # a path holding "%": its file:// spelling is not percent-encoded (see the note)
    again = parse_uri(canonical)
    assert again.canonical == canonical  # one spelling per source
    assert again.scheme == parsed.scheme == canonical.split("://")[0]
    if parsed.scheme == "gs":
        assert not canonical.endswith("/")
        # Scheme case and a trailing slash spell the same source.
        assert parse_uri(canonical.upper()[:2] + canonical[2:] + "/").canonical == canonical


@settings(SETTINGS, max_examples=examples(6))
@given(spelling=st.sampled_from(["plain", "file", "localhost", "slash", "dot", "percent"]))
def test_spellings_of_one_local_source_publish_one_key(
    spelling, tiny_checkpoint_with_tokenizer, capsys
):
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        source = base / "my ckpt"
        shutil.copytree(tiny_checkpoint_with_tokenizer, source)
        uri = {
            "plain": str(source),
            "file": f"file://{source}",
            "localhost": f"file://localhost{source}",
            "slash": f"{source}/",
            "dot": f"{base}/./my ckpt",
            "percent": f"file://{str(source).replace(' ', '%20')}",
        }[spelling]
        root = base / "root"
        code = run_and_check(capsys, _run_argv(uri, root))
        if spelling == "percent":
            # A percent-escape is refused, never decoded (the chart could not decode it alike).
            assert code == 2
            assert not list(root.glob("tiny@*"))
            return
        assert code == 0
        plain = request_from_args(build_parser().parse_args(_run_argv(str(source), root))).key
        assert [p.relative_to(root).as_posix() for p in root.glob("tiny@*/*")] == [plain]


# --- config.json -----------------------------------------------------------------------------

_json_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**65), max_value=2**65)
    | st.sampled_from([0, 1, 2, 4, 8, 255, 256, 319, 320, 321, INT32_MAX, INT32_MAX + 1, -1])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["float16", "float32", "bfloat16", "gptj", "codegen", "gelu_new", "relu"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_FIELDS = ["n_embd", "n_head", "n_layer", "vocab_size", "n_inner", "rotary_dim", "n_positions",
           "eos_token_id", "bos_token_id", "activation_function", "dtype", "torch_dtype",
           "model_type", "architectures", "tie_word_embeddings"]  # fmt: skip


@pytest.fixture(scope="module")
def base_config(tiny_checkpoint_with_tokenizer) -> dict:
    return json.loads((tiny_checkpoint_with_tokenizer / "config.json").read_text())


@settings(SETTINGS, max_examples=examples(15))
@given(changes=st.dictionaries(st.sampled_from(_FIELDS), _json_value, min_size=1, max_size=3))
def test_any_config_json_publishes_what_loads_or_is_a_typed_error(
    changes, base_config, tiny_checkpoint_with_tokenizer, capsys
):
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "ckpt"
        shutil.copytree(tiny_checkpoint_with_tokenizer, source)
        (source / "config.json").write_text(json.dumps({**base_config, **changes}))
        run_and_check(capsys, _run_argv(str(source), Path(tmp) / "root"))


_token_id = st.integers(-1, 2**40) | st.sampled_from([0, 2, 319, 320, 321, INT32_MAX, 2**31, 2**32])


@settings(SETTINGS, max_examples=examples(10))
@given(
    ids=st.dictionaries(
        st.sampled_from(["eos_token_id", "bos_token_id"]),
        _token_id | st.lists(_token_id, min_size=1, max_size=2),
        min_size=1,
    )
)
def test_token_ids_publish_only_inside_the_vocabulary(
    ids, base_config, tiny_checkpoint_with_tokenizer, capsys
):
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "ckpt"
        shutil.copytree(tiny_checkpoint_with_tokenizer, source)
        (source / "config.json").write_text(json.dumps({**base_config, **ids}))
        run_and_check(capsys, _run_argv(str(source), Path(tmp) / "root"))


@settings(SETTINGS, max_examples=examples(4))
@given(depth=st.sampled_from([100, 5_000, 100_000]), where=st.sampled_from(["config", "index"]))
def test_deeply_nested_json_is_bad_input(depth, where, tiny_checkpoint_with_tokenizer, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "ckpt"
        shutil.copytree(tiny_checkpoint_with_tokenizer, source)
        nested = "[" * depth + "]" * depth
        if where == "config":
            (source / "config.json").write_text(f'{{"model_type": "gptj", "x": {nested}}}')
        else:
            (source / "model.safetensors.index.json").write_text(f'{{"weight_map": {nested}}}')
        assert run_and_check(capsys, _run_argv(str(source), Path(tmp) / "root")) == 2


# --- the tokenizer ---------------------------------------------------------------------------


@settings(SETTINGS, max_examples=examples(8))
@given(
    name=st.sampled_from(["tokenizer.json", "vocab.json", "merges.txt"]),
    content=st.binary(max_size=200)
    | st.sampled_from([b"{}", b"[]", b"null", b'{"model": 5}', b'{"version": "1.0"}']),
)
def test_a_garbage_tokenizer_is_refused_before_anything_is_published(
    name, content, tiny_checkpoint_with_tokenizer, capsys
):
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "ckpt"
        shutil.copytree(tiny_checkpoint_with_tokenizer, source)
        if name != "tokenizer.json":
            (source / "tokenizer.json").unlink()  # vocab.json + merges.txt are what loads then
        (source / name).write_bytes(content)
        root = Path(tmp) / "root"
        run_and_check(capsys, _run_argv(str(source), root))


# --- safetensors headers: our reader against the safetensors library ---------------------------

_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "F64": 8, "BOOL": 1}


@st.composite
def headers(draw) -> tuple[dict, int]:
    """A safetensors header (possibly wrong: overlapping, aliasing, gaps, out of bounds, wrong
    lengths) and the number of data bytes after it."""
    count = draw(st.integers(1, 4))
    entries, offset = {}, 0
    for i in range(count):
        dtype = draw(st.sampled_from([*_DTYPES, "F8_E4M3", "X"]))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        size = math.prod(shape) * _DTYPES.get(dtype, 1)
        begin = draw(st.sampled_from([offset, offset, 0, max(0, offset - 1), offset + 1]))
        end = draw(st.sampled_from([begin + size, begin + size, begin + size + 1, begin]))
        entries[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        offset = max(offset, end)
    data = draw(st.sampled_from([offset, offset, offset + 1, max(0, offset - 1)]))
    return entries, data


def _write_safetensors(path: Path, header: dict, data: int) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    payload = bytes(range(256)) * (data // 256 + 1)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload[:data])


@settings(SETTINGS, max_examples=examples(300))
@given(generated=headers())
def test_our_safetensors_reader_accepts_what_the_library_accepts_and_no_more(generated):
    import torch
    from safetensors import safe_open

    header, data = generated
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        _write_safetensors(path, header, data)
        try:
            with safe_open(path, framework="pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except Exception:  # the library refuses the file
            theirs = None
        else:
            theirs = {
                name: t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                for name, t in tensors.items()
            }
        try:
            ours = SafetensorsFile(path)
        except LoaderError:
            ours = None
        if ours is None:
            return  # refusing is allowed (an unsupported dtype); the converse is checked below
        assert theirs is not None, header  # never more than the library accepts
        assert sorted(ours.infos()) == sorted(theirs)
        for name in ours.infos():
            assert ours.get(name).tobytes() == theirs[name], name
        ours.close()


def test_overlapping_and_aliased_tensors_are_refused(tmp_path):
    aliased = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}  # fmt: skip
    overlapping = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}  # fmt: skip
    for header, data in ((aliased, 8), (overlapping, 12)):
        path = tmp_path / "model.safetensors"
        _write_safetensors(path, header, data)
        with pytest.raises(LoaderError, match="overlaps"):
            SafetensorsFile(path)


# --- numbers of the command line -------------------------------------------------------------

_edges = st.sampled_from(
    [-1, 0, 1, 2, 3, 8, 64, INT32_MAX, INT32_MAX + 1, 2**32, 2**63, 2**64, 2**64 + 1]
)
_FLAGS = ["--max-batch-size", "--instance-count", "--preferred-batch-size", "--tp-size",
          "--pp-size", "--max-queue-delay-us", "--workers", "--gpus-per-replica"]  # fmt: skip
_FLOATS = ["--lock-expiry-s", "--lock-timeout-s", "--retry-deadline", "--gpu-memory-gib"]


@settings(SETTINGS, max_examples=examples(15))
@given(
    numbers=st.dictionaries(st.sampled_from(_FLAGS), _edges, min_size=1, max_size=3),
    floats=st.dictionaries(
        st.sampled_from(_FLOATS),
        st.sampled_from(["0", "-1", "1", "0.5", "1e9", "1e309", "nan", "inf", "-inf", "40"]),
        max_size=2,
    ),
)
def test_numbers_at_and_beyond_their_limits_publish_what_loads_or_are_typed_errors(
    numbers, floats, tiny_checkpoint_with_tokenizer, capsys
):
    extra = [f"{flag}={value}" for flag, value in {**numbers, **floats}.items()]
    with tempfile.TemporaryDirectory() as tmp:
        argv = _run_argv(str(tiny_checkpoint_with_tokenizer), Path(tmp) / "root")
        # Later flags win: the generated numbers replace the defaults above.
        run_and_check(capsys, [*argv, "--backend", "python", *extra])
