"""The Hugging Face checkpoint format the loader reads: file names, weight layouts, dtypes.

A checkpoint directory holds ``config.json``, weights in one of :data:`WEIGHT_FILES` (a single
file, or shards named by an index) and tokenizer files. The checkpoint reader, the ``hf://``
source, the repository writer, the pipeline and the planner take these facts from here.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

CONFIG_FILE = "config.json"

#: Tokenizer files a checkpoint may have (a ``tokenizer.json``, or ``vocab.json`` with
#: ``merges.txt``, plus their settings); copied into a repository when present.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


@dataclass(frozen=True)
class WeightFiles:
    """One way of storing weights: a single file, or shards (prefix...suffix) with an index."""

    name: str
    single: str
    shard_prefix: str
    shard_suffix: str
    index: str

    def files(self, names: Iterable[str]) -> list[str]:
        """The names among ``names`` that belong to this format (index included), sorted."""
        return sorted(
            n
            for n in names
            if n in (self.single, self.index)
            or (n.startswith(self.shard_prefix) and n.endswith(self.shard_suffix))
        )


#: Weight formats in order of preference: the first one a checkpoint has is used.
WEIGHT_FILES: tuple[WeightFiles, ...] = (
    WeightFiles(
        "safetensors", "model.safetensors", "model-", ".safetensors", "model.safetensors.index.json"
    ),
    WeightFiles(
        "pytorch", "pytorch_model.bin", "pytorch_model-", ".bin", "pytorch_model.bin.index.json"
    ),
)

#: File name endings of weights, in any format (also those the converter does not read).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def is_weight_file(relpath: str) -> bool:
    """Whether ``relpath`` names a file of weights (a single file or a shard, never an index):
    the large files of a checkpoint, fetched after the small ones when a conversion overlaps
    the download."""
    return relpath.endswith(WEIGHT_SUFFIXES)


#: ``torch_dtype`` (transformers 4) / ``dtype`` (transformers 5) of config.json -> our name.
CONFIG_DTYPES: dict[str, str] = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def declared_dtype(config: Mapping[str, object]) -> str | None:
    """The weights' dtype a config.json declares (``fp32``, ``fp16``, ``bf16``); None when it
    declares none of those."""
    return CONFIG_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or ""))


def config_dtype(config: Mapping[str, object]) -> str:
    """The dtype to size a config.json's weights in: the one it declares (:func:`declared_dtype`),
    else ``fp32``, the widest the converter writes, also for a declaration it does not know
    (``auto``, ``float64``, a list): the converter then follows the weights' own dtypes."""
    return declared_dtype(config) or "fp32"
