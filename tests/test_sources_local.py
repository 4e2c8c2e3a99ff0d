"""Source URIs, local checkpoints, the shared transfer helpers and progress lines."""

from __future__ import annotations

import io
import logging
import os
import shutil
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.errors import (
    CheckpointError,
    InsufficientDiskSpaceError,
    NotOursError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    TransientSourceError,
)
from loader.progress import byte_progress
from loader.sources import SCHEMES, fetch, parse_uri
from loader.sources.failures import Funnel, is_transient, retry_after_s, status_of
from loader.sources.hf import select_files
from loader.sources.transfer import ensure_disk_space


@pytest.mark.parametrize(
    ("uri", "scheme", "location", "path", "revision"),
    [
        ("gs://bucket/a/b/ckpt/", "gs", "bucket", "a/b/ckpt", None),
        ("gs://bucket", "gs", "bucket", "", None),
        ("hf://org/name@v1.0", "hf", "org/name", "", "v1.0"),
        ("hf://org/name", "hf", "org/name", "", None),
        ("hf://gpt2", "hf", "gpt2", "", None),
        ("file:///data/ckpt%20v1", "file", "/data/ckpt v1", "", None),
        ("/data/ckpt", "file", "/data/ckpt", "", None),
    ],
)
def test_uris_parse_into_scheme_location_prefix_and_revision(uri, scheme, location, path, revision):
    parsed = parse_uri(uri)
    assert (parsed.scheme, parsed.location, parsed.path, parsed.revision) == (
        scheme, location, path, revision)  # fmt: skip
    assert parsed.raw == uri
    assert parsed.scheme in SCHEMES


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_uri("ckpt").location == str(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("s3://bucket/x", "Unsupported source URI scheme 's3'"),
        ("gs:///x", "no bucket"),
        ("hf://", "does not name a repository"),
        ("hf://a/b/c", "does not name a repository"),
        ("hf://org/name@", "empty revision"),
        ("file://host/x", "names a host"),
        ("", "empty"),
    ],
)
def test_malformed_uris_are_source_errors_with_a_hint(uri, words):
    with pytest.raises(SourceError, match=words) as info:
        parse_uri(uri)
    assert info.value.remediation


def test_unknown_scheme_hint_lists_the_supported_ones():
    with pytest.raises(SourceError) as info:
        parse_uri("s3://b/x")
    assert "gs://" in info.value.remediation and "hf://" in info.value.remediation


@pytest.fixture
def local_ckpt(tmp_path):
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "gptj"}')
    (src / "model.safetensors").write_bytes(b"\1" * 5000)
    (src / "sub" / "extra.txt").write_text("x")
    (src / ".hidden").write_text("not listed")
    return src


def test_local_directory_is_used_in_place(local_ckpt, tmp_path):
    result = fetch(f"file://{local_ckpt}", tmp_path / "unused")
    assert result.path == local_ckpt
    assert result.files == ["config.json", "model.safetensors", "sub/extra.txt"]
    assert result.bytes == sum((local_ckpt / f).stat().st_size for f in result.files)
    assert result.revision is None
    assert not (tmp_path / "unused").exists()


def test_local_copy_copies_then_skips_identical_files(local_ckpt, tmp_path):
    dest = tmp_path / "copy"
    first = fetch(str(local_ckpt), dest, copy=True)
    assert first.path == dest and first.downloaded_bytes == first.bytes
    assert (dest / "sub" / "extra.txt").read_text() == "x"
    assert (dest / "model.safetensors").read_bytes() == b"\1" * 5000
    (dest / "config.json").write_text("changed")
    again = fetch(str(local_ckpt), dest, copy=True)
    assert again.downloaded_bytes == (local_ckpt / "config.json").stat().st_size
    assert (dest / "config.json").read_text() == '{"model_type": "gptj"}'


@pytest.mark.parametrize(
    "name",
    ["CONFIG.json", "Sub/extra.txt", "SUB", "model.\u017fafetensors"],
    ids=["case", "case of a folder", "a file where a folder goes", "long s"],
)
def test_a_copy_whose_names_alias_on_some_file_systems_copies_nothing(local_ckpt, tmp_path, name):
    """Before: both names were copied; into a case-insensitive or normalising destination
    (SMB, some NFS servers) one file stood for both, the one copied last."""
    (local_ckpt / name).parent.mkdir(exist_ok=True)
    (local_ckpt / name).write_text("another file")
    dest = tmp_path / "copy"
    with pytest.raises(SourceError, match="cannot both be copied") as info:
        fetch(str(local_ckpt), dest, copy=True)
    assert "Rename or remove one of them" in info.value.remediation
    assert not dest.exists()


def test_missing_local_path_is_a_not_found_error_naming_it(tmp_path):
    with pytest.raises(SourceNotFoundError, match=str(tmp_path / "absent")):
        fetch(str(tmp_path / "absent"))


def test_a_local_file_instead_of_a_directory_is_refused(local_ckpt):
    with pytest.raises(SourceNotFoundError, match="not a directory"):
        fetch(str(local_ckpt / "config.json"))


