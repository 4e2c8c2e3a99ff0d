"""Triton Python-backend model ``postprocessing``: FasterTransformer's batch -> this request's answer.

Inputs: FasterTransformer's ``output_ids`` (UINT32, [beam, W + M]), ``sequence_length`` (INT32,
[beam]), ``cum_log_probs`` and ``output_log_probs`` (FP32; the latter [beam, M]), and the
request's ``input_lengths``, ``request_output_len`` and ``end_id`` (as ``preprocessing`` sent
them to FasterTransformer). Outputs: ``completion`` (BYTES, [beam]), ``output_ids``,
``sequence_length`` and ``cum_log_probs``, holding exactly the tokens the request asked for.

FasterTransformer answers in the batch's layout (``loader/repository/models/README.md``): every
row is ``W + M`` wide (``W`` the batch's widest prompt, ``M`` its largest
``request_output_len``), ``sequence_length`` is ``W`` + the row's generated tokens, and a row
that asked for fewer tokens than ``M`` gets one token more than it asked for (FT's length check
follows the sampling). ``M`` is the width of ``output_log_probs``, so ``W`` and each row's count
``n`` follow; this model keeps the first ``min(n, request_output_len)`` generated tokens:

* ``output_ids``: the prompt, those tokens, then ``end_id``, as wide as the request's longest
  prompt plus its largest ``request_output_len``;
* ``sequence_length``: the row's prompt length + those tokens (a stopping ``end_id`` counts, as
  in FasterTransformer);
* ``completion``: their text, without an ``end_id`` that ends them; special tokens left out;
* ``cum_log_probs``: FasterTransformer's sum where the row got no extra token; NaN where it did
  (the extra token's log probability is in the sum, and the per-token values that would let us
  take it out are not reliable in a batch: FT ``GptJ::setOutputTensors`` lays them out with the
  stride of the batch's first request).

So a request gets the same answer alone and batched with any others.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenization import TOKENIZER_DIR, load_tokenizer


def _input(request: object, name: str) -> np.ndarray:
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


def answer(
    output_ids: np.ndarray,
    sequence_length: np.ndarray,
    cum_log_probs: np.ndarray,
    log_probs_width: int,
    input_lengths: np.ndarray,
    output_lens: np.ndarray,
    end_ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int]]]:
    """FasterTransformer's ``[rows, beams, ...]`` results -> ``(output_ids, sequence_length,
    cum_log_probs, generated tokens per (row, beam) without a final end_id)``."""
    rows, beams, wide = output_ids.shape
    batch_width = wide - log_probs_width  # W
    width = int(input_lengths.max()) + int(output_lens.max())
    ids = np.empty((rows, beams, width), dtype=np.uint32)
    lengths = np.empty((rows, beams), dtype=np.int32)
    cums = np.empty((rows, beams), dtype=np.float32)
    texts: list[list[int]] = []
    for row in range(rows):
        start, asked, end_id = int(input_lengths[row]), int(output_lens[row]), int(end_ids[row])
        for beam in range(beams):
            counted = int(sequence_length[row, beam]) - batch_width
            kept = max(0, min(counted, asked))
            tokens = output_ids[row, beam, start : start + kept]
            ids[row, beam] = end_id
            ids[row, beam, : start + kept] = output_ids[row, beam, : start + kept]
            lengths[row, beam] = start + kept
            cums[row, beam] = cum_log_probs[row, beam] if counted <= asked else np.nan
            text = tokens.tolist()
            if text and text[-1] == end_id:
                text.pop()
            texts.append(text)
    return ids, lengths, cums, texts


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.tokenizer = load_tokenizer(Path(__file__).parent / TOKENIZER_DIR)

    def execute(self, requests: list) -> list:
        return [self._respond(request) for request in requests]

    def _respond(self, request: object) -> object:
        output_ids = _input(request, "output_ids")
        rows = output_ids.shape[0]
        beams = output_ids.reshape(rows, -1, output_ids.shape[-1])
        per_row = (rows, beams.shape[1])
        ids, lengths, cums, tokens = answer(
            beams,
            _input(request, "sequence_length").reshape(per_row),
            _input(request, "cum_log_probs").reshape(per_row),
            int(_input(request, "output_log_probs").shape[-1]),
            _input(request, "input_lengths").reshape(rows, -1)[:, 0],
            _input(request, "request_output_len").reshape(rows, -1)[:, 0],
            _input(request, "end_id").reshape(rows, -1)[:, 0],
        )
        texts = self.tokenizer.decode_batch(tokens, skip_special_tokens=True)
        completion = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("completion", completion.reshape(per_row)),
                pb_utils.Tensor("output_ids", ids),
                pb_utils.Tensor("sequence_length", lengths),
                pb_utils.Tensor("cum_log_probs", cums),
            ]
        )
