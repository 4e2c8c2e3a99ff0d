"""Paths under ROOT the loader did not make are left alone: generated trees of links, files and
foreign directories where the loader's own names go.

Hypothesis plants, at each name the loader uses for a key (``<name>@<rev>``, the key itself,
``.staging`` and a dead loader's staging name, ``.trash`` and a replaced copy's name,
``.locks`` and the key's lock, ``.work`` and the key's download directory), nothing or one of:
a link to a directory outside ROOT, a link to a file outside ROOT, a file, a directory holding a
user's file, a directory carrying another key's marker. Then ``run`` and ``prune`` run. The
property: each exits 0 (``run`` with the key a real directory under ROOT that verifies
complete) or 2/75 with an error and a hint, never a traceback; nothing outside ROOT changes;
nothing planted changes or disappears.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.cli import build_parser, main
from loader.cli.run import request_from_args
from loader.fs import host_digest
from loader.repository import manifest
from loader.repository.key import key_filename
from tests.fault_sweep import snapshot
from tests.tiers import examples

KINDS = ("absent", "link-dir", "link-file", "file", "dir", "marked-other")
#: Where the loader's names go, relative to ROOT, with ``{k}`` the key as one file name.
PLACES = (
    "{parent}",
    "{parent}/{variant}",
    ".staging",
    ".staging/{k}.{dead}-{host}.0123456789ab",
    ".trash",
    ".trash/{k}.0123456789ab",
    ".locks",
    ".locks/{k}.lock",
    ".work",
    ".work/{k}",
)
MARKERS = (".model-loader-staging", ".model-loader-download", "manifest.json")


def _plant(root: Path, rel: str, kind: str, outside: Path) -> list[str]:
    """Plant ``kind`` at ``root/rel``; returns the planted paths (relative to ROOT)."""
    path = root / rel
    if kind == "absent" or not path.parent.is_dir() or path.parent.is_symlink():
        return []
    if os.path.lexists(path):
        return []
    if kind == "link-dir":
        path.symlink_to(outside / "dir")
    elif kind == "link-file":
        path.symlink_to(outside / "file.txt")
    elif kind == "file":
        path.write_text("a user's file\n")
    elif kind == "dir":
        path.mkdir()
        (path / "users-data.txt").write_text("keep me\n")
    elif kind == "marked-other":
        path.mkdir()
        for marker in MARKERS[:2]:
            (path / marker).write_text("someone@else/tp1-pp1-i1-00000000\n")
        (path / "users-data.txt").write_text("keep me\n")
    planted = [rel]
    if kind in ("dir", "marked-other"):
        planted += [f"{rel}/{name}" for name in os.listdir(path)]
    return planted


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run_argv(source: Path, root: Path) -> list[str]:
    return ["run", "--source", str(source), "--repository", str(root), "--model-name", "tiny",
            "--revision", "r1", "--tp-size", "1", "--pp-size", "1", "--instance-count", "1",
            "--lock-expiry-s", "1", "--lock-timeout-s", "5"]  # fmt: skip


def _typed(code: int, err: str) -> str | None:
    if code not in (0, 2, 75):
        return f"exit {code}: {err[-500:]}"
    if "Traceback" in err or "this is a bug" in err:
        return f"a traceback: {err[-500:]}"
    if code and not ("error:" in err and "hint:" in err):
        return f"exit {code} without an error and a hint: {err[-500:]}"
    return None


@settings(
    max_examples=examples(15),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=len(PLACES), max_size=len(PLACES)))
def test_what_the_loader_did_not_make_under_root_is_left_alone(
    tiny_checkpoint_with_tokenizer, dead_pid, capsys, caplog, kinds
):
    caplog.set_level(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        root, outside = base / "root", base / "outside"
        (outside / "dir").mkdir(parents=True)
        (outside / "dir" / "precious.txt").write_text("not the loader's\n")
        (outside / "file.txt").write_text("not the loader's either\n")
        root.mkdir()
        argv = _run_argv(tiny_checkpoint_with_tokenizer, root)
        key = request_from_args(build_parser().parse_args(argv)).key
        parent, variant = key.split("/")
        names = {"parent": parent, "variant": variant, "k": key_filename(key), "dead": dead_pid,
                 "host": host_digest()}  # fmt: skip
        planted: list[str] = []
        for place, kind in zip(PLACES, kinds, strict=True):
            planted += _plant(root, place.format(**names), kind, outside)
        before_outside = snapshot(outside)
        before = {rel: v for rel, v in snapshot(root).items() if rel in planted}

        code = main(argv)
        out, err = capsys.readouterr()
        problem = _typed(code, err)
        assert problem is None, (kinds, problem)
        if code == 0:
            published = Path(out.splitlines()[-1])
            assert published == root / key, kinds
            assert not (root / parent).is_symlink() and not published.is_symlink(), kinds
            assert manifest.verify(published, key=key) == [], kinds

        code = main(["prune", "--repository", str(root), "--keep", "1", "--lock-expiry-s", "1"])
        _, err = capsys.readouterr()
        problem = _typed(code, err)
        assert problem is None, (kinds, "prune", problem)

        assert snapshot(outside) == before_outside, (kinds, "something outside ROOT changed")
        after = snapshot(root)
        changed = {rel: (v, after.get(rel)) for rel, v in before.items() if after.get(rel) != v}
        assert not changed, (kinds, changed)
        shutil.rmtree(root, ignore_errors=True)
