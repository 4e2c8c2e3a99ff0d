"""gs:// sources against the real fake-gcs-server on 127.0.0.1 (filesystem backend)."""

from __future__ import annotations

import contextlib
import filecmp
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from loader import fs
from loader.errors import (
    ChecksumMismatchError,
    InsufficientDiskSpaceError,
    NotOursError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    TransientSourceError,
)
from loader.sources import ArrivalHooks, fetch, gcs, transfer
from tests.leftovers import left_by_a_fetch
from tests.servers import GcsServer, ThrottleProxy, free_port
from tests.tinymodels import for_tiny_model

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)


BUCKET = "models"
SLICE = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def emulator(monkeypatch, server):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)


@pytest.fixture(scope="module")
def single(server, tiny_checkpoint_with_tokenizer, tmp_path_factory) -> Path:
    """A single-file safetensors checkpoint at gs://models/org/tiny (and a decoy sibling)."""
    server.upload_dir(BUCKET, "org/tiny", tiny_checkpoint_with_tokenizer)
    decoy = tmp_path_factory.mktemp("decoy")
    (decoy / "config.json").write_text('{"decoy": true}')
    (decoy / "extra.bin").write_bytes(b"decoy")
    server.upload_dir(BUCKET, "org/tiny-old", decoy)
    return tiny_checkpoint_with_tokenizer


@pytest.fixture(scope="module")
def sharded(server, tiny_sharded_bin_checkpoint, tmp_path_factory) -> Path:
    """A sharded .bin checkpoint with a nested folder at gs://models/team/a/b/tiny-sharded."""
    src = tmp_path_factory.mktemp("sharded") / "ckpt"
    shutil.copytree(tiny_sharded_bin_checkpoint, src)
    (src / "extras").mkdir()
    (src / "extras" / "notes.txt").write_text("nested object\n")
    server.upload_dir(BUCKET, "team/a/b/tiny-sharded", src)
    return src


def same_tree(a: Path, b: Path) -> list[str]:
    """Relative paths of the files under ``a`` after asserting ``b`` has the same bytes."""
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    visible = sorted(
        p.relative_to(b).as_posix()
        for p in b.rglob("*")
        if p.is_file() and not p.relative_to(b).as_posix().startswith(".")
    )
    assert visible == files
    for rel in files:
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel
    return files


def test_single_file_checkpoint_lands_under_dest_verified(single, tmp_path):
    result = fetch(f"gs://{BUCKET}/org/tiny", tmp_path / "dest")
    files = same_tree(single, tmp_path / "dest")
    assert result.path == tmp_path / "dest"
    assert result.files == files
    assert "model.safetensors" in files
    assert result.bytes == sum((single / f).stat().st_size for f in files)
    assert result.downloaded_bytes == result.bytes
    assert result.revision and result.revision.startswith("gen-")
    assert not (tmp_path / "dest" / transfer.PARTIAL_DIR).exists()


def test_prefix_does_not_match_sibling_prefixes(single, tmp_path):
    result = fetch(f"gs://{BUCKET}/org/tiny/", tmp_path / "dest")
    assert "extra.bin" not in result.files
    assert '"decoy"' not in (tmp_path / "dest" / "config.json").read_text()


def test_sharded_checkpoint_with_nested_prefix_keeps_relative_paths(sharded, tmp_path):
    result = fetch(f"gs://{BUCKET}/team/a/b/tiny-sharded", tmp_path / "dest")
    files = same_tree(sharded, tmp_path / "dest")
    assert "extras/notes.txt" in files
    assert "pytorch_model.bin.index.json" in files
    assert sum(f.startswith("pytorch_model-") for f in files) >= 2
    assert result.files == files


def test_large_objects_download_in_slices_and_verify(single, tmp_path, monkeypatch):
    monkeypatch.setattr(gcs, "SLICE_BYTES", 4096)
    result = fetch(f"gs://{BUCKET}/org/tiny", tmp_path / "dest", workers=4)
    same_tree(single, tmp_path / "dest")
    assert (single / "model.safetensors").stat().st_size > 10 * 4096
    assert result.downloaded_bytes == result.bytes


def test_uri_naming_one_object_gives_dest_slash_its_basename(single, tmp_path):
    result = fetch(f"gs://{BUCKET}/org/tiny/model.safetensors", tmp_path / "dest")
    assert result.files == ["model.safetensors"]
    assert filecmp.cmp(
        single / "model.safetensors", tmp_path / "dest" / "model.safetensors", shallow=False
    )


