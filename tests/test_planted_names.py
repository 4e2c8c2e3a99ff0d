"""Nothing under ROOT is trusted, the loader's own trees included: at every name a run makes
(found by running, not listed), something else is planted, and the next ``run`` and ``prune``
neither follow it nor lose anything to it.

The names come from a clean run: every path the seam of ``loader.fs`` sees under ROOT
(``tests/faults.py``), the run's own owner tag replaced by a dead loader's (so a staging
directory's name is a dead loader's leftover). The scenarios: a local source, ``gs://`` and
``hf://`` fetched whole (``--no-overlap``) and overlapped, and a resume (an overlapped run
killed once its outputs were moved into its staging directory: the names are those of the
tree it left, where each entry is replaced). At each name, one of:

* a link to a directory outside ROOT, a link to a file outside ROOT, a relative link whose
  ``..`` leads out of ROOT;
* a user's file, a directory holding a user's file, a FIFO (never to be read: it would block);
* in a journal, lines naming ``..`` and paths (``moved-into ..``, an output ``../x``).

``make test`` plants at one name in three (:func:`tests.tiers.sampled`), one kind each (in turn,
a link out of ROOT at every other one), of the local and resume runs (the resume leaves out the
model directories of the staging directory its rerun builds anew), and of the ``gs://`` and
``hf://`` runs outside the staging tree, which every source's run builds alike
(:data:`SHARED_TREE`); ``make test-faults`` every kind at every name of every run.

A missing parent is made a directory (the loader's marker and record in it where the loader's
would carry them, the directories below recorded as the loader records its own). The property,
for ``run`` and then ``prune`` (each in a forked process, with an alarm against a hang): exit 0
(``run``: the key a real directory under ROOT that verifies complete) or 2/75 with an error and
a hint, never a traceback; nothing outside ROOT changes; a planted entry of any kind (a file, a
directory, a link, a FIFO) is left exactly as it was, inside the loader's marked trees too: never
removed, replaced, written, followed or written through (at most it moved with a directory of
the loader's holding it). Only a journal's lines, planted into the loader's own journal, may be
rewritten by the loader.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.repository import manifest
from loader.repository.publish import DOWNLOAD_MARKER, STAGING_MARKER
from tests.fault_sweep import scratch, snapshot
from tests.faults import site_here
from tests.tiers import EXHAUSTIVE, FAST_TIER, sampled

#: Every kind at every name: ``make test-faults`` (about 9 min on one core). ``make test`` plants
#: at one name in three, one kind each, in turn (:data:`IN_TURN`).
EVERY_KIND = EXHAUSTIVE

KEY_DIR = "tiny@r1"
KINDS = ("link-dir", "link-file", "link-up", "file", "dir", "fifo")
#: The order ``make test`` plants in, one kind per name: a link out of ROOT at every other one.
IN_TURN = ("link-dir", "file", "link-file", "dir", "link-up", "fifo")
HANG_S = 120
#: An owner tag, ``<pid>-<host digest>``, as a dot-separated part of a name.
_OWNER = re.compile(r"(?<=\.)\d+-[0-9a-f]{8}(?=\.|/|$)")
#: Entries of one directory planted at (others of the same kind there add nothing).
PER_DIRECTORY = 3


def _argv(source: str, root: Path, *extra: str) -> list[str]:
    return ["run", "--source", source, "--repository", str(root), "--model-name", "tiny",
            "--revision", "r1", "--tp-size", "1", "--pp-size", "1", "--instance-count", "1",
            "--lock-expiry-s", "1", "--lock-timeout-s", "5", "--retry-deadline", "5",
            *extra]  # fmt: skip


def _prune_argv(root: Path) -> list[str]:
    return ["prune", "--repository", str(root), "--keep", "1", "--lock-expiry-s", "1"]


# --- what a clean run names ------------------------------------------------------------------


class _Paths:
    """Every path the seam sees, in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, op: str, path: str) -> None:
        self.seen.extend(path.split(" -> "))


def _names(seen: list[str], root: Path, dead: str) -> list[str]:
    """The paths below ``root`` in ``seen``, relative, with every owner tag made ``dead``'s."""
    found: dict[str, None] = {}
    prefix = str(root) + os.sep
    for path in seen:
        if path.startswith(prefix):
            found[_OWNER.sub(dead, path[len(prefix) :])] = None
    return list(found)


