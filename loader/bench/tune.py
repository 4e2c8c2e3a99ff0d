"""Find the instance count and dynamic-batching setting of a repository by measuring them.

:func:`tune` writes one variant of a published repository per combination of instance count
(1..k) and dynamic batching (off; on with the preferred batch sizes), serves each in turn with
the local CPU Triton, sweeps it with perf_analyzer with every workload of the
:class:`~loader.bench.settings.SweepSettings`, and picks the winner (:func:`pick_winner`).

Only stable measurements decide: a level whose windows or rounds did not agree is reported
(:attr:`TuneResult.unstable`) but never wins. The choice is *certain* only when every round,
taken alone, chooses the same variant (at least two rounds, and the run not cut short by its
time cap); otherwise :attr:`TuneResult.verdict` says plainly why it is uncertain and no values
are offered to paste. A variant's score is, over the workloads, the
lowest ratio of its best throughput within the latency budget to the best any variant reached
on that workload: the winner is never far from the best on any kind of traffic. Among scores
within ``tolerance`` of the top one, fewer instances win (each instance costs memory), then the
higher score. :func:`values_snippet` prints the winner as the lines to paste into
``values/<cluster>.yaml``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loader.bench import variants as variants_mod
from loader.bench.compare import Comparison, Target, check_drivable, compare
from loader.bench.report import Winner
from loader.bench.results import Measurement, Sweep, format_number
from loader.bench.settings import SweepSettings
from loader.bench.variants import Variant
from loader.errors import LoaderError
from loader.limits import INSTANCE_COUNT_MOST

log = logging.getLogger(__name__)

#: Scores within this fraction of the best count as a tie.
DEFAULT_TOLERANCE = 0.05


def plan_variants(
    instance_counts: Sequence[int],
    *,
    preferred_batch_sizes: Sequence[int] = (),
    max_queue_delay_us: int = 100,
    batching: Sequence[bool] = (False, True),
) -> list[Variant]:
    """Every combination, fewest instances first, batching off before on."""
    if not instance_counts or any(not 1 <= i <= INSTANCE_COUNT_MOST for i in instance_counts):
        raise LoaderError(
            f"instance counts must be from 1 to {INSTANCE_COUNT_MOST} (the chart's bound), got "
            f"{list(instance_counts)}",
            f"Pass --max-instances K (1 to {INSTANCE_COUNT_MOST}) or --instance-counts 1 2 4.",
        )
    return [
        Variant(
            instance_count=count,
            dynamic_batching=on,
            preferred_batch_sizes=tuple(preferred_batch_sizes) if on else (),
            max_queue_delay_us=max_queue_delay_us,
        )
        for count in sorted(set(instance_counts))
        for on in batching
    ]


@dataclass(frozen=True)
class Choice:
    """The winning variant, its score and its best stable level per workload."""

    variant: Variant
    score: float
    best: dict[str, Winner]  # by workload label ("" for a single workload)


@dataclass(frozen=True)
class TuneResult:
    sweeps: list[Sweep]
    variants: dict[str, Variant]  # by sweep label
    choice: Choice | None
    max_p95_ms: float | None
    #: What each round, taken alone, chose (``None``: nothing stable in that round).
    round_choices: tuple[str | None, ...] = ()
    #: Whether the time cap cut the run short.
    complete: bool = True
    #: Every round as measured.
    by_round: tuple[tuple[Sweep, ...], ...] = ()

    @property
    def unstable(self) -> list[tuple[Sweep, Measurement]]:
        """Every level no round measured stably: reported, never chosen."""
        return [(s, m) for s in self.sweeps for m in s.unstable]

    @property
    def certain(self) -> bool:
        return self.choice is not None and self.verdict.startswith("certain")

    @property
    def verdict(self) -> str:
        """``certain: ...`` or ``uncertain: ...``, with the reason in words."""
        return verdict(self.choice, self.round_choices, complete=self.complete)


def verdict(choice: Choice | None, round_choices: Sequence[str | None], *, complete: bool) -> str:
    """Whether a choice stands: every round chose it, at least two rounds, nothing cut short."""
    if choice is None:
        return "uncertain: no configuration has a stable level (nothing to choose from)"
    label = choice.variant.label
    if not complete:
        return (
            "uncertain: the time cap cut the run short, so not every configuration was "
            "measured as often (raise --max-minutes)"
        )
    if len(round_choices) < 2:
        return (
            f"uncertain: one round only, which cannot tell {label}'s lead from the machine's "
            "noise (pass --rounds 2 or more)"
        )
    agree = sum(1 for c in round_choices if c == label)
    if agree < len(round_choices):
        chosen = ", ".join(c or "none" for c in round_choices)
        return (
            f"uncertain: the rounds chose differently ({chosen}); the configurations are "
            "within the machine's noise of each other here"
        )
    return f"certain: each of the {len(round_choices)} rounds chose {label}"


def pick_winner(
    sweeps: Sequence[Sweep],
    variants: Mapping[str, Variant],
    *,
    max_p95_ms: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Choice | None:
    """The variant (``variants``: by sweep label) to use; see the module docstring."""
    best = {id(s): m for s in sweeps if (m := s.best(max_p95_ms=max_p95_ms)) is not None}
    top: dict[str, float] = {}
    for s in sweeps:
        if id(s) in best:
            top[s.workload] = max(top.get(s.workload, 0.0), best[id(s)].throughput)
    workloads = sorted({s.workload for s in sweeps})
    scores: dict[str, float] = {}
    winners: dict[str, dict[str, Winner]] = {}
    for label in dict.fromkeys(s.label for s in sweeps):
        own = {s.workload: s for s in sweeps if s.label == label}
        ratios = []
        for workload in workloads:
            sweep = own.get(workload)
            if sweep is None or id(sweep) not in best or top.get(workload, 0.0) <= 0:
                ratios.append(0.0)
                continue
            ratios.append(best[id(sweep)].throughput / top[workload])
            winners.setdefault(label, {})[workload] = Winner(sweep, best[id(sweep)])
        scores[label] = min(ratios, default=0.0)
    candidates = {label: score for label, score in scores.items() if score > 0}
    if not candidates:
        return None
    top_score = max(candidates.values())
    close = [label for label, score in candidates.items() if score >= top_score * (1 - tolerance)]
    label = min(close, key=lambda x: (variants[x].instance_count, -candidates[x]))
    return Choice(variant=variants[label], score=candidates[label], best=winners[label])


def values_snippet(
    choice: Choice,
    *,
    max_p95_ms: float | None,
    measured_by: str = "model-loader tune",
) -> str:
    """The lines for ``values/<cluster>.yaml`` (chart keys ``triton.instanceCount`` etc.)."""
    budget = f"p95 <= {max_p95_ms:g} ms" if max_p95_ms is not None else "no latency budget"
    variant = choice.variant
    lines = [f"# Measured by `{measured_by}` ({budget}): {variant.label} served"]
    for workload, winner in choice.best.items():
        m = winner.measurement
        requests = f" with {workload}" if workload else ""
        lines.append(
            f"#   {format_number(m.throughput)} infer/sec{requests} at concurrency "
            f"{m.concurrency}, p95 latency {m.p95_ms:.1f} ms"
        )
    lines += [
        "triton:",
        f"  instanceCount: {variant.instance_count}",
        "  dynamicBatching:",
        f"    enabled: {'true' if variant.dynamic_batching else 'false'}",
    ]
    if variant.dynamic_batching:
        sizes = ", ".join(map(str, variant.preferred_batch_sizes))
        lines.append(f"    preferredBatchSize: [{sizes}]")
        lines.append(f"    maxQueueDelayMicroseconds: {variant.max_queue_delay_us}")
    return "\n".join(lines) + "\n"


def tune(
    repository: Path,
    settings: SweepSettings,
    *,
    work_dir: Path,
    planned: Sequence[Variant],
    tolerance: float = DEFAULT_TOLERANCE,
    on_start: Callable[[Target, str], None] | None = None,
    on_measurement: Callable[[Target, Measurement], None] | None = None,
    on_partial: Callable[[TuneResult], None] | None = None,
) -> TuneResult:
    """Measure every ``planned`` variant of ``repository`` (see :func:`plan_variants`) and pick
    the winner."""
    work_dir = Path(work_dir)
    configs = variants_mod.read_configs(repository)
    name = settings.model or variants_mod.ensemble_name(configs)
    check_drivable(str(repository), configs.get(name), name, settings)  # before any copy
    targets = []
    for variant in planned:
        path = variants_mod.make_variant(repository, work_dir / variant.label, variant)
        targets.append(Target(label=variant.label, repository=path, settings=variant.settings()))
    by_label = {v.label: v for v in planned}

    def partial(comparison: Comparison) -> None:
        if on_partial is not None:
            on_partial(_result(comparison, by_label, settings, tolerance))

    comparison = compare(
        targets,
        settings,
        log_dir=work_dir / "logs",
        on_start=on_start,
        on_measurement=on_measurement,
        on_partial=partial,
    )
    result = _result(comparison, by_label, settings, tolerance)
    if result.choice is None:
        log.warning("no configuration has a stable level within p95 <= %s ms", settings.max_p95_ms)
    return result


def _result(
    comparison: Comparison,
    by_label: Mapping[str, Variant],
    settings: SweepSettings,
    tolerance: float,
) -> TuneResult:
    budget = settings.max_p95_ms
    choice = pick_winner(comparison.sweeps, by_label, max_p95_ms=budget, tolerance=tolerance)
    rounds = tuple(
        None if (c := pick_winner(r, by_label, max_p95_ms=budget, tolerance=tolerance)) is None
        else c.variant.label
        for r in comparison.by_round
    )  # fmt: skip
    return TuneResult(
        sweeps=comparison.sweeps,
        variants=dict(by_label),
        choice=choice,
        max_p95_ms=budget,
        round_choices=rounds,
        complete=comparison.complete,
        by_round=tuple(tuple(r) for r in comparison.by_round),
    )
