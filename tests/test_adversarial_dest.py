"""Adversarial DESTs of ``model-loader fetch`` and OUTPUT_DIRs of ``model-loader convert``:
what others plant at the names the loader creates there, runs killed and run again, two runs
at once. Each test checks that what is not the loader's stays byte for byte, that the command
ends with a typed error (``error:`` and ``hint:`` lines, exit 2 or 75) or the right bytes, and
never with a traceback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.sources.transfer import PARTIAL_DIR
from tests.at_step import AtStep, picked_calls

#: A pid no process of this host has (above the kernel's largest), tagged with this host: the
#: owner tag a stopped fetch of this host left in its partial names.
GONE = f"{2**22 + 7}-{fs.host_digest()}"


def _fetch_copy(capsys, source: Path, dest: Path) -> tuple[int, str]:
    code = main(["fetch", "--copy", str(source), str(dest)])
    return code, capsys.readouterr().err


def _same_files(source: Path, dest: Path) -> None:
    for f in source.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize("kind", ["link", "dangling link", "FIFO"])
def test_a_link_or_fifo_at_a_stopped_fetchs_partial_name_stays_and_the_fetch_finishes(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, kind
):
    """Before: a link or FIFO at the name of a gone owner's partial file (``.partial/<name>.
    <owner>``) was kept by the removal of what stopped fetches left, which then took
    ``.partial`` for empty and failed removing it (ENOTEMPTY: exit 1, "this is a bug")."""
    dest = tmp_path / "dest"
    (dest / PARTIAL_DIR).mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"a user's\n")
    planted = dest / PARTIAL_DIR / f"config.json.{GONE}"
    if kind == "FIFO":
        os.mkfifo(planted)
    else:
        planted.symlink_to(victim if kind == "link" else tmp_path / "nothing")

    code, err = _fetch_copy(capsys, tiny_checkpoint_with_tokenizer, dest)
    assert code == 0, err
    assert "Traceback" not in err
    _same_files(tiny_checkpoint_with_tokenizer, dest)
    assert os.path.lexists(planted) and victim.read_bytes() == b"a user's\n"
    code, err = _fetch_copy(capsys, tiny_checkpoint_with_tokenizer, dest)  # and again
    assert code == 0, err
    assert os.path.lexists(planted)


def test_a_partial_directory_another_fetch_fills_while_it_is_removed_stays_the_loaders(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """Two fetches into one DEST: one removes ``.partial`` once its own files are gone just
    as the other puts its partial file there (ENOTEMPTY), or removes it first (ENOENT). Before:
    exit 1, "this is a bug"; now the fetch ends well and the other's file stays."""
    for race in ("fills", "removes"):
        dest = tmp_path / race
        other = dest / PARTIAL_DIR / f"config.json.{os.getppid()}-{fs.host_digest()}.0badcafe"

        def hook(op: str, path: str, race: str = race, other: Path = other) -> None:
            if op != "rmdir" or not path.endswith(f"/{PARTIAL_DIR}"):
                return
            if race == "fills":
                other.write_bytes(b"the other fetch's bytes\n")
            else:
                os.rmdir(path)

        with fs.inject(hook):
            code, err = _fetch_copy(capsys, tiny_checkpoint_with_tokenizer, dest)
        assert code == 0, err
        _same_files(tiny_checkpoint_with_tokenizer, dest)
        if race == "fills":
            assert other.read_bytes() == b"the other fetch's bytes\n"
            # The other fetch is done with it: ``.partial`` is still the loader's, and goes
            # (before: the removal recorded, then failed, lost it: kept as someone else's).
            other.unlink()
            code, err = _fetch_copy(capsys, tiny_checkpoint_with_tokenizer, dest)
            assert code == 0, err
            assert not (dest / PARTIAL_DIR).exists(), err
        else:
            assert not (dest / PARTIAL_DIR).exists()


# --- what stands at a name the fetch writes: refused before anything is written ---------------


