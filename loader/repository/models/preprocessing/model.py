"""Triton Python-backend model ``preprocessing``: a client's request -> every input of FT.

Inputs: ``prompt`` (BYTES, [1] per row), ``request_output_len`` and the client's optional
sampling inputs (``loader/repository/tensors.py``, ``PREPROCESSING_INPUTS``). Outputs: every
input of the ``fastertransformer`` model, always (``PREPROCESSING_OUTPUTS``): ``input_ids``
(UINT32, rows of one request right-padded with 0 to its longest prompt), ``input_lengths``,
``request_output_len``, the client's value of each optional input it sent, and
FasterTransformer's own default for each it did not (:data:`DEFAULTS`, each from the C++ code
that applies it when the input is absent).

Why always all of them: Triton's dynamic batcher puts two requests in one batch only when they
carry the same set of inputs (core ``RequiredEqualInputs::HasEqualInputs``), so clients that
send different optional fields would never share a batch; and the FasterTransformer backend
takes the first request's inputs as the batch's (BE ``ModelInstanceState::SetInputTensors``).
With every input present, every value present means what its absence means, with one
exception: ``is_return_log_probs`` is always true (the client's flag is accepted and has no
effect), because ``postprocessing`` reads FasterTransformer's layout from the log probabilities.

The tokenizer is the checkpoint's own, copied into ``1/tokenizer/`` by the repository writer;
``start_id`` and ``end_id`` are the checkpoint's (``config.ini``), parameters of this model.

**Bounds.** This is the first step that sees a client's request (the ensemble's, and the
streaming model's and any other model's that calls it through BLS), so it refuses, per request
and before any work is done, what the repository's bounds exclude (its parameters
``max_sequence_length`` and ``vocab_size``, derived from the model and the plan
by the loader's ``loader/repository/bounds.py``): a prompt longer in bytes than the context can
hold (before tokenising it), prompt tokens + ``request_output_len`` beyond
``max_sequence_length``, ``start_id``/``end_id`` outside the vocabulary. Each refusal names the field and the limit. Its status is INVALID_ARGUMENT
where the Python backend carries error codes (python_backend r23.10 and later: the local 2.51);
python_backend r23.05 sends every error of a Python model as INTERNAL
(``ModelInstanceState::ProcessRequests``, ``src/python_be.cc``), with the same message. The other
requests of the batch are answered as usual.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenization import TOKENIZER_DIR, load_tokenizer

#: name -> (numpy dtype, value FasterTransformer uses when the input is absent; FT = its src/):
#:
#: * ``runtime_top_k`` 0: ``TopKSamplingLayer::setup`` (``tmp_top_k = 0``).
#: * ``runtime_top_p`` 0: ``TopKSamplingLayer::setup`` (``top_p = 0.0f`` without the input);
#:   ``TopPSamplingLayer::setup`` skips every row then, and with 0 every row has ``top_k > 0``
#:   after ``setup_topk_runtime_args`` (0 and 0 mean greedy) and is skipped as well.
#: * ``temperature`` 1: ``BaseSamplingLayer::setup`` (``default_temperature``).
#: * ``repetition_penalty`` 1: without the input ``BaseSamplingLayer::setup`` applies no penalty;
#:   with 1.0 everywhere ``BaseSamplingLayer::forward`` skips the kernel (``ALL_OF``), and a row
#:   of 1.0 in a batch with other penalties is divided or multiplied by 1: unchanged.
#: * ``random_seed`` 0: ``BaseSamplingLayer::setup`` initialises every state with seed 0, as
#:   ``curand_init(0, 0, 0)`` per row does.
#: * ``len_penalty``, ``beam_search_diversity_rate`` 0: ``OnlineBeamSearchLayer::invokeSoftMax``
#:   (beam search only).
#: * ``beam_width`` 1: ``GptJTritonModelInstance::forward``.
#: * ``bad_words_list``, ``stop_words_list`` ``[[0], [-1]]``: a list whose only offset is -1
#:   holds no word (``ban_bad_words``, ``stop_words_criterion`` return at a negative offset).
#: * ``start_id``, ``end_id``: ``GptJ::forward``, ``handleOptArg`` with ``config.ini``'s ids
#:   (this model's parameters).
DEFAULTS: dict[str, tuple[type, object]] = {
    "runtime_top_k": (np.uint32, 0),
    "runtime_top_p": (np.float32, 0.0),
    "temperature": (np.float32, 1.0),
    "repetition_penalty": (np.float32, 1.0),
    "random_seed": (np.uint64, 0),
    "len_penalty": (np.float32, 0.0),
    "beam_search_diversity_rate": (np.float32, 0.0),
    "beam_width": (np.uint32, 1),
}
#: The empty word list, one per row: ids ``[0]``, offsets ``[-1]``.
EMPTY_WORDS = ((0,), (-1,))
WORD_LISTS = ("bad_words_list", "stop_words_list")
#: The bounds this model enforces, parameters of its ``config.pbtxt``.
BOUNDS = ("max_sequence_length", "vocab_size")
#: How much a normaliser may shrink a prompt before tokenising (NFKC and the like): the
#: byte bound is this much looser for a tokenizer that has one.
NORMALIZER_SLACK = 4


class Refused(Exception):
    """A request outside the repository's bounds: the message names the field and the limit."""


