"""A loader killed (SIGKILL) while it removes a tree of its own (a replaced published copy, a
dead loader's staging directory) leaves a tree the next loader still recognises as the
loader's and removes: nothing of the loader's is left behind for good.

A tree is the loader's by its marker file (and, for a repository, its manifest naming the key);
a removal that took those first and was stopped there would leave a tree nobody may remove.
The loader runs in a forked copy of this process and kills itself at the k-th unlink or rmdir
below ``ROOT/.staging`` (``tests/test_kill_points.py``'s ``forked``), for several k; the next
``run`` of the key must leave ``.staging`` holding only what a user put there. The last test
kills at every write of a marked tree's record (between a create and its record, between a
removal's record and the removal) and at every removal, locally and from ``gs://``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loader import fs
from loader.cli import main
from loader.repository import manifest
from loader.repository.publish import STAGING_DIR
from tests.fault_sweep import scratch
from tests.faults import site_here
from tests.test_kill_points import KILLED, _argv, forked
from tests.tiers import EXHAUSTIVE

pytestmark = pytest.mark.slow  # a dozen forked loaders, each killed

#: The k-th removal below .staging to be killed at: the first ones (where the marker went
#: before), one in the middle and one near the end of a repository's ~50 entries.
AT = [1, 2, 3, 4, 20, 45]


class KillAtRemoval:
    """Kill this process at the ``k``-th unlink or rmdir below ``ROOT/.staging``."""

    def __init__(self, k: int) -> None:
        self.k, self.seen = k, 0

    def __call__(self, op: str, path: str) -> None:
        if op in ("unlink", "rmdir") and f"/{STAGING_DIR}/" in path:
            self.seen += 1
            if self.seen == self.k:
                os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def template(tiny_checkpoint_with_tokenizer, tmp_path_factory) -> Path:
    """A root with the key published, and a file of the user's in ``.staging``."""
    base = tmp_path_factory.mktemp("published")
    with contextlib.redirect_stdout(sys.stderr):
        assert main(_argv(str(tiny_checkpoint_with_tokenizer), base / "root")) == 0
    (base / "root" / STAGING_DIR / "notes.txt").write_text("the user's")
    return base


@contextlib.contextmanager
def _root_from(template: Path) -> Iterator[Path]:
    """A scratch copy of ``template``: its ``root``."""
    with scratch() as base:
        shutil.copytree(template, base, dirs_exist_ok=True)
        yield base / "root"


def _staged(root: Path) -> list[str]:
    return sorted(p.name for p in (root / STAGING_DIR).iterdir())


@pytest.mark.parametrize("k", AT)
def test_a_replaced_copy_whose_removal_was_killed_is_removed_by_the_next_run(
    k, tiny_checkpoint_with_tokenizer, template
):
    source = str(tiny_checkpoint_with_tokenizer)
    with _root_from(template) as root:
        # --force: the new copy is swapped in, the old one (now at the staging name) removed.
        assert forked(_argv(source, root, "--force"), KillAtRemoval(k)) == KILLED
        (key,) = root.glob("tiny@r1/*")
        assert manifest.verify(key) == []
        assert len(_staged(root)) == 2  # the user's file and the half-removed copy
        with contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, root)) == 0  # up to date: it tidies what was left
        assert _staged(root) == ["notes.txt"]
        assert (root / STAGING_DIR / "notes.txt").read_text() == "the user's"


@pytest.mark.parametrize("k", AT)
def test_a_staging_directory_whose_clearing_was_killed_is_cleared_by_the_next_run(
    k, tiny_checkpoint_with_tokenizer, template
):
    source = str(tiny_checkpoint_with_tokenizer)
    with _root_from(template) as root:
        # A dead loader's complete staging directory (its pid is gone: a forked child that
        # exited), as a loader killed just before its rename leaves it.
        (key,) = root.glob("tiny@r1/*")
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        from loader.fs import host_digest

        dead = f"{key.parent.name}__{key.name}.{pid}-{host_digest()}.0123456789ab"
        shutil.copytree(key, root / STAGING_DIR / dead)
        shutil.rmtree(key)  # the key is absent: the next run clears the leftover, publishes
        assert forked(_argv(source, root), KillAtRemoval(k)) == KILLED
        assert dead in _staged(root)
        with contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, root)) == 0
        assert _staged(root) == ["notes.txt"]
        (key,) = root.glob("tiny@r1/*")
        assert manifest.verify(key) == []


