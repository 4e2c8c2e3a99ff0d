"""Triton Python-backend model ``fastertransformer``: the CPU reference of FT GPT-J.

Same name, inputs, outputs and parameters as the FasterTransformer-backend model, and it sends
what the C++ backend sends (the wire contract in ``loader/repository/models/README.md``, with
the upstream file and function of each rule):

* ``sequence_length`` is INT32 (FT ``GptJTritonModelInstance::forward`` makes it
  ``ft::TYPE_INT32``; the backend answers with each tensor's own type);
* ``output_log_probs`` and ``cum_log_probs`` exist only when the batch's first row has
  ``is_return_log_probs`` true (same function: ``*((bool*)...at("is_return_log_probs").data)``),
  and then for every request of the batch; Triton's dynamic batcher only joins requests that
  send the same optional inputs;
* a batch is as wide as its longest prompt (the backend pads a ragged ``input_ids`` with 0s,
  BE ``ModelInstanceState::SetInputTensors``): every request's ``output_ids`` is that width plus
  the batch's largest ``request_output_len``, and ``sequence_length`` counts that width (see
  :mod:`loader.reference.generate`);
* a head size without a generation kernel is refused at load (FT would generate garbage).

At load it reads the ``<T>-gpu`` directory named by the ``model_checkpoint_path`` parameter, or
FT's default ``<model dir>/<version>/<tensor_para_size>-gpu`` when the parameter is absent (the
loader leaves it out so a repository can move), with :mod:`loader.reference`, and checks what
FasterTransformer would: ``tensor_para_size`` matches the files, ``num_layer`` is divisible by
``pipeline_para_size``. A mismatch fails the load with the reason in Triton's log.

``execute`` receives every request of a dynamic batch at once and completes all their rows as
ONE NumPy batch (:mod:`loader.reference.generate`: FT sampling semantics, padding masks, a shared
KV cache).

**Decoupled (streaming) mode**, when the config has ``model_transaction_policy { decoupled:
true }``: like FasterTransformer's streaming callback (BE ``streaming_callback``), every
decoding step sends each request that produced a token a response holding its outputs so far
(same shapes as the non-streaming response); the step that completes a request sends its last
response flagged ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` instead, so the end of a stream
carries data and is visible to a Triton 23.05 client (which is not told of an empty final
response). A request the client cancelled (``is_cancelled``, python_backend r23.10 and later;
absent in 23.05) gets no more responses, and generation stops once every request of the batch
is complete or cancelled.

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
from loader.reference.generate import (
    BatchGeneration,
    GenerationRequest,
    GenerationResult,
    SamplingConfig,
    generate,
    validate_requests,
    words_from_ft_list,
)


def _parameters(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def _word_lists(request: object, name: str, batch: int) -> list[tuple[tuple[int, ...], ...]]:
    """Per-row words of an optional FT ``[2, L]`` word-list input (``bad_words_list``...)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return [()] * batch
    lists = tensor.as_numpy().reshape(batch, 2, -1)
    return [words_from_ft_list(lists[i]) for i in range(batch)]


def _optional(request: object, name: str, batch: int, default: float | int) -> np.ndarray:
    """An optional per-row scalar input (sent as [1] or reshaped to []), or the default."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return np.full(batch, default)
    return tensor.as_numpy().reshape(batch, -1)[:, 0]


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
        self.logger.log_info(
            f"CPU reference GPT-J loaded from {path}: {cfg.num_layer} layers, "
            f"{cfg.head_num} heads x {cfg.size_per_head}, vocab {cfg.vocab_size}, tp {tp}, pp {pp}"
        )

    def _rows(self, request: object) -> list[GenerationRequest]:
        """The request's rows (each prompt cut to its ``input_lengths``)."""
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
        batch = ids.shape[0]
        ids = ids.reshape(batch, -1)
        lengths = pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy()
        lengths = lengths.reshape(batch, -1)[:, 0]
        out_lens = pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy()
        out_lens = out_lens.reshape(batch, -1)[:, 0]
        cfg = self.config
        end_id = _optional(request, "end_id", batch, cfg.end_id)
        top_k = _optional(request, "runtime_top_k", batch, 0)
        top_p = _optional(request, "runtime_top_p", batch, 0.0)
        temperature = _optional(request, "temperature", batch, 1.0)
        penalty = _optional(request, "repetition_penalty", batch, 1.0)
        seed = _optional(request, "random_seed", batch, 0)
        beam_width = _optional(request, "beam_width", batch, 1)
        bad_words = _word_lists(request, "bad_words_list", batch)
        stop_words = _word_lists(request, "stop_words_list", batch)
        if int(beam_width.max()) > 1:
            raise ValueError("beam search (beam_width > 1) is not supported by the CPU reference")
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

    def _collect(
        self, requests: list, fail: Callable[[int, Exception], None]
    ) -> tuple[Batch | None, dict[int, tuple[int, int]]]:
        """All valid requests' rows as one batch; ``fail(n, error)`` for each invalid one."""
        rows: list[GenerationRequest] = []
        spans: dict[int, tuple[int, int]] = {}
        width = 0
        for n, request in enumerate(requests):
            try:
                request_rows = self._rows(request)
            except (LoaderError, ValueError) as exc:
                fail(n, exc)
                continue
            spans[n] = (len(rows), len(rows) + len(request_rows))
            rows.extend(request_rows)
            width = max(width, _input_width(request))
        if not rows:
            return None, spans
        return Batch(rows, width, _returns_log_probs(requests[0])), spans

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
            results = generate(
                self.model,
                batch.rows,
                vocab_size=self.config.vocab_size,
                padded_input_length=batch.width,
            )
            for n, (start, stop) in spans.items():
                responses[n] = _response(results[start:stop], log_probs=batch.log_probs)
        return responses

    def _stream(self, requests: list) -> None:
        """Decoupled mode: one response per generated token, the last one flagged final."""
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
        """Generate ``batch`` step by step, sending each open request its snapshot; a request
        leaves ``open_requests`` once its final response (or final flag) is sent."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        generation = BatchGeneration(
            self.model,
            batch.rows,
            vocab_size=self.config.vocab_size,
            padded_input_length=batch.width,
        )
        for step in generation:
            complete = generation.finished | (generation.num_generated >= generation.output_lens)
            results = generation.results()
            for n in sorted(open_requests):
                start, stop = spans[n]
                if _cancelled(senders[n]):
                    senders[n].send(flags=final)
                    open_requests.discard(n)
                    continue
                if not step.produced[start:stop].any():
                    continue
                response = _response(results[start:stop], log_probs=batch.log_probs)
                if complete[start:stop].all():
                    senders[n].send(response, flags=final)
                    open_requests.discard(n)
                else:
                    senders[n].send(response)
            if not open_requests:
                break
        results = generation.results()
        for n in sorted(open_requests):  # not reached unless generation ended early
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
    ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
    return int(ids.reshape(ids.shape[0], -1).shape[1])


def _returns_log_probs(first: object) -> bool:
    """FT reads ``is_return_log_probs`` of the batch's first row only (absent: false)."""
    tensor = pb_utils.get_input_tensor_by_name(first, "is_return_log_probs")
    return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])


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
