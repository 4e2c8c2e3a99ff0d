"""Triton Python-backend model ``postprocessing``: generated token ids -> completion text.

Inputs ``output_ids`` (UINT32, [beam, seq], prompt included, as FasterTransformer returns them),
``sequence_length`` (UINT32, [beam]) and ``input_lengths`` (UINT32, [1]); output ``completion``
(BYTES, [beam]): the text of ``output_ids[input_length:sequence_length]`` per beam, i.e. the
generated text with the prompt removed (special tokens such as end-of-text are dropped).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenization import TOKENIZER_DIR, load_tokenizer


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.tokenizer = load_tokenizer(Path(__file__).parent / TOKENIZER_DIR)

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "sequence_length").as_numpy()
            starts = pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy()
            batch = ids.shape[0]
            ids = ids.reshape(batch, -1, ids.shape[-1])
            lengths = lengths.reshape(batch, -1)
            starts = starts.reshape(batch, -1)[:, 0]
            sequences = [
                ids[row, beam, int(starts[row]) : int(lengths[row, beam])].tolist()
                for row in range(batch)
                for beam in range(ids.shape[1])
            ]
            texts = self.tokenizer.decode_batch(sequences, skip_special_tokens=True)
            completion = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
            completion = completion.reshape(batch, ids.shape[1])
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("completion", completion)]
                )
            )
        return responses
