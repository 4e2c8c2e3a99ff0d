"""Every file-system change `run`, `convert`, `prune` and `fetch` make goes through loader.fs:
the one module that works relative to directory descriptors and holds the fault-injection seam.

Python raises an audit event for every file opened for writing, created, renamed, removed or
changed in mode (``sys.addaudithook``). While the commands run, each such event is traced to
the loader's own frame that caused it (the standard library's are looked through; a third-party
library's own work, such as the Hub client's downloads, is its own): that frame must be in
``loader/fs.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

import loader
from loader.cli import main

PACKAGE = str(Path(loader.__file__).parent) + os.sep
FS = str(Path(loader.__file__).parent / "fs.py")
STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CHANGES = {
    "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.link", "os.symlink",
    "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move",
}  # fmt: skip

_watching = threading.Event()
_found: list[str] = []


def _writes(event: str, args: tuple) -> bool:
    if event in CHANGES:
        return True
    if event != "open" or len(args) < 3:
        return False
    _path, mode, flags = args[:3]
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & WRITE_FLAGS)


def _audit(event: str, args: tuple) -> None:
    if not _watching.is_set() or not _writes(event, args):
        return
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(STDLIB) or name.startswith("<"):
            frame = frame.f_back  # the standard library acts for its caller
            continue
        if name.startswith(PACKAGE) and name != FS:
            _found.append(f"{event} {str(args[0])[-80:]} from {name[len(PACKAGE):]}:"
                          f"{frame.f_lineno}")  # fmt: skip
        return  # loader/fs.py, or a third-party library's own work


sys.addaudithook(_audit)


@contextlib.contextmanager
def watching():
    _found.clear()
    _watching.set()
    try:
        yield _found
    finally:
        _watching.clear()


def _run_argv(source: Path, root: Path, *extra: str) -> list[str]:
    return ["run", "--source", str(source), "--repository", str(root), "--model-name", "tiny",
            "--revision", "r1", "--tp-size", "1", "--pp-size", "1", "--instance-count", "1",
            "--backend", "python", *extra]  # fmt: skip


@pytest.fixture
def quiet(capsys):
    yield
    capsys.readouterr()


def test_run_force_prune_convert_and_fetch_change_files_only_through_loader_fs(
    tiny_checkpoint_with_tokenizer, tmp_path, quiet
):
    source, root = tiny_checkpoint_with_tokenizer, tmp_path / "root"
    with watching() as found:
        assert main(_run_argv(source, root)) == 0
        assert main(_run_argv(source, root, "--force")) == 0
        assert main(_run_argv(source, root, "--revision", "r2")) == 0
        assert main(["prune", "--repository", str(root), "--keep", "1"]) == 0
        assert main(["convert", str(source), str(tmp_path / "out"), "--tp-size", "2"]) == 0
        assert main(["fetch", str(source), str(tmp_path / "copy"), "--copy"]) == 0
    assert found == [], "\n".join(
        sorted(set(f.split(" from ")[1] + " " + f.split()[0] for f in found))
    )


#: The functions of loader.fs that take a path: only ever to read a source (a checkpoint, a
#: tokenizer, a token or request file), or to name the trees that are confined or followed.
READS_A_PATH = {"open_read", "read_file", "regular_size", "stat_path"}
NAMES_A_TREE = {"confined", "confined_within", "followed", "pinned"}
#: ... or to say, in a message, what stands where the user named a directory, or to name the
#: file a descriptor has open (for a library that opens a name itself).
DESCRIBES_A_PATH = {"by_descriptor", "not_a_directory", "what_stands_at"}


def test_loader_fs_writes_only_through_a_directory_and_one_name(tmp_path):
    """Below ROOT, everything the loader creates, writes, renames or removes is a ``Dir`` and
    one name: no function of loader.fs takes a path to change something. A path-taking
    function added to the module fails here until it is listed as a reader; each reader,
    given a path below a confined tree, refuses a link on the way and changes nothing."""
    import inspect

    from loader import fs
    from loader.errors import NotOursError

    takes_path = {
        name
        for name, function in inspect.getmembers(fs, inspect.isfunction)
        if function.__module__ == fs.__name__
        and not name.startswith("_")
        and any(
            "Path" in str(p.annotation) for p in inspect.signature(function).parameters.values()
        )
    }
    assert takes_path == READS_A_PATH | NAMES_A_TREE | DESCRIBES_A_PATH
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "file").write_text("not the loader's\n")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "sub").symlink_to(tmp_path / "outside")
    path = tmp_path / "root" / "sub" / "file"
    with fs.confined(tmp_path / "root"), watching() as found:
        for name in sorted(READS_A_PATH):
            call = getattr(fs, name)
            with pytest.raises(NotOursError):
                call(path, limit=100) if name == "read_file" else call(path)
    assert found == []
    assert os.listdir(tmp_path / "outside") == ["file"]


def test_describing_a_path_follows_no_link_below_a_confined_tree(tmp_path):
    """``not_a_directory`` says what stands at a path: a link the user named is followed (to
    say what it leads to), one below a confined tree is only named, never followed."""
    from loader import fs
    from loader.errors import NotOursError

    (tmp_path / "outside").mkdir()
    os.mkfifo(tmp_path / "outside" / "fifo")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "sub").symlink_to(tmp_path / "outside")
    (tmp_path / "root" / "to-fifo").symlink_to(tmp_path / "outside" / "fifo")
    seen: list[tuple[str, str]] = []
    with fs.inject(lambda op, path: seen.append((op, path))):
        given = fs.not_a_directory(tmp_path / "root" / "to-fifo")
        with fs.confined(tmp_path / "root"):
            below = fs.not_a_directory(tmp_path / "root" / "to-fifo")
            through = fs.not_a_directory(tmp_path / "root" / "sub" / "fifo")
    assert given == "is a symbolic link to a FIFO, not a directory"
    assert below == "is a symbolic link, not a directory"
    assert through == "lies below a symbolic link the loader does not follow there"
    assert fs.not_a_directory(tmp_path / "root" / "nothing") == "does not exist"
    assert fs.not_a_directory(tmp_path / "root") == "is a directory"
    # stat_path's refusal names the link and where it leads (it asked a closed descriptor,
    # and said "something else").
    with fs.confined(tmp_path / "root"), pytest.raises(NotOursError) as refused:
        fs.stat_path(tmp_path / "root" / "to-fifo")
    assert f"is a symbolic link to {tmp_path / 'outside' / 'fifo'}" in refused.value.message
