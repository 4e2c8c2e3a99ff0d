"""The bounds every inference request is held to, derived from the model and the plan, in one place.

``preprocessing`` is the first step that sees a client's request (the ensemble's first step; the
streaming model and any model calling it through BLS go through it too). It refuses, per
request and before any work, what these bounds exclude, naming the field and the limit; the
numbers reach it as parameters of its ``config.pbtxt`` (:meth:`RequestBounds.parameters`), so
a repository states its own limits:

* ``max_sequence_length``: prompt tokens + ``request_output_len`` per row, at most the model's
  context, ``n_positions`` (``config.ini``'s ``max_pos_seq_len``). The GPU-memory plan sizes the
  KV cache and the context buffers of every instance for ``max_batch_size`` rows of exactly this
  length (:func:`loader.plan.estimate_memory`), so a request within it fits what was planned.
* ``vocab_size``: ``start_id`` and ``end_id`` below it (FasterTransformer looks a finished row's
  ``end_id`` up in the embedding table: an id beyond it reads past the table on the GPU).
* ``max_batch_size``: rows of one request, enforced by Triton itself from the models'
  ``max_batch_size`` (INVALID_ARGUMENT before any model runs).
* the prompt's bytes: at most ``max_sequence_length`` times the longest token of the
  tokenizer's vocabulary in bytes (times 4 when the tokenizer normalises its input), checked
  before the prompt is tokenised. A longer prompt has more tokens than the context holds, so no
  valid prompt is refused, and a megabyte prompt is refused without being tokenised.

What no bound here can cover (SECURITY.md): the size of a message Triton 23.05 receives before
any model sees it (gRPC's limit is fixed at 2 GiB, ``MAX_GRPC_MESSAGE_SIZE`` in
``src/common.h``; HTTP has no switch), and a caller of the step model ``fastertransformer``
itself, which skips ``preprocessing``.
"""

from __future__ import annotations

from dataclasses import dataclass

from loader.errors import RepositoryError
from loader.formats.fastertransformer import FTConfig


@dataclass(frozen=True)
class RequestBounds:
    """What one request may ask for (see the module docstring)."""

    max_sequence_length: int
    vocab_size: int
    max_batch_size: int

    def __post_init__(self) -> None:
        for name in ("max_sequence_length", "vocab_size", "max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RepositoryError(
                    f"request bound {name} must be a positive integer, got {value!r}",
                    "Check the checkpoint's n_positions and vocab_size and --max-batch-size.",
                )

    @classmethod
    def for_model(cls, config: FTConfig, *, max_batch_size: int) -> RequestBounds:
        """The bounds of a repository serving ``config`` (``config.ini``'s numbers)."""
        return cls(
            max_sequence_length=config.max_pos_seq_len,
            vocab_size=config.vocab_size,
            max_batch_size=max_batch_size,
        )

    def parameters(self) -> dict[str, str]:
        """``preprocessing``'s ``config.pbtxt`` parameters (``max_batch_size`` is the config's
        own field, not a parameter)."""
        return {
            "max_sequence_length": str(self.max_sequence_length),
            "vocab_size": str(self.vocab_size),
        }
