"""The business-logic-scripting (BLS) steps shared by the ``llm`` and streaming models.

Copied beside their ``model.py`` (``1/bls.py``) by the repository writer, as
``tokenization.py`` is: a Triton Python model imports only what its version directory holds.
Both models run ``preprocessing`` -> ``fastertransformer`` -> ``postprocessing`` per request
through Triton's BLS API, with the tensor names below (``loader/repository/tensors.py``).

**Memory.** The FasterTransformer backend answers with GPU buffers (BE
``ModelInstanceState::ReadOutputTensors`` hands ``BackendOutputResponder::ProcessTensor``
``TRITONSERVER_MEMORY_GPU``), and a BLS request that states no preferred memory keeps that memory
type (python_backend r23.05 ``request_executor.cc``, ``ResponseAlloc``); ``as_numpy()`` on such a
tensor raises "Tensor is stored in GPU and cannot be converted to NumPy" (``pb_tensor.cc``,
``PbTensor::AsNumpy``). Every request made here asks for CPU memory
(``pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)``, in r23.05).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

PREPROCESSING = "preprocessing"
FASTERTRANSFORMER = "fastertransformer"
POSTPROCESSING = "postprocessing"

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
#: ``postprocessing``'s outputs.
ANSWER = ("completion", "output_ids", "sequence_length", "cum_log_probs")
#: What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class StepError(RuntimeError):
    """A composing model answered with an error."""


def sender_cancelled(sender: object) -> bool:
    """``InferenceResponseSender.is_cancelled`` exists from python_backend r23.10 on; on 23.05
    a cancelled stream is not seen, and the generation simply runs to its end."""
    is_cancelled = getattr(sender, "is_cancelled", None)
    return bool(is_cancelled()) if is_cancelled is not None else False


def bls_request(model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> object:
    """A BLS request whose results come back in CPU memory (see "Memory" above)."""
    return pb_utils.InferenceRequest(
        model_name=model,
        requested_output_names=list(outputs),
        inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()],
        preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
    )


def checked(response: object) -> object:
    """``response``, unless the model answered with an error (:class:`StepError`)."""
    if response.has_error():
        raise StepError(response.error().message())
    return response


def send(model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> object:
    """One request to ``model`` and its answer (an error answer is a :class:`StepError`)."""
    return checked(bls_request(model, inputs, outputs).exec())


def outputs_of(response: object, names: tuple[str, ...], model: str) -> dict[str, np.ndarray]:
    """The named outputs of a response, as NumPy arrays; a missing one is a :class:`StepError`."""
    found = {}
    for name in names:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is not None:
            found[name] = tensor.as_numpy()
    missing = [name for name in names if name not in found]
    if missing:
        raise StepError(f"{model} sent a response without {', '.join(missing)}")
    return found


#: How long ``finalize`` waits, in all, for the requests still being served.
FINALIZE_WAIT_S = 30.0


class RequestThreads:
    """Each request served in its own thread, so ``execute`` returns at once and one instance
    streams any number of requests. A request that fails ends its client's stream with the
    error (a failure of the kinds in ``quiet`` is the client's and is not logged)."""

    def __init__(
        self,
        serve: Callable[[object, object], None],
        *,
        name: str,
        quiet: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._serve, self._name, self._quiet = serve, name, quiet
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def start(self, requests: list) -> None:
        for request in requests:
            thread = threading.Thread(target=self._run, args=(request,), daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _run(self, request: object) -> None:
        sender = request.get_response_sender()
        try:
            self._serve(request, sender)
        except Exception as exc:  # every failure must end the client's stream
            if not isinstance(exc, self._quiet):
                pb_utils.Logger.log_error(f"{self._name} request failed: {exc}")
            try:
                sender.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError(str(exc))
                    ),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
            except Exception as send_failure:  # the client is gone (e.g. it cancelled)
                pb_utils.Logger.log_warn(f"could not send the error to the client: {send_failure}")
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def join(self, timeout_s: float = FINALIZE_WAIT_S) -> None:
        """Wait for the requests being served, :data:`FINALIZE_WAIT_S` in all (not per request):
        the instance's unloading never waits longer than that, however many are left."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        left = sum(thread.is_alive() for thread in threads)
        if left:
            pb_utils.Logger.log_warn(
                f"{self._name}: unloading with {left} request(s) still being served"
            )
