"""How a run of the bench measures: one value object for every sweep of the run.

:class:`SweepSettings` carries what every configuration of a run is measured with (concurrency
levels, perf_analyzer's options, the request files, the protocol, rounds, latency budget), so
:func:`~loader.bench.compare.compare`, :func:`~loader.bench.tune.tune` and the serving
experiment take one argument instead of a dozen. A :class:`Workload` is one request file in
perf_analyzer's ``--input-data`` format; a run measures every configuration with each of them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loader import fs
from loader.bench.perf_analyzer import DEFAULT_STABILITY_PERCENTAGE, PerfAnalyzerOptions
from loader.errors import LoaderError

#: The request files shipped in the project's ``bench/`` directory.
BENCH_DIR = Path("bench")
#: The production request (one prompt, 32 output tokens).
PRODUCTION_REQUEST = "test.json"
#: Prompts of many lengths, as real traffic sends them (see bench/README.md).
MIXED_REQUESTS = "mixed.json"


@dataclass(frozen=True)
class Workload:
    """A request file; ``name`` labels its sweeps (the file's stem by default)."""

    path: Path
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", Path(self.path).stem)


@dataclass(frozen=True)
class RequestShape:
    """What a request file asks for: how many distinct requests, the prompt lengths (in
    characters: the tokens depend on the tokenizer) and the tokens each asks to generate."""

    requests: int
    prompt_chars: tuple[int, int]  # shortest, longest
    output_tokens: tuple[int, int]  # fewest, most

    @property
    def text(self) -> str:
        def span(pair: tuple[int, int]) -> str:
            return f"{pair[0]}" if pair[0] == pair[1] else f"{pair[0]}-{pair[1]}"

        kind = "1 request" if self.requests == 1 else f"{self.requests} requests"
        return (
            f"{kind}: prompt {span(self.prompt_chars)} characters, "
            f"{span(self.output_tokens)} output tokens"
        )


def request_shape(path: Path | str) -> RequestShape | None:
    """The :class:`RequestShape` of a perf_analyzer input-data file; None if it cannot be read
    (the bench has read it already: a plot is drawn without the shape rather than not at all)."""

    def first(value: object) -> object:
        values = value.get("content") if isinstance(value, dict) else value
        return values[0] if isinstance(values, list) and values else values

    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))["data"]
        prompts = [len(str(first(e["prompt"]))) for e in entries]
        outputs = [int(first(e["request_output_len"])) for e in entries]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    if not entries:
        return None
    return RequestShape(len(entries), (min(prompts), max(prompts)), (min(outputs), max(outputs)))


def find_request_file(name: str) -> Path:
    """``bench/<name>`` in the current directory, else in this source checkout."""
    here = BENCH_DIR / name
    if here.is_file():
        return here.resolve()
    checkout = Path(__file__).resolve().parents[2] / BENCH_DIR / name
    if checkout.is_file():
        return checkout
    raise LoaderError(
        f"the request file bench/{name} is not here (no {here.resolve()})",
        "Run from the project's root directory, or pass --input-data with a JSON file in "
        "perf_analyzer's format.",
    )


def workloads_from_paths(paths: Sequence[Path | str]) -> tuple[Workload, ...]:
    """One workload per file; a missing file or two files of the same name are user errors."""
    workloads = []
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise LoaderError(
                f"input data file {path} {fs.what_stands_at(path, 'a file')}",
                "Pass --input-data with JSON files in perf_analyzer's format (bench/test.json "
                "is the production request, bench/mixed.json a mix of prompt lengths).",
            )
        workloads.append(Workload(path.resolve()))
    names = [w.name for w in workloads]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise LoaderError(
            f"two request files share the name {', '.join(twice)}",
            "Give the request files different names: the name labels their results.",
        )
    return tuple(workloads)


@dataclass(frozen=True)
class SweepSettings:
    """Everything a run measures every configuration with.

    ``options`` are perf_analyzer's (its ``input_data`` is replaced per workload); ``model``
    is the model to measure (``None``: a repository's ensemble); ``rounds`` > 1 sweeps every
    configuration that many times, round after round, and reports each level's median round;
    ``max_p95_ms`` is the latency budget a winner must keep; ``max_seconds`` caps the run.
    """

    concurrencies: tuple[int, ...]
    workloads: tuple[Workload, ...]
    options: PerfAnalyzerOptions = field(default_factory=PerfAnalyzerOptions)
    model: str | None = None
    protocol: str = "http"
    perf_analyzer: str | Path | None = None
    rounds: int = 1
    max_p95_ms: float | None = None
    #: The run's time cap in seconds (no level starts after it); ``None``: no cap.
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if not self.concurrencies:
            raise LoaderError("no concurrency level to measure", "Pass --concurrency-range.")
        if not self.workloads:
            raise LoaderError("no request file to send", "Pass --input-data FILE.")
        if self.rounds < 1:
            raise LoaderError(
                f"--rounds must be at least 1, got {self.rounds}", "Pass --rounds 1 or more."
            )

    @property
    def agreement_percentage(self) -> float:
        """How far a level's rounds (and windows) may differ: the stability percentage."""
        value = self.options.stability_percentage
        return DEFAULT_STABILITY_PERCENTAGE if value is None else value

    def options_for(self, workload: Workload) -> PerfAnalyzerOptions:
        return dataclasses.replace(self.options, input_data=workload.path)

    def request_files(self) -> dict[str, Path]:
        """Each workload's request file by the label its sweeps carry."""
        return {self.workload_label(w): w.path for w in self.workloads}

    def workload_label(self, workload: Workload) -> str:
        """How a sweep names its workload: empty when the run has only one."""
        return workload.name if len(self.workloads) > 1 else ""
