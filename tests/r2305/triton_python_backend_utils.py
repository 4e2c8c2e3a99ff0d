"""The ``triton_python_backend_utils`` surface of python_backend r23.05, and nothing more.

The Triton 23.05 image runs our Python models with this API (python_backend ``r23.05``,
``src/pb_stub.cc`` ``PYBIND11_EMBEDDED_MODULE`` and ``src/resources/triton_python_backend_utils.py``).
Every class has ``__slots__`` and only the methods r23.05 has, so a model that calls anything
newer (``InferenceResponseSender.is_cancelled`` came in r23.10, for instance) fails with an
AttributeError here. ``InferenceRequest.exec`` runs the named model in this process: the test
driver registers the loaded models in :data:`MODELS`.

**Memory types.** A tensor lives in CPU or GPU memory. The FasterTransformer backend answers
with GPU buffers (fastertransformer_backend ``ModelInstanceState::ReadOutputTensors`` passes
``TRITONSERVER_MEMORY_GPU`` to ``BackendOutputResponder::ProcessTensor``, which asks the caller's
allocator for that type), and the r23.05 BLS allocator keeps the type asked for unless the
request set ``preferred_memory`` (python_backend ``request_executor.cc``, ``ResponseAlloc``). So
the outputs of a model in :data:`GPU_OUTPUT_MODELS` come back as GPU tensors unless the BLS
request asked for ``TRITONSERVER_MEMORY_CPU``, and ``as_numpy()`` on a GPU tensor raises as
``PbTensor::AsNumpy`` does. Inputs a Python model receives are CPU tensors (the backend's
``FORCE_CPU_ONLY_INPUT_TENSORS`` defaults to yes, ``python_be.cc``).
"""

from __future__ import annotations

import json
import threading

import numpy as np

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

#: ``PreferredMemory::MemoryType`` (pb_preferred_memory.h: GPU, CPU, DEFAULT), exported by
#: r23.05's ``triton_python_backend_utils`` (pb_stub.cc).
TRITONSERVER_MEMORY_GPU = 0
TRITONSERVER_MEMORY_CPU = 1

#: model name -> (TritonPythonModel instance, decoupled), filled by the test driver.
MODELS: dict[str, tuple[object, bool]] = {}
#: Models whose outputs are GPU tensors (the FasterTransformer backend), filled by the driver.
GPU_OUTPUT_MODELS: set[str] = set()


class TritonError:
    __slots__ = ("_message",)

    def __init__(self, message: str) -> None:
        self._message = message

    def message(self) -> str:
        return self._message


class TritonModelException(Exception):
    pass


class PreferredMemory:
    __slots__ = ("_device_id", "_type")

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        if preferred_memory_type not in (TRITONSERVER_MEMORY_GPU, TRITONSERVER_MEMORY_CPU):
            raise TypeError(f"not a MemoryType: {preferred_memory_type!r}")
        self._type = preferred_memory_type
        self._device_id = preferred_device_id


class Tensor:
    __slots__ = ("_array", "_gpu", "_name")

    def __init__(self, name: str, array: np.ndarray) -> None:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"Tensor {name!r} needs a numpy array, got {type(array).__name__}")
        self._name = name
        self._array = array
        self._gpu = False

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        if self._gpu:
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return not self._gpu


def data(tensor: Tensor) -> np.ndarray:
    """A tensor's values wherever they live (test helper, not part of the API: what Triton's
    ensemble scheduler and the CPU-only inputs of a Python model see)."""
    return tensor._array


def _in_memory(tensor: Tensor, gpu: bool) -> Tensor:
    copy = Tensor(tensor.name(), tensor._array)
    copy._gpu = gpu
    return copy


class InferenceResponse:
    __slots__ = ("_error", "_tensors")

    def __init__(self, output_tensors: list, error: TritonError | None = None) -> None:
        self._tensors = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class InferenceResponseSender:
    """r23.05: ``send(response=None, flags=0)`` and nothing else."""

    __slots__ = ("_condition", "_sent")

    def __init__(self) -> None:
        self._sent: list[tuple[InferenceResponse | None, int]] = []
        self._condition = threading.Condition()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self._condition:
            self._sent.append((response, flags))
            self._condition.notify_all()


def sent(sender: InferenceResponseSender) -> list[tuple[InferenceResponse | None, int]]:
    """What a sender has sent so far (test helper, not part of the API)."""
    return list(sender._sent)


def wait_final(sender: InferenceResponseSender, timeout: float) -> bool:
    """Wait until ``sender`` sent a final flag (test helper, not part of the API)."""
    with sender._condition:
        return sender._condition.wait_for(
            lambda: any(f & TRITONSERVER_RESPONSE_COMPLETE_FINAL for _, f in sender._sent),
            timeout,
        )


class InferenceRequest:
    __slots__ = (
        "_correlation_id",
        "_flags",
        "_inputs",
        "_model_name",
        "_model_version",
        "_preferred_memory",
        "_request_id",
        "_requested",
        "_sender",
        "_timeout",
    )

    def __init__(
        self,
        *,
        inputs: list,
        requested_output_names: list,
        model_name: str,
        request_id: str = "",
        correlation_id: int = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: object | None = None,
    ) -> None:
        # A Python model's inputs are CPU tensors (FORCE_CPU_ONLY_INPUT_TENSORS).
        self._inputs = [_in_memory(t, False) for t in inputs]
        self._requested = list(requested_output_names)
        if preferred_memory is not None and not isinstance(preferred_memory, PreferredMemory):
            raise TypeError("preferred_memory must be a PreferredMemory")
        self._preferred_memory = preferred_memory
        self._model_name = model_name
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._sender = InferenceResponseSender()

    def inputs(self) -> list:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return "{}"

    def requested_output_names(self) -> list:
        return self._requested

    def get_response_sender(self) -> InferenceResponseSender:
        return self._sender

    def exec(self, decoupled: bool = False):
        model, model_decoupled = MODELS[self._model_name]
        if decoupled != model_decoupled:
            raise TritonModelException(
                f"model {self._model_name} is {'' if model_decoupled else 'not '}decoupled"
            )
        if not decoupled:
            [response] = model.execute([self])
            return self._received(response)
        model.execute([self])
        if not wait_final(self._sender, 120):
            raise TritonModelException(f"{self._model_name} sent no final response")
        return iter([self._received(r) for r, _ in sent(self._sender) if r is not None])

    def async_exec(self, decoupled: bool = False):
        raise NotImplementedError("not used by the project's models")

    def _received(self, response: InferenceResponse) -> InferenceResponse:
        """The response as the caller gets it: the requested outputs, in the memory type the
        answering model's outputs have unless this request preferred CPU memory."""
        if response.has_error():
            return response
        names = self._requested
        kept = [t for t in response.output_tensors() if not names or t.name() in names]
        cpu = (
            self._preferred_memory is not None
            and self._preferred_memory._type == TRITONSERVER_MEMORY_CPU
        )
        gpu = self._model_name in GPU_OUTPUT_MODELS and not cpu
        return InferenceResponse(output_tensors=[_in_memory(t, gpu) for t in kept])


class Logger:
    __slots__ = ()

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        print(f"[model] {message}", flush=True)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message)


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((i for i in model_config.get("input", []) if i["name"] == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((o for o in model_config.get("output", []) if o["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))
