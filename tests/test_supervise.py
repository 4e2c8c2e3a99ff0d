"""``convert`` and ``run`` started as the installed command (``python -m loader``) work in a
supervised child: a child killed by a signal still ends with an ``error:`` line, an exit code
that says what happened, and nothing of its own left behind (loader.cli.supervise).

The processes here are real: the test finds the child through ``/proc`` (the parent's
``children``), waits until the child has the source's weights memory-mapped (its ``maps``),
and then cuts the file short or signals the child, as another process or the kernel would.
``main(argv)`` called in a process never forks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader import ledger
from loader.checkpoint import open_checkpoint
from loader.cli import main
from loader.cli.supervise import clean_up
from loader.errors import EXIT_TRANSIENT, SourceShrankError
from loader.repository.lock import LOCKS_DIR
from loader.repository.publish import STAGING_DIR
from tests import procs
from tests.stalled import as_a_shell_starts
from tests.test_convert_signals import write_medium_gptj

ROOT = Path(__file__).resolve().parent.parent


def _start(*argv: object) -> subprocess.Popen:
    """``model-loader ARGV`` as the installed command starts it."""
    return subprocess.Popen(
        as_a_shell_starts([sys.executable, "-m", "loader", *map(str, argv)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def _mapping_child(proc: subprocess.Popen, path: Path) -> int:
    """The pid of ``proc``'s child once it has ``path`` memory-mapped."""
    child, mapped = _mapping_child_of(proc, path.parent, path.name)
    assert mapped == Path(os.path.realpath(path)), mapped
    return child


