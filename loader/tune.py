"""Find the instance count and dynamic-batching setting of a repository by measuring them.

:func:`tune` writes one variant of a published repository per combination of instance count
(1..k) and dynamic batching (off; on with the preferred batch sizes), serves each in turn with
the local CPU Triton, sweeps it with perf_analyzer (:mod:`loader.bench`), and picks the winner:
the highest throughput at any concurrency whose p95 latency fits the budget. Among results within
``tolerance`` of that throughput the one with fewer instances wins (each instance costs memory),
then the lower p95 latency. :func:`values_snippet` prints the winner as the lines to paste into
``values/<cluster>.yaml``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loader.bench import variants as variants_mod
from loader.bench.compare import Target, compare
from loader.bench.perf_analyzer import PerfAnalyzerOptions
from loader.bench.report import Winner
from loader.bench.results import Measurement, Sweep, format_number
from loader.bench.variants import Variant
from loader.errors import LoaderError

log = logging.getLogger(__name__)

#: Results within this fraction of the best throughput count as a tie.
DEFAULT_TOLERANCE = 0.05


def plan_variants(
    instance_counts: Sequence[int],
    *,
    preferred_batch_sizes: Sequence[int] = (),
    max_queue_delay_us: int = 100,
    batching: Sequence[bool] = (False, True),
) -> list[Variant]:
    """Every combination, fewest instances first, batching off before on."""
    if not instance_counts or any(i < 1 for i in instance_counts):
        raise LoaderError(
            f"instance counts must be 1 or more, got {list(instance_counts)}",
            "Pass --max-instances K (K >= 1) or --instance-counts 1 2 4.",
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
class TuneResult:
    sweeps: list[Sweep]
    variants: dict[str, Variant]  # by sweep label
    winner: Winner | None
    max_p95_ms: float | None

    @property
    def winning_variant(self) -> Variant | None:
        return None if self.winner is None else self.variants[self.winner.sweep.label]


def pick_winner(
    sweeps: Sequence[Sweep],
    variants: dict[str, Variant],
    *,
    max_p95_ms: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Winner | None:
    """Best throughput within the budget; near-ties go to fewer instances, then lower p95."""
    best = [Winner(s, m) for s in sweeps if (m := s.best(max_p95_ms=max_p95_ms)) is not None]
    if not best:
        return None
    top = max(w.measurement.throughput for w in best)
    close = [w for w in best if w.measurement.throughput >= top * (1.0 - tolerance)]
    return min(
        close,
        key=lambda w: (variants[w.sweep.label].instance_count, w.measurement.p95_us),
    )


def values_snippet(
    variant: Variant,
    measurement: Measurement,
    *,
    label: str,
    max_p95_ms: float | None,
    measured_by: str = "model-loader tune",
) -> str:
    """The lines for ``values/<cluster>.yaml`` (chart keys ``triton.instanceCount`` etc.)."""
    budget = f"p95 <= {max_p95_ms:g} ms" if max_p95_ms is not None else "no latency budget"
    lines = [
        f"# Measured by `{measured_by}` ({budget}): {label} served "
        f"{format_number(measurement.throughput)} infer/sec",
        f"# at concurrency {measurement.concurrency} with p95 latency {measurement.p95_ms:.1f} ms.",
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
    *,
    work_dir: Path,
    instance_counts: Sequence[int],
    concurrencies: list[int],
    options: PerfAnalyzerOptions,
    preferred_batch_sizes: Sequence[int] = (),
    max_queue_delay_us: int = 100,
    max_p95_ms: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    model: str | None = None,
    protocol: str = "http",
    perf_analyzer: str | Path | None = None,
    on_start: Callable[[Target], None] | None = None,
    on_measurement: Callable[[Target, Measurement], None] | None = None,
    rounds: int = 1,
) -> TuneResult:
    """Measure every variant of ``repository`` and pick the winner."""
    planned = plan_variants(
        instance_counts,
        preferred_batch_sizes=preferred_batch_sizes,
        max_queue_delay_us=max_queue_delay_us,
    )
    work_dir = Path(work_dir)
    targets = []
    for variant in planned:
        path = variants_mod.make_variant(repository, work_dir / variant.label, variant)
        targets.append(Target(label=variant.label, repository=path, settings=variant.settings()))
    sweeps = compare(
        targets,
        concurrencies=concurrencies,
        options=options,
        model=model,
        protocol=protocol,
        perf_analyzer=perf_analyzer,
        log_dir=work_dir / "logs",
        on_start=on_start,
        on_measurement=on_measurement,
        rounds=rounds,
    )
    by_label = {v.label: v for v in planned}
    winner = pick_winner(sweeps, by_label, max_p95_ms=max_p95_ms, tolerance=tolerance)
    if winner is None:
        log.warning("no configuration stays within p95 <= %s ms", max_p95_ms)
    return TuneResult(sweeps=sweeps, variants=by_label, winner=winner, max_p95_ms=max_p95_ms)
