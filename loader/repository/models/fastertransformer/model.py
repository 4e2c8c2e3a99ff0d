"""Triton Python-backend model ``fastertransformer``: the CPU reference of FT GPT-J.

Same name, inputs, outputs and parameters as the FasterTransformer-backend model, and it answers
what the C++ backend answers (the wire contract in ``loader/repository/models/README.md``; BE =
fastertransformer_backend ``src/libfastertransformer.cc``, FT = FasterTransformer ``src/``):

* **One input set per batch.** The backend takes the first request's inputs as the batch's
  (``ModelInstanceState::SetInputTensors`` iterates ``requests[0]``'s inputs), so a later request
  that lacks one of them gets Triton's error (``BackendInputCollector``,
  ``TRITONBACKEND_RequestInput``: "input 'NAME' does not exist in request") and one that sends
  more has the extra inputs ignored. Triton's dynamic batcher never joins requests with different
  input sets (core ``RequiredEqualInputs::HasEqualInputs``), so this shows only when something
  else does.
* ``sequence_length`` is INT32 (FT ``GptJTritonModelInstance::forward`` makes it ``TYPE_INT32``;
  the backend answers with each tensor's own type).
* ``output_log_probs`` and ``cum_log_probs`` exist only when the batch's first row has
  ``is_return_log_probs`` true (same function), and then for every request of the batch.
* The batch runs as FT runs it (:mod:`loader.reference.generate`): ``W`` wide (the backend pads a
  ragged ``input_ids`` with 0s), shorter rows sample one token more than they asked for, per-row
  cuRAND XORWOW draws, the batch-level temperature and repetition-penalty rules, and the output
  layout of ``GptJ::setOutputTensors``, ``output_log_probs`` misaligned in a batch whose first row
  asked for fewer tokens than another.
* A head size without a generation kernel is refused at load (FT would generate garbage).

At load it reads the ``<T>-gpu`` directory named by the ``model_checkpoint_path`` parameter, or
FT's default ``<model dir>/<version>/<tensor_para_size>-gpu`` when the parameter is absent (the
loader leaves it out so a repository can move), with :mod:`loader.reference`, and checks what
FasterTransformer would: ``tensor_para_size`` matches the files, ``num_layer`` is divisible by
``pipeline_para_size``. A mismatch fails the load with the reason in Triton's log. Each instance
computes on one BLAS thread (:mod:`loader.reference.blas`): Triton's instances are the
parallelism.

``execute`` receives every request of a dynamic batch at once and completes all their rows as
ONE NumPy batch.

**Decoupled (streaming) mode**, when the config has ``model_transaction_policy { decoupled:
true }``, as the backend's ``streaming_callback``: after every step but the last (and not after
the step that finished every row) each request of the batch gets a response with its rows so far
(same shapes as the non-streaming response), the requests that are already done included; then
each gets a final response with data, flagged ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``
(``ProcessRequests``), which a Triton 23.05 client sees because it carries data. Beyond the C++:
a request the client cancelled (``is_cancelled``, python_backend r23.10 and later; absent in
23.05) gets no more responses, and generation stops once every request of the batch is cancelled.

The runtime precision (``data_type``) is float32 on the CPU whatever the parameter says. The
``loader`` package this file imports is copied next to it by the repository writer
(``1/loader/``), so the repository is self-contained. It runs on the Python of the Triton 23.05
image (3.10) with the r23.05 ``triton_python_backend_utils``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from loader.errors import LoaderError
from loader.formats.fastertransformer import check_head_size
from loader.reference import GptJ, load_ft_checkpoint
from loader.reference.blas import limit_blas_threads
from loader.reference.generate import (
    BatchGeneration,
    GenerationRequest,
    GenerationResult,
    SamplingConfig,
    validate_requests,
    words_from_ft_list,
)


def _parameters(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


class _Inputs:
    """A request's inputs as FT sees them: only the names the batch's first request sent."""

    def __init__(self, request: object, names: tuple[str, ...]) -> None:
        self.request = request
        self.names = names

    def array(self, name: str) -> np.ndarray | None:
        if name not in self.names:
            return None
        tensor = pb_utils.get_input_tensor_by_name(self.request, name)
        return None if tensor is None else tensor.as_numpy()

    def per_row(self, name: str, batch: int, default: float | int) -> np.ndarray:
        """An optional per-row scalar input (sent as [1] or reshaped to []), or FT's default."""
        value = self.array(name)
        if value is None:
            return np.full(batch, default)
        return value.reshape(batch, -1)[:, 0]

    def words(self, name: str, batch: int) -> list[tuple[tuple[int, ...], ...]]:
        """Per-row words of an optional FT ``[2, L]`` word-list input (``bad_words_list``...)."""
        value = self.array(name)
        if value is None:
            return [()] * batch
        lists = value.reshape(batch, 2, -1)
        return [words_from_ft_list(lists[i]) for i in range(batch)]


