"""Hugging Face checkpoint -> FasterTransformer GPT-J files, in one streaming pass.

* :mod:`.registry`: architectures keyed by config.json ``model_type``;
* :mod:`.gptj`, :mod:`.codegen`: name mapping and split choice per architecture;
* :mod:`.splits`: the shared split rules (replicated, column/row parallel, fused QKV);
* :mod:`.dtypes`: output dtypes and casts;
* :mod:`.writer`: chunked, threaded writing into a temp dir renamed into place;
* :mod:`.sequential`: :func:`convert_checkpoint`, checks first, then writes.
"""

from . import codegen, gptj  # noqa: F401  (register the architectures)
from .registry import ARCHITECTURES, get_architecture
from .sequential import ConvertResult, convert_checkpoint

__all__ = ["ARCHITECTURES", "ConvertResult", "convert_checkpoint", "get_architecture"]
