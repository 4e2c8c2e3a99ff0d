"""Triton Python-backend model ``preprocessing``: prompt text -> token ids.

Input ``prompt`` (BYTES, [1] per row); outputs ``input_ids`` (UINT32, [-1], rows of one request
right-padded with 0 to its longest prompt), ``input_lengths`` (UINT32, [1]) and
``is_return_log_probs`` (BOOL, [1], always true: the ensemble returns the log probabilities on
every request, because an ensemble output that FasterTransformer did not produce would fail
the request). The client's own ``is_return_log_probs`` is accepted and has no effect. The
tokenizer is the checkpoint's own, copied into ``1/tokenizer/`` by the repository writer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenization import TOKENIZER_DIR, load_tokenizer


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.tokenizer = load_tokenizer(Path(__file__).parent / TOKENIZER_DIR)

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            prompts = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy()
            texts = [_text(v) for v in prompts.reshape(prompts.shape[0], -1)[:, 0]]
            encoded = [enc.ids for enc in self.tokenizer.encode_batch(texts)]
            lengths = np.array([[len(ids)] for ids in encoded], dtype=np.uint32)
            if int(lengths.min()) == 0:
                error = pb_utils.TritonError("the prompt is empty: send at least one character")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            ids = np.zeros((len(encoded), int(lengths.max())), dtype=np.uint32)
            for row, token_ids in enumerate(encoded):
                ids[row, : len(token_ids)] = token_ids
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("input_ids", ids),
                        pb_utils.Tensor("input_lengths", lengths),
                        pb_utils.Tensor(
                            "is_return_log_probs", np.ones((len(encoded), 1), dtype=np.bool_)
                        ),
                    ]
                )
            )
        return responses
