"""The tensor contract of a published repository: names, data types, dims, optionality.

One table per model. The config builders (:mod:`loader.repository.config`) turn these into
``ModelConfig`` inputs/outputs, the Python-backend models read the same names, and the ensemble
wiring is derived from them. Dims exclude the batch dimension (every model batches).

The ensemble's inputs are exactly the fields of the request our users send (the seed's
``test.json`` for perf_analyzer), each ``[1]``; all but ``prompt`` and ``request_output_len``
are optional. ``preprocessing`` turns them into every input of ``fastertransformer``, each filled
with FasterTransformer's own default where the client sent nothing, so every request reaching
``fastertransformer`` carries the same input set and any two can share a batch. Every ensemble
output is produced by ``postprocessing`` (never straight by ``fastertransformer``), which cuts
FasterTransformer's batch layout down to what the request asked for, so each output exists in
every response whatever the client asks for and never depends on the batch
(``loader/repository/models/README.md``, "The client-facing model").

``fastertransformer``'s tables are the FasterTransformer backend's wire contract for GPT-J, as
its C++ sends and reads them (the wire contract in the same README): ``sequence_length`` is INT32, the log
probabilities exist only when the batch's first ``is_return_log_probs`` is true, and
``input_ids`` is ragged (:data:`RAGGED_INPUT`).
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


# --- fastertransformer: the FasterTransformer backend's GPT-J contract --------------------

#: The input whose length differs between requests. With dynamic batching it is
#: ``allow_ragged_batch`` and a BATCH_ITEM_SHAPE batch input ``<name>_item_shape`` (TYPE_INT32)
#: tells the backend each request's length (BE ``ModelInstanceState::ValidateInputs`` and
#: ``ModelInstanceState::SetInputTensors``); without it Triton batches equal lengths only.
RAGGED_INPUT = "input_ids"

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

#: What FasterTransformer sends back (the ``fastertransformer`` model's outputs).
FT_RESULTS: tuple[Tensor, ...] = (
    Tensor("output_ids", "UINT32", (-1, -1)),
    # INT32 whatever upstream's configs declare: FT GptJTritonModelInstance::forward.
    Tensor("sequence_length", "INT32", (-1,)),
    Tensor("cum_log_probs", "FP32", (-1,)),
    Tensor("output_log_probs", "FP32", (-1, -1)),
)

FASTERTRANSFORMER_OUTPUTS: tuple[Tensor, ...] = FT_RESULTS

#: Outputs sent only when the batch's first row asks (``is_return_log_probs``).
LOG_PROB_OUTPUTS: tuple[str, ...] = ("cum_log_probs", "output_log_probs")

# --- the ensemble (the model users call) -------------------------------------------------

#: The client's optional sampling inputs (``preprocessing`` passes them on to
#: ``fastertransformer``, or FasterTransformer's default in their place).
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

#: What a client gets: the text and FasterTransformer's results cut to the tokens the request
#: asked for. No ``output_log_probs``: FasterTransformer lays them out with the stride of the
#: batch's first request (``GptJ::setOutputTensors``), so in a batch of different
#: ``request_output_len`` another request's numbers would be returned as this one's, and no
#: step after FasterTransformer can tell (the models README, "The client-facing model").
ENSEMBLE_OUTPUTS: tuple[Tensor, ...] = (
    Tensor("completion", "BYTES", (-1,)),
    Tensor("output_ids", "UINT32", (-1, -1)),
    Tensor("sequence_length", "INT32", (-1,)),
    Tensor("cum_log_probs", "FP32", (-1,)),
)

#: The streaming model's outputs: the ensemble's, and ``is_final``, true in the last response
#: of a stream. A Triton 23.05 gRPC client is told neither of the final flag nor of an empty
#: final response (the ``triton_final_response`` parameter came later), so the end of a stream
#: is in the data.
STREAMING_OUTPUTS: tuple[Tensor, ...] = (*ENSEMBLE_OUTPUTS, Tensor("is_final", "BOOL", (1,)))

# --- preprocessing: prompt text -> every input of fastertransformer -----------------------

#: ``is_return_log_probs`` is accepted (clients written for FasterTransformer send it) and has no
#: effect: ``fastertransformer`` is always asked for the log probabilities, which
#: ``postprocessing`` needs to read FasterTransformer's layout.
PREPROCESSING_INPUTS: tuple[Tensor, ...] = (
    Tensor("prompt", "BYTES", (1,)),
    Tensor("request_output_len", "UINT32", (1,)),
    *SAMPLING_INPUTS,
)
#: Every input of ``fastertransformer``, always (the models README, "One input set").
PREPROCESSING_OUTPUTS: tuple[Tensor, ...] = tuple(
    Tensor(t.name, t.dtype, t.dims) for t in FASTERTRANSFORMER_INPUTS
)

# --- postprocessing: FT's results -> completion text + the client's outputs --------------

POSTPROCESSING_INPUTS: tuple[Tensor, ...] = (
    *FT_RESULTS,
    Tensor("input_lengths", "UINT32", (1,)),
    Tensor("request_output_len", "UINT32", (-1,)),
    Tensor("end_id", "UINT32", (1,)),
)
POSTPROCESSING_OUTPUTS: tuple[Tensor, ...] = ENSEMBLE_OUTPUTS

# --- llm: Triton's LLM convention (the TensorRT-LLM and vLLM backends' names) ---------------

#: The inputs of the ``llm`` model, as the TensorRT-LLM backend's ``ensemble`` /
#: ``tensorrt_llm_bls`` and the vLLM backend name them: ``text_input`` ([1], vLLM's shape),
#: ``max_tokens``, and the optional sampling fields, each mapped onto the FasterTransformer
#: input ``preprocessing`` fills (``loader/repository/models/llm/model.py``). Word lists are
#: strings, one word (or phrase) per element, tokenized by the model with the checkpoint's
#: tokenizer. No ``min_tokens``: FasterTransformer's GPT-J reads an optional ``min_length``
#: (``GptJ::forward``, ``BaseSamplingLayer::setup``), but :data:`FASTERTRANSFORMER_INPUTS` does
#: not declare it and the CPU reference does not implement it (``docs/llm.md``).
LLM_INPUTS: tuple[Tensor, ...] = (
    Tensor("text_input", "BYTES", (1,)),
    Tensor("max_tokens", "INT32", (1,)),
    Tensor("stream", "BOOL", (1,), optional=True),
    Tensor("exclude_input_in_output", "BOOL", (1,), optional=True),
    Tensor("temperature", "FP32", (1,), optional=True),
    Tensor("top_k", "INT32", (1,), optional=True),
    Tensor("top_p", "FP32", (1,), optional=True),
    Tensor("repetition_penalty", "FP32", (1,), optional=True),
    Tensor("seed", "UINT64", (1,), optional=True),
    Tensor("stop_words", "BYTES", (-1,), optional=True),
    Tensor("bad_words", "BYTES", (-1,), optional=True),
)

#: Every response: ``text_output`` (the whole text, or the increment when streaming),
#: ``finish_reason`` (``""`` in every streamed response but the last; ``length`` or ``stop``),
#: the token counts and FasterTransformer's cumulative log probability (NaN where it cannot be
#: told: ``postprocessing``).
LLM_OUTPUTS: tuple[Tensor, ...] = (
    Tensor("text_output", "BYTES", (-1,)),
    Tensor("finish_reason", "BYTES", (1,)),
    Tensor("num_input_tokens", "INT32", (1,)),
    Tensor("num_output_tokens", "INT32", (1,)),
    Tensor("cum_log_probs", "FP32", (1,)),
)