def test_rerun_downloads_nothing_and_keeps_the_files(single, tmp_path):
    fetch(f"gs://{BUCKET}/org/tiny", tmp_path / "dest")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "dest").iterdir()}
    again = fetch(f"gs://{BUCKET}/org/tiny", tmp_path / "dest")
    assert again.downloaded_bytes == 0
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "dest").iterdir()} == before


def test_a_damaged_local_file_is_downloaded_again(single, tmp_path):
    dest = tmp_path / "dest"
    fetch(f"gs://{BUCKET}/org/tiny", dest)
    target = dest / "model.safetensors"
    target.write_bytes(b"\0" * target.stat().st_size)
    result = fetch(f"gs://{BUCKET}/org/tiny", dest)
    assert result.downloaded_bytes == target.stat().st_size
    same_tree(single, dest)


def test_a_file_of_dests_that_no_fetch_wrote_is_never_replaced(single, tmp_path):
    """DEST already holds the user's own file at an object's name: refused (it is not the
    loader's to replace), kept byte for byte; once moved away, the fetch goes through."""
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "config.json").write_text("the user's\n")
    with pytest.raises(NotOursError, match=r"config\.json"):
        fetch(f"gs://{BUCKET}/org/tiny", dest)
    assert (dest / "config.json").read_text() == "the user's\n"
    (dest / "config.json").unlink()
    fetch(f"gs://{BUCKET}/org/tiny", dest)
    same_tree(single, dest)


def test_missing_bucket_is_a_not_found_error_naming_it(tmp_path):
    with pytest.raises(SourceNotFoundError, match="gs://no-such-bucket"):
        fetch("gs://no-such-bucket/ckpt", tmp_path / "dest")


def test_missing_prefix_is_a_not_found_error_naming_the_uri(single, tmp_path):
    with pytest.raises(SourceNotFoundError, match="gs://models/org/nothing-here") as info:
        fetch(f"gs://{BUCKET}/org/nothing-here", tmp_path / "dest")
    assert "gcloud storage ls gs://models/org/" in info.value.remediation


