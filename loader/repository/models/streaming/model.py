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

**Memory.** The FasterTransformer backend answers with GPU buffers (BE
``ModelInstanceState::ReadOutputTensors`` hands ``BackendOutputResponder::ProcessTensor``
``TRITONSERVER_MEMORY_GPU``), and a BLS request that states no preferred memory keeps that memory
type (python_backend r23.05 ``request_executor.cc``, ``ResponseAlloc``); ``as_numpy()`` on such a
tensor raises "Tensor is stored in GPU and cannot be converted to NumPy" (``pb_tensor.cc``,
``PbTensor::AsNumpy``). Every BLS request here asks for CPU memory
(``pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)``, in r23.05).

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
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

PREPROCESSING = "preprocessing"
FASTERTRANSFORMER = "fastertransformer"
POSTPROCESSING = "postprocessing"

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
#: Every input of ``fastertransformer`` (``tensors.FASTERTRANSFORMER_INPUTS``): what
#: ``preprocessing`` returns.
FT_INPUTS = (
    "input_ids",
    "input_lengths",
    "request_output_len",
    "start_id",
    "end_id",
    "runtime_top_k",
    "beam_width",
    "runtime_top_p",
    "temperature",
    "len_penalty",
    "repetition_penalty",
    "beam_search_diversity_rate",
    "random_seed",
    "is_return_log_probs",
    "bad_words_list",
    "stop_words_list",
)
#: ``fastertransformer``'s outputs (all four: ``preprocessing`` asks for the log probabilities).
FT_RESULTS = ("output_ids", "sequence_length", "cum_log_probs", "output_log_probs")
#: What ``postprocessing`` also needs from ``preprocessing``'s outputs.
REQUEST_FIELDS = ("input_lengths", "request_output_len", "end_id")
#: ``postprocessing``'s outputs, passed to the client (``completion`` as an increment).
ANSWER = ("completion", "output_ids", "sequence_length", "cum_log_probs")
#: What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class StepError(RuntimeError):
    """A composing model answered with an error."""


def _cancelled(sender: object) -> bool:
    """``InferenceResponseSender.is_cancelled`` exists from python_backend r23.10 on; on 23.05
    a cancelled stream is not seen, and the generation simply runs to its end."""
    is_cancelled = getattr(sender, "is_cancelled", None)
    return bool(is_cancelled()) if is_cancelled is not None else False


def _request(model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> object:
    """A BLS request whose results come back in CPU memory (see "Memory" above)."""
    return pb_utils.InferenceRequest(
        model_name=model,
        requested_output_names=list(outputs),
        inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()],
        preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
    )


def _exec(request: object) -> object:
    response = request.exec()
    if response.has_error():
        raise StepError(response.error().message())
    return response


def _outputs(response: object, names: tuple[str, ...], model: str) -> dict[str, np.ndarray]:
    """The named outputs of a response, as NumPy arrays."""
    found = {}
    for name in names:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is not None:
            found[name] = tensor.as_numpy()
    missing = [name for name in names if name not in found]
    if missing:
        raise StepError(f"{model} sent a response without {', '.join(missing)}")
    return found


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
        client = {}
        for name in CLIENT_INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                client[name] = tensor.as_numpy()
        ft_inputs = _outputs(
            _exec(_request(PREPROCESSING, client, FT_INPUTS)), FT_INPUTS, PREPROCESSING
        )
        fields = {name: ft_inputs[name] for name in REQUEST_FIELDS}
        stream = _request(FASTERTRANSFORMER, ft_inputs, FT_RESULTS).exec(decoupled=True)
        increments = TextIncrements()
        answer: dict[str, np.ndarray] | None = None
        cancelled = False
        for response in stream:
            if response.has_error():
                raise StepError(response.error().message())
            if cancelled or not response.output_tensors():
                continue  # an empty final response, or a stream nobody listens to any more
            if _cancelled(sender):
                cancelled = True  # let the generation end; it cannot be called back
                continue
            snapshot = _outputs(response, FT_RESULTS, FASTERTRANSFORMER)
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
        response = _exec(_request(POSTPROCESSING, {**snapshot, **fields}, ANSWER))
        return _outputs(response, ANSWER, POSTPROCESSING)

    @staticmethod
    def _response(completion: np.ndarray, answer: dict[str, np.ndarray], *, final: bool) -> object:
        tensors = [pb_utils.Tensor("completion", completion)]
        tensors += [pb_utils.Tensor(name, answer[name]) for name in ANSWER if name != "completion"]
        is_final = np.full((completion.shape[0], 1), final, dtype=np.bool_)
        tensors.append(pb_utils.Tensor("is_final", is_final))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self) -> None:
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=30)
