"""JSON documents the loader reads (``config.json``, indexes, safetensors headers, manifests,
journals, locks): one parser, whose every failure is a ``ValueError``.

``json.loads`` raises ``RecursionError`` for a document nested deeper than the interpreter's
stack allows (``[[[[...]]]]``); read from a checkpoint or a remote listing, that is bad input
like any other malformed document, so it is a ``ValueError`` here and callers report it as
theirs (a :class:`~loader.errors.CheckpointError`, a manifest to republish). Sizes are bounded
where the bytes are read (:func:`loader.fs.read_file`). Standard library only.
"""

from __future__ import annotations

import json
from typing import Any

#: The largest index (``*.index.json``) the loader reads: an index of a large model is a few MB
#: (about 80 bytes a tensor). A run reads it twice: at 64 MiB, one padded with empty lists held
#: about 1.7 GB and 35 s of CPU for each read, and converted.
MAX_CONFIG_BYTES = 16 * 2**20
#: The largest ``config.json`` the loader reads: real ones are a few kB. Parsed, a document
#: takes up to about 25 times its size (an empty list or object every 3 bytes), and a run
#: parses config.json more than once: at the index's 64 MiB (as it was), a padded config.json
#: held about 1.6 GB and 30 s of CPU for each read, and converted.
MAX_CONFIG_JSON_BYTES = 2**20


class TooDeep(ValueError):
    """A document nested deeper than the parser's stack allows."""


def loads(data: bytes | str) -> Any:
    """``json.loads`` whose failures are all ``ValueError`` (see the module docstring)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise TooDeep("it is nested too deeply to be a document of its kind") from None