def _stop(pid: int) -> None:
    """Stop ``pid`` and return once it is stopped (a signal is delivered asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        assert time.monotonic() < deadline, "the child never stopped"
        time.sleep(0.001)


def _convert_argv(src: Path, out: Path) -> list[object]:
    return ["convert", src, out, "--tp-size", "2", "--workers", "1"]


def _run_argv(src: Path, root: Path) -> list[object]:
    return ["run", "--source", src, "--repository", root, "--model-name", "m", "--tp-size", "2",
            "--pp-size", "1", "--instance-count", "1", "--backend", "python"]  # fmt: skip


@pytest.fixture
def medium(tmp_path: Path) -> Path:
    """A 230 MB GPT-J checkpoint (converting it takes about a second) with a tokenizer."""
    from loader.demo.tokenizer import train_tokenizer
    from tests.conftest import TOKENIZER_CORPUS

    src = tmp_path / "src"
    write_medium_gptj(src)
    train_tokenizer(TOKENIZER_CORPUS, 320, src)
    return src


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "dtype", "how"),
    [
        # Every output is cast from the map: the read past the end is SIGBUS, always.
        ("convert", "fp32", ["reading past its new end killed the reader with SIGBUS."]),
        # The same, unless the file was cut while run held an earlier map of it (its checks
        # before converting): the converter's own map then opens on the shorter file, and it
        # says so before reading anything.
        (
            "run",
            "fp32",
            [
                "the loader stopped reading it.",
                "reading past its new end killed the reader with SIGBUS.",
            ],
        ),
        # Outputs that are a plain run of source bytes are copied by the kernel
        # (copy_file_range): it reads nothing past the new end, and the converter says so.
        (
            "convert",
            "fp16",
            [
                "the loader stopped reading it.",
                "reading past its new end killed the reader with SIGBUS.",
            ],
        ),
        # Outputs kept in the source's dtype are written straight from the map: write(2)
        # answers EFAULT for those pages, which the converter reports itself (or a cast
        # reads past the end first: SIGBUS).
        (
            "run",
            "fp16",
            [
                "the loader stopped reading it.",
                "reading past its new end killed the reader with SIGBUS.",
            ],
        ),
    ],
)
def test_a_source_cut_short_under_the_map_is_a_transient_error_naming_it(
    command, dtype, how, medium, tmp_path
):
    weights, out = medium / "model.safetensors", tmp_path / "out"
    out.mkdir()
    argv = _convert_argv(medium, out) if command == "convert" else _run_argv(medium, out)
    argv = [*argv, "--dtype", dtype]
    size = weights.stat().st_size
    proc = _start(*argv)
    child = _mapping_child(proc, weights)
    _stop(child)  # held while the file is cut short; it reads on after
    os.truncate(weights, size // 2)
    os.kill(child, signal.SIGCONT)
    stdout, err = proc.communicate(timeout=120)

    assert proc.returncode == EXIT_TRANSIENT, err  # not 135: a rerun reads the source again
    said = (
        f"error: A source file shrank while the loader read it: {weights} ({size} bytes when "
        f"the loader opened it, {size // 2} now); "
    )
    assert any(said + end in err for end in how), err
    assert err.rstrip().splitlines()[-1].startswith("hint: Let nothing write the source")
    assert "Traceback" not in err
    assert stdout == ""
    left = [p for p in out.rglob("*") if p.name not in (LOCKS_DIR, STAGING_DIR)]
    assert left == []  # no partial directory, staging directory or lock file

    # The next run refuses the file left cut short, named, and leaves nothing either.
    rerun = _start(*argv)
    stdout, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 2, err
    assert f"error: {weights} is truncated or corrupt" in err
    assert [p for p in out.rglob("*") if p.name not in (LOCKS_DIR, STAGING_DIR)] == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL])
def test_a_converter_killed_by_a_signal_says_so_and_leaves_nothing(sig, medium, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(*_convert_argv(medium, out), "--dtype", "fp32")
    os.kill(_mapping_child(proc, medium / "model.safetensors"), sig)
    stdout, err = proc.communicate(timeout=120)

    assert proc.returncode == 128 + sig, err  # the code a shell gives a killed process
    assert f"error: The loader was killed by {sig.name} before it finished" in err
    hint = err.rstrip().splitlines()[-1]
    assert hint.startswith("hint: ")
    assert ("OOM killer" in hint) == (sig == signal.SIGKILL)
    assert "removed " in err and ".2-gpu.partial-" in err
    assert stdout == ""
    assert list(out.iterdir()) == []


@pytest.mark.slow
def test_a_converter_killed_while_it_stops_is_not_blamed_on_memory(medium, tmp_path):
    """A SIGTERM passed on to the converter, then SIGKILL before it had unwound (a pod's grace
    period too short): the hint said "most often the OOM killer"; it says the stop did not wait
    long enough. Stopped first, the child takes neither signal before SIGKILL; the supervisor
    takes SIGTERM (15) before SIGCHLD (17), the lower pending signal first."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(*_convert_argv(medium, out), "--dtype", "fp32")
    child = _mapping_child(proc, medium / "model.safetensors")
    _stop(child)
    proc.send_signal(signal.SIGTERM)
    os.kill(child, signal.SIGKILL)
    stdout, err = proc.communicate(timeout=120)

    assert proc.returncode == 137, err
    assert "error: The loader was killed by SIGKILL before it finished" in err
    hint = err.rstrip().splitlines()[-1]
    assert hint.startswith("hint: It was stopping on SIGTERM (passed on to it)"), err
    assert "OOM" not in hint
    assert stdout == ""
    assert list(out.iterdir()) == []


@pytest.mark.slow
def test_a_run_killed_while_converting_leaves_no_lock_and_no_staging(medium, tmp_path):
    root = tmp_path / "root"
    proc = _start(*_run_argv(medium, root))
    child = _mapping_child(proc, medium / "model.safetensors")
    assert list((root / STAGING_DIR).iterdir())  # the child is converting into its staging
    assert list((root / LOCKS_DIR).iterdir())  # under the key's lock
    os.kill(child, signal.SIGKILL)
    stdout, err = proc.communicate(timeout=120)

    assert proc.returncode == 137, err
    assert "error: The loader was killed by SIGKILL" in err
    assert stdout == ""
    # The parent took the dead child's lock over and removed its staging directory, as the
    # next loader of the key would have.
    assert list((root / STAGING_DIR).iterdir()) == []
    assert list((root / LOCKS_DIR).iterdir()) == []
    assert not list(root.glob("m@*/*"))  # nothing published

    # The next run publishes, and its last stdout line is the published path.
    rerun = _start(*_run_argv(medium, root))
    stdout, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    (published,) = root.glob("m@*/*")
    assert stdout.splitlines()[-1] == str(published)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [
        (signal.SIGTERM, 143, "terminated (SIGTERM); stopped cleanly"),
        (signal.SIGINT, 130, "interrupted"),
        (signal.SIGHUP, 129, "hung up (SIGHUP: its terminal closed); stopped cleanly"),
    ],
)
def test_a_signal_to_the_supervisor_reaches_the_command(sig, code, said, medium, tmp_path):
    root = tmp_path / "root"
    proc = _start(*_run_argv(medium, root))
    _mapping_child(proc, medium / "model.safetensors")
    proc.send_signal(sig)
    stdout, err = proc.communicate(timeout=120)

    assert proc.returncode == code, err
    if said is not None:
        assert err.rstrip().splitlines()[-1] == said
    assert "error:" not in err
    assert stdout == ""
    assert list((root / STAGING_DIR).iterdir()) == []
    assert list((root / LOCKS_DIR).iterdir()) == []