def _input_names(request: object) -> tuple[str, ...]:
    return tuple(tensor.name() for tensor in request.inputs())


def _missing_input(request: object, names: tuple[str, ...]) -> str | None:
    """The first of the batch's input names ``request`` lacks (what the backend's input
    collector trips over), or None."""
    own = set(_input_names(request))
    return next((name for name in names if name not in own), None)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = _parameters(config)
        tp = int(params.get("tensor_para_size", "1") or 1)
        pp = int(params.get("pipeline_para_size", "1") or 1)
        default_path = Path(args["model_repository"]) / args["model_version"] / f"{tp}-gpu"
        path = Path(params.get("model_checkpoint_path") or default_path)
        self.checkpoint = load_ft_checkpoint(path)
        cfg = self.checkpoint.config
        if self.checkpoint.tensor_para_size != tp:
            raise ValueError(
                f"tensor_para_size {tp} in config.pbtxt does not match the checkpoint {path}, "
                f"converted for tensor_para_size {self.checkpoint.tensor_para_size}; publish the "
                "repository again with matching --tp-size"
            )
        if pp < 1 or cfg.num_layer % pp:
            raise ValueError(
                f"pipeline_para_size {pp} does not divide num_layer {cfg.num_layer} of {path}"
            )
        check_head_size(cfg.size_per_head, where=str(path))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.model = GptJ(self.checkpoint)
        self.config = cfg
        self.logger = pb_utils.Logger
        threads = limit_blas_threads(1)
        self.logger.log_info(
            f"CPU reference GPT-J loaded from {path}: {cfg.num_layer} layers, "
            f"{cfg.head_num} heads x {cfg.size_per_head}, vocab {cfg.vocab_size}, tp {tp}, pp {pp}; "
            f"BLAS threads {sorted(set(threads.values())) or 'unchanged'}"
        )

    def _rows(self, inputs: _Inputs) -> list[GenerationRequest]:
        """The request's rows (each prompt cut to its ``input_lengths``)."""
        ids = inputs.array("input_ids")
        batch = ids.shape[0]
        ids = ids.reshape(batch, -1)
        lengths = inputs.array("input_lengths").reshape(batch, -1)[:, 0]
        out_lens = inputs.array("request_output_len").reshape(batch, -1)[:, 0]
        cfg = self.config
        # FT's defaults for absent inputs: GptJ::forward (handleOptArg: start_id, end_id from
        # config.ini), TopKSamplingLayer::setup (runtime_top_k 0), BaseSamplingLayer::setup
        # (temperature 1, no repetition penalty, random seed 0), TopPSamplingLayer::setup (no
        # top-p), GptJTritonModelInstance::forward (beam_width 1).
        end_id = inputs.per_row("end_id", batch, cfg.end_id)
        top_k = inputs.per_row("runtime_top_k", batch, 0)
        top_p = inputs.per_row("runtime_top_p", batch, 0.0)
        temperature = inputs.per_row("temperature", batch, 1.0)
        penalty = inputs.per_row("repetition_penalty", batch, 1.0)
        seed = inputs.per_row("random_seed", batch, 0)
        beam_width = inputs.per_row("beam_width", batch, 1)
        bad_words = inputs.words("bad_words_list", batch)
        stop_words = inputs.words("stop_words_list", batch)
        if int(beam_width.max()) > 1:
            raise ValueError("beam search (beam_width > 1) is not supported by the CPU reference")
        self._check_sequence(ids.shape[1], out_lens)
        rows = []
        for i in range(batch):
            length = int(lengths[i])
            if not 0 < length <= ids.shape[1]:
                raise ValueError(f"input_lengths {length} does not fit input_ids of {ids.shape[1]}")
            sampling = SamplingConfig(
                top_k=int(top_k[i]),
                top_p=float(top_p[i]),
                temperature=float(temperature[i]),
                repetition_penalty=float(penalty[i]),
                random_seed=int(seed[i]),
            )
            rows.append(
                GenerationRequest(
                    input_ids=ids[i, :length].astype(np.int64).tolist(),
                    output_len=int(out_lens[i]),
                    end_id=int(end_id[i]),
                    sampling=sampling,
                    bad_words=bad_words[i],
                    stop_words=stop_words[i],
                )
            )
        validate_requests(rows, cfg.vocab_size)
        return rows

    def _check_sequence(self, width: int, out_lens: np.ndarray) -> None:
        """Refuse a request whose rows would be longer than the model's context
        (``config.ini``'s ``max_pos_seq_len``, what the deployment's GPU memory is planned
        for). FasterTransformer sizes its buffers for ``input_ids``' width + the largest
        ``request_output_len`` (``GptJTritonModelInstance::forward``, ``allocateBuffer``; a
        uint32 sum that wraps around) and allocates them outside any ``try``, in the thread the
        backend starts per GPU (``ThreadForward``, ``src/libfastertransformer.cc``, catches
        nothing): an allocation that fails aborts tritonserver, every client with it."""
        longest = int(out_lens.max())
        context = self.config.max_pos_seq_len
        if width + longest > context:
            raise ValueError(
                f"request_output_len: input_ids width {width} + request_output_len {longest} = "
                f"{width + longest} tokens, more than the model's context of {context} "
                "(max_pos_seq_len) that this deployment's GPU memory is planned for; ask for at "
                f"most {max(context - width, 0)} tokens"
            )

    def _collect(
        self, requests: list, fail: Callable[[int, Exception], None]
    ) -> tuple[Batch | None, dict[int, tuple[int, int]]]:
        """All valid requests' rows as one batch; ``fail(n, error)`` for each invalid one."""
        names = _input_names(requests[0])
        rows: list[GenerationRequest] = []
        spans: dict[int, tuple[int, int]] = {}
        width = 0
        for n, request in enumerate(requests):
            width = max(width, _input_width(request))
            missing = _missing_input(request, names)
            if missing is not None:
                fail(n, ValueError(f"input '{missing}' does not exist in request"))
                continue
            try:
                request_rows = self._rows(_Inputs(request, names))
            except (LoaderError, ValueError) as exc:
                fail(n, exc)
                continue
            spans[n] = (len(rows), len(rows) + len(request_rows))
            rows.extend(request_rows)
        if not rows:
            return None, spans
        log_probs = _Inputs(requests[0], names).array("is_return_log_probs")
        first_row_asks = log_probs is not None and bool(log_probs.reshape(-1)[0])
        return Batch(rows, width, first_row_asks), spans

    def _generation(self, batch: Batch) -> BatchGeneration:
        return BatchGeneration(
            self.model,
            batch.rows,
            vocab_size=self.config.vocab_size,
            padded_input_length=batch.width,
        )

    def execute(self, requests: list) -> list | None:
        if self.decoupled:
            self._stream(requests)
            return None
        responses: list = [None] * len(requests)

        def fail(n: int, exc: Exception) -> None:
            error = pb_utils.TritonError(str(exc))
            responses[n] = pb_utils.InferenceResponse(output_tensors=[], error=error)

        batch, spans = self._collect(requests, fail)
        if batch is not None:
            self.logger.log_verbose(
                f"generating {len(spans)} requests ({len(batch.rows)} rows, "
                f"{batch.width} tokens wide) as one batch"
            )
            generation = self._generation(batch)
            for _ in generation:
                pass
            results = generation.results()
            for n, (start, stop) in spans.items():
                responses[n] = _response(results[start:stop], log_probs=batch.log_probs)
        return responses

    def _stream(self, requests: list) -> None:
        """Decoupled mode: a response per step to every request, then a final one with data."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        senders = {n: request.get_response_sender() for n, request in enumerate(requests)}

        def fail(n: int, exc: Exception) -> None:
            error = pb_utils.TritonError(str(exc))
            senders[n].send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=final)

        batch, spans = self._collect(requests, fail)
        if batch is None:
            return
        open_requests = set(spans)
        try:
            self._stream_batch(batch, spans, senders, open_requests)
        except Exception as exc:  # every open stream must still end, with the reason
            self.logger.log_error(f"streaming generation failed: {exc}")
            for n in open_requests:
                error = pb_utils.TritonError(f"generation failed: {exc}")
                senders[n].send(
                    pb_utils.InferenceResponse(output_tensors=[], error=error), flags=final
                )

    def _stream_batch(
        self,
        batch: Batch,
        spans: dict[int, tuple[int, int]],
        senders: dict[int, object],
        open_requests: set[int],
    ) -> None:
        """Run ``batch``, calling back as ``streaming_callback`` does; a request leaves
        ``open_requests`` once its final response (or final flag) is sent."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        generation = self._generation(batch)
        for step in generation:
            for n in sorted(open_requests):
                if _cancelled(senders[n]):
                    senders[n].send(flags=final)
                    open_requests.discard(n)
            if not open_requests:
                break
            if step.last:
                continue  # GptJ::forward skips the callback of its last step
            results = generation.results()
            for n in sorted(open_requests):
                start, stop = spans[n]
                senders[n].send(_response(results[start:stop], log_probs=batch.log_probs))
        results = generation.results()
        for n in sorted(open_requests):
            start, stop = spans[n]
            senders[n].send(_response(results[start:stop], log_probs=batch.log_probs), flags=final)
            open_requests.discard(n)

    def finalize(self) -> None:
        self.model = None


