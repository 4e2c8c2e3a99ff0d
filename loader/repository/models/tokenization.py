"""Load a checkpoint's own tokenizer from a model's ``1/tokenizer/`` directory.

Copied next to ``model.py`` of the ``preprocessing`` and ``postprocessing`` models (see this
package's ``README.md``); it needs only the ``tokenizers`` package. A directory with
``tokenizer.json`` is loaded as is; otherwise ``vocab.json`` + ``merges.txt`` are read as a
GPT-2 style byte-level BPE (what GPT-J and CodeGen checkpoints ship).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

TOKENIZER_DIR = "tokenizer"


def load_tokenizer(directory: Path | str, names: Collection[str] | None = None) -> Tokenizer:
    """The tokenizer of ``directory``; with ``names``, of those files only, as a directory
    holding just them loads (the loader checks what a repository will hold this way)."""
    directory = Path(directory)
    found = {
        name: str(directory / name)
        for name in TOKENIZER_FILES
        if (names is None or name in names) and (directory / name).is_file()
    }
    return tokenizer_from(found, directory)


#: The files a tokenizer is loaded from: tokenizer.json, or vocab.json + merges.txt.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")


def tokenizer_from(paths: Mapping[str, str], directory: Path | str) -> Tokenizer:
    """The tokenizer of the files ``paths`` maps by name (of :data:`TOKENIZER_FILES`) to a
    path that opens each (the loader's check gives ``/proc/self/fd/N`` of a file it opened:
    the library reads the very file checked); ``directory`` names where they are."""
    if "tokenizer.json" in paths:
        return Tokenizer.from_file(paths["tokenizer.json"])
    if "vocab.json" in paths and "merges.txt" in paths:
        tokenizer = Tokenizer(models.BPE.from_file(paths["vocab.json"], paths["merges.txt"]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer
    raise FileNotFoundError(
        f"{directory} holds neither tokenizer.json nor vocab.json + merges.txt; "
        "publish the repository again from a checkpoint that includes its tokenizer files"
    )