@pytest.mark.slow
def test_the_command_dies_with_its_supervisor(medium, tmp_path):
    """``kill -9`` of the loader stops its work at once, as it did without a supervisor (the
    next loader of the key removes what it left): no orphan goes on to publish."""
    root = tmp_path / "root"
    proc = _start(*_run_argv(medium, root))
    _mapping_child(proc, medium / "model.safetensors")
    proc.kill()
    _, err = proc.communicate(timeout=120)  # its pipes close once the child is gone too
    assert proc.returncode == -signal.SIGKILL
    assert not list(root.glob("m@*/*")), err  # the child did not go on to publish
    assert list((root / STAGING_DIR).iterdir())  # left, as by any loader killed with -9


@pytest.mark.slow
def test_a_terminals_ctrl_c_reaches_the_command_once(medium, tmp_path):
    """Ctrl-C on a terminal signals its whole foreground process group, the supervisor and
    its child alike: the supervisor does not send it a second time (which would interrupt the
    child's unwinding)."""
    import pty

    out = tmp_path / "out"
    out.mkdir()
    argv = [
        sys.executable,
        "-m",
        "loader",
        *map(str, _convert_argv(medium, out)),
        "--dtype",
        "fp32",
    ]
    pid, terminal = pty.fork()
    if pid == 0:  # the loader, on the new terminal
        os.chdir(ROOT)
        wrapped = as_a_shell_starts(argv)
        os.execve(wrapped[0], wrapped, {**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(".2-gpu.partial-") for p in out.iterdir()):
            assert time.monotonic() < deadline, "the conversion never started writing"
            time.sleep(0.001)
        os.write(terminal, b"\x03")
        said = b""
        with contextlib.suppress(OSError):  # EIO once the loader closed the terminal
            while chunk := os.read(terminal, 4096):
                said += chunk
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(terminal)
    text = said.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 130, text
    assert text.count("interrupted") == 1
    assert "Traceback" not in text
    assert list(out.iterdir()) == []


def test_main_with_argv_runs_in_this_process(tiny_checkpoint_with_tokenizer, tmp_path, capsys):
    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(os.getpid()))
    out = tmp_path / "out"
    source = str(tiny_checkpoint_with_tokenizer)
    assert main(["convert", source, str(out), "--tp-size", "1"]) == 0
    assert forks == []
    assert not ledger.active()  # nothing is recorded where no supervisor reads it
    assert capsys.readouterr().out.splitlines()[-1] == str(out / "1-gpu")


def test_a_file_cut_short_before_it_is_mapped_is_a_transient_error(
    tiny_checkpoint_with_tokenizer, tmp_path
):
    src = tmp_path / "src"
    src.mkdir()
    for path in tiny_checkpoint_with_tokenizer.iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    weights = src / "model.safetensors"
    size = weights.stat().st_size
    checkpoint = open_checkpoint(src)  # the header checked at this size
    os.truncate(weights, size - 1)
    with pytest.raises(SourceShrankError) as caught:
        checkpoint.get(checkpoint.names()[0])
    assert caught.value.exit_code == EXIT_TRANSIENT
    assert f"{weights} ({size} bytes when the loader opened it, {size - 1} now)" in (
        caught.value.message
    )