@pytest.fixture(scope="module")
def gcs(tmp_path_factory, tiny_checkpoint_with_tokenizer):
    from tests.servers import GcsServer

    server = GcsServer(tmp_path_factory.mktemp("gcs")).start()
    server.upload_dir("models", "org/tiny", tiny_checkpoint_with_tokenizer)
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", server.url)
    yield server
    mp.undo()
    server.stop()


class KillAtWorkRemoval(KillAtRemoval):
    """Kill this process at the ``k``-th unlink or rmdir below ``ROOT/.work`` once the
    repository is published (the rename out of ``.staging``)."""

    published = False

    def __call__(self, op: str, path: str) -> None:
        source, _, target = path.partition(" -> ")
        if op.startswith("rename") and f"/{STAGING_DIR}/" in source and STAGING_DIR not in target:
            self.published = True
        if self.published and op in ("unlink", "rmdir") and "/.work/" in path:
            self.seen += 1
            if self.seen == self.k:
                os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.server
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_download_directory_whose_removal_was_killed_is_removed_and_reused(k, gcs):
    source = "gs://models/org/tiny"
    with scratch() as base:
        root = base / "root"
        # Published, then killed while removing its download directory (the marker sorts
        # first among its names).
        assert forked(_argv(source, root, "--no-overlap"), KillAtWorkRemoval(k)) == KILLED
        (key,) = root.glob("tiny@r1/*")
        assert manifest.verify(key) == []
        with contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, root)) == 0  # up to date: it tidies what was left
            assert not (root / ".work").exists() or list((root / ".work").iterdir()) == []
            assert main(_argv(source, root, "--force")) == 0  # downloads into it again
        (key,) = root.glob("tiny@r1/*")
        assert manifest.verify(key) == []


class KillBeforeMarkedRename:
    """Kill this process just before the rename that gives a new marked directory below
    ``under`` its name (:meth:`loader.fs.Dir.make_marked`: the marker is written and synced
    under a temporary name first)."""

    def __init__(self, under: str) -> None:
        self.under = under

    def __call__(self, op: str, path: str) -> None:
        source, _, _ = path.partition(" -> ")
        if op.startswith("rename") and source.endswith(".tmp") and self.under in source:
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_staging_directory_killed_before_its_name_was_given_is_cleared_by_the_next_run(
    tiny_checkpoint_with_tokenizer, template
):
    source = str(tiny_checkpoint_with_tokenizer)
    with _root_from(template) as root:
        killer = KillBeforeMarkedRename(f"/{STAGING_DIR}/")
        assert forked(_argv(source, root, "--force"), killer) == KILLED
        assert len(_staged(root)) == 2  # the user's file and the marked temporary directory
        with contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, root, "--force")) == 0
        assert _staged(root) == ["notes.txt"]


@pytest.mark.server
def test_a_download_directory_killed_before_its_name_was_given_is_cleared_by_the_next_run(gcs):
    source = "gs://models/org/tiny"
    with scratch() as base:
        root = base / "root"
        (root / ".work").mkdir(parents=True)
        (root / ".work" / "notes.txt").write_text("the user's")
        assert forked(_argv(source, root), KillBeforeMarkedRename("/.work/")) == KILLED
        assert len(list((root / ".work").iterdir())) == 2
        with contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, root)) == 0
        assert [p.name for p in (root / ".work").iterdir()] == ["notes.txt"]
        (key,) = root.glob("tiny@r1/*")
        assert manifest.verify(key) == []


class KillAtRecordOrRemoval:
    """Kill this process at the ``k``-th call opening a marked tree's record (each create and
    removal in a tree writes it: the kill falls between a create and its record, or between
    a removal's record and the removal) or, with ``removal``, at the ``k``-th unlink or rmdir
    below the root; with ``within``, only those whose path holds it; with ``k`` None, count
    them and note each one's kind (:func:`_kind`)."""

    def __init__(self, k: int | None, *, removal: bool, within: str = "/root/") -> None:
        self.k, self.removal, self.within, self.seen = k, removal, within, 0
        self.kinds: list[tuple] = []

    def __call__(self, op: str, path: str) -> None:
        if self.removal:
            counted = op in ("unlink", "rmdir") and "/root/" in path
        else:
            counted = op == "open" and path.endswith(f"/{fs.MADE}")
        if counted and self.within in path:
            self.seen += 1
            if self.k is None:
                self.kinds.append(_kind(op, path))
            elif self.seen == self.k:
                os.kill(os.getpid(), signal.SIGKILL)


