"""The overlapped conversion's state machine (loader.convert.schedule) and its journal
(loader.convert.overlapped.Journal), on their own: no threads, no downloads."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import digest
from loader.convert.overlapped import Journal
from loader.convert.schedule import Schedule, Step
from tests.tiers import examples

#: out_i reads shard s_i only.
ONE_EACH = {f"out{i}": frozenset({f"s{i}"}) for i in range(1, 5)}


def test_one_shard_downloads_at_a_time():
    schedule = Schedule(ONE_EACH, window=3)
    assert schedule.admit("s1")
    assert not schedule.admit("s2")  # s1 still downloading
    assert schedule.arrived("s1") == Step(write=("out1",))
    assert schedule.admit("s2")


def test_at_most_window_shards_are_held_while_outputs_are_written():
    schedule = Schedule(ONE_EACH, window=2)
    for shard in ("s1", "s2"):
        assert schedule.admit(shard)
        schedule.arrived(shard)
    assert schedule.held == {"s1", "s2"}
    assert not schedule.admit("s3")  # the window is full and out1, out2 are being written
    assert schedule.written("out1") == Step(delete=("s1",))
    assert schedule.admit("s3")


def test_one_more_shard_is_let_in_when_those_held_cannot_progress_alone():
    needs = {"all": frozenset({"s1", "s2", "s3"})}
    schedule = Schedule(needs, window=2)
    for shard in ("s1", "s2"):
        assert schedule.admit(shard)
        assert schedule.arrived(shard) == Step()
    assert schedule.admit("s3")  # nothing is written: without s3 nothing ever would be
    assert schedule.arrived("s3") == Step(write=("all",))
    assert schedule.written("all") == Step(delete=("s1", "s2", "s3"))
    assert schedule.finished and not schedule.held


def test_a_shard_is_deleted_only_once_every_output_reading_it_is_written():
    needs = {"a": frozenset({"s1"}), "b": frozenset({"s1", "s2"})}
    schedule = Schedule(needs, window=2)
    schedule.admit("s1")
    assert schedule.arrived("s1") == Step(write=("a",))
    assert schedule.written("a") == Step()  # b still reads s1
    schedule.admit("s2")
    assert schedule.arrived("s2") == Step(write=("b",))
    assert schedule.written("b") == Step(delete=("s1", "s2"))


def test_a_resumed_schedule_skips_the_shards_only_written_outputs_read():
    needs = {"a": frozenset({"s1"}), "b": frozenset({"s1", "s2"}), "c": frozenset({"s3"})}
    schedule = Schedule(needs, done={"b", "c"})
    assert schedule.skip == {"s2", "s3"}
    assert list(schedule.waiting) == ["a"]
    # A skipped shard that arrives anyway (it was already downloaded) goes at once.
    assert schedule.arrived("s3") == Step(delete=("s3",))


def test_missing_names_the_absent_shards_once_nothing_is_being_written():
    needs = {"a": frozenset({"s1"}), "b": frozenset({"s1", "s2"})}
    schedule = Schedule(needs)
    schedule.arrived("s1")
    assert schedule.missing() == []  # a is being written
    schedule.written("a")
    assert schedule.missing() == ["s2"]


def test_files_that_no_output_reads_are_not_scheduled():
    schedule = Schedule(ONE_EACH, window=1)
    assert schedule.admit("s1")
    assert schedule.admit("README.md")
    assert schedule.arrived("README.md") == Step()
    assert schedule.held == {"s1"}


@st.composite
def plans(draw):
    shards = [f"s{i}" for i in range(draw(st.integers(1, 7)))]
    outputs = draw(st.integers(1, 9))
    needs = {
        f"out{i}": frozenset(draw(st.lists(st.sampled_from(shards), min_size=1, max_size=3)))
        for i in range(outputs)
    }
    done = draw(st.sets(st.sampled_from(sorted(needs))))
    return needs, done, draw(st.integers(1, 3))


@settings(max_examples=examples(200), deadline=None, derandomize=True, database=None)
@given(plan=plans(), data=st.data())
def test_any_schedule_writes_everything_once_and_bounds_the_shards_held(plan, data):
    """A fetch asking to start the next shard in name order whenever it likes, downloads
    finishing and writers finishing in any order the schedule allows."""
    needs, done, window = plan
    schedule = Schedule(needs, done=done, window=window)
    queue = sorted({s for shards in needs.values() for s in shards} - schedule.skip)
    delivered = list(queue)
    downloading: list[str] = []
    writing: list[str] = []
    written: list[str] = []
    deleted: list[str] = []

    def follow(step: Step) -> None:
        writing.extend(step.write)
        for shard in step.delete:
            assert all(out in done or out in written for out in needs if shard in needs[out])
            deleted.append(shard)

    while queue or downloading or writing:
        moves = ["admit"] * bool(queue) + ["arrive"] * bool(downloading) + ["write"] * bool(writing)
        move = data.draw(st.sampled_from(moves))
        if move == "admit":
            busy = bool(writing)
            if schedule.admit(queue[0]):
                downloading.append(queue.pop(0))
                assert len(downloading) == 1  # one shard downloads at a time
                # Beyond the window only while nothing is written: those held cannot progress.
                assert len(schedule.held) <= window or not busy
            else:
                assert downloading or writing, "nothing can progress: the schedule stalled"
        elif move == "arrive":
            follow(schedule.arrived(downloading.pop(0)))
        else:
            out = writing.pop(data.draw(st.integers(0, len(writing) - 1)))
            written.append(out)
            follow(schedule.written(out))
    assert sorted(written) == sorted(set(needs) - done)
    assert sorted(deleted) == sorted(delivered)  # each delivered shard deleted, once
    assert schedule.finished and schedule.missing() == [] and not schedule.held


# --- the journal ---------------------------------------------------------------------------


def _write(folder: Path, name: str, data: bytes) -> str:
    """Write ``data`` as ``folder/name``; returns its digest (what the writers journal)."""
    (folder / name).write_bytes(data)
    return digest.of_bytes(data)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_journal_keeps_the_outputs_recorded_under_the_same_header(tmp_path):
    folder = tmp_path / "2-gpu"
    journal = Journal(folder, "rev fp16 2")
    assert journal.resume() == {}
    sha_a = _write(folder, "a.bin", b"aaaa")
    journal.record("a.bin", 4, sha_a)
    _write(folder, "b.bin", b"bb")  # written, never recorded (killed before its fsync)
    assert Journal(folder, "rev fp16 2").resume() == {"a.bin": (4, sha_a)}
    assert _names(folder) == ["a.bin"]
    assert journal.path.parent == folder.parent  # the journal is never among the outputs
    # The rewritten journal still keeps it.
    assert Journal(folder, "rev fp16 2").resume() == {"a.bin": (4, sha_a)}


@pytest.mark.parametrize("header", ["rev2 fp16 2", "rev fp32 2", "rev fp16 4"])
def test_outputs_of_another_source_revision_dtype_or_tp_are_removed(tmp_path, header):
    folder = tmp_path / "2-gpu"
    journal = Journal(folder, "rev fp16 2")
    journal.resume()
    journal.record("a.bin", 4, _write(folder, "a.bin", b"aaaa"))
    assert Journal(folder, header).resume() == {}
    assert _names(folder) == []


def test_outputs_journaled_with_another_digest_are_written_again(tmp_path):
    """A journal names its digest's algorithm: one of an earlier loader (sha256 digests, right
    for their files) is not reused by a conversion that records BLAKE3, whose manifest would
    otherwise list sha256 values as BLAKE3 ones."""
    folder = tmp_path / "2-gpu"
    journal = Journal(folder, "rev fp16 2", "sha256")
    journal.resume()
    _write(folder, "a.bin", b"aaaa")
    sha = hashlib.sha256(b"aaaa").hexdigest()
    journal.record("a.bin", 4, sha)
    assert Journal(folder, "rev fp16 2", "sha256").resume() == {"a.bin": (4, sha)}
    assert Journal(folder, "rev fp16 2").resume() == {}
    assert _names(folder) == []


def test_outputs_journaled_by_other_converter_code_are_written_again(tmp_path, monkeypatch):
    """A run killed, then run again by a loader whose converter differs (upgraded meanwhile:
    a split fixed, a check on the weights added): the outputs the first one wrote are not
    kept, so none is published as what this loader writes."""
    from loader.convert import overlapped

    folder = tmp_path / "2-gpu"
    journal = Journal(folder, "rev fp16 2")
    journal.resume()
    journal.record("a.bin", 4, _write(folder, "a.bin", b"aaaa"))
    assert Journal(folder, "rev fp16 2").resume() == {"a.bin": (4, digest.of_bytes(b"aaaa"))}
    monkeypatch.setattr(overlapped, "converter_digest", lambda: "0" * 64, raising=False)
    assert Journal(folder, "rev fp16 2").resume() == {}
    assert _names(folder) == []


def test_an_output_changed_after_it_was_recorded_is_written_again(tmp_path):
    folder = tmp_path / "2-gpu"
    journal = Journal(folder, "h")
    journal.resume()
    for name in ("same.bin", "grown.bin", "replaced.bin", "rotted.bin", "linked.bin"):
        journal.record(name, 4, _write(folder, name, b"1234"))
    sha = digest.of_bytes(b"1234")
    _write(folder, "grown.bin", b"12345")
    replacement = folder / "new"
    replacement.write_bytes(b"1234")
    os.replace(replacement, folder / "replaced.bin")  # same size, another inode
    # Same size, inode and mtime, other bytes: only the digest tells.
    rotted = folder / "rotted.bin"
    before = rotted.stat()
    with open(rotted, "r+b") as fh:
        fh.write(b"4321")
    os.utime(rotted, ns=(before.st_atime_ns, before.st_mtime_ns))
    # A link in place of a journaled output is never followed, nor removed: the loader makes
    # no links, so it is someone else's (the output is then refused where it is written).
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"1234")
    (folder / "linked.bin").unlink()
    (folder / "linked.bin").symlink_to(elsewhere)
    assert Journal(folder, "h").resume() == {"same.bin": (4, sha)}
    assert _names(folder) == ["linked.bin", "same.bin"]
    assert (folder / "linked.bin").is_symlink() and elsewhere.read_bytes() == b"1234"


def test_lines_that_are_not_records_are_ignored(tmp_path):
    folder = tmp_path / "2-gpu"
    folder.mkdir()
    sha = digest.of_bytes(b"x")
    (folder / "x").write_bytes(b"x")
    ino, mtime = (folder / "x").stat().st_ino, (folder / "x").stat().st_mtime_ns
    lines = ["h", "garbage", f"../x 1 {sha} {ino} {mtime}", f".journal 1 {sha} {ino} {mtime}",
             f"x 1 not-a-digest {ino} {mtime}", f"x 1 {sha} {ino}"]  # fmt: skip
    Journal(folder, "h").path.write_text("\n".join(lines) + "\n")
    assert Journal(folder, "h").resume() == {}


# --- admission blocks instead of polling ---------------------------------------------------


def test_admit_waits_for_the_shard_ahead_to_arrive_then_admits(tiny_overlapped, monkeypatch):
    """The waiting admit is woken by the arrival, not by asking again: with a wait far longer
    than the test, it still answers as soon as the shard ahead is here."""
    from loader.convert import overlapped

    monkeypatch.setattr(overlapped, "ADMIT_WAIT_S", 3600.0)
    conversion, shards = tiny_overlapped
    first, second = shards[0], shards[1]
    assert conversion.admit(first.name)
    answers: list[bool] = []
    waiter = threading.Thread(target=lambda: answers.append(conversion.admit(second.name)))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive()  # still waiting: the first shard has not arrived
    conversion.arrived(first.name, first)
    waiter.join(timeout=300)
    assert answers == [True]


def test_an_output_is_journaled_only_after_its_fsync(tiny_overlapped):
    """The journal is what a resumed run trusts: each line must follow the fsync of the output
    it names (an output journaled first could be lost with its line kept)."""
    from loader import fs

    conversion, shards = tiny_overlapped
    journal = conversion._journal.path
    synced: set[str] = set()
    appends: list[set[str]] = []

    def watch(op: str, path: str) -> None:
        if op == "fsync":
            synced.add(Path(path).name)
        elif op == "write" and path == str(journal):
            appends.append(set(synced))

    with fs.inject(watch):
        for shard in shards:
            while not conversion.admit(shard.name):
                pass
            conversion.arrived(shard.name, shard)
        conversion.finish()
    names = [line.split()[0] for line in journal.read_text().splitlines()[1:]]
    assert len(names) == len(appends) == len(conversion.plan.outputs)
    for name, fsynced_before in zip(names, appends, strict=True):
        assert name in fsynced_before, name


@pytest.fixture
def tiny_overlapped(tmp_path):
    """An overlapped conversion of a tiny sharded checkpoint whose small files are here."""
    import shutil

    from loader.checkpoint import read_hf_config, read_inventory
    from loader.convert import plan_conversion
    from loader.convert.overlapped import OverlappedConversion
    from loader.parallel import Parallelism
    from tests.tinymodels import build_tiny_model

    model = build_tiny_model(seed=1).half()
    source = tmp_path / "source"
    model.save_pretrained(
        source, max_shard_size=sum(p.numel() * 2 for p in model.parameters()) // 3
    )
    download = tmp_path / "download"
    shutil.copytree(source, download)
    plan = plan_conversion(
        read_hf_config(download), read_inventory(download), parallelism=Parallelism(tp=1)
    )

    class Quiet:
        def update(self, n: int) -> None:
            pass

    conversion = OverlappedConversion(
        plan, tmp_path / "converted", revision="r", progress=Quiet(), window=2
    )
    with conversion:
        yield conversion, [download / name for name in plan.inventory.files]


@pytest.mark.parametrize("changed", ["convert/gptj.py", "checkpoint.py", "formats/jsondoc.py"])
def test_the_converter_code_a_journal_records_changes_with_any_byte_of_it(
    tmp_path, monkeypatch, changed
):
    """What a journal records as the converter's code takes in every file that decides what
    an output holds, by its bytes: one byte changed in the converter, the checkpoint reader or
    the formats' facts (the same size: a check's comparison flipped) is other code, and its
    outputs are written again."""
    import shutil

    from loader.convert import overlapped

    package = Path(overlapped.__file__).resolve().parent.parent
    copy = tmp_path / "loader"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(overlapped, "__file__", str(copy / "convert" / "overlapped.py"))
    digest_of = overlapped.converter_digest.__wrapped__
    assert digest_of() == overlapped.converter_digest()  # the copy is the same code
    data = bytearray((copy / changed).read_bytes())
    data[len(data) // 2] ^= 1  # (a digit, a letter: one bit of one byte)
    (copy / changed).write_bytes(bytes(data))
    assert digest_of() != overlapped.converter_digest()