def test_an_earlier_loaders_dest_whose_source_changed_is_refused_before_anything_is_copied(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """DEST fetched by a loader that kept no record (its files are no fetch's as far as the
    record tells), the source changed since. Before: the files sorting before the changed one
    were copied, then the fetch stopped at it (and a gs:// or hf:// fetch downloaded it whole
    first). Now the fetch names every such file and writes nothing."""
    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint_with_tokenizer, source)
    dest = tmp_path / "dest"
    shutil.copytree(source, dest)  # what the earlier loader left: the files, no record
    (source / "config.json").write_text((source / "config.json").read_text() + "\n")
    (source / "added.txt").write_text("new in the source\n")
    (dest / "tokenizer.json").write_text("the user's own\n")
    before = {p.name: p.read_bytes() for p in dest.iterdir()}

    code, err = _fetch_copy(capsys, source, dest)
    assert code == 2, err
    assert "Traceback" not in err
    error = next(line for line in err.splitlines() if line.startswith("error:"))
    assert "config.json" in error and "tokenizer.json" in error
    assert "hint:" in err and "DEST" in err and "--" not in err.split("hint:")[1]
    assert {p.name: p.read_bytes() for p in dest.iterdir() if p.name in before} == before
    assert not (dest / "added.txt").exists() and not (dest / PARTIAL_DIR).exists()


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory):
    from tests.servers import GcsServer

    server = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    yield server
    server.stop()


@pytest.mark.server
def test_a_gs_fetch_refuses_what_stands_at_an_objects_name_before_downloading_it(
    gcs_server, tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch
):
    """Before: the whole object was downloaded into ``.partial``, then its rename into place
    refused; now nothing is downloaded."""
    from loader.errors import InTheWayError
    from loader.sources import fetch

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.url)
    gcs_server.upload_dir("models", "org/tiny", tiny_checkpoint_with_tokenizer)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "model.safetensors").write_bytes(b"the user's\n")
    (dest / "tokenizer.json").mkdir()
    with pytest.raises(InTheWayError) as info:
        fetch("gs://models/org/tiny", dest)
    assert "model.safetensors" in info.value.message and "tokenizer.json" in info.value.message
    assert (dest / "model.safetensors").read_bytes() == b"the user's\n"
    assert sorted(p.name for p in dest.iterdir() if not p.name.startswith(fs.MARKER_PREFIX)) == [
        "model.safetensors",
        "tokenizer.json",
    ]


# --- killed and run again ---------------------------------------------------------------------

#: Runs ``model-loader ARGS...`` and kills itself (SIGKILL) at the first call of the loader's
#: file-system seam whose operation is ``OP`` and whose path holds ``PART``.
_KILLED_AT = """
import os, signal, sys
from loader import fs
from loader.cli import main
op, part, *args = sys.argv[1:]
def hook(called, path):
    if called == op and part in path:
        os.kill(os.getpid(), signal.SIGKILL)
with fs.inject(hook):
    sys.exit(main(args))
"""


@pytest.mark.parametrize(
    ("op", "part"),
    [
        ("write", f"{fs.MADE}."),
        ("fsync", f"{fs.MADE}."),
        ("link", f"{fs.MADE}."),
        ("rename-noreplace", f"{fs.MADE}."),  # moved aside to be removed
        ("unlink", f"{fs.MARKER_PREFIX}gone."),  # removed there
    ],
)
def test_a_fetch_killed_while_it_marks_dest_leaves_no_temporary_record_after_a_rerun(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, op, part
):
    """Before: a fetch killed between writing its record under a temporary name and removing
    that name left ``DEST/.model-loader-made.<owner>.<hex>.tmp`` for good (no rerun removed
    it). Now a rerun removes a gone owner's temporary record, told by its content; a user's
    file of such a name holding anything else stays."""
    dest = tmp_path / "dest"
    dest.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    args = ["fetch", "--copy", str(tiny_checkpoint_with_tokenizer), str(dest)]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_AT, op, part, *args],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert list(dest.glob(f"{fs.MADE}.*.tmp")) or list(dest.glob(part + "*"))  # it left one
    users = dest / f"{fs.MADE}.{GONE}.0badcafe.tmp"
    users.write_text("a user's\n")

    code, err = _fetch_copy(capsys, tiny_checkpoint_with_tokenizer, dest)
    assert code == 0, err
    _same_files(tiny_checkpoint_with_tokenizer, dest)
    assert [p.name for p in dest.glob(f"{fs.MADE}.*")] == [users.name]
    assert not list(dest.glob(f"{fs.MARKER_PREFIX}gone.*"))
    assert users.read_text() == "a user's\n"