def test_cli_fetch_prints_the_local_path_last(local_ckpt, capsys):
    assert main(["fetch", str(local_ckpt)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(local_ckpt)


def test_cli_fetch_of_a_missing_path_exits_2_with_error_and_hint(tmp_path, capsys):
    assert main(["fetch", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "error: Local source" in err and "hint: " in err and "Traceback" not in err


class _Response:
    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.status_code = status
        self.headers = headers or {}


class _HttpFailure(Exception):
    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status}")
        self.response = _Response(status, headers)


def _flaky(*outcomes):
    calls = iter(outcomes)

    def fn():
        outcome = next(calls)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return fn


def test_funnel_backs_off_then_succeeds():
    sleeps: list[float] = []
    funnel = Funnel(60, sleep=sleeps.append)
    fn = _flaky(ConnectionError("reset"), _HttpFailure(503), "done")
    assert funnel(fn, what="thing") == "done"
    assert len(sleeps) == 2 and all(0 <= s <= 30 for s in sleeps)


def test_funnel_waits_at_least_what_retry_after_asks():
    sleeps: list[float] = []
    funnel = Funnel(60, sleep=sleeps.append)
    fn = _flaky(_HttpFailure(429, {"Retry-After": "7"}), "done")
    assert funnel(fn, what="thing") == "done"
    assert sum(sleeps) >= 7


def test_funnel_gives_up_at_its_deadline_with_a_transient_error():
    def always():
        raise ConnectionError("reset by peer")

    with pytest.raises(TransientSourceError, match="reset by peer") as info:
        Funnel(0.3)(always, what="gs://b/o")
    assert info.value.exit_code == 75 and "gs://b/o kept failing" in info.value.message


@pytest.mark.parametrize(
    ("failure", "typed", "words"),
    [(_HttpFailure(404), SourceNotFoundError, r"Thing does not exist \(404\)"),
     (_HttpFailure(403), SourcePermissionError, r"Permission denied reading thing \(403\)")],
)  # fmt: skip
def test_funnel_types_permanent_failures_at_once(failure, typed, words):
    calls = []

    def missing():
        calls.append(1)
        raise failure

    with pytest.raises(typed, match=words):
        Funnel(60)(missing, what="thing")
    assert len(calls) == 1


def test_funnel_leaves_failures_it_cannot_name_alone():
    with pytest.raises(FileNotFoundError):
        Funnel(60)(_flaky(FileNotFoundError("gone")), what="x")


def test_google_retry_retries_honours_retry_after_and_types_the_last_failure():
    """The Retry handed to google-cloud-storage calls: the same rules as the tenacity one."""
    sleeps: list[float] = []
    funnel = Funnel(60, sleep=sleeps.append)
    fn = _flaky(_HttpFailure(503, {"Retry-After": "3"}), "done")
    assert funnel.gcs(lambda retry: retry(fn)(), what="thing") == "done"
    assert sleeps == [3.0]  # the server's wait; the backoff pause is the library's own
    with pytest.raises(TransientSourceError, match="thing kept failing"):
        Funnel(0.2).gcs(lambda retry: retry(_flaky(*[ConnectionError()] * 99))(), what="thing")
    with pytest.raises(SourceNotFoundError):
        Funnel(60).gcs(lambda retry: retry(_flaky(_HttpFailure(404)))(), what="thing")


def test_failure_classification_reads_status_and_retry_after_through_causes():
    try:
        try:
            raise _HttpFailure(503, {"Retry-After": "Wed, 21 Oct 2037 07:28:00 GMT"})
        except _HttpFailure as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        wrapped = outer
    assert status_of(wrapped) == 503 and is_transient(wrapped)
    assert retry_after_s(wrapped, now=0) > 1e9
    assert not is_transient(_HttpFailure(404)) and not is_transient(ValueError())
    assert is_transient(TimeoutError()) and retry_after_s(ValueError()) is None


def test_disk_space_check_refuses_more_than_is_free(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    ensure_disk_space(tmp_path / "not" / "yet", 1024, what="small")
    with pytest.raises(InsufficientDiskSpaceError, match="free"):
        ensure_disk_space(tmp_path, free + 1, what="big")


def test_progress_off_a_terminal_is_plain_log_lines_with_rate(caplog):
    stream = io.StringIO()  # not a TTY
    with (
        caplog.at_level(logging.INFO, logger="loader.progress"),
        byte_progress("gs://b/ckpt", 4_000_000, stream=stream, interval=0.0) as progress,
    ):
        for _ in range(4):
            progress.update(1_000_000)
    lines = [r.getMessage() for r in caplog.records if r.name == "loader.progress"]
    assert len(lines) >= 4
    assert lines[0].startswith("gs://b/ckpt: 1.00MB / 4.00MB (25%) at ")
    assert lines[-1].startswith("gs://b/ckpt: 4.00MB / 4.00MB (100%) at ")
    assert all(line.endswith("/s") for line in lines)
    assert stream.getvalue() == ""  # no bar drawn


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["config.json", "model.safetensors", "pytorch_model.bin", "flax_model.msgpack",
          "tokenizer.json", "README.md", "onnx/model.onnx"],
         ["config.json", "model.safetensors", "tokenizer.json"]),
        (["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "model.safetensors.index.json", "pytorch_model.bin", "vocab.json", "merges.txt"],
         ["config.json", "merges.txt", "model-00001-of-00002.safetensors",
          "model-00002-of-00002.safetensors", "model.safetensors.index.json", "vocab.json"]),
        (["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
          "pytorch_model.bin.index.json", "tf_model.h5", "special_tokens_map.json"],
         ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
          "pytorch_model.bin.index.json", "special_tokens_map.json"]),
    ],
)  # fmt: skip
def test_only_one_weight_format_and_the_tokenizer_files_are_selected(names, expected):
    assert select_files(names) == expected


@pytest.mark.parametrize(
    ("names", "words"),
    [(["model.safetensors"], "config.json"),
     (["config.json", "flax_model.msgpack", "tf_model.h5"], "no weights")],
)  # fmt: skip
def test_selection_without_config_or_weights_is_a_checkpoint_error(names, words):
    with pytest.raises(CheckpointError, match=words):
        select_files(names)


def test_cli_fetch_of_a_local_path_with_dest_but_no_copy_is_refused(local_ckpt, tmp_path, capsys):
    dest = tmp_path / "dest"
    assert main(["fetch", str(local_ckpt), str(dest)]) == 2
    err = capsys.readouterr().err
    assert "would be ignored" in err and "--copy" in err
    assert not dest.exists()
    assert main(["fetch", str(local_ckpt), str(dest), "--copy"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(dest)


def _tree(directory: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
        for p in sorted(directory.rglob("*"))
    }


def test_a_link_at_a_confined_copys_destination_is_refused_not_taken_for_the_source(
    local_ckpt, tmp_path
):
    """``run`` copies into its work directory (a confined tree): a link planted there that
    leads to the source itself is not read through to decide the copy has nothing to do (the
    checkpoint would then be used from wherever the link leads); it is a NotOursError naming
    it, and the source is left as it was."""
    root = tmp_path / "root"
    dest = root / ".work" / "key" / "source"
    dest.parent.mkdir(parents=True)
    dest.symlink_to(local_ckpt)
    before = _tree(local_ckpt)
    with fs.confined(root), pytest.raises(NotOursError, match=str(dest)):
        fetch(str(local_ckpt), dest, copy=True)
    assert _tree(local_ckpt) == before
    assert os.readlink(dest) == str(local_ckpt)


def test_a_copy_onto_the_source_itself_has_nothing_to_do(local_ckpt, tmp_path):
    """DEST the user names is followed as given: the source itself, or a link to it, is a copy
    with nothing to do, and the source is left as it was."""
    before = _tree(local_ckpt)
    assert fetch(str(local_ckpt), local_ckpt, copy=True).path == local_ckpt
    (tmp_path / "same").symlink_to(local_ckpt)
    assert fetch(str(local_ckpt), tmp_path / "same", copy=True).path == local_ckpt
    assert _tree(local_ckpt) == before


def test_the_disk_space_probe_never_follows_a_link_below_a_confined_tree(tmp_path):
    """Where a download goes below ROOT, the deepest level there is asked for its disk through
    a descriptor: a link on the way (to another disk, say) is refused, never asked through."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "key").mkdir(parents=True)
    (outside / "key" / "user.txt").write_text("the user's")
    root.mkdir()
    (root / ".work").symlink_to(outside)
    with fs.confined(root), pytest.raises(NotOursError, match=str(root / ".work")):
        ensure_disk_space(root / ".work" / "key" / "source", 1, what="a download")
    assert _tree(outside) == {"key": None, "key/user.txt": b"the user's"}
    (root / ".work").unlink()
    (root / ".work").mkdir()
    with fs.confined(root):
        ensure_disk_space(root / ".work" / "key" / "source", 1, what="a download")


def test_a_local_file_written_to_while_it_is_copied_is_a_changed_source(local_ckpt, tmp_path):
    """A source file written to between its copy and the comparison of the copy with it: the
    source changed while it was copied (75, run again), not a disk that copied wrongly (2);
    the copy is not put in place."""
    from tests.at_step import AtStep

    source = local_ckpt / "model.safetensors"

    def compared(op: str, path: str) -> str | None:  # the source opened again, to compare
        return path if op == "open" and path == str(source) else None

    def written(_: str) -> None:
        before = source.stat()
        source.write_bytes(b"\2" * before.st_size)
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))

    dest = tmp_path / "copy"
    swap = AtStep(2, compared, written)
    with fs.inject(swap), pytest.raises(TransientSourceError, match="changed") as info:
        fetch(str(local_ckpt), dest, copy=True)
    assert swap.done and "model.safetensors" in str(info.value)
    assert not (dest / "model.safetensors").exists()
