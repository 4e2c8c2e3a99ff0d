"""What a remote listing names (a ``gs://`` object below its prefix, a file of a Hub
repository), checked before it reaches the file system: one rule for every remote source.

A listed name becomes a path below DEST one level at a time (:mod:`loader.sources.transfer`),
so it must be a relative path of plain names (no empty, ``.`` or ``..`` level: ``p//x`` would
land where ``p/x`` does), print as it is (a line break in a name would start a log line of its
own), lie outside the loader's own ``.partial/`` and record names (``.model-loader-*``), go no deeper than the loader's own walks remove (:data:`loader.fs.MAX_NAME_LEVELS`) and
fit the file system with the suffix its download carries while it is in progress.

A case-insensitive or normalising file system (SMB, some NFS servers, a volume created with
Unicode normalisation) keeps one file for names that differ only in case or in how their
letters are composed: those names are compared folded (:func:`folded`), the loader's own
names too (``.Partial/`` is ``.partial/`` there), and the names of one listing must stay apart
once folded (:func:`colliding`): no two naming one file, no file where another's directory
goes.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterable

from loader import fs
from loader.errors import SourceError
from loader.sources.transfer import PARTIAL_DIR

#: The longest name (one path component) a local file system takes, in bytes: ``NAME_MAX``.
NAME_MAX = 255


def listed_parts(rel: str, *, what: str, remedy: str, suffix: int) -> list[str]:
    """The levels of the listed name ``rel`` (``a/b/model.safetensors``), each a plain name;
    a :class:`SourceError` naming it otherwise (``what``: ``Object gs://b/'p/x'``, ``remedy``:
    what to change in the source). ``suffix``: the bytes a level's name grows by while its
    download is in progress. Nothing is written for a refused name."""
    parts = rel.split("/")
    if not all(fs.is_name(part) for part in parts) or not rel.isprintable():
        raise SourceError(
            f"{what} is named {rel[:120]!r}, which is not a relative path of plain names (an "
            "empty, '.' or '..' level, a '//', a NUL or a character that does not print); such "
            "a name could land where another file does, or forge a log line; nothing was "
            "written for it.",
            remedy,
        )
    if folded(parts[0]) == folded(PARTIAL_DIR):
        raise SourceError(
            f"{what} is named {rel[:120]!r}, under {PARTIAL_DIR}/, the name the loader keeps "
            "for downloads in progress; nothing was written for it.",
            remedy,
        )
    if folded(parts[0]).startswith(folded(fs.MARKER_PREFIX)):
        raise SourceError(
            f"{what} is named {rel[:120]!r}, a name starting with {fs.MARKER_PREFIX!r}, which "
            "the loader keeps for its record of what it wrote (it would replace that record); "
            "nothing was written for it.",
            remedy,
        )
    if len(parts) > fs.MAX_NAME_LEVELS:
        raise SourceError(
            f"{what} is named {rel[:60]!r}..., nested {len(parts)} levels deep; the loader "
            f"downloads no file nested more than {fs.MAX_NAME_LEVELS} levels deep; nothing was "
            "written for it.",
            remedy,
        )
    long = [p for p in parts if len(os.fsencode(p)) + suffix > NAME_MAX]
    if long:
        raise SourceError(
            f"{what} is named {rel[:60]!r}..., with a path component of "
            f"{len(os.fsencode(long[0]))} bytes; a file system takes names of at most "
            f"{NAME_MAX} bytes, and the loader adds {suffix} while the file downloads (at most "
            f"{NAME_MAX - suffix} bytes); nothing was written for it.",
            remedy,
        )
    return parts


def folded(rel: str) -> str:
    """``rel`` as a case-insensitive, normalising file system compares it: NFKC, case folded."""
    return unicodedata.normalize("NFKC", rel).casefold()


def colliding(rels: Iterable[str]) -> tuple[str, str, bool] | None:
    """The first two names of a listing that cannot both be files on every file system, and
    whether the second would have to be a directory holding the first's file (``a`` and
    ``A/b``) rather than the same file (``a/b`` and ``A/B``); None when all stay apart."""
    files: dict[str, str] = {}
    for rel in sorted(rels):
        key = folded(rel)
        if key in files:
            return files[key], rel, False
        files[key] = rel
    for key, rel in sorted(files.items()):
        parts = key.split("/")
        for depth in range(1, len(parts)):
            parent = files.get("/".join(parts[:depth]))
            if parent is not None:
                return parent, rel, True
    return None