def test_a_users_file_renamed_to_a_stopped_markings_temporary_record_at_any_step_stays(
    tmp_path,
):
    """A fetch stopped while it marked DEST left a temporary record, which the next one judges
    by its content and removes: a user's file renamed to that name at any step after the read
    (the removal went by name) stays whole."""
    from loader.sources.transfer import FETCH_MARKER

    def left(dest: Path) -> Path:
        dest.mkdir()
        tmp = dest / f"{fs.MADE}.{GONE}.0badcafe.tmp"
        tmp.write_bytes(b"")
        tmp.write_bytes(fs.made_header(FETCH_MARKER) + fs.made_line((fs.MADE,), tmp.stat()))
        return tmp

    def mark(dest: Path) -> None:
        with fs.confined(dest), fs.Dir.open(dest) as d:
            d.mark_in_place(FETCH_MARKER, "model-loader fetch")

    counted = tmp_path / "count"
    tmp = left(counted)
    steps, _ = picked_calls(lambda op, path: path, lambda: mark(counted))
    assert not tmp.exists()
    judged = steps.index(f"read {tmp}") + 1
    for step in range(judged + 1, len(steps) + 1):
        tmp = left(tmp_path / f"at-{step}")
        theirs = tmp_path / f"theirs-{step}"
        theirs.write_text("a user's\n")
        hook = AtStep(step, lambda op, path: path, lambda _, t=tmp, o=theirs: os.rename(o, t))
        with fs.inject(hook):
            mark(tmp.parent)
        assert tmp.read_text() == "a user's\n", (step, steps[step - 1])


def test_a_partial_directory_another_fetch_removes_before_the_file_is_made_is_made_again(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """Two fetches into one DEST: one removes ``.partial/sub`` (empty: it is done) just after
    the other entered it to create its partial file there. Before: the other stopped with
    exit 75, saying another process (a user, a script) removed it; now it makes it again."""
    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint_with_tokenizer, source)
    (source / "sub" / "deep").mkdir(parents=True)
    (source / "sub" / "deep" / "notes.txt").write_text("nested\n")
    dest = tmp_path / "dest"
    removed: list[str] = []

    def hook(op: str, path: str) -> None:
        if op == "open" and "/.partial/sub/deep/notes.txt." in path and not removed:
            removed.append(path)
            os.rmdir(os.path.dirname(path))  # empty: the file is not made yet

    with fs.inject(hook):
        code, err = _fetch_copy(capsys, source, dest)
    assert removed, "the race was not run"
    assert code == 0, err
    assert (dest / "sub" / "deep" / "notes.txt").read_text() == "nested\n"
    assert not (dest / PARTIAL_DIR).exists()


# --- convert's OUTPUT_DIR -----------------------------------------------------------------------


def test_a_conversion_that_exists_already_is_refused_with_a_hint_naming_output_dir(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """Before: the hint said "choose another output directory", naming no argument of the
    command; now it names OUTPUT_DIR (and the one option that replaces it)."""
    out = tmp_path / "out"
    args = ["convert", str(tiny_checkpoint_with_tokenizer), str(out), "--tp-size", "1"]
    assert main(args) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in (out / "1-gpu").iterdir()}
    assert main(args) == 2
    err = capsys.readouterr().err
    hint = next(line for line in err.splitlines() if line.startswith("hint:"))
    assert "OUTPUT_DIR" in hint and "--force" in hint, err
    assert {p.name: p.read_bytes() for p in (out / "1-gpu").iterdir()} == before


# --- what a killed fetch left, when the rerun finds everything present ---------------------------