def _kind(op: str, path: str) -> tuple:
    """What tells one kill point from another: the loader's call site and how deep below the
    root the entry lies (points of one kind differ only in which file of a directory)."""
    return site_here(op, skip=3), path.partition("/root/")[2].count("/")


def _points(kinds: list[tuple], every: bool) -> list[int]:
    """The kill points (1-based): every one, or the first of each kind."""
    if every:
        return list(range(1, len(kinds) + 1))
    first: dict[tuple, int] = {}
    for k, kind in enumerate(kinds, 1):
        first.setdefault(kind, k)
    return sorted(first.values())


def _left(root: Path) -> list[str]:
    """What ``.staging``, ``.work`` and ``.trash`` hold, below the root."""
    return sorted(
        str(p.relative_to(root))
        for d in (STAGING_DIR, ".work", ".trash")
        if (root / d).is_dir()
        for p in (root / d).rglob("*")
    )


@pytest.mark.server
@pytest.mark.parametrize("every", [False, pytest.param(True, marks=EXHAUSTIVE)],
                         ids=["each-kind", "every-point"])  # fmt: skip
@pytest.mark.parametrize("removal", [False, True], ids=["record", "removal"])
@pytest.mark.parametrize("remote", [False, True], ids=["local", "gs"])
def test_a_run_killed_at_any_record_or_removal_leaves_nothing_for_good(
    removal, remote, every, request, tiny_checkpoint_with_tokenizer
):
    """Killed between any create in a marked tree and its record, between any removal's
    record and the removal, or at any removal: the next runs publish (0), and the loader's
    directories keep only the user's files (nothing was left kept as someone else's, and no
    name refused as one).

    From ``gs://``, only the points in the download directory (``.work``) are killed at: the
    rest of a ``--no-overlap`` run is the local run's code on the downloaded copy, whose points
    the local cases kill at.

    ``make test`` kills at the first point of each kind (a call site of the loader at one depth
    below the root: about a tenth of the points), ``make test-faults`` at every point."""
    within = "/root/.work/" if remote else "/root/"
    if remote:
        request.getfixturevalue("gcs")
    source = "gs://models/org/tiny" if remote else str(tiny_checkpoint_with_tokenizer)
    users = [f"{STAGING_DIR}/notes.txt", ".work/notes.txt"]

    # Removals: --force over a published key (the old copy goes, and the download directory).
    extra = ["--force"] if removal else []

    def fresh(base: Path) -> Path:
        root = base / "root"
        if removal:
            with contextlib.redirect_stdout(sys.stderr):
                assert main(_argv(source, root, "--no-overlap")) == 0
        for rel in users:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("the user's")
        return root

    with scratch() as base:
        root = fresh(base)
        counter = KillAtRecordOrRemoval(None, removal=removal, within=within)
        with fs.inject(counter), contextlib.redirect_stdout(sys.stderr):
            assert main(_argv(source, root, "--no-overlap", *extra)) == 0
    assert counter.seen > (3 if remote else 10)
    failures = []
    points = _points(counter.kinds, every)
    for k in points:
        with scratch() as base:
            root = fresh(base)
            argv = _argv(source, root, "--no-overlap", "--lock-expiry-s", "1")
            killer = KillAtRecordOrRemoval(k, removal=removal, within=within)
            if forked([*argv, *extra], killer) != KILLED:
                failures.append(f"{k}: not killed")
                continue
            with contextlib.redirect_stdout(sys.stderr):
                codes = [main(argv), main([*argv, "--force"])]
            keys = list(root.glob("tiny@r1/*"))
            left = _left(root)
            if codes != [0, 0] or len(keys) != 1 or manifest.verify(keys[0]) or left != users:
                failures.append(f"{k}: exits {codes}, keys {keys}, left {left}")
            if any((root / rel).read_text() != "the user's" for rel in users):
                failures.append(f"{k}: a user's file changed")
    assert not failures, f"{len(failures)} of {len(points)} kill points:\n" + "\n".join(failures)
