"""The numbers a user may set, each with its default and the least value that works: one home
for both.

The library takes them as the defaults of typed parameters and checks a value with
:meth:`Limit.check` where it enters (:class:`~loader.run.RunRequest`, :func:`loader.sources.fetch`,
:func:`loader.repository.prune.prune`); the error names the setting in words. The command line
takes each flag's default and the help's "(default: ...)" from here, and names the flag in the
same error (:func:`loader.cli.limit_argument`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loader.errors import LoaderError


@dataclass(frozen=True)
class Limit:
    """A number a user may set: what it is, its default and the least value that works."""

    #: The setting in words, as a sentence's subject ("the retry deadline").
    what: str
    default: float | None
    least: float
    #: Appended to numbers (" s"), or "".
    unit: str = ""
    #: The least value itself is refused too ("more than 0 s").
    exclusive: bool = False
    #: What goes wrong below the least value, for the error.
    why: str = ""
    #: The largest value that works (None: no bound but finiteness).
    most: float | None = None

    @property
    def lower(self) -> str:
        return f"{'more than' if self.exclusive else 'at least'} {self.format(self.least)}"

    @property
    def bound(self) -> str:
        upper = "" if self.most is None else f" and at most {self.format(self.most)}"
        return self.lower + upper

    def format(self, value: float) -> str:
        return f"{value:g}{self.unit}"

    def ok(self, value: float | None) -> bool:
        """Whether ``value`` works (None: not set, the caller's own default applies). Only a
        finite number does: infinity would wait or retry forever, NaN passes no comparison."""
        if value is None:
            return True
        if not math.isfinite(value):
            return False
        if self.most is not None and value > self.most:
            return False
        return value > self.least or (value == self.least and not self.exclusive)

    def check(self, value: float | None) -> None:
        """Raise a :class:`SettingError` unless ``value`` works."""
        if not self.ok(value):
            raise SettingError(self, value)  # type: ignore[arg-type]


class SettingError(LoaderError):
    """A setting outside its :class:`Limit`. :meth:`says` words the error for another subject
    (the command line names its flag)."""

    def __init__(self, limit: Limit, value: float) -> None:
        self.limit = limit
        self.value = value
        default = (
            "" if limit.default is None else f" (the default is {limit.format(limit.default)})"
        )
        super().__init__(
            self.says(limit.what[0].upper() + limit.what[1:]),
            f"Set {limit.what} to {limit.bound}{default}.",
        )

    def says(self, subject: str) -> str:
        """The error's sentence with ``subject`` as its subject."""
        limit, value = self.limit, self.value
        if not math.isfinite(value):
            bound, why = f"a finite number {limit.bound}", ""
        elif limit.most is not None and value > limit.most:
            bound, why = f"at most {limit.format(limit.most)}", ""
        else:
            bound, why = limit.lower, f": {limit.why}" if limit.why else ""
        return f"{subject} must be {bound}, got {limit.format(value)}{why}."


#: The longest wait any setting may ask for: beyond it a number is a typo, and a Job that
#: retries or waits that long waits forever in effect.
WEEK_S = 7 * 24 * 3600.0

#: How long a failing source is retried (and one network read waited for).
RETRY_DEADLINE_S = Limit("the retry deadline", 300.0, 0.0, " s", exclusive=True, most=WEEK_S)
#: A publish lock without a heartbeat for this long is taken over by a waiting loader.
LOCK_EXPIRY_S = Limit(
    "the publish lock expiry",
    120.0,
    1.0,
    " s",
    why="a waiting loader would take over the lock of a loader that merely paused",
    most=WEEK_S,
)
#: How long a loader waits for another one publishing the same key.
LOCK_TIMEOUT_S = Limit("the publish lock timeout", 6 * 3600.0, 0.0, " s", most=WEEK_S)
#: How long ``serve`` waits for the local tritonserver to be ready.
STARTUP_TIMEOUT_S = Limit("the startup timeout", 120.0, 0.0, " s", exclusive=True, most=WEEK_S)
#: How long ``complete`` waits for each answer (the readiness checks', the model list's, the
#: completion's).
COMPLETION_TIMEOUT_S = Limit(
    "the completion timeout", 600.0, 0.0, " s", exclusive=True, most=WEEK_S
)
#: How far perf_analyzer's windows of a level may differ and still count as stable, in percent
#: of their mean (None: perf_analyzer's own, 10).
STABILITY_PERCENTAGE = Limit("the stability percentage", None, 0.0, "%", exclusive=True)
#: Requests ``bench --ttft`` sends per concurrency level (its default:
#: :data:`loader.bench.stream.DEFAULT_REQUESTS`).
REQUESTS_PER_LEVEL = Limit("the number of requests per level", None, 1)
#: How long ``bench --ttft`` goes on sending new requests at one concurrency level (its default:
#: :data:`loader.bench.stream.DEFAULT_MAX_SECONDS`).
SECONDS_PER_LEVEL = Limit(
    "the time per concurrency level", None, 0.0, " s", exclusive=True, most=WEEK_S
)
#: Published keys kept per model name by pruning.
PRUNE_KEEP = Limit("the number of keys kept per model name", 2, 1)
#: Parallel download and conversion workers (None: chosen per source).
WORKERS = Limit("the number of workers", None, 1)
#: The byte-range slice size large gs:// objects are split into, in MiB (one slice per download
#: worker is held in memory; one request each, and the unit a killed download resumes from).
SLICE_MIB = Limit("the slice size", 16, 1, " MiB")
#: The memory of one GPU, in GiB, that ``run`` and ``plan`` check a configuration against
#: (None: not checked). At most the chart's bound (``cluster.gpuMemoryGiB``), far beyond any
#: GPU made: a larger number is a typo.
GPU_MEMORY_GIB = Limit("the memory of one GPU", None, 0.0, " GiB", exclusive=True, most=1024.0)

#: Bounds of the deployment's counts, the chart's own (``values.schema.json``): a key the loader
#: publishes, or a plan it prints, is one the chart can install. Far beyond any node or model
#: deployed today; a larger number is a typo.
#: ``model.tensorParallelSize`` and ``model.pipelineParallelSize``.
PARALLEL_SIZE_MOST = 32
#: ``triton.instanceCount``: each FasterTransformer instance holds its own copy of the weights.
INSTANCE_COUNT_MOST = 16
#: ``cluster.gpusPerNode``.
GPUS_PER_NODE_MOST = 64
