"""The tensor contract of a published repository: names, data types, dims, optionality.

One table per model. The config builders (:mod:`loader.repository.config`) turn these into
``ModelConfig`` inputs/outputs, the Python-backend models read the same names, and the ensemble
wiring is derived from them. Dims exclude the batch dimension (every model batches).

The ensemble's inputs are exactly the fields of the request our users send (the seed's
``test.json`` for perf_analyzer), each ``[1]``; all but ``prompt`` and ``request_output_len``
are optional.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tensor:
    """One input or output: ``reshape`` is the shape the model sees (``()`` = a scalar)."""

    name: str
    dtype: str  # a Triton DataType name without the TYPE_ prefix, e.g. "UINT32"
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None


# --- the ensemble (the model users call) -------------------------------------------------

#: Sampling inputs the ensemble forwards to the ``fastertransformer`` model unchanged.
SAMPLING_INPUTS: tuple[Tensor, ...] = (
    Tensor("runtime_top_k", "UINT32", (1,), optional=True),
    Tensor("runtime_top_p", "FP32", (1,), optional=True),
    Tensor("temperature", "FP32", (1,), optional=True),
    Tensor("repetition_penalty", "FP32", (1,), optional=True),
    Tensor("start_id", "UINT32", (1,), optional=True),
    Tensor("end_id", "UINT32", (1,), optional=True),
    Tensor("random_seed", "UINT64", (1,), optional=True),
    Tensor("is_return_log_probs", "BOOL", (1,), optional=True),
)

ENSEMBLE_INPUTS: tuple[Tensor, ...] = (
    Tensor("prompt", "BYTES", (1,)),
    Tensor("request_output_len", "UINT32", (1,)),
    *SAMPLING_INPUTS,
)

ENSEMBLE_OUTPUTS: tuple[Tensor, ...] = (
    Tensor("completion", "BYTES", (-1,)),
    Tensor("output_ids", "UINT32", (-1, -1)),
    Tensor("sequence_length", "UINT32", (-1,)),
    Tensor("cum_log_probs", "FP32", (-1,)),
    Tensor("output_log_probs", "FP32", (-1, -1)),
)

# --- preprocessing: prompt text -> token ids ---------------------------------------------

PREPROCESSING_INPUTS: tuple[Tensor, ...] = (Tensor("prompt", "BYTES", (1,)),)
PREPROCESSING_OUTPUTS: tuple[Tensor, ...] = (
    Tensor("input_ids", "UINT32", (-1,)),
    Tensor("input_lengths", "UINT32", (1,)),
)

# --- fastertransformer: FT_FORMAT.md 3.2 (GPT-J) -----------------------------------------

_SCALAR = ()

FASTERTRANSFORMER_INPUTS: tuple[Tensor, ...] = (
    Tensor("input_ids", "UINT32", (-1,)),
    Tensor("input_lengths", "UINT32", (1,), reshape=_SCALAR),
    Tensor("request_output_len", "UINT32", (-1,)),
    Tensor("start_id", "UINT32", (1,), optional=True, reshape=_SCALAR),
    Tensor("end_id", "UINT32", (1,), optional=True, reshape=_SCALAR),
    Tensor("runtime_top_k", "UINT32", (1,), optional=True, reshape=_SCALAR),
    Tensor("beam_width", "UINT32", (1,), optional=True, reshape=_SCALAR),
    Tensor("runtime_top_p", "FP32", (1,), optional=True, reshape=_SCALAR),
    Tensor("temperature", "FP32", (1,), optional=True, reshape=_SCALAR),
    Tensor("len_penalty", "FP32", (1,), optional=True, reshape=_SCALAR),
    Tensor("repetition_penalty", "FP32", (1,), optional=True, reshape=_SCALAR),
    Tensor("beam_search_diversity_rate", "FP32", (1,), optional=True, reshape=_SCALAR),
    Tensor("random_seed", "UINT64", (1,), optional=True, reshape=_SCALAR),
    Tensor("is_return_log_probs", "BOOL", (1,), optional=True, reshape=_SCALAR),
    Tensor("bad_words_list", "INT32", (2, -1), optional=True),
    Tensor("stop_words_list", "INT32", (2, -1), optional=True),
)

FASTERTRANSFORMER_OUTPUTS: tuple[Tensor, ...] = (
    Tensor("output_ids", "UINT32", (-1, -1)),
    Tensor("sequence_length", "UINT32", (-1,)),
    Tensor("cum_log_probs", "FP32", (-1,)),
    Tensor("output_log_probs", "FP32", (-1, -1)),
)

# --- postprocessing: generated ids -> text -----------------------------------------------

POSTPROCESSING_INPUTS: tuple[Tensor, ...] = (
    Tensor("output_ids", "UINT32", (-1, -1)),
    Tensor("sequence_length", "UINT32", (-1,)),
    Tensor("input_lengths", "UINT32", (1,)),
)
POSTPROCESSING_OUTPUTS: tuple[Tensor, ...] = (Tensor("completion", "BYTES", (-1,)),)