def _temporary(path: Path) -> dict:
    st = os.lstat(path)
    return {"kind": "temporary", "path": str(path), "dev": st.st_dev, "ino": st.st_ino}


def test_the_ledger_keeps_what_fits_and_counts_the_rest(tmp_path):
    block = ledger.open_shared()
    try:
        (tmp_path / "shard").write_bytes(b"x" * 10)
        with open(tmp_path / "shard", "rb") as fh:
            ledger.note_mapped(tmp_path / "shard", fh.fileno())
        ledger.note_lock(tmp_path, "m@r/tp1-pp1-i1-0", 60.0)
        for i in range(ledger.SIZE // 4096 + 10):  # more than the block holds
            ledger.note_lock(tmp_path / ("x" * 4000), f"k{i}", 60.0)
    finally:
        ledger.stop()
    recorded = ledger.entries(block)
    assert recorded.mapped[0]["path"] == str(tmp_path / "shard")
    assert recorded.mapped[0]["size"] == 10
    assert recorded.locks[0]["key"] == "m@r/tp1-pp1-i1-0"
    assert 200 < len(recorded.locks) < ledger.SIZE // 4000
    assert recorded.dropped == ledger.SIZE // 4096 + 10 + 1 - len(recorded.locks)


def test_only_the_very_directory_the_child_made_is_removed(tmp_path):
    """What a dead child recorded is removed only while it is still that directory: one made
    again under its name, a link put there, or a name without the child's pid stays."""
    pid = 4242
    made = tmp_path / f".2-gpu.partial-{pid}-0a1b2c3d"
    made.mkdir()
    (made / "model.wte.bin").write_bytes(b"x")
    again = tmp_path / f".1-gpu.partial-{pid}-0a1b2c3d"
    again.mkdir()
    recorded_again = _temporary(again)
    moved = again.rename(tmp_path / "moved")  # kept: its inode cannot be reused
    again.mkdir()  # another directory under the recorded name
    target = tmp_path / "users"
    target.mkdir()
    (target / "keep").write_text("mine")
    linked = tmp_path / f".4-gpu.partial-{pid}-0a1b2c3d"
    linked.symlink_to(target)
    other = tmp_path / f".8-gpu.partial-{pid + 1}-0a1b2c3d"
    other.mkdir()
    recorded = ledger.Entries(
        mapped=[],
        temporary=[_temporary(made), recorded_again, _temporary(linked), _temporary(other)],
        locks=[],
        dropped=0,
    )

    assert clean_up(recorded, pid) == [made]
    assert not made.exists()
    assert again.is_dir() and moved.is_dir() and linked.is_symlink() and other.is_dir()
    assert (target / "keep").read_text() == "mine"


def _bin_of(safetensors_dir: Path) -> None:
    """The same checkpoint as a single ``pytorch_model.bin`` (torch.save of its tensors)."""
    import torch
    from safetensors.torch import load_file

    weights = safetensors_dir / "model.safetensors"
    torch.save(load_file(weights), safetensors_dir / "pytorch_model.bin")
    weights.unlink()


def _cut_short_while_mapped(proc: subprocess.Popen, pid: int, weights: Path) -> tuple[int, str]:
    """Cut ``weights`` to half while ``pid`` (``proc``'s converter) holds it mapped and is
    stopped; the converter's size, and ``proc``'s stderr once it ended."""
    _stop(pid)
    size = weights.stat().st_size
    os.truncate(weights, size // 2)
    os.kill(pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    return size, err


def _said_shrank(err: str, weights: Path, size: int) -> None:
    said = (
        f"error: A source file shrank while the loader read it: {weights} ({size} bytes when "
        f"the loader opened it, {size // 2} now); "
    )
    assert said in err, err
    assert err.rstrip().splitlines()[-1].startswith("hint: Let nothing write the source")
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("command", ["convert", "run"])
def test_a_torch_bin_cut_short_under_the_map_is_a_transient_error_naming_it(
    command, medium, tmp_path
):
    _bin_of(medium)
    weights, out = medium / "pytorch_model.bin", tmp_path / "out"
    out.mkdir()
    argv = _convert_argv(medium, out) if command == "convert" else _run_argv(medium, out)
    argv = [*argv, "--dtype", "fp32"]  # every output cast from torch's map: SIGBUS
    proc = _start(*argv)
    size, err = _cut_short_while_mapped(proc, _mapping_child(proc, weights), weights)

    assert proc.returncode == EXIT_TRANSIENT, err
    _said_shrank(err, weights, size)
    assert [p for p in out.rglob("*") if p.name not in (LOCKS_DIR, STAGING_DIR)] == []

    rerun = _start(*argv)  # the file left cut short: refused, named, nothing left
    _, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 2, err
    assert f"error: {weights} is truncated or corrupt" in err
    assert "Traceback" not in err
    assert [p for p in out.rglob("*") if p.name not in (LOCKS_DIR, STAGING_DIR)] == []


def _mapping_child_of(proc: subprocess.Popen, below: Path, name: str) -> tuple[int, Path]:
    """``proc``'s child once it has a file ``name`` below ``below`` mapped, and that file."""
    deadline = time.monotonic() + 300  # a download comes first where the source is remote
    prefix = os.path.realpath(below) + "/"
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never mapped the weights"
        for child in procs.children(proc.pid):
            try:
                maps = Path(f"/proc/{child}/maps").read_text().splitlines()
            except OSError:
                continue
            for line in maps:
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith(prefix) and path.endswith("/" + name):
                    return child, Path(path)
        time.sleep(0.001)


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    from tests.servers import GcsServer

    srv = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    yield srv
    srv.stop()


@pytest.mark.slow
@pytest.mark.server
def test_the_loaders_own_copy_cut_short_under_the_map_is_transient_and_fetched_again(
    gcs, medium, tmp_path, monkeypatch
):
    """A ``gs://`` checkpoint that is not sharded is converted from the loader's own copy
    (``.work/<key>/source``): that copy cut short while mapped is the same typed error, and
    the next run finds the copy no longer matching the bucket's checksum, fetches it again
    and publishes."""
    from loader.repository import manifest
    from loader.repository.publish import WORK_DIR

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    gcs.upload_dir("models", "medium", medium)
    root = tmp_path / "root"
    root.mkdir()
    argv = [*_run_argv("gs://models/medium", root), "--dtype", "fp32"]
    proc = _start(*argv)
    child, weights = _mapping_child_of(proc, root / WORK_DIR, "model.safetensors")
    assert weights.parent.name == "source"
    size, err = _cut_short_while_mapped(proc, child, weights)

    assert proc.returncode == EXIT_TRANSIENT, err
    _said_shrank(err, weights, size)
    assert {p.name for p in root.iterdir()} <= {WORK_DIR, LOCKS_DIR, STAGING_DIR}
    for kept in (LOCKS_DIR, STAGING_DIR):  # no lock, no staging directory; the copy is kept
        assert not (root / kept).exists() or list((root / kept).iterdir()) == []

    rerun = _start(*argv)
    stdout, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    published = Path(stdout.splitlines()[-1])
    assert manifest.verify(published) == []
    assert not (root / WORK_DIR).exists() or list((root / WORK_DIR).iterdir()) == []


def test_a_link_at_roots_lock_directory_is_refused_when_clearing_a_key(tmp_path):
    """Clearing a dead loader's key looks for its lock in ROOT's lock directory through a
    descriptor: a link planted there (to a directory holding a lock file of that name) is a
    NotOursError naming it, never looked through, and nothing it leads to changes."""
    from loader.cli.supervise import _clear_key
    from loader.errors import NotOursError
    from loader.repository.lock import lock_path

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    held = lock_path(root, "tiny@r1/1")
    (outside / held.name).write_text("a user's file\n")
    (root / LOCKS_DIR).symlink_to(outside)
    with pytest.raises(NotOursError, match=str(root / LOCKS_DIR)):
        _clear_key(root, "tiny@r1/1", 1.0)
    assert os.listdir(outside) == [held.name]
    assert (outside / held.name).read_text() == "a user's file\n"
    (root / LOCKS_DIR).unlink()
    assert _clear_key(root, "tiny@r1/1", 1.0) == []  # nothing there: nothing said removed
