"""Call sites of the loader's file-system seam (loader.fs), found by running, not listed.

A *site* is one call the seam sees, named by its operation and the chain of the loader's own
frames that made it (file:line:function, innermost first, ``loader/fs.py`` left out): the same code
reached from two places is two sites. :class:`Recorder` collects the sites of a clean run, in
the order first seen; :class:`FailAt` makes the first call of one site fail with an errno, or
run any action there (a kill).
"""

from __future__ import annotations

import errno
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import loader
from loader import fs

PACKAGE = str(Path(loader.__file__).parent) + os.sep
SEAM = str(Path(fs.__file__))
#: Frames of a site kept (innermost first): enough to tell verify from build for shared helpers.
DEPTH = 4

Site = tuple[str, tuple[str, ...]]


def site_here(op: str, skip: int = 2) -> Site:
    """The site of a seam call made now (called from inside the hook)."""
    frames = []
    frame = sys._getframe(skip)
    while frame is not None and len(frames) < DEPTH:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE) and name != SEAM:
            frames.append(f"{name[len(PACKAGE) :]}:{frame.f_lineno}:{frame.f_code.co_name}")
        frame = frame.f_back
    return op, tuple(frames)


def describe(site: Site) -> str:
    op, frames = site
    return f"{op} at {' < '.join(frames)}"


@dataclass
class Recorder:
    """Every site a run makes, first-seen order, with the paths it touched."""

    sites: dict[Site, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, op: str, path: str) -> None:
        site = site_here(op)
        with self.lock:
            self.sites.setdefault(site, path)


@dataclass
class FailAt:
    """Fail the first call of ``site`` with ``code`` (or call ``action`` there instead)."""

    site: Site
    code: int = errno.EIO
    action: Callable[[str], None] | None = None
    hit: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, op: str, path: str) -> None:
        if op != self.site[0] or self.hit is not None:
            return
        if site_here(op) != self.site:
            return
        with self.lock:
            if self.hit is not None:
                return
            self.hit = path
        if self.action is not None:
            self.action(path)
            return
        raise OSError(self.code, os.strerror(self.code), _path_of(path))


def _path_of(seen: str) -> str:
    """The path an OSError names: the target of ``a -> b`` (a rename), else the path."""
    return seen.split(" -> ")[-1]


_TOKEN = re.compile(r"[0-9a-f]{12}|\d+-[0-9a-f]{8}")


def normal(path: str, root: Path) -> str:
    """``path`` without the run's root and its random parts (for messages)."""
    return _TOKEN.sub("*", path.replace(str(root), "<root>"))
