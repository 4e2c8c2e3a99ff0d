"""Load a checkpoint's own tokenizer from a model's ``1/tokenizer/`` directory.

Copied next to ``model.py`` of the ``preprocessing`` and ``postprocessing`` models (see this
package's ``README.md``); it needs only the ``tokenizers`` package. A directory with
``tokenizer.json`` is loaded as is; otherwise ``vocab.json`` + ``merges.txt`` are read as a
GPT-2 style byte-level BPE (what GPT-J and CodeGen checkpoints ship).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

TOKENIZER_DIR = "tokenizer"


def load_tokenizer(directory: Path | str, names: Collection[str] | None = None) -> Tokenizer:
    """The tokenizer of ``directory``; with ``names``, of those files only, as a directory
    holding just them loads (the loader checks what a repository will hold this way)."""
    directory = Path(directory)

    def present(name: str) -> bool:
        return (names is None or name in names) and (directory / name).is_file()

    if present("tokenizer.json"):
        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if present(vocab.name) and present(merges.name):
        tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer
    raise FileNotFoundError(
        f"{directory} holds neither tokenizer.json nor vocab.json + merges.txt; "
        "publish the repository again from a checkpoint that includes its tokenizer files"
    )
