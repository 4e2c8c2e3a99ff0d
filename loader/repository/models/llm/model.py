"""Triton Python-backend model ``llm``: Triton's LLM convention over FasterTransformer.

Every published repository serves this decoupled model beside the model named after the
checkpoint, with the names the TensorRT-LLM and vLLM backends use (``text_input``,
``max_tokens`` -> ``text_output``, ``finish_reason``, ...; ``loader/repository/tensors.py``,
``LLM_INPUTS``/``LLM_OUTPUTS``), so tools written for those backends (benchmarks, Triton's
``generate`` endpoint, OpenAI front ends) work unchanged. It runs, through Triton's BLS API, what
the model named after the checkpoint runs:

1. ``preprocessing`` with the client's fields renamed (:data:`FIELDS`: ``text_input`` ->
   ``prompt``, ``max_tokens`` -> ``request_output_len``, ``top_k`` -> ``runtime_top_k``, ``top_p``
   -> ``runtime_top_p``, ``seed`` -> ``random_seed``; ``temperature`` and ``repetition_penalty``
   as they are), so a request gets the tokens the same request gets from the ensemble;
   ``temperature`` 0 means greedy, as in vLLM and OpenAI's API (``runtime_top_k`` 1, the other
   sampling fields not sent);
2. ``fastertransformer``, with ``stop_words`` and ``bad_words`` tokenized by the checkpoint's
   tokenizer (``encode_batch``, as ``preprocessing`` tokenizes a prompt) into FasterTransformer's
   ``stop_words_list`` / ``bad_words_list`` (``[[ids...], [end offsets..., -1]]``);
3. ``postprocessing``, which cuts FasterTransformer's batch to this request's tokens.

Outputs, one request of one prompt at a time:

* ``text_output``: the generated text (special tokens left out, as ``postprocessing`` decodes);
  without ``exclude_input_in_output`` the prompt is put before it (vLLM's default: the prompt is
  included when not streaming, left out when streaming). A stop word that ended the text is not
  part of it (OpenAI's and vLLM's convention); it is counted in ``num_output_tokens``.
* ``finish_reason``: ``stop`` when ``end_id`` or a stop word ended the generation, else
  ``length``.
* ``num_input_tokens``: the prompt's tokens; ``num_output_tokens``: the tokens FasterTransformer
  generated for the request (a stopping ``end_id`` or stop word included, as its
  ``sequence_length`` counts them); ``cum_log_probs``: ``postprocessing``'s (NaN for a request
  that got FasterTransformer's extra token in a batch).

With ``stream`` true (only when ``fastertransformer`` is decoupled, i.e. the repository was
published with ``--streaming``) every FasterTransformer step that adds text for this request is
one response holding the new text; text that may be the start of a stop word, and bytes that are
not yet a whole UTF-8 character, are held back until the next token decides. Every response but
the last has ``finish_reason`` ``""``; the last (whose text may be empty) ``length`` or ``stop``:
a Triton 23.05 gRPC client is not told of the final flag, so the end of a stream is in the data.

Bad input is answered with a Triton error whose message starts with the field's name (``max_tokens:
must be at least 1 (got 0)``); what FasterTransformer cannot do is refused the same way (top-k
beyond its kernels' 1024, a bad word ending in token 0, which it never bans, ...). Every BLS call
asks for CPU memory: the FasterTransformer backend answers in GPU memory (see
``bls.py``, "Memory").
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

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
from tokenization import TOKENIZER_DIR, load_tokenizer

#: This model's input -> (``preprocessing``'s input, its numpy dtype).
FIELDS = {
    "text_input": ("prompt", np.object_),
    "max_tokens": ("request_output_len", np.uint32),
    "top_k": ("runtime_top_k", np.uint32),
    "top_p": ("runtime_top_p", np.float32),
    "temperature": ("temperature", np.float32),
    "repetition_penalty": ("repetition_penalty", np.float32),
    "seed": ("random_seed", np.uint64),
}
#: Every input of this model (``tensors.LLM_INPUTS``).
INPUTS = (
    "text_input",
    "max_tokens",
    "stream",
    "exclude_input_in_output",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
    "stop_words",
    "bad_words",
)
#: Every output (``tensors.LLM_OUTPUTS``).
OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "cum_log_probs")
#: FasterTransformer's top-k kernels take k up to 1024 and clip larger values silently
#: (``TopKSamplingLayer``; the CPU reference's ``TOP_K_MAX``).
TOP_K_MAX = 1024
STOP, LENGTH = "stop", "length"


class FieldError(ValueError):
    """A client's field that cannot be served; the message starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")


