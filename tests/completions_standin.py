"""A stand-in for the repositories' ``llm`` model, for the completions service's own tests.

It keeps the ``llm`` model's contract (inputs, outputs, decoupled streaming, the end of a
stream shown by ``finish_reason``, errors that start with the field's name, the
``max_model_len`` and ``served_model_name`` parameters) with a model whose every answer the
tests can predict and slow down: each token is a word of a fixed list, chosen from the prompt
and the position (greedy) or by a NumPy generator seeded with ``seed`` (sampling), and it
waits ``token_delay_s`` before each. Like FasterTransformer it stops at a stop word only when
its last tokens spell it exactly (the service also finds one inside a token). Like the
repositories' models it sees a cancelled request
only where python_backend has ``is_cancelled`` (r23.10 on); it appends one line per request to
``activity_log`` (how many tokens it generated, and whether it saw the cancellation), so a test
can tell what Triton did with a request the service closed.

The end-to-end tests run the service against the published tiny repository's real ``llm``
model; this one serves what needs a model the test controls (slow tokens, a known text).
"""

from __future__ import annotations

from pathlib import Path

MODEL_PY = r"""
import json
import threading
import time
import zlib

import numpy as np
import triton_python_backend_utils as pb_utils

WORDS = ["alpha", "beta", "gamma", "delta", "\n", "epsilon", "zeta", "eta", "theta", "\n"]


def _input(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)


def _cancelled(sender):
    is_cancelled = getattr(sender, "is_cancelled", None)
    return bool(is_cancelled()) if is_cancelled is not None else False


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.max_model_len = int(params["max_model_len"])
        self.delay = float(params["token_delay_s"])
        self.log = params["activity_log"]
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def _serve(self, request):
        sender = request.get_response_sender()
        try:
            self._generate(request, sender)
        except ValueError as exc:
            sender.send(
                pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def _generate(self, request, sender):
        prompt = _input(request, "text_input")[0].decode()
        max_tokens = int(_input(request, "max_tokens")[0])
        stream = bool(_input(request, "stream", [False])[0])
        stops = [s.decode() for s in _input(request, "stop_words", [])]
        top_k = _input(request, "top_k")
        top_p = _input(request, "top_p")
        seed = _input(request, "seed")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1 (got {max_tokens})")
        prompt_tokens = len(prompt.split()) or 1
        if prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: the prompt's {prompt_tokens} tokens and {max_tokens} more exceed "
                f"the context of {self.max_model_len}"
            )
        sampled = (top_k is None or int(top_k[0]) != 1) and top_p is not None
        rng = np.random.default_rng(int(seed[0]) if seed is not None else 0)
        base = zlib.crc32(prompt.encode())
        text, reason, made, cancelled, pieces = "", "length", 0, False, []
        for position in range(max_tokens):
            time.sleep(self.delay)
            if _cancelled(sender):
                cancelled = True
                break
            index = int(rng.integers(len(WORDS))) if sampled else (base + position) % len(WORDS)
            word = WORDS[index]
            piece = word if word == "\n" else " " + word
            text += piece
            pieces.append(piece)
            made += 1
            # Like FasterTransformer: a stop word ends the generation when the last tokens spell
            # it exactly, never in the middle of a token.
            if any("".join(pieces[-k:]) == s for s in stops for k in range(1, len(pieces) + 1)):
                reason = "stop"
            last = reason == "stop" or position == max_tokens - 1
            if stream:
                self._send(sender, piece, reason if last else "", prompt_tokens, made, last)
            if reason == "stop":
                break
        with self.lock, open(self.log, "a") as out:
            out.write(json.dumps({"prompt": prompt, "tokens": made, "cancelled": cancelled}) + "\n")
        if cancelled:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        elif not stream:
            self._send(sender, text, reason, prompt_tokens, made, True)

    def _send(self, sender, text, reason, prompt_tokens, made, last):
        outputs = [
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)),
            pb_utils.Tensor("num_input_tokens", np.array([prompt_tokens], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([made], dtype=np.int32)),
            pb_utils.Tensor("cum_log_probs", np.array([0.0], dtype=np.float32)),
        ]
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
        sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)
"""

CONFIG = """name: "llm"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true }},
  {{ name: "top_k" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "top_p" data_type: TYPE_FP32 dims: [ 1 ] optional: true }},
  {{ name: "repetition_penalty" data_type: TYPE_FP32 dims: [ 1 ] optional: true }},
  {{ name: "seed" data_type: TYPE_UINT64 dims: [ 1 ] optional: true }},
  {{ name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }},
  {{ name: "bad_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }}
]
output [
  {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }},
  {{ name: "finish_reason" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "num_input_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "num_output_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "cum_log_probs" data_type: TYPE_FP32 dims: [ 1 ] }}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "max_model_len" value: {{ string_value: "{max_model_len}" }} }}
parameters {{ key: "served_model_name" value: {{ string_value: "{name}" }} }}
parameters {{ key: "token_delay_s" value: {{ string_value: "{delay}" }} }}
parameters {{ key: "activity_log" value: {{ string_value: "{log}" }} }}
{extra}"""


def make_standin_repository(
    root: Path,
    *,
    name: str = "standin-7b",
    max_model_len: int = 64,
    token_delay_s: float = 0.0,
    infill_template: str | None = None,
) -> Path:
    """``root/llm`` with the stand-in; returns ``root``. The activity log is
    ``root / "activity.jsonl"``."""
    model = root / "llm"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(MODEL_PY)
    extra = ""
    if infill_template is not None:
        escaped = infill_template.replace("\\", "\\\\").replace('"', '\\"')
        extra = f'parameters {{ key: "infill_template" value: {{ string_value: "{escaped}" }} }}\n'
    (model / "config.pbtxt").write_text(
        CONFIG.format(
            name=name,
            max_model_len=max_model_len,
            delay=token_delay_s,
            log=root / "activity.jsonl",
            extra=extra,
        )
    )
    return root


def activity(root: Path) -> list[dict]:
    import json

    log = root / "activity.jsonl"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]