def test_object_whose_bytes_do_not_match_its_checksum_is_rejected(server, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(os.urandom(200_000))
    server.upload_dir(BUCKET, "corrupt/ckpt", src)
    stored = server.stored_path(BUCKET, "corrupt/ckpt/model.safetensors")
    with open(stored, "r+b") as fh:  # flip bytes behind the server's back; metadata unchanged
        fh.seek(1000)
        fh.write(b"\xff\xfe\xfd\xfc")
    dest = tmp_path / "dest"
    with pytest.raises(ChecksumMismatchError, match=r"corrupt/ckpt/model\.safetensors"):
        fetch(f"gs://{BUCKET}/corrupt/ckpt", dest)
    assert not (dest / "model.safetensors").exists()
    leftovers = list((dest / transfer.PARTIAL_DIR).rglob("model.safetensors*"))
    assert leftovers == []


@pytest.mark.parametrize(
    "dropped",
    [("Md5Hash",), ("Crc32c",)],
    ids=["crc32c-only-like-a-composite-object", "md5-only"],
)
def test_an_object_with_one_of_its_two_checksums_is_fetched_and_verified(server, tmp_path, dropped):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(os.urandom(100_000))
    prefix = f"onesum-{dropped[0].lower()}"
    server.upload_dir(BUCKET, prefix, src)
    server.drop_checksums(BUCKET, f"{prefix}/model.safetensors", *dropped)
    dest = tmp_path / "dest"
    fetch(f"gs://{BUCKET}/{prefix}", dest)
    same_tree(src, dest)
    # Damaged where it lies: the checksum left still catches it.
    with open(server.stored_path(BUCKET, f"{prefix}/model.safetensors"), "r+b") as fh:
        fh.seek(500)
        fh.write(b"\x00\xff\x00\xff")
    with pytest.raises(ChecksumMismatchError, match=rf"{prefix}/model\.safetensors"):
        fetch(f"gs://{BUCKET}/{prefix}", tmp_path / "again")


def test_an_object_without_any_checksum_is_refused_before_anything_is_downloaded(server, tmp_path):
    """No retry could verify its bytes: exit 2 naming it and what to do, never 75 forever."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(os.urandom(100_000))
    server.upload_dir(BUCKET, "nosum", src)
    server.drop_checksums(BUCKET, "nosum/model.safetensors", "Crc32c", "Md5Hash")
    dest = tmp_path / "dest"
    for _ in range(2):  # the same answer every time
        with pytest.raises(SourceError) as info:
            fetch(f"gs://{BUCKET}/nosum", dest, retry_deadline_s=5)
        assert not isinstance(info.value, TransientSourceError | ChecksumMismatchError)
        assert info.value.exit_code == 2
        assert f"gs://{BUCKET}/nosum/model.safetensors" in info.value.message
        assert "neither a CRC32C nor an MD5" in info.value.message
        assert "Upload the object again" in info.value.remediation
        assert not dest.exists() or [p for p in dest.rglob("*") if p.is_file()] == []
    # A fetch that skips it (already converted) does not need it.
    fetch(f"gs://{BUCKET}/nosum", dest, hooks=ArrivalHooks(skip=frozenset({"model.safetensors"})))
    assert (dest / "config.json").read_text() == "{}"
    assert not (dest / "model.safetensors").exists()
    # One object named by its own name: the object named is that one.
    with pytest.raises(SourceError) as info:
        fetch(f"gs://{BUCKET}/nosum/model.safetensors", tmp_path / "one", retry_deadline_s=5)
    assert f"Object gs://{BUCKET}/nosum/model.safetensors has neither" in info.value.message


@pytest.fixture
def no_read_back(monkeypatch) -> list[Path]:
    """Reading a downloaded file back for its checksum fails the test; a file found already in
    place (read to decide whether to keep it) is recorded in the list returned."""
    present: list[Path] = []
    real = gcs._verified

    def verified(top, rel, blob):
        present.append(top.path / rel)
        return real(top, rel, blob)

    def refuse(*args, **kwargs):
        raise AssertionError(f"a download was read back: {args}")

    monkeypatch.setattr(gcs, "_verified", verified)
    for name in ("crc32c_of", "md5_of"):
        monkeypatch.setattr(gcs, name, refuse)
    return present


@contextlib.contextmanager
def _one_object_behind(
    proxy: ThrottleProxy, tmp_path: Path, monkeypatch, bucket: str, size: int
) -> Iterator[Path]:
    """``gs://BUCKET/ckpt/model.safetensors`` of ``size`` random bytes on a fresh emulator with
    ``proxy`` in front of it (the loader's endpoint); yields the source folder."""
    srv = GcsServer(tmp_path / "gcs").start()
    proxy.target_port = srv.port
    proxy.start()
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "model.safetensors").write_bytes(os.urandom(size))
        srv.upload_dir(bucket, "ckpt", src)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        yield src
    finally:
        proxy.stop()
        srv.stop()


def test_a_byte_changed_in_transit_is_caught_from_the_bytes_received(
    tmp_path, monkeypatch, no_read_back
):
    """No read-back: the CRC32C of what arrived, slice by slice, is what is compared."""
    proxy = ThrottleProxy(0, flip_first=1, flip_at=5 * SLICE // 2, fail_path="/download/")
    size = 3 * SLICE + 12345
    with _one_object_behind(proxy, tmp_path, monkeypatch, "flip", size) as src:
        dest = tmp_path / "dest"
        with pytest.raises(ChecksumMismatchError, match=r"ckpt/model\.safetensors"):
            fetch("gs://flip/ckpt", dest, workers=1, slice_bytes=5 * SLICE)
        assert proxy.flips == 1
        assert not (dest / "model.safetensors").exists()
        assert list((dest / transfer.PARTIAL_DIR).rglob("model.safetensors*")) == []
        # Sliced (slices arrive in any order, their values are combined), this time intact.
        result = fetch("gs://flip/ckpt", dest, workers=3, slice_bytes=SLICE)
        same_tree(src, dest)
        assert result.downloaded_bytes == size
        assert no_read_back == [dest / "model.safetensors"] * 2  # looked for, absent both times


def test_a_server_that_ignores_the_byte_range_is_refused_before_its_body_is_read(
    tmp_path, monkeypatch
):
    proxy = ThrottleProxy(0, strip_range=True)
    with _one_object_behind(proxy, tmp_path, monkeypatch, "norange", 3 * SLICE) as src:
        with pytest.raises(SourceError, match="ignored the byte range") as info:
            fetch("gs://norange/ckpt", tmp_path / "dest", slice_bytes=SLICE, retry_deadline_s=5)
        assert f"for {SLICE} bytes at offset" in info.value.message
        assert "--slice-mib larger than the largest object" in info.value.remediation
        # One slice for the whole object needs no range.
        fetch("gs://norange/ckpt", tmp_path / "dest", slice_bytes=4 * SLICE)
        same_tree(src, tmp_path / "dest")


def _left_by_a_gone_run(server, tmp_path: Path, prefix: str, size: int) -> tuple[bytes, Path, Path]:
    """``size`` random bytes uploaded as ``prefix/model.safetensors``; the bytes, the fetch's
    DEST and where a loader that is gone left that object's partial file."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(size)
    (src / "model.safetensors").write_bytes(data)
    server.upload_dir(BUCKET, prefix, src)
    (blob,) = server.client().list_blobs(BUCKET, prefix=prefix)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # the run that left them
    gone.wait()
    owner = f"{gone.pid}-{fs.host_digest()}"
    dest = tmp_path / "dest"
    return data, dest, dest / transfer.PARTIAL_DIR / f"model.safetensors.{blob.generation}.{owner}"


@pytest.mark.parametrize("damaged", [False, True])
def test_slices_a_killed_run_wrote_are_read_back_never_trusted(
    server, tmp_path, monkeypatch, damaged
):
    """What a killed run left (a partial file, a journal of its finished slices) may have lost
    a slice the journal lists (it is not fsynced for a transient fetch): those slices' CRC32C
    comes from the disk, so a lost one fails the checksum and the next run starts over."""
    prefix = f"resume-{damaged}/ckpt"
    data, dest, partial = _left_by_a_gone_run(server, tmp_path, prefix, 4 * SLICE + 100)
    kept = bytearray(data[: 2 * SLICE]) + bytes(len(data) - 2 * SLICE)
    if damaged:
        kept[SLICE + 7] ^= 0x01  # a slice the journal lists did not reach the disk intact
    rel = partial.relative_to(dest).as_posix()
    left_by_a_fetch(dest, rel, bytes(kept))
    left_by_a_fetch(dest, f"{rel}.slices", f"0 {SLICE - 1}\n{SLICE} {2 * SLICE - 1}\n".encode())
    read_back: list[tuple[int, int]] = []
    real = gcs.crc32c_of

    def recorded(fh, start=0, length=None):
        read_back.append((start, length))
        return real(fh, start, length)

    monkeypatch.setattr(gcs, "crc32c_of", recorded)
    if damaged:
        with pytest.raises(ChecksumMismatchError) as info:
            fetch(f"gs://{BUCKET}/{prefix}", dest, slice_bytes=SLICE)
        assert "downloads this object from scratch" in info.value.remediation
        assert not (dest / "model.safetensors").exists()
    result = fetch(f"gs://{BUCKET}/{prefix}", dest, slice_bytes=SLICE)
    assert (dest / "model.safetensors").read_bytes() == data
    if damaged:
        assert read_back == [(0, SLICE), (SLICE, SLICE)]  # the first run's; the second resumed none
        assert result.downloaded_bytes == len(data)
    else:
        assert read_back == [(0, SLICE), (SLICE, SLICE)]
        assert result.downloaded_bytes == len(data) - 2 * SLICE


@pytest.mark.parametrize(
    "planted", ["partial-link", "journal-link", "journal-fifo", "journal-lines"]
)
def test_what_a_stopped_run_left_is_never_followed_or_read_blocking(
    server, tmp_path, monkeypatch, planted
):
    """The partial file and journal a gone run left are taken over as names in their
    directory, when both are files: a link there is never followed nor removed (what it points
    to stays as it was), a FIFO is never read (no hang) nor removed, and journal lines that are not two numbers naming a slice (paths,
    ``..``, NUL, a third field) are ignored. The fetch then completes from the bucket."""
    prefix = f"planted-{planted}/ckpt"
    data, dest, partial = _left_by_a_gone_run(server, tmp_path, prefix, 3 * SLICE + 10)
    journal = partial.with_name(partial.name + ".slices")
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the loader's\n" * 100)
    rel = partial.relative_to(dest).as_posix()
    left_by_a_fetch(dest, rel, data[:SLICE] + bytes(len(data) - SLICE))
    left_by_a_fetch(dest, f"{rel}.slices", f"0 {SLICE - 1}\n".encode())
    if planted == "partial-link":
        partial.unlink()
        partial.symlink_to(outside)
    elif planted == "journal-link":
        journal.unlink()
        journal.symlink_to(outside)
    elif planted == "journal-fifo":
        journal.unlink()
        os.mkfifo(journal)
    else:
        journal.write_text(f"x y\n../../outside 1\n0 {SLICE - 1} 7\n-1 5\n\0 \0\n0 {SLICE - 1}\n")

    def hang(*_):
        raise AssertionError("the fetch blocked on what was planted")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)
    try:
        result = fetch(f"gs://{BUCKET}/{prefix}", dest, slice_bytes=SLICE)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert (dest / "model.safetensors").read_bytes() == data
    assert outside.read_bytes() == b"not the loader's\n" * 100
    resumed = SLICE if planted == "journal-lines" else 0  # the one line naming a slice
    assert result.downloaded_bytes == len(data) - resumed
    if planted == "journal-lines":
        assert not (dest / transfer.PARTIAL_DIR).exists()
    else:  # a link or a FIFO is not the loader's: neither taken over nor removed; the gone
        # run's own file beside it is, once the fetch is whole (nothing resumes it any more)
        planted_at = partial if planted == "partial-link" else journal
        assert [p.name for p in (dest / transfer.PARTIAL_DIR).iterdir()] == [planted_at.name]


def test_not_enough_disk_space_fails_before_downloading(single, tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "DISK_MARGIN", 1 << 60)
    dest = tmp_path / "dest"
    with pytest.raises(InsufficientDiskSpaceError, match="need"):
        fetch(f"gs://{BUCKET}/org/tiny", dest)
    written = [p for p in dest.rglob("*") if p.is_file() and p.stat().st_blocks > 0]
    assert {p.name for p in written} <= {fs.MADE, transfer.FETCH_MARKER}  # its record only


def test_connection_refused_is_retried_then_a_transient_error(tmp_path, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    start = time.monotonic()
    with pytest.raises(TransientSourceError, match="attempts"):
        fetch(f"gs://{BUCKET}/org/tiny", tmp_path / "dest", retry_deadline_s=2.0)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("status", [429, 503])
def test_429_and_5xx_are_retried_then_a_transient_error(status, server, tmp_path, monkeypatch):
    proxy = ThrottleProxy(server.port, status=status).start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        with pytest.raises(TransientSourceError, match=str(status)):
            fetch(f"gs://{BUCKET}/org/tiny", tmp_path / "dest", retry_deadline_s=2.0)
        assert proxy.requests >= 2
    finally:
        proxy.stop()


def test_permission_denied_fails_at_once_with_what_to_check(server, tmp_path, monkeypatch):
    proxy = ThrottleProxy(server.port, status=403).start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        with pytest.raises(SourcePermissionError, match="gs://models") as info:
            fetch(f"gs://{BUCKET}/org/tiny", tmp_path / "dest", retry_deadline_s=30)
        assert proxy.requests >= 1
        assert len(set(proxy.request_lines)) == len(proxy.request_lines)  # none retried
        assert "roles/storage.objectViewer" in info.value.remediation
    finally:
        proxy.stop()


def test_transient_download_failures_are_retried_and_the_fetch_completes(tmp_path, monkeypatch):
    """The first two media requests answer 503."""
    proxy = ThrottleProxy(0, status=503, fail_first=2, fail_path="/download/")
    srv = GcsServer(tmp_path / "gcs", external_url=proxy.url).start()
    proxy.target_port = srv.port
    proxy.start()
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "config.json").write_text("{}")
        (src / "model.safetensors").write_bytes(os.urandom(300_000))
        srv.upload_dir("flaky", "ckpt", src)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        result = fetch("gs://flaky/ckpt", tmp_path / "dest", workers=1, retry_deadline_s=30)
        same_tree(src, tmp_path / "dest")
        assert proxy.requests == 2
        assert result.downloaded_bytes == result.bytes
    finally:
        proxy.stop()
        srv.stop()


def test_a_429_with_retry_after_is_waited_out_before_the_next_attempt(
    tmp_path, monkeypatch, caplog
):
    proxy = ThrottleProxy(0, status=429, fail_first=1, fail_path="/download/", retry_after=2)
    srv = GcsServer(tmp_path / "gcs", external_url=proxy.url).start()
    proxy.target_port = srv.port
    proxy.start()
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "model.safetensors").write_bytes(os.urandom(100_000))
        srv.upload_dir("busy", "ckpt", src)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="loader.sources.failures"):
            fetch("gs://busy/ckpt", tmp_path / "dest", workers=1, retry_deadline_s=30)
        assert time.monotonic() - started >= 2.0  # a lower bound: never sooner than asked
        same_tree(src, tmp_path / "dest")
        assert proxy.requests == 1
        assert "Retry-After of 2 s" in caplog.text
    finally:
        proxy.stop()
        srv.stop()


def test_connections_cut_mid_object_are_retried_and_the_result_verified(
    tmp_path, monkeypatch, caplog
):
    proxy = ThrottleProxy(0, cut_first=3, cut_after=100_000)
    with _one_object_behind(proxy, tmp_path, monkeypatch, "cut", 1_000_000) as src:
        with caplog.at_level(logging.WARNING, logger="loader.sources.failures"):
            result = fetch("gs://cut/ckpt", tmp_path / "dest", workers=1, retry_deadline_s=30)
        same_tree(src, tmp_path / "dest")
        assert proxy.cuts == 3
        assert caplog.text.count("; retrying") == 3
        assert result.downloaded_bytes == 1_000_000


def test_an_object_that_trickles_is_dropped_and_retried_until_the_deadline(tmp_path, monkeypatch):
    """A server or proxy sending a few bytes at a time, each within the read timeout, held the
    download for good (the timeout is per read): below the pace the answer is dropped and the
    slice asked for again, within the retry deadline."""
    from loader.sources import transfer

    monkeypatch.setattr(transfer, "STALL_S", 0.5)
    monkeypatch.setattr(transfer, "STALL_BYTES", 64 * 1024)
    # 2 kB every tenth of a second: never idle, 10 kB in half a second, below the pace.
    proxy = ThrottleProxy(0, rate=20_000, piece=2000)
    with _one_object_behind(proxy, tmp_path, monkeypatch, "slow", 1_000_000):
        with pytest.raises(TransientSourceError, match="slowed to") as failed:
            fetch("gs://slow/ckpt", tmp_path / "dest", workers=1, retry_deadline_s=4)
        assert "gs://slow/ckpt/model.safetensors" in str(failed.value)
    assert not (tmp_path / "dest" / "model.safetensors").exists()


def test_fetch_killed_with_sigkill_resumes_without_downloading_complete_files(
    tmp_path, monkeypatch
):
    """Kill `model-loader fetch` halfway through a 24 MiB object, rerun, check the result."""
    proxy = ThrottleProxy(0, rate=12e6)
    srv = GcsServer(tmp_path / "gcs", external_url=proxy.url).start()
    proxy.target_port = srv.port
    proxy.start()
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "config.json").write_text('{"model_type": "gptj"}')
        (src / "model.safetensors").write_bytes(os.urandom(6 * SLICE))
        srv.upload_dir("big", "ckpt", src)
        dest = tmp_path / "dest"
        env = {**os.environ, "STORAGE_EMULATOR_HOST": proxy.url}
        cmd = [
            sys.executable,
            "-m",
            "loader",
            "fetch",
            "gs://big/ckpt",
            str(dest),
            "--workers",
            "1",
            "--slice-mib",
            str(SLICE >> 20),
        ]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        journals = dest / transfer.PARTIAL_DIR
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            done = [
                line
                for j in journals.glob("model.safetensors.*.slices")
                for line in j.read_text().splitlines()
            ]
            if len(done) >= 2:
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, "fetch finished before it could be killed"
        assert not (dest / "model.safetensors").exists()  # nothing unverified in place
        config_stat = (dest / "config.json").stat()

        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        result = fetch("gs://big/ckpt", dest, retry_deadline_s=30, slice_bytes=SLICE)
        same_tree(src, dest)
        size = (src / "model.safetensors").stat().st_size
        assert 0 < result.downloaded_bytes <= size - 2 * SLICE  # resumed, not restarted
        after = (dest / "config.json").stat()
        assert (after.st_ino, after.st_mtime_ns) == (config_stat.st_ino, config_stat.st_mtime_ns)
        assert not (dest / transfer.PARTIAL_DIR).exists()
    finally:
        proxy.stop()
        srv.stop()


def test_cli_fetch_prints_the_path_last_and_logs_progress_lines(single, server, tmp_path):
    dest = tmp_path / "dest"
    env = {**os.environ, "STORAGE_EMULATOR_HOST": server.url}
    out = subprocess.run(
        [sys.executable, "-m", "loader", "fetch", f"gs://{BUCKET}/org/tiny", str(dest)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == str(dest)
    assert "loader.progress" in out.stderr and "(100%) at" in out.stderr
    same_tree(single, dest)


def test_cli_missing_bucket_exits_2_with_a_hint_and_no_traceback(server, tmp_path):
    env = {**os.environ, "STORAGE_EMULATOR_HOST": server.url}
    out = subprocess.run(
        [sys.executable, "-m", "loader", "fetch", "gs://absent/x", str(tmp_path / "d")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "error: Bucket gs://absent does not exist" in out.stderr
    assert "hint:" in out.stderr
    assert "Traceback" not in out.stderr


def test_run_from_gs_publishes_a_repository_that_triton_serves(
    server, single, tiny_checkpoint_with_tokenizer, tmp_path
):
    """`model-loader run --source gs://...` end to end, then one completion on the real Triton."""
    from tokenizers import Tokenizer

    from loader.completion import complete, load_request
    from loader.repository import manifest
    from loader.serving import TritonServer

    root = tmp_path / "models"
    env = {**os.environ, "STORAGE_EMULATOR_HOST": server.url}
    proc = subprocess.run(
        [sys.executable, "-m", "loader", "run", "--source", f"gs://{BUCKET}/org/tiny",
         "--repository", str(root), "--model-name", "tiny", "--revision", "v1",
         "--tp-size", "1", "--pp-size", "1", "--instance-count", "1", "--backend", "python"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    published = Path(proc.stdout.splitlines()[-1])
    assert published.parent.name == "tiny@v1"
    assert (published / ".ready").is_file()
    assert manifest.verify(published) == []
    assert manifest.read_manifest(published)["source_revision"].startswith("gen-")
    assert not (root / ".work").exists() or not any((root / ".work").iterdir())

    request = for_tiny_model(load_request(Path(__file__).parents[1] / "bench" / "test.json"))
    request.update(request_output_len=[6], runtime_top_k=[1])
    prompt_ids = Tokenizer.from_file(str(tiny_checkpoint_with_tokenizer / "tokenizer.json"))
    prompt_ids = prompt_ids.encode(request["prompt"][0]).ids
    with TritonServer(published) as triton:
        completion = complete(triton.http_url, "tiny", request)
    assert completion.sequence_length == len(prompt_ids) + 6
    assert completion.output_ids[: len(prompt_ids)].tolist() == prompt_ids
    assert completion.text


def test_a_download_whose_body_stalls_fails_at_the_retry_deadline(tmp_path, monkeypatch):
    """The server sends the first 64 KiB of the body, then nothing for half a minute."""
    proxy = ThrottleProxy(0, rate=2000.0)
    srv = GcsServer(tmp_path / "gcs", external_url=proxy.url).start()
    proxy.target_port = srv.port
    proxy.start()
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "model.safetensors").write_bytes(os.urandom(1_000_000))
        srv.upload_dir("stall", "ckpt", src)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        started = time.monotonic()
        with pytest.raises(TransientSourceError, match="kept failing") as info:
            fetch("gs://stall/ckpt", tmp_path / "dest", workers=1, retry_deadline_s=3)
        assert "object gs://stall/ckpt/model.safetensors" in info.value.message
        # bounded by the deadline (3 s) plus one last wait, not by the 300 s read timeout
        assert time.monotonic() - started < 30
    finally:
        proxy.stop()
        srv.stop()


def test_objects_that_cannot_all_be_local_files_are_refused_by_name(tmp_path, monkeypatch):
    srv = GcsServer(tmp_path / "gcs", backend="memory").start()
    try:
        nested, flat = tmp_path / "nested", tmp_path / "flat"
        (nested / "a").mkdir(parents=True)
        (nested / "a" / "b").write_text("nested")
        flat.mkdir()
        (flat / "a").write_text("flat")
        srv.upload_dir(BUCKET, "collide", nested)
        srv.upload_dir(BUCKET, "collide", flat)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", srv.url)
        with pytest.raises(SourceError, match="collide/a and gs://models/collide/a/b") as info:
            fetch(f"gs://{BUCKET}/collide", tmp_path / "dest")
        assert "Rename one of them" in info.value.remediation
        assert not (tmp_path / "dest" / "a").exists()
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "pair",
    [("config.json", "Config.json"),
     ("model-\u00e9.safetensors", "model-e\u0301.safetensors"),
     ("notes/a", "NOTES/A"),
     ("extra", "EXTRA/b")],
    ids=["case", "composed", "case in a folder", "a file where a folder goes"],
)  # fmt: skip
def test_objects_that_alias_on_some_file_systems_are_refused_by_name(server, tmp_path, pair):
    """Before: both were downloaded; on a case-insensitive or normalising volume (SMB, some
    NFS servers) one file stood for both, the last downloaded, and the conversion read the
    other object's bytes under the name the fingerprint recorded for the first (the Hub's
    listing was refused for this; the bucket's was not)."""
    src = tmp_path / "src"
    for number, name in enumerate(pair):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(f"object {number}")
    prefix = f"alias-{zlib.crc32(repr(pair).encode())}"
    server.upload_dir(BUCKET, prefix, src)
    with pytest.raises(SourceError, match="collide") as info:
        fetch(f"gs://{BUCKET}/{prefix}", tmp_path / "dest")
    assert "Rename one of them" in info.value.remediation
    assert not (tmp_path / "dest").exists() or fs_names(tmp_path / "dest") == []


def fs_names(dest: Path) -> list[str]:
    """What a fetch left under ``dest`` besides its own record and partial directory."""
    return sorted(
        p.relative_to(dest).as_posix()
        for p in dest.rglob("*")
        if not p.relative_to(dest).parts[0].startswith(".")
    )


@pytest.mark.parametrize(
    ("name", "needle"),
    [(".partial/x", "downloads in progress"), (".Partial/x", "downloads in progress"),
     (".MODEL-LOADER-made", "record of what it wrote"),
     ("x" * 230, "path component of 230 bytes")],
)  # fmt: skip
def test_objects_with_reserved_or_overlong_names_are_refused(server, tmp_path, name, needle):
    src = tmp_path / "src"
    (src / name).parent.mkdir(parents=True, exist_ok=True)
    (src / name).write_text("x")
    (src / "config.json").write_text("{}")
    prefix = f"odd-{len(name)}-{zlib.crc32(name.encode())}"
    server.upload_dir(BUCKET, prefix, src)
    with pytest.raises(SourceError, match=needle):
        fetch(f"gs://{BUCKET}/{prefix}", tmp_path / "dest")
    assert not (tmp_path / "dest" / "config.json").exists()


def test_a_fetch_planned_from_another_listing_downloads_nothing(single, tmp_path):
    """An overlapped run plans its conversion from a first fetch of the small files and
    journals its outputs under that fetch's revision; the fetch of the shards that finds
    the prefix at another revision (an object uploaded again meanwhile) stops before it
    writes anything, and one at the same revision fetches."""
    from loader.sources import ArrivalHooks

    uri = f"gs://{BUCKET}/org/tiny"
    first = fetch(uri, tmp_path / "first")
    with pytest.raises(TransientSourceError, match="changed while it was loading"):
        fetch(uri, tmp_path / "dest", hooks=ArrivalHooks(planned="gen-0123456789abcdef"))
    assert not (tmp_path / "dest").exists()
    again = fetch(uri, tmp_path / "dest", hooks=ArrivalHooks(planned=first.revision))
    assert again.revision == first.revision and (tmp_path / "dest" / "config.json").is_file()


def test_a_destination_holding_a_link_to_elsewhere_is_never_written_through(sharded, tmp_path):
    dest, elsewhere = tmp_path / "dest", tmp_path / "elsewhere"
    dest.mkdir()
    elsewhere.mkdir()
    (dest / "extras").symlink_to(elsewhere)
    with pytest.raises(NotOursError, match="symbolic link"):
        fetch(f"gs://{BUCKET}/team/a/b/tiny-sharded", dest)
    assert list(elsewhere.iterdir()) == []


def test_a_link_planted_at_a_folder_below_dest_is_never_followed(sharded, tmp_path):
    """A library call (no command confined it): ``dest/extras`` is a link to a folder outside
    holding the object's very bytes. It is neither taken as the object nor written through."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_bytes((sharded / "extras" / "notes.txt").read_bytes())
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "extras").symlink_to(outside)
    with pytest.raises(NotOursError, match="extras"):
        fetch(f"gs://{BUCKET}/team/a/b/tiny-sharded", dest)
    assert sorted(p.name for p in outside.iterdir()) == ["notes.txt"]
    assert (dest / "extras").is_symlink()
