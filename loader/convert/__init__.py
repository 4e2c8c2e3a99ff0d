"""Hugging Face checkpoint -> FasterTransformer GPT-J files, in one streaming pass.

* :mod:`.registry`: architectures keyed by config.json ``model_type``;
* :mod:`.gptj`, :mod:`.codegen`: name mapping and split choice per architecture;
* :mod:`.splits`: the shared split rules (replicated, column/row parallel, fused QKV);
* :mod:`.dtypes`: output dtypes and casts;
* :mod:`.writer`: chunked, threaded writing into a temp dir renamed into place;
* :mod:`.plan`: the one conversion plan (what is read, checked and written) both ways follow;
* :mod:`.sequential`: :func:`convert_checkpoint`, every file on disk, checks first, then writes;
* :mod:`.schedule`, :mod:`.overlapped`: converting shards as they arrive.
"""

from . import codegen, gptj  # noqa: F401  (register the architectures)
from .plan import ConversionPlan, ConvertResult, plan_conversion
from .registry import ARCHITECTURES, get_architecture
from .sequential import convert_checkpoint, convert_planned

__all__ = [
    "ARCHITECTURES",
    "ConversionPlan",
    "ConvertResult",
    "convert_checkpoint",
    "convert_planned",
    "get_architecture",
    "plan_conversion",
]
