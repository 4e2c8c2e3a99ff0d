"""CPU reference of FasterTransformer GPT-J: read ``<T>-gpu`` files, run the forward pass.

* :class:`FTConfig` (the ``[gptj]`` section of ``config.ini``) lives in :mod:`loader.formats.fastertransformer`.
* :mod:`loader.reference.weights`: :func:`load_ft_checkpoint` reads a ``<T>-gpu`` directory.
* :mod:`loader.reference.gptj`: :class:`GptJ`, the batched NumPy forward pass with a KV cache.
* :mod:`loader.reference.generate`: a batch generated as FasterTransformer runs it, and what its
  Triton backend sends back.
* :mod:`loader.reference.curand`: cuRAND's XORWOW generator and ``curand_uniform``.
* :mod:`loader.reference.blas`: one BLAS thread per process.

Depends on NumPy and :mod:`loader.errors` only (no torch), so it can run inside a Triton
Python-backend model.
"""

from loader.formats.fastertransformer import FTConfig

from .gptj import GptJ
from .weights import FTCheckpoint, load_ft_checkpoint

__all__ = ["FTCheckpoint", "FTConfig", "GptJ", "load_ft_checkpoint"]