def _thin(names: list[str]) -> list[str]:
    """Every name that is a parent of another, and at most :data:`PER_DIRECTORY` others of each
    directory (the converter's many outputs are alike)."""
    parents = {n.rsplit("/", 1)[0] for n in names if "/" in n}
    counts: dict[str, int] = {}
    kept = []
    for name in names:
        parent = name.rsplit("/", 1)[0] if "/" in name else ""
        if name not in parents:
            counts[parent] = counts.get(parent, 0) + 1
            if counts[parent] > PER_DIRECTORY:
                continue
        kept.append(name)
    return kept


def _tree(root: Path) -> list[str]:
    """Every entry under ``root``, relative, parents first."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


# --- planting ---------------------------------------------------------------------------------


def _copy(template: Path, root: Path) -> None:
    """``template`` copied to ``root``, the records of its marked trees made to name the copies
    of what they named (a copy has new inode numbers; without this everything in the copy would
    be someone else's)."""
    shutil.copytree(template, root, symlinks=True)
    for made in root.rglob(fs.MADE):
        top = made.parent
        old_top = template / top.relative_to(root)
        lines = (old_top / fs.MADE).read_bytes().split(b"\n")
        _, records = fs.parse_made(b"\n".join(lines))
        out = [lines[0] + b"\n"]
        for rel, entries in records.items():
            old, new = old_top.joinpath(*rel), top.joinpath(*rel)
            if not os.path.lexists(new):
                continue
            was = os.lstat(old)
            if any(ino == was.st_ino for ino, _ in entries):
                out.append(fs.made_line(rel, os.lstat(new)))
        made.write_bytes(b"".join(out))


def _marker_for(rel: str) -> str | None:
    """The marker a loader's directory at ``rel`` carries (None: it carries none)."""
    parts = rel.split("/")
    if len(parts) == 2 and parts[0] == ".work":
        return DOWNLOAD_MARKER
    if len(parts) == 2 and parts[0] == ".staging":
        return STAGING_MARKER
    return None


def _parents(root: Path, rel: str, key: str) -> None:
    """Make the missing parents of ``root/rel`` directories, with the loader's marker and
    record where its directory carries them; one made inside a marked tree is recorded there,
    as the loader records the directories it makes."""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        sub = "/".join(parts[:i])
        path = root / sub
        if os.path.lexists(path):
            continue
        path.mkdir()
        marker = _marker_for(sub)
        if marker is not None:
            (path / fs.MADE).write_bytes(fs.made_header(marker))
            (path / marker).write_text(f"{key}\n")
            with open(path / fs.MADE, "ab") as fh:
                fh.write(fs.made_line((marker,), os.lstat(path / marker)))
        for j in range(1, i):
            top = root.joinpath(*parts[:j])
            if (top / fs.MADE).is_file() and not (top / fs.MADE).is_symlink():
                with open(top / fs.MADE, "ab") as fh:
                    fh.write(fs.made_line(tuple(parts[j:i]), os.lstat(path)))
                break


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _plant(root: Path, rel: str, kind: str, outside: Path, key: str) -> bool:
    """Plant ``kind`` at ``root/rel`` (replacing what is there); False when it cannot be
    planted there (a parent is not a directory)."""
    path = root / rel
    if rel.endswith(".journal") and kind == "file":
        kind = "journal"  # a journal gets names with `..` in it instead of a user's file
    try:
        _parents(root, rel, key)
    except (FileExistsError, NotADirectoryError):
        return False
    if kind == "journal":  # the loader's own journal (its record names it), lines added in place
        ours = path.is_file() and not path.is_symlink()
        if not ours:
            _remove(path)
        hexd = "0" * 64
        with open(path, "a") as fh:
            fh.write(("" if ours else "x\n") + f"../x 1 {hexd} 1 1\nmoved-into ..\n"
                     f"moved-into ../../outside\nmoved-into {outside}/dir\n")  # fmt: skip
        return True
    _remove(path)
    if kind == "link-dir":
        path.symlink_to(outside / "dir")
    elif kind == "link-file":
        path.symlink_to(outside / "file.txt")
    elif kind == "link-up":
        depth = len(Path(rel).parts) - 1
        path.symlink_to(Path(*([".."] * (depth + 1)), "outside", "dir"))
    elif kind == "file":
        path.write_text("a user's file\n")
    elif kind == "dir":
        path.mkdir()
        (path / "users-data.txt").write_text("keep me\n")
    elif kind == "fifo":
        os.mkfifo(path)
    return True


# --- running ----------------------------------------------------------------------------------


def _forked(argv: list[str], log: Path, hook: fs.Hook | None = None) -> int:
    """``model-loader argv`` in a forked copy of this process, its stdout and stderr into
    ``log`` (``hook`` on the seam of ``loader.fs`` while it runs); the exit code, or minus the
    signal that ended it (SIGALRM: it hung)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            signal.alarm(HANG_S)
            out = open(log, "w")  # noqa: SIM115 - the child exits below
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            sys.stdout = sys.stderr = out
            with fs.inject(hook) if hook is not None else contextlib.nullcontext():
                code = main(argv)
            out.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _typed(code: int, text: str) -> str | None:
    if code == -signal.SIGALRM:
        return f"hung for {HANG_S} s"
    if code not in (0, 2, 75):
        return f"exit {code}: {text[-600:]}"
    if "Traceback" in text or "this is a bug" in text:
        return f"a traceback: {text[-600:]}"
    if code and not ("error:" in text and "hint:" in text):
        return f"exit {code} without an error and a hint: {text[-600:]}"
    return None


def _left_alone(before: dict[str, str], after: dict[str, str], planted: str) -> str | None:
    """A planted entry, of any kind, is exactly as it was: never removed, replaced, written
    through or changed in place. It may have moved with a directory of the loader's holding it
    (then all of it is still there, elsewhere)."""
    mine = {rel: v for rel, v in before.items() if rel == planted or rel.startswith(planted + "/")}
    if all(rel not in after for rel in mine):
        lost = Counter(mine.values()) - Counter(after.values())
        return f"removed: {dict(lost)}" if lost else None
    changed = {rel: (v, after.get(rel)) for rel, v in mine.items() if after.get(rel) != v}
    return f"changed in place: {changed}" if changed else None


def _case(template: Path, source: str, rel: str, kind: str, extra: tuple[str, ...]) -> str | None:
    """Plant ``kind`` at ``rel`` in a copy of ``template``, then run and prune; what went
    wrong, or None."""
    with scratch() as base:
        root, outside = base / "root", base / "outside"
        _copy(template, root)
        (outside / "dir").mkdir(parents=True)
        (outside / "dir" / "precious.txt").write_text("not the loader's\n")
        (outside / "file.txt").write_text("not the loader's either\n")
        key = f"{KEY_DIR}/{_variant(template, source)}"
        at = root / rel
        own_journal = (  # lines planted into the loader's own journal (:func:`_plant`)
            kind == "file" and rel.endswith(".journal") and at.is_file() and not at.is_symlink()
        )
        if not _plant(root, rel, kind, outside, key):
            return None
        before_outside = snapshot(outside)
        before = snapshot(root)
        for argv in (_argv(source, root, *extra), _prune_argv(root)):
            log = base / "log"
            code = _forked(argv, log)
            text = log.read_text(errors="replace")
            problem = _typed(code, text)
            if problem is not None:
                return f"{argv[0]}: {problem}"
            if argv[0] == "run" and code == 0:
                published = Path(text.strip().splitlines()[-1])
                if (
                    published != root / key
                    or published.is_symlink()
                    or (root / KEY_DIR).is_symlink()
                ):
                    return f"published at {published}"
                if manifest.verify(published, key=key) != []:
                    return "published a copy that does not verify"
        if snapshot(outside) != before_outside:
            return "something outside ROOT changed"
        if own_journal:  # the loader's own file: it may rewrite or remove it (never follow it)
            return None
        return _left_alone(before, snapshot(root), rel)


_VARIANTS: dict[tuple[str, str], str] = {}


def _variant(template: Path, source: str) -> str:
    return _VARIANTS[(str(template), source)]


#: Where every source's run builds the same repository: ``make test`` plants there in the local
#: and the resume sweeps (the resume's staging directory holds the outputs an overlapped run
#: moved into it), and leaves it out of the gs:// and the hf:// sweeps, which plant at the names
#: their own download and conversion make (``make test-faults`` plants everywhere in every sweep).
SHARED_TREE = ".staging"


def _sweep(
    template: Path,
    source: str,
    names: list[str],
    extra: tuple[str, ...],
    every: bool,
    *,
    shared: bool = True,
):
    names = _thin(names)
    if not (shared or every):
        names = [n for n in names if n.split("/")[0] != SHARED_TREE]
    cases = [(rel, kind) for rel in names for kind in KINDS]
    if not every:  # one name in three, one kind each, in turn: a link out of ROOT every other
        cases = [(rel, IN_TURN[i % len(IN_TURN)]) for i, rel in enumerate(sampled(names))]
        if FAST_TIER:
            cases = cases[:: max(1, len(cases) // 12)]
    assert cases
    failures = []
    for rel, kind in cases:
        problem = _case(template, source, rel, kind, extra)
        if problem is not None:
            failures.append(f"{kind} at {rel}: {problem}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


@pytest.fixture(scope="module")
def dead() -> str:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return f"{pid}-{fs.host_digest()}"


def _clean_names(source: str, template: Path, dead: str, extra: tuple[str, ...]) -> list[str]:
    """The names a clean run from ``template`` makes under ROOT (owner tags made ``dead``'s),
    and the key it publishes (kept for the cases)."""
    with scratch() as base:
        root = base / "root"
        _copy(template, root)
        paths = _Paths()
        with fs.inject(paths), contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, root, *extra)) == 0
        (published,) = (root / KEY_DIR).iterdir()
        _VARIANTS[(str(template), source)] = published.name
        names = _names(paths.seen, root, dead)
    names = [n for n in names if n.split("/")[0] != KEY_DIR or n.count("/") <= 2]
    assert any(n.startswith(".staging/") for n in names), names
    return names


# --- local -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def empty(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("empty") / "root"
    path.mkdir()
    return path


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=EVERY_KIND)],
                         ids=["each-name", "every-kind"])  # fmt: skip
def test_local_run_at_every_name_it_makes(tiny_checkpoint_with_tokenizer, empty, dead, every):
    source = str(tiny_checkpoint_with_tokenizer)
    names = _clean_names(source, empty, dead, ())
    _sweep(empty, source, names, (), every)


# --- gs:// ------------------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("extra", [(), ("--no-overlap",)], ids=["overlapped", "whole"])
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=EVERY_KIND)],
                         ids=["each-name", "every-kind"])  # fmt: skip
def test_gcs_run_at_every_name_it_makes(gs, empty, dead, extra, every):
    names = _clean_names(gs, empty, dead, extra)
    assert any(n.endswith(".journal") for n in names) or extra, names
    _sweep(empty, gs, names, extra, every, shared=False)


# --- hf:// ------------------------------------------------------------------------------------


@pytest.mark.server
# The whole (not overlapped) hf:// run makes the same download names without the arrival
# hooks: swept in `make test-faults` only, to keep `make test` within its time.
@pytest.mark.parametrize("extra", [(), pytest.param(("--no-overlap",), marks=EVERY_KIND)],
                         ids=["overlapped", "whole"])  # fmt: skip
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=EVERY_KIND)],
                         ids=["each-name", "every-kind"])  # fmt: skip
def test_hf_run_at_every_name_it_makes(hf, empty, dead, extra, every):
    names = _clean_names(hf, empty, dead, extra)
    assert any(n.endswith(".incomplete") and "/.partial/hf." in n for n in names), names
    _sweep(empty, hf, names, extra, every, shared=False)


class _KillAfterTheMove:
    """Kill this process at the first file-system call after the outputs moved into staging."""

    def __init__(self) -> None:
        self.moved = False

    def __call__(self, op: str, path: str) -> None:
        if self.moved:
            os.kill(os.getpid(), signal.SIGKILL)
        if op.startswith("rename") and any(f.endswith(":move_into") for f in site_here(op)[1]):
            self.moved = True


@pytest.fixture(scope="module")
def killed(gs, tmp_path_factory) -> Path:
    """A root an overlapped run left when it was killed right after moving its outputs into
    its staging directory (outputs, journal, download directory, staging directory, lock)."""
    root = tmp_path_factory.mktemp("killed") / "root"
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            with fs.inject(_KillAfterTheMove()):
                code = main(_argv(gs, root))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert list(root.glob(".staging/*/fastertransformer/1/*-gpu"))
    return root


@pytest.mark.server
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=EVERY_KIND)],
                         ids=["each-name", "every-kind"])  # fmt: skip
def test_resume_at_every_name_a_killed_run_left(gs, killed, dead, every):
    left = _tree(killed)
    clean = _clean_names(gs, killed, dead, ())
    if not every:  # the model directories of the staging directory the rerun builds anew
        clean = [n for n in clean if not _built_anew(n, left)]
    names = list(dict.fromkeys(left + clean))
    assert any(n.endswith(".journal") for n in names), names
    _sweep(killed, gs, names, (), every)


def _built_anew(name: str, left: list[str]) -> bool:
    """Whether ``name`` lies in a model directory (not the converted weights) of a staging
    directory the killed run did not leave: the rerun builds those as a run from an empty root
    does, and ``make test`` plants there in the local sweep."""
    parts = name.split("/")
    if parts[0] != SHARED_TREE or len(parts) < 3 or parts[2] == "fastertransformer":
        return False
    left_dirs = {_OWNER.sub("", n.split("/")[1]) for n in left if n.startswith(f"{SHARED_TREE}/")}
    return _OWNER.sub("", parts[1]) not in left_dirs and not parts[2].startswith(".")


# --- while a run works ----------------------------------------------------------------------
#
# The sweeps above plant before a run starts. These plant while one works: the run's hook of the
# seam of ``loader.fs`` replaces an entry the run made (a directory it works in, a file it wrote)
# at the first call the run makes on it or below it, then the run goes on (or is killed there,
# and a second run resumes). The names are those of a clean run, owner tags and random parts
# made patterns (a live run's own names carry its own).

#: An owner tag with the random part a name of the loader's may carry after it, and the
#: generation number of a partial download: what differs from one run's names to the next.
_LIVE_PARTS = re.compile(r"(?<=\.)(\d+-[0-9a-f]{8}(\.[0-9a-f]{8,})?|\d{10,}(?=\.))")


def _pattern(rel: str) -> str:
    return _LIVE_PARTS.sub("*", rel)


#: The calls that change a directory: made below one, the loader holds it open.
_CHANGES = frozenset({"mkdir", "write", "link", "rename", "rename-noreplace", "rename-exchange"})


class _ReplaceLive:
    """At the run's first call on the file ``target`` (a pattern of :func:`_pattern`), or its
    first call that changes something below the directory ``target`` (the loader holds it open
    by then), while the loader's own entry is there, replace that entry by ``kind`` (and write
    its name to ``record``); then go on or, with ``kill``, end the process there (SIGKILL).
    With ``before``, plant at the first call on ``target`` while nothing is there yet (the
    name the loader is about to create)."""

    def __init__(
        self, root: Path, target: str, kind: str, outside: Path, kill: bool, before: bool
    ) -> None:
        self.root, self.target, self.kind, self.outside, self.kill, self.before = (
            root, target, kind, outside, kill, before,
        )  # fmt: skip
        self.planted: str | None = None
        self.record: Path | None = None
        self._lock = threading.Lock()

    def __call__(self, op: str, path: str) -> None:
        prefix = str(self.root) + os.sep
        for one in path.split(" -> "):
            if self.planted is not None or not one.startswith(prefix):
                continue
            parts = one[len(prefix) :].split("/")
            for i in range(1, len(parts) + 1):
                rel = "/".join(parts[:i])
                if _pattern(rel) == self.target:
                    self._replace(rel, below=i < len(parts) and op in _CHANGES)
                    break

    def _replace(self, rel: str, *, below: bool) -> None:
        path = self.root / rel
        with self._lock:
            found = os.lstat(path) if os.path.lexists(path) else None
            if self.planted is not None or (found is None) != self.before:
                return
            if self.before and (below or not path.parent.is_dir()):
                return
            if found is not None and not (
                (stat.S_ISDIR(found.st_mode) and below) or stat.S_ISREG(found.st_mode)
            ):
                return
            _plant(self.root, rel, self.kind, self.outside, key="")
            self.planted = rel
            if self.record is not None:
                self.record.write_text(rel)  # before a kill
        if self.kill:
            os.kill(os.getpid(), signal.SIGKILL)


def _forked_with(hook: _ReplaceLive, argv: list[str], log: Path) -> tuple[int, str | None]:
    """:func:`_forked` with ``hook`` on the seam: the exit code and what the hook replaced."""
    hook.record = log.with_suffix(".planted")
    code = _forked(argv, log, hook)
    return code, hook.record.read_text() if hook.record.exists() else None


def _live_case(
    source: str, extra: tuple[str, ...], target: str, kind: str, kill: bool, before: bool
) -> str | None:
    """A run of ``source`` into an empty root with ``target`` replaced by ``kind`` while it
    works, then a run again and a prune; what went wrong, None, or ``"not met"`` when the
    run made no such entry this time."""
    with scratch() as base:
        root, outside = base / "root", base / "outside"
        root.mkdir()
        (outside / "dir").mkdir(parents=True)
        (outside / "dir" / "precious.txt").write_text("not the loader's\n")
        (outside / "file.txt").write_text("not the loader's either\n")
        before_outside = snapshot(outside)
        hook = _ReplaceLive(root, target, kind, outside, kill, before)
        log = base / "log"
        code, planted = _forked_with(hook, _argv(source, root, *extra), log)
        if planted is None:
            return "not met"  # the run made no such entry this time (a race of its threads)
        text = log.read_text(errors="replace")
        problem = None if kill and code == -signal.SIGKILL else _typed(code, text)
        if problem is not None:
            return f"run: {problem}"
        if snapshot(outside) != before_outside:
            return "run: something outside ROOT changed"
        before = snapshot(root)
        for argv in (_argv(source, root, *extra), _prune_argv(root)):
            code = _forked(argv, log)
            text = log.read_text(errors="replace")
            problem = _typed(code, text)
            if problem is not None:
                return f"{argv[0]} after: {problem}"
            if argv[0] == "run" and code == 0:
                published = Path(text.strip().splitlines()[-1])
                if published.is_symlink() or manifest.verify(published) != []:
                    return f"published {published}, which does not verify"
        if snapshot(outside) != before_outside:
            return "something outside ROOT changed"
        if kind == "file":  # a regular file at a name the loader writes may be rewritten
            return None
        return _left_alone(before, snapshot(root), planted)


def _live_targets(names: list[str]) -> list[str]:
    """The patterns of the entries a clean run made and worked in: every directory, and at most
    :data:`PER_DIRECTORY` files of each (the lock's directory and the published key's are
    the other sweeps'), in the order the run met them."""
    patterns = list(dict.fromkeys(_pattern(n) for n in names))
    return [
        p for p in _thin(patterns)
        if p.split("/")[0] in (".work", ".staging") and not p.endswith(".tmp")
    ]  # fmt: skip


@pytest.mark.server
@pytest.mark.parametrize(
    ("scheme", "extra", "every"),
    [
        ("gs", (), False),
        pytest.param("gs", (), True, marks=EVERY_KIND),
        # fetched whole and the hf:// run: the same trees but the download's, in make test-faults
        pytest.param("gs", ("--no-overlap",), True, marks=EVERY_KIND),
        pytest.param("hf", (), True, marks=EVERY_KIND),
    ],
    ids=["gs-some-names", "gs-every-kind", "gs-whole-every-kind", "hf-every-kind"],
)
def test_entries_of_a_live_remote_run_replaced_while_it_works(request, empty, scheme, extra, every):
    """A ``gs://`` or ``hf://`` run whose download area, journals, outputs and staging tree are
    replaced under it (a link out of ROOT, a FIFO, a user's file or directory), going on or
    killed there: it and the run after it end typed, nothing outside ROOT changes, nothing
    planted is followed or changed in place."""
    source = request.getfixturevalue(scheme)
    with scratch() as base:
        root = base / "root"
        root.mkdir()
        paths = _Paths()
        with fs.inject(paths), contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, root, *extra)) == 0
        names = _names(paths.seen, root, "0-00000000")
    targets = _live_targets(names)
    assert any(t.endswith(".journal") for t in targets) or extra, targets
    assert any("/.partial/" in t for t in targets), targets
    kinds = ("link-dir", "link-file", "fifo", "dir", "file")
    # every kind at every name; in turn, planted before the loader makes it or once it is
    # there, the run going on or killed there
    cases = [(t, k, i % 2 == 1, i % 4 >= 2)
             for i, (t, k) in enumerate((t, k) for t in targets for k in kinds)]  # fmt: skip
    if not every:  # a link out of ROOT, a FIFO or a file, in turn over some of the names
        picked = targets[:: max(1, len(targets) // (8 if FAST_TIER else 16))]
        cases = [(t, kinds[i % 3 * 2 % 5], i % 2 == 1, i % 4 >= 2) for i, t in enumerate(picked)]
    failures, met = [], 0
    for target, kind, kill, before in cases:
        problem = _live_case(source, extra, target, kind, kill, before)
        met += problem != "not met"
        if problem not in (None, "not met"):
            when = (
                f"{'before it is made' if before else 'live'}, {'killed' if kill else 'going on'}"
            )
            failures.append(f"{kind} at {target} ({when}): {problem}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
    assert met >= len(cases) * 2 // 3, f"only {met} of {len(cases)} entries were met"


def test_a_journal_names_only_a_staging_directory(tmp_path):
    """The journal's move line is one name, checked on read: ``..``, a path, NUL and empty
    are not followed."""
    from loader.convert.overlapped import Journal

    with fs.confined(tmp_path):
        journal = Journal(tmp_path / "out", "h")
        for bad in ("..", "../x", "/etc", "a/b", "", "x\0y"):
            journal.path.write_text(f"h b3\nmoved-into {bad}\n")
            assert journal.moved_to() is None, bad
            with pytest.raises(ValueError):
                journal.record_move(bad)
        journal.record_move("tiny@r1.123-abcdef01.0123456789ab")
        assert journal.moved_to() == "tiny@r1.123-abcdef01.0123456789ab"
        journal.close()


def test_a_journal_keeps_only_outputs_named_by_one_name_in_its_directory(tmp_path):
    """Output lines naming ``..``, a path, NUL or a dot file keep nothing and reach nothing:
    the outputs are names in the output directory's descriptor."""
    from loader import digest
    from loader.convert.overlapped import Journal

    victim = tmp_path / "victim"
    victim.write_bytes(b"not the loader's")
    st = victim.stat()
    hexdigest = digest.of_bytes(b"not the loader's")
    (tmp_path / "work" / "out").mkdir(parents=True)
    with fs.confined(tmp_path / "work"):
        journal = Journal(tmp_path / "work" / "out", "h")
        lines = [
            f"{bad} {st.st_size} {hexdigest} {st.st_ino} {st.st_mtime_ns}"
            for bad in ("../../victim", str(victim), "x\0y", "..", ".", "a/../../victim")
        ]
        journal.path.write_text(f"{journal.header}\n" + "\n".join(lines) + "\n")
        try:
            assert journal.resume() == {}
        finally:
            journal.close()
    assert victim.read_bytes() == b"not the loader's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim", "work"]


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_fifo_or_link_at_the_journal_is_refused_not_read(tmp_path, kind):
    from loader.convert.overlapped import Journal
    from loader.errors import NotOursError

    outside = tmp_path / "outside"
    outside.write_text("h b3\nmoved-into x\n")
    (tmp_path / "work").mkdir()
    journal_path = tmp_path / "work" / "out.journal"
    if kind == "fifo":
        os.mkfifo(journal_path)
    else:
        journal_path.symlink_to(outside)
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.alarm(30)  # a FIFO read would block forever
    try:
        with fs.confined(tmp_path / "work"):
            journal = Journal(tmp_path / "work" / "out", "h")
            try:
                with pytest.raises(NotOursError):
                    journal.moved_to()
                with pytest.raises(NotOursError):
                    journal.record_move("name")
            finally:
                journal.close()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert outside.read_text() == "h b3\nmoved-into x\n"


@pytest.mark.server
@pytest.mark.parametrize("kind", ["empty dir", "dir"])
def test_a_directory_put_where_the_outputs_move_into_staging_is_refused_never_replaced(
    gs, tmp_path, capsys, kind
):
    """An overlapped run moves its finished outputs into its staging directory in one rename:
    a directory someone put at their place meanwhile is refused (2, naming it), neither
    replaced (an empty one: ``rename`` would have removed it) nor the exit 1 of
    ``ENOTEMPTY``."""
    root = tmp_path / "root"
    planted = []

    def plant(op: str, path: str) -> None:
        if (
            op.startswith("rename")
            and "/converted/" in path
            and "/.staging/" in path
            and not planted
        ):
            place = Path(path.split(" -> ")[1])
            place.mkdir()
            if kind == "dir":
                (place / "users-data.txt").write_text("keep me\n")
            planted.append((place, os.stat(place).st_ino))

    with fs.inject(plant):
        code = main(_argv(gs, root))
    _, err = capsys.readouterr()
    assert planted
    assert code == 2, err
    assert "error:" in err and "hint:" in err and str(planted[0][0]) in err