@dataclass(frozen=True)
class Batch:
    """The rows of one ``execute`` call, as FasterTransformer would receive them."""

    rows: list[GenerationRequest]
    width: int  # input_ids.shape[1] after the backend's padding: the longest request
    log_probs: bool  # the first row's is_return_log_probs


def _input_width(request: object) -> int:
    """The width of a request's ``input_ids``: the backend pads the batch to the widest."""
    tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if tensor is None:
        return 0
    ids = tensor.as_numpy()
    return int(ids.reshape(ids.shape[0], -1).shape[1])


def _cancelled(sender: object) -> bool:
    """``InferenceResponseSender.is_cancelled`` exists from python_backend r23.10 on."""
    is_cancelled = getattr(sender, "is_cancelled", None)
    return bool(is_cancelled()) if is_cancelled is not None else False


def _response(results: list[GenerationResult], *, log_probs: bool) -> object:
    """One request's rows in FT's layout: ``[rows, beam=1, ...]``; log probs only on request."""
    output_ids = np.stack([r.output_ids for r in results])[:, None, :].astype(np.uint32)
    sequence_length = np.array([[r.sequence_length] for r in results], dtype=np.int32)
    tensors = [
        pb_utils.Tensor("output_ids", output_ids),
        pb_utils.Tensor("sequence_length", sequence_length),
    ]
    if log_probs:
        output_log_probs = np.stack([r.output_log_probs for r in results])[:, None, :]
        cum_log_probs = np.array([[r.cum_log_prob] for r in results], dtype=np.float32)
        tensors += [
            pb_utils.Tensor("output_log_probs", output_log_probs.astype(np.float32)),
            pb_utils.Tensor("cum_log_probs", cum_log_probs),
        ]
    return pb_utils.InferenceResponse(output_tensors=tensors)
