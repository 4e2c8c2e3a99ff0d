"""Triton Python-backend model ``postprocessing``: FasterTransformer's results -> the client's.

Inputs: FasterTransformer's ``output_ids`` (UINT32, [beam, seq], prompt included),
``sequence_length`` (INT32, [beam]), ``cum_log_probs`` and ``output_log_probs``; the request's
``input_lengths`` (UINT32, [1]) and optional ``end_id`` (UINT32, [1]; default: the ``end_id``
parameter, the checkpoint's end-of-text id). Outputs: ``completion`` (BYTES, [beam]) and the
four FasterTransformer results unchanged, so that every output the ensemble declares comes from
this one step.

``completion`` is the text of the generated tokens: ``output_ids[input_length:sequence_length]``
without the ``end_id`` tokens that end it. In a ragged batch FasterTransformer counts the
batch's longest prompt in every row's ``sequence_length`` and fills the difference with
``end_id`` (the wire contract in ``loader/repository/models/README.md``), so dropping trailing ``end_id`` tokens is what makes a
completion the same alone and batched. Special tokens are left out of the text.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenization import TOKENIZER_DIR, load_tokenizer

#: FasterTransformer results passed to the client unchanged.
PASSED_THROUGH = ("output_ids", "sequence_length", "cum_log_probs", "output_log_probs")


def generated_tokens(row: np.ndarray, start: int, stop: int, end_id: int) -> list[int]:
    """``row[start:stop]`` without the ``end_id`` tokens at its end."""
    tokens = row[start:stop].tolist()
    while tokens and tokens[-1] == end_id:
        tokens.pop()
    return tokens


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.tokenizer = load_tokenizer(Path(__file__).parent / TOKENIZER_DIR)
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.end_id = int(parameters.get("end_id", {}).get("string_value", "-1") or -1)

    def execute(self, requests: list) -> list:
        return [self._respond(request) for request in requests]

    def _end_ids(self, request: object, batch: int) -> np.ndarray:
        tensor = pb_utils.get_input_tensor_by_name(request, "end_id")
        if tensor is None:
            return np.full(batch, self.end_id, dtype=np.int64)
        return tensor.as_numpy().reshape(batch, -1)[:, 0].astype(np.int64)

    def _respond(self, request: object) -> object:
        ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "sequence_length").as_numpy()
        starts = pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy()
        batch = ids.shape[0]
        beams = ids.reshape(batch, -1, ids.shape[-1])
        lengths = lengths.reshape(batch, -1)
        starts = starts.reshape(batch, -1)[:, 0]
        end_ids = self._end_ids(request, batch)
        sequences = [
            generated_tokens(
                beams[row, beam], int(starts[row]), int(lengths[row, beam]), int(end_ids[row])
            )
            for row in range(batch)
            for beam in range(beams.shape[1])
        ]
        texts = self.tokenizer.decode_batch(sequences, skip_special_tokens=True)
        completion = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
        tensors = [pb_utils.Tensor("completion", completion.reshape(batch, beams.shape[1]))]
        for name in PASSED_THROUGH:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            tensors.append(pb_utils.Tensor(name, tensor.as_numpy()))
        return pb_utils.InferenceResponse(output_tensors=tensors)
