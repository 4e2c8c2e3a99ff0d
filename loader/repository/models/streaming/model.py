"""Triton Python-backend model ``<NAME>`` of a streaming repository: text increments per token.

A streaming repository (``model-loader run --streaming``) serves the model clients call as this
decoupled model instead of the ensemble, with the ensemble's exact inputs and outputs. For each
request it runs, through Triton's business-logic scripting (BLS) API:

1. ``preprocessing`` (the client's inputs -> every input of ``fastertransformer``, FT's default
   where the client sent nothing), once;
2. ``fastertransformer`` in decoupled mode: FasterTransformer's streaming callback (and the CPU
   reference) sends every request of the batch its outputs so far after every decoding step but
   the last, then a final response with data;
3. ``postprocessing`` on every such snapshot: the text generated so far and FasterTransformer's
   outputs cut to the tokens the request asked for,

and sends the client one response per snapshot that holds a new token, whose ``completion``
holds only the text that is new since the previous response (the other outputs are
postprocessing's: ``output_ids``, ``sequence_length``, ``cum_log_probs`` so far). The last
response is flagged final and carries the rest of the text (often empty), so the concatenated
``completion`` of a stream equals the non-streaming completion for the same request and seed.
Every response also carries ``is_final`` (BOOL [1]), true in the last one only: a Triton 23.05
gRPC client is not told of the final flag, so this is how it sees the end of the stream.

**Memory.** Every request it sends asks for CPU memory: the FasterTransformer backend answers
in GPU memory (``bls.py``, "Memory").

Why not an ensemble: the increment needs the text already sent for this request. An ensemble
step is stateless and FasterTransformer sends every request of a batch a response at every step
until the batch's longest row ends, and repeats the last state in its final response, so only a
per-request loop can tell new text from old. A partial multi-byte character (decoded as U+FFFD)
is held back until the next token completes it.

Each request is served in its own thread (``execute`` returns at once), so one instance streams
any number of requests; the ``fastertransformer`` model batches them as configured. A client
that cancels its request gets no further text; the generation it started runs to its end in
``fastertransformer`` (this Triton's BLS cannot cancel a request it sent), then the next
request is served as usual.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from bls import (
    ANSWER,
    FASTERTRANSFORMER,
    FT_INPUTS,
    FT_RESULTS,
    POSTPROCESSING,
    PREPROCESSING,
    REPLACEMENT,
    REQUEST_FIELDS,
    RequestThreads,
    StepError,
    bls_request,
    checked,
    outputs_of,
    send,
    sender_cancelled,
)

#: The client's inputs ``preprocessing`` takes (the ensemble's, ``tensors.PREPROCESSING_INPUTS``).
CLIENT_INPUTS = (
    "prompt",
    "request_output_len",
    "runtime_top_k",
    "runtime_top_p",
    "temperature",
    "repetition_penalty",
    "start_id",
    "end_id",
    "random_seed",
    "is_return_log_probs",
)


class TextIncrements:
    """The text of each (row, beam) sent so far, and what a new snapshot adds to it."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], str] = {}

    def step(self, texts: np.ndarray, *, final: bool) -> np.ndarray:
        """``texts`` (rows, beams) of BYTES, the whole text so far -> the increments."""
        increments = np.empty(texts.shape, dtype=np.object_)
        for index, value in np.ndenumerate(texts):
            text = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
            if not final:
                text = text.rstrip(REPLACEMENT)
            sent = self.sent.get(index, "")
            # Until the end, hold back text that does not extend what was sent.
            new = text[len(sent) :] if final or text.startswith(sent) else ""
            self.sent[index] = sent + new
            increments[index] = new.encode("utf-8")
        return increments


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError(
                f"model {args['model_name']} streams and needs model_transaction_policy "
                "{ decoupled: true }; publish the repository again with model-loader run"
            )
        self.logger = pb_utils.Logger
        self._requests = RequestThreads(self._stream, name="streaming")

    def execute(self, requests: list) -> None:
        self._requests.start(requests)
        return None

    def _stream(self, request: object, sender: object) -> None:
        client = {}
        for name in CLIENT_INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                client[name] = tensor.as_numpy()
        ft_inputs = outputs_of(send(PREPROCESSING, client, FT_INPUTS), FT_INPUTS, PREPROCESSING)
        fields = {name: ft_inputs[name] for name in REQUEST_FIELDS}
        stream = bls_request(FASTERTRANSFORMER, ft_inputs, FT_RESULTS).exec(decoupled=True)
        increments = TextIncrements()
        answer: dict[str, np.ndarray] | None = None
        cancelled = False
        for response in stream:
            checked(response)
            if cancelled or not response.output_tensors():
                continue  # an empty final response, or a stream nobody listens to any more
            if sender_cancelled(sender):
                cancelled = True  # let the generation end; it cannot be called back
                continue
            snapshot = outputs_of(response, FT_RESULTS, FASTERTRANSFORMER)
            latest = self._answer(snapshot, fields)
            if answer is not None and np.array_equal(
                latest["sequence_length"], answer["sequence_length"]
            ):
                continue  # FT calls back every request of the batch; this one has no new token
            answer = latest
            sender.send(
                self._response(
                    increments.step(answer["completion"], final=False), answer, final=False
                )
            )
        if cancelled:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if answer is None:
            raise StepError(f"{FASTERTRANSFORMER} ended the stream without a result")
        sender.send(
            self._response(increments.step(answer["completion"], final=True), answer, final=True),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )

    @staticmethod
    def _answer(
        snapshot: dict[str, np.ndarray], fields: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """``postprocessing``'s answer to one FasterTransformer snapshot."""
        response = send(POSTPROCESSING, {**snapshot, **fields}, ANSWER)
        return outputs_of(response, ANSWER, POSTPROCESSING)

    @staticmethod
    def _response(completion: np.ndarray, answer: dict[str, np.ndarray], *, final: bool) -> object:
        tensors = [pb_utils.Tensor("completion", completion)]
        tensors += [pb_utils.Tensor(name, answer[name]) for name in ANSWER if name != "completion"]
        is_final = np.full((completion.shape[0], 1), final, dtype=np.bool_)
        tensors.append(pb_utils.Tensor("is_final", is_final))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self) -> None:
        self._requests.join()
