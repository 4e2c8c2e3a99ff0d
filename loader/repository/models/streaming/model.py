"""Triton Python-backend model ``<NAME>`` of a streaming repository: text increments per token.

A streaming repository (``model-loader run --streaming``) serves the model clients call as this
decoupled model instead of the ensemble, with the ensemble's exact inputs and outputs. For each
request it runs, through Triton's business-logic scripting (BLS) API:

1. ``preprocessing`` (prompt -> ``input_ids``, ``input_lengths``), once;
2. ``fastertransformer`` in decoupled mode: FasterTransformer's streaming callback (and the CPU
   reference) sends the outputs so far after every decoding step, then a final response;
3. ``postprocessing`` on every such snapshot (the text generated so far),

and sends the client one response per snapshot whose ``completion`` holds only the text that
is new since the previous response (the other outputs are the snapshot: ``output_ids``,
``sequence_length``, ``cum_log_probs``, ``output_log_probs`` so far). The last response is
flagged final and carries the rest of the text (often empty), so the concatenated
``completion`` of a stream equals the non-streaming completion for the same request and seed.
Every response also carries ``is_final`` (BOOL [1]), true in the last one only: a Triton 23.05
gRPC client is not told of the final flag, so this is how it sees the end of the stream.

Why not an ensemble: the increment needs the text already sent for this request. An ensemble
step is stateless and FasterTransformer re-sends rows that have finished (a batch keeps
stepping until its longest row ends) and repeats the last step in its final response, so only
a per-request loop can tell new text from old. A partial multi-byte character (decoded as
U+FFFD) is held back until the next token completes it.

Each request is served in its own thread (``execute`` returns at once), so one instance streams
any number of requests; the ``fastertransformer`` model batches them as configured. A client
that cancels its request gets no further text; the generation it started runs to its end in
``fastertransformer`` (this Triton's BLS cannot cancel a request it sent), then the next
request is served as usual.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

PREPROCESSING = "preprocessing"
FASTERTRANSFORMER = "fastertransformer"
POSTPROCESSING = "postprocessing"

#: Request inputs passed to ``fastertransformer`` unchanged when the client sends them. The
#: client's ``is_return_log_probs`` is not among them: this model always asks for the log
#: probabilities, so every response carries every output the model declares.
FORWARDED_INPUTS = (
    "request_output_len",
    "runtime_top_k",
    "runtime_top_p",
    "temperature",
    "repetition_penalty",
    "start_id",
    "end_id",
    "random_seed",
)
#: ``fastertransformer`` outputs passed to the client as they are (the snapshot).
SNAPSHOT_OUTPUTS = ("output_ids", "sequence_length", "cum_log_probs", "output_log_probs")
#: What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class StepError(RuntimeError):
    """A composing model answered with an error."""


def _cancelled(sender: object) -> bool:
    """``InferenceResponseSender.is_cancelled`` exists from python_backend r23.10 on; on 23.05
    a cancelled stream is not seen, and the generation simply runs to its end."""
    is_cancelled = getattr(sender, "is_cancelled", None)
    return bool(is_cancelled()) if is_cancelled is not None else False


def _exec(request: object) -> object:
    response = request.exec()
    if response.has_error():
        raise StepError(response.error().message())
    return response


def _output(response: object, name: str) -> np.ndarray:
    return pb_utils.get_output_tensor_by_name(response, name).as_numpy()


def _snapshot(response: object) -> dict[str, np.ndarray]:
    """The outputs a ``fastertransformer`` response carries (all four: the request asked for
    the log probabilities)."""
    snapshot = {}
    for name in SNAPSHOT_OUTPUTS:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is not None:
            snapshot[name] = tensor.as_numpy()
    missing = set(SNAPSHOT_OUTPUTS) - set(snapshot)
    if missing:
        raise StepError(f"{FASTERTRANSFORMER} sent a response without {', '.join(sorted(missing))}")
    return snapshot


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
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def execute(self, requests: list) -> None:
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()
        return None

    def _serve(self, request: object) -> None:
        sender = request.get_response_sender()
        try:
            self._stream(request, sender)
        except Exception as exc:  # every failure must end the client's stream
            self.logger.log_error(f"streaming request failed: {exc}")
            error = pb_utils.TritonError(str(exc))
            try:
                sender.send(
                    pb_utils.InferenceResponse(output_tensors=[], error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
            except Exception as send_failure:  # the client is gone (e.g. it cancelled)
                self.logger.log_warn(f"could not send the error to the client: {send_failure}")
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _stream(self, request: object, sender: object) -> None:
        prompt = pb_utils.get_input_tensor_by_name(request, "prompt")
        pre = _exec(
            pb_utils.InferenceRequest(
                model_name=PREPROCESSING,
                requested_output_names=["input_ids", "input_lengths"],
                inputs=[pb_utils.Tensor("prompt", prompt.as_numpy())],
            )
        )
        input_lengths = _output(pre, "input_lengths")
        inputs = [
            pb_utils.Tensor("input_ids", _output(pre, "input_ids")),
            pb_utils.Tensor("input_lengths", input_lengths),
            pb_utils.Tensor("is_return_log_probs", np.ones_like(input_lengths, dtype=np.bool_)),
        ]
        for name in FORWARDED_INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs.append(pb_utils.Tensor(name, tensor.as_numpy()))
        stream = pb_utils.InferenceRequest(
            model_name=FASTERTRANSFORMER,
            requested_output_names=list(SNAPSHOT_OUTPUTS),
            inputs=inputs,
        ).exec(decoupled=True)
        end_id = pb_utils.get_input_tensor_by_name(request, "end_id")
        increments = TextIncrements()
        snapshot: dict[str, np.ndarray] | None = None
        texts: np.ndarray | None = None
        cancelled = False
        for response in stream:
            if response.has_error():
                raise StepError(response.error().message())
            if cancelled or not response.output_tensors():
                continue  # FT's empty final response, or a stream nobody listens to any more
            if _cancelled(sender):
                cancelled = True  # let the generation end; it cannot be called back
                continue
            snapshot = _snapshot(response)
            texts = self._texts(snapshot, input_lengths, end_id)
            sender.send(self._response(increments.step(texts, final=False), snapshot, final=False))
        if cancelled:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if snapshot is None or texts is None:
            raise StepError(f"{FASTERTRANSFORMER} ended the stream without a result")
        sender.send(
            self._response(increments.step(texts, final=True), snapshot, final=True),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )

    @staticmethod
    def _texts(
        snapshot: dict[str, np.ndarray], input_lengths: np.ndarray, end_id: object | None
    ) -> np.ndarray:
        inputs = [pb_utils.Tensor(name, value) for name, value in snapshot.items()]
        inputs.append(pb_utils.Tensor("input_lengths", input_lengths))
        if end_id is not None:
            inputs.append(pb_utils.Tensor("end_id", end_id.as_numpy()))
        post = _exec(
            pb_utils.InferenceRequest(
                model_name=POSTPROCESSING, requested_output_names=["completion"], inputs=inputs
            )
        )
        return _output(post, "completion")

    @staticmethod
    def _response(
        completion: np.ndarray, snapshot: dict[str, np.ndarray], *, final: bool
    ) -> object:
        tensors = [pb_utils.Tensor("completion", completion)]
        tensors += [pb_utils.Tensor(name, value) for name, value in snapshot.items()]
        is_final = np.full((completion.shape[0], 1), final, dtype=np.bool_)
        tensors.append(pb_utils.Tensor("is_final", is_final))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self) -> None:
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=30)