@pytest.mark.server
@pytest.mark.parametrize("scheme", ["gs", "hf"])
def test_a_rerun_that_finds_every_file_present_removes_what_a_killed_fetch_left(
    gcs_server, tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch, scheme
):
    """A fetch killed after its last file was in place, before it removed its partial files
    (an hf:// fetch's staging directory ``.partial/hf.<owner>``, a gs:// partial file): the
    rerun has nothing to download. Before: it never looked at ``.partial``, which stayed for
    good; now what gone owners of this host left there goes (what others put there stays)."""
    from loader.sources import fetch
    from tests.leftovers import left_by_a_fetch
    from tests.servers import ForgedHub

    files = {p.name: p.read_bytes() for p in tiny_checkpoint_with_tokenizer.iterdir()}
    dest = tmp_path / "dest"
    hub = ForgedHub().start()
    try:
        if scheme == "hf":
            hub.add("org/tiny", files)
            monkeypatch.setenv("HF_ENDPOINT", hub.url)
            uri, left = "hf://org/tiny", f"{PARTIAL_DIR}/hf.{GONE}/model.safetensors.incomplete"
        else:
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.url)
            gcs_server.upload_dir("models", "left/tiny", tiny_checkpoint_with_tokenizer)
            uri, left = "gs://models/left/tiny", f"{PARTIAL_DIR}/model.safetensors.1.{GONE}"
        fetch(uri, dest)
        left_by_a_fetch(dest, left, b"half a download")
        others = dest / PARTIAL_DIR / "someone-elses.txt"
        others.write_text("not the loader's\n")
        result = fetch(uri, dest)
    finally:
        hub.stop()
    assert result.downloaded_bytes == 0
    assert not (dest / left).exists()
    assert others.read_text() == "not the loader's\n"
    assert {name: (dest / name).read_bytes() for name in files} == files


@pytest.mark.server
def test_a_stopped_download_no_fetch_recorded_is_not_taken_over_and_the_fetch_finishes(
    tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch
):
    """At a gone owner's staging name (``.partial/hf.<owner>``) stands what DEST's record does
    not name: a DEST of a loader that kept no record, killed mid-download, or a user's files.
    Before: the fetch took it over (a rename), which the record refused: exit 2 at every run,
    for good. Now it is no partial download of a fetch's: left as it is, the file downloaded
    anew."""
    from loader.sources import fetch
    from tests.servers import ForgedHub

    files = {p.name: p.read_bytes() for p in tiny_checkpoint_with_tokenizer.iterdir()}
    dest = tmp_path / "dest"
    planted = dest / PARTIAL_DIR / f"hf.{GONE}" / "model.safetensors.incomplete"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"an earlier loader's half download")
    hub = ForgedHub().start()
    try:
        hub.add("org/tiny", files)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        fetch("hf://org/tiny", dest)
    finally:
        hub.stop()
    assert {name: (dest / name).read_bytes() for name in files} == files
    assert planted.read_bytes() == b"an earlier loader's half download"


@pytest.mark.parametrize("case", ["output is a file", "output below a FIFO", "tp 0"])
def test_convert_hints_name_output_dir_and_only_its_own_options(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys, case
):
    """Before: an OUTPUT_DIR that cannot be a directory got "Choose an output directory ...",
    naming no argument; a --tp-size of 0 got "Pass --tp-size, --pp-size and --instance-count
    ...", an option convert lacks. Now the hint names OUTPUT_DIR, or the one flag at fault."""
    planted = tmp_path / "planted"
    out, tp = planted, "1"
    if case == "output is a file":
        planted.write_bytes(b"a user's\n")
    elif case == "output below a FIFO":
        os.mkfifo(planted)
        out = planted / "out"
    else:
        planted.write_bytes(b"a user's\n")
        out, tp = tmp_path / "out", "0"
    code = main(["convert", str(tiny_checkpoint_with_tokenizer), str(out), "--tp-size", tp])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    hint = next(line for line in err.splitlines() if line.startswith("hint:"))
    if case == "tp 0":
        assert "--tp-size" in hint and "--instance-count" not in hint, err
    else:
        assert "OUTPUT_DIR" in hint, err
    if planted.is_file():
        assert planted.read_bytes() == b"a user's\n"