def in_llm_terms(message: str) -> str:
    """``preprocessing``'s refusal in this model's names: it bounds every request at the first
    step that sees it and names its own inputs (``request_output_len: the prompt's ...``); the
    client sent this model's (``max_tokens``), so the message names those."""
    renamed = {theirs: ours for ours, (theirs, _) in FIELDS.items() if theirs != ours}
    field, sep, why = message.partition(": ")
    if sep and field in renamed:
        message = f"{renamed[field]}: {why}"
    for theirs, ours in renamed.items():
        if "_" in theirs:  # an input's name, never a word of the prose (as "prompt" is)
            message = re.sub(rf"\b{theirs}\b", ours, message)
    return message


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _scalar(request: object, name: str) -> object:
    """The single value of an optional ``[1]`` input, or None when the client left it out."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise FieldError(name, f"send one value (got {values.size})")
    return values[0]


def _words(request: object, name: str) -> list[str]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    return [_text(value) for value in tensor.as_numpy().reshape(-1)]


def word_list(words: list[tuple[int, ...]]) -> np.ndarray:
    """FasterTransformer's ``[1, 2, L]`` word list: the ids, then each word's end offset, -1
    padded; ``[[0], [-1]]`` (no word) for an empty list (``preprocessing``'s ``EMPTY_WORDS``)."""
    if not words:
        return np.array([[[0], [-1]]], dtype=np.int32)
    ids = [token for word in words for token in word]
    offsets = np.cumsum([len(word) for word in words]).tolist()
    offsets += [-1] * (len(ids) - len(offsets))
    return np.array([[ids, offsets]], dtype=np.int32)


def held_back(sequence: list[int], generated: int, stop_words: list[tuple[int, ...]]) -> int:
    """How many of the last ``generated`` tokens of ``sequence`` may still turn out to start a
    stop word (its proper prefix ends the sequence), so are not shown yet."""
    most = 0
    for word in stop_words:
        for size in range(min(len(word) - 1, len(sequence)), 0, -1):
            if tuple(sequence[-size:]) == word[:size]:
                most = max(most, size)
                break
    return min(most, generated)


def ending_stop_word(sequence: list[int], stop_words: list[tuple[int, ...]]) -> int:
    """The length of the longest stop word ``sequence`` ends with (0: none). FasterTransformer
    matches a stop word against the row's whole buffer, prompt included
    (``stop_words_criterion``)."""
    ends = [len(word) for word in stop_words if tuple(sequence[-len(word) :]) == word]
    return max(ends, default=0)


class Request:
    """One client request, checked: what ``preprocessing`` gets and what is done around it."""

    def __init__(self, request: object, tokenizer: object, *, can_stream: bool) -> None:
        prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
        if prompt.size != 1:
            raise FieldError("text_input", f"send one prompt per request (got {prompt.size})")
        self.prompt = _text(prompt.reshape(-1)[0])
        if not self.prompt:
            raise FieldError("text_input", "the prompt is empty: send at least one character")
        max_tokens = int(_scalar(request, "max_tokens"))
        if max_tokens < 1:
            raise FieldError("max_tokens", f"must be at least 1 (got {max_tokens})")
        self.max_tokens = max_tokens
        stream = _scalar(request, "stream")
        self.stream = bool(stream) if stream is not None else False
        if self.stream and not can_stream:
            raise FieldError(
                "stream",
                "this repository generates each completion in one piece (its "
                "fastertransformer model is not decoupled); send stream false, or publish the "
                "repository with model-loader run --streaming",
            )
        exclude = _scalar(request, "exclude_input_in_output")
        self.exclude_input = bool(exclude) if exclude is not None else self.stream
        self.client = {
            "prompt": np.array([[self.prompt.encode("utf-8")]], dtype=np.object_),
            "request_output_len": np.array([[max_tokens]], dtype=np.uint32),
        }
        self._sampling(request)
        self.stop_words = self._tokenized(request, "stop_words", tokenizer)
        self.bad_words = self._tokenized(request, "bad_words", tokenizer)
        for word, ids in zip(_words(request, "bad_words"), self.bad_words, strict=True):
            if ids[-1] == 0:
                raise FieldError(
                    "bad_words",
                    f"{word!r} ends in token id 0, which FasterTransformer never bans "
                    "(ban_bad_words); leave it out",
                )

    def _sampling(self, request: object) -> None:
        values = {name: _scalar(request, name) for name in FIELDS if name not in ("text_input",)}
        values.pop("max_tokens")
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = values[name]
            if value is not None and not math.isfinite(float(value)):
                raise FieldError(name, f"must be a finite number (got {float(value)})")
        temperature, top_k = values["temperature"], values["top_k"]
        if temperature is not None and float(temperature) < 0:
            raise FieldError("temperature", f"must be 0 (greedy) or more (got {temperature})")
        if top_k is not None and not 0 <= int(top_k) <= TOP_K_MAX:
            raise FieldError(
                "top_k",
                f"must be between 0 (no limit) and {TOP_K_MAX}, FasterTransformer's top-k "
                f"limit (got {int(top_k)})",
            )
        top_p = values["top_p"]
        if top_p is not None and not 0 <= float(top_p) <= 1:
            raise FieldError("top_p", f"must be between 0 and 1 (got {float(top_p)})")
        penalty = values["repetition_penalty"]
        if penalty is not None and not float(penalty) > 0:
            raise FieldError(
                "repetition_penalty", f"must be more than 0; 1 is none (got {float(penalty)})"
            )
        if temperature is not None and float(temperature) == 0:
            # Greedy: FasterTransformer's top-1. The argmax depends on the repetition penalty
            # only (temperature scales every logit alike; top-p keeps the most probable id).
            values = {"top_k": np.uint32(1), "repetition_penalty": penalty, "seed": values["seed"]}
        for name, value in values.items():
            if value is not None:
                target, dtype = FIELDS[name]
                self.client[target] = np.array([[value]], dtype=dtype)

    @staticmethod
    def _tokenized(request: object, name: str, tokenizer: object) -> list[tuple[int, ...]]:
        words = _words(request, name)
        if any(not word for word in words):
            raise FieldError(name, "holds an empty string; send words of at least one character")
        return [tuple(enc.ids) for enc in tokenizer.encode_batch(words)] if words else []


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError(
                f"model {args['model_name']} needs model_transaction_policy "
                "{ decoupled: true }; publish the repository again with model-loader run"
            )
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.can_stream = parameters.get("streaming") == "true"
        self.max_model_len = (
            int(parameters["max_model_len"]) if "max_model_len" in parameters else None
        )
        self.tokenizer = load_tokenizer(Path(__file__).parent / TOKENIZER_DIR)
        self.logger = pb_utils.Logger
        self._requests = RequestThreads(self._serve, name="llm", quiet=(FieldError,))

    def execute(self, requests: list) -> None:
        self._requests.start(requests)
        return None

    def _serve(self, request: object, sender: object) -> None:
        self._generate(Request(request, self.tokenizer, can_stream=self.can_stream), sender)

    def _generate(self, req: Request, sender: object) -> None:
        preprocessed = bls_request(PREPROCESSING, req.client, FT_INPUTS).exec()
        if preprocessed.has_error():  # a bound refused the request: the client's field named
            field, _, why = in_llm_terms(preprocessed.error().message()).partition(": ")
            raise FieldError(field, why) if why else StepError(field)
        ft_inputs = outputs_of(preprocessed, FT_INPUTS, PREPROCESSING)
        prompt_tokens = int(ft_inputs["input_lengths"].reshape(-1)[0])
        if self.max_model_len is not None and prompt_tokens + req.max_tokens > self.max_model_len:
            raise FieldError(
                "max_tokens",
                f"the prompt's {prompt_tokens} tokens and max_tokens {req.max_tokens} exceed the "
                f"model's context of {self.max_model_len} tokens (max_model_len); ask for at "
                f"most {max(self.max_model_len - prompt_tokens, 0)} tokens or send a shorter prompt",
            )
        ft_inputs["stop_words_list"] = word_list(req.stop_words)
        ft_inputs["bad_words_list"] = word_list(req.bad_words)
        fields = {name: ft_inputs[name] for name in REQUEST_FIELDS}
        end_id = int(ft_inputs["end_id"].reshape(-1)[0])
        answer = Answer(req, self.tokenizer, prompt_tokens, end_id)
        if not self.can_stream:
            snapshot = outputs_of(
                send(FASTERTRANSFORMER, ft_inputs, FT_RESULTS),
                FT_RESULTS,
                FASTERTRANSFORMER,
            )
            answer.update(self._postprocess(snapshot, fields))
            sender.send(
                answer.response(final=True), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            )
            return
        last, cancelled = None, False
        for response in bls_request(FASTERTRANSFORMER, ft_inputs, FT_RESULTS).exec(decoupled=True):
            checked(response)
            if cancelled or not response.output_tensors():
                continue  # an empty final response, or a stream nobody listens to any more
            if sender_cancelled(sender):
                cancelled = True  # let the generation end; it cannot be called back
                continue
            last = outputs_of(response, FT_RESULTS, FASTERTRANSFORMER)
            if not req.stream:
                continue  # one answer, from the last snapshot
            if answer.update(self._postprocess(last, fields)):
                increment = answer.response(final=False)
                if increment is not None:
                    sender.send(increment)
        if cancelled:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if last is None:
            raise StepError(f"{FASTERTRANSFORMER} ended the stream without a result")
        if not req.stream:
            answer.update(self._postprocess(last, fields))
        sender.send(
            answer.response(final=True), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    @staticmethod
    def _postprocess(snapshot: dict[str, np.ndarray], fields: dict[str, np.ndarray]) -> dict:
        response = send(POSTPROCESSING, {**snapshot, **fields}, ANSWER)
        return outputs_of(response, ANSWER, POSTPROCESSING)

    def finalize(self) -> None:
        self._requests.join()


class Answer:
    """One request's answer so far: its tokens, the text already sent, and the responses."""

    def __init__(self, req: Request, tokenizer: object, prompt_tokens: int, end_id: int) -> None:
        self.req, self.tokenizer = req, tokenizer
        self.prompt_tokens, self.end_id = prompt_tokens, end_id
        self.sequence: list[int] = []
        self.cum_log_probs = float("nan")
        self.sent = ""
        self.responses = 0

    def update(self, answer: dict[str, np.ndarray]) -> bool:
        """Take ``postprocessing``'s answer; False when it adds no token for this request
        (FasterTransformer calls back every request of its batch at every step)."""
        length = int(answer["sequence_length"].reshape(-1)[0])
        sequence = answer["output_ids"].reshape(-1)[:length].tolist()
        if self.sequence and len(sequence) == len(self.sequence):
            return False
        self.sequence = sequence
        self.cum_log_probs = float(answer["cum_log_probs"].reshape(-1)[0])
        return True

    def _finish(self) -> tuple[list[int], str]:
        """The generated tokens to show and the finish reason, once generation ended."""
        generated = self.sequence[self.prompt_tokens :]
        if generated and generated[-1] == self.end_id:
            return generated[:-1], STOP
        stop = ending_stop_word(self.sequence, self.req.stop_words)
        if stop:
            return generated[: max(len(generated) - stop, 0)], STOP
        return generated, LENGTH

    def response(self, *, final: bool) -> object | None:
        """The response to send now: the text not sent yet (None while streaming when there is
        none), the finish reason (``""`` until the last response) and the counts."""
        generated = self.sequence[self.prompt_tokens :]
        if final:
            shown, reason = self._finish()
        else:
            if generated and generated[-1] == self.end_id:
                generated = generated[:-1]
            keep = len(generated) - held_back(self.sequence, len(generated), self.req.stop_words)
            shown, reason = generated[:keep], ""
        text = self.tokenizer.decode_batch([shown], skip_special_tokens=True)[0]
        if not final:
            text = text.rstrip(REPLACEMENT)
        # Until the end, hold back text that does not extend what was sent.
        new = text[len(self.sent) :] if final or text.startswith(self.sent) else ""
        if not final and not new:
            return None
        self.sent += new
        if not self.req.exclude_input and self.responses == 0:
            new = self.req.prompt + new
        self.responses += 1
        counts = len(self.sequence) - self.prompt_tokens
        tensors = [
            pb_utils.Tensor("text_output", np.array([[new.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.array([[reason.encode()]], dtype=np.object_)),
            pb_utils.Tensor("num_input_tokens", np.array([[self.prompt_tokens]], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([[counts]], dtype=np.int32)),
            pb_utils.Tensor("cum_log_probs", np.array([[self.cum_log_probs]], dtype=np.float32)),
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)
