"""What a stopped fetch leaves in its DEST, written the way the loader writes it: DEST carries
the loader's record (:func:`loader.sources.transfer.mark_dest`) and every level is created
through :mod:`loader.fs`, so it is recorded as the loader's. A file planted by hand is someone
else's (the loader never replaces or removes it): tests of that plant by hand."""

from __future__ import annotations

from pathlib import Path

from loader import fs
from loader.fs import Dir
from loader.sources.transfer import mark_dest


def left_by_a_fetch(dest: Path, rel: str, data: bytes) -> Path:
    """``DEST/rel`` holding ``data``, as a fetch stopped after writing it leaves it."""
    *levels, name = rel.split("/")
    with fs.confined(dest), Dir.open(dest, create=True) as top:
        mark_dest(top)
        with top.makedirs(levels) as d:
            d.write(name, data, exclusive=False)
    return Path(dest).joinpath(rel)