def _error(message: str) -> object:
    """A TritonError with INVALID_ARGUMENT where python_backend supports error codes (r23.10
    and later); r23.05's TritonError takes the message only."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    if code is None:
        return pb_utils.TritonError(message)
    return pb_utils.TritonError(message, code)


def longest_token_bytes(tokenizer: object) -> int:
    """The most bytes of text one token of ``tokenizer`` can stand for: its longest
    vocabulary entry in UTF-8 (a byte-level BPE writes each byte as one character of at most
    two UTF-8 bytes, so this over-counts, never under-counts)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token.encode("utf-8")) for token in vocab), default=1)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.tokenizer = load_tokenizer(Path(__file__).parent / TOKENIZER_DIR)
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.ids = {name: int(parameters[name]["string_value"]) for name in ("start_id", "end_id")}
        missing = [name for name in BOUNDS if name not in parameters]
        if missing:
            raise ValueError(
                f"preprocessing's config.pbtxt lacks the parameters {', '.join(missing)} (the "
                "bounds of a request); publish the repository again with `model-loader run`"
            )
        self.bounds = {name: int(parameters[name]["string_value"]) for name in BOUNDS}
        slack = NORMALIZER_SLACK if self.tokenizer.normalizer is not None else 1
        self.max_prompt_bytes = (
            self.bounds["max_sequence_length"] * longest_token_bytes(self.tokenizer) * slack
        )

    def execute(self, requests: list) -> list:
        return [self._respond(request) for request in requests]

    def _per_row(self, request: object, name: str, dtype: type, default: object, rows: int):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            return np.full((rows, 1), default, dtype=dtype)
        return tensor.as_numpy().reshape(rows, -1)[:, :1].astype(dtype)

    def _respond(self, request: object) -> object:
        try:
            return self._inputs(request)
        except Refused as refusal:
            return pb_utils.InferenceResponse(output_tensors=[], error=_error(str(refusal)))

    def _inputs(self, request: object) -> object:
        prompts = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy()
        rows = prompts.shape[0]
        values = prompts.reshape(rows, -1)[:, 0]
        longest = max(len(v) if isinstance(v, bytes) else len(str(v).encode()) for v in values)
        context = self.bounds["max_sequence_length"]
        if longest > self.max_prompt_bytes:
            raise Refused(
                f"prompt: {longest} bytes, more than the {self.max_prompt_bytes} bytes the "
                f"model's context of {context} tokens can hold (max_sequence_length); send a "
                "shorter prompt"
            )
        texts = [_text(v) for v in values]
        encoded = [enc.ids for enc in self.tokenizer.encode_batch(texts)]
        lengths = np.array([[len(ids)] for ids in encoded], dtype=np.uint32)
        if int(lengths.min()) == 0:
            raise Refused("prompt: the prompt is empty: send at least one character")
        output_len = pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy()
        output_len = output_len.reshape(rows, -1)[:, :1].astype(np.int64)
        for row in range(rows):
            prompt, wanted = int(lengths[row, 0]), int(output_len[row, 0])
            if prompt + wanted > context:
                raise Refused(
                    f"request_output_len: the prompt's {prompt} tokens + request_output_len "
                    f"{wanted} = {prompt + wanted} tokens, more than the model's context of "
                    f"{context} (max_sequence_length); ask for at most "
                    f"{max(context - prompt, 0)} tokens or send a shorter prompt"
                )
        ids = np.zeros((rows, int(lengths.max())), dtype=np.uint32)
        for row, token_ids in enumerate(encoded):
            ids[row, : len(token_ids)] = token_ids
        values = {
            "input_ids": ids,
            "input_lengths": lengths,
            "request_output_len": output_len.astype(np.uint32),
            "is_return_log_probs": np.ones((rows, 1), dtype=np.bool_),
        }
        for name, default in self.ids.items():
            values[name] = self._per_row(request, name, np.uint32, default, rows)
            self._below(name, values[name], self.bounds["vocab_size"], "vocab_size")
        for name, (dtype, default) in DEFAULTS.items():
            values[name] = self._per_row(request, name, dtype, default, rows)
        for name in WORD_LISTS:
            values[name] = np.tile(np.array(EMPTY_WORDS, dtype=np.int32), (rows, 1, 1))
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in values.items()]
        )

    @staticmethod
    def _below(name: str, value: np.ndarray, limit: int, bound: str) -> None:
        if int(value.max()) >= limit:
            raise Refused(
                f"{name}: {int(value.max())} is outside the model's vocabulary of {limit} ids "
                f"({bound}); send an id below {limit}, or none for the model's own"
            )
