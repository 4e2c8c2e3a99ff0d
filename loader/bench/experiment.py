"""The serving experiment of our production merge request, on this machine's CPU Triton.

``make bench-serving`` runs it: the demo's small CodeGen checkpoint
(:func:`loader.demo.checkpoint.build_demo_checkpoint`) is published by the loader with the CPU
reference backend (``model-loader run --backend python``); variants with instance count 1 and 2
and dynamic batching off and on (the chart's preferred batch sizes and queue delay) are served in
turn by the local Triton and swept with perf_analyzer at concurrency 1 to 16, sending the
production request (``bench/test.json``). The report (tables, CSV, PNG, summary) goes to the
output directory; the summary names the best configuration, its throughput ratio to the naive
one (I=1, no batching) at the highest concurrency, and the values the chart should default to.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import time
from pathlib import Path

from loader.bench import variants as variants_mod
from loader.bench.arguments import TablePrinter, options_from_args
from loader.bench.compare import Target, compare
from loader.bench.report import throughput_ratio
from loader.bench.results import Sweep
from loader.bench.sweep import parse_concurrency_range
from loader.tune import pick_winner, plan_variants, values_snippet

log = logging.getLogger(__name__)

MODEL_NAME = "codegen"
#: Concurrency 1 to 16 (perf_analyzer's START:END:STEP, END included).
CONCURRENCY_RANGE = "1:16:3"
INSTANCE_COUNTS = (1, 2)
#: The chart's defaults for dynamic batching (charts/model-triton/values.yaml).
PREFERRED_BATCH_SIZES = (4, 8)
MAX_QUEUE_DELAY_US = 100
#: Measurement settings of the experiment where the command line leaves perf_analyzer's own.
#: Windows of a fixed number of requests keep the p95 of slow levels (a few requests a second)
#: meaningful. Each level reports 3 windows (48 requests) together; the stability check is
#: relaxed to 100 % because our 2-core machines are shared with other work, whose load makes
#: tighter checks fail at every level (the summary records the load average per configuration).
MEASUREMENT_DEFAULTS = {
    "measurement_mode": "count_windows",
    "measurement_request_count": 16,
    "stability_percentage": 100.0,
    "max_trials": 6,
}
BASELINE = "i1-batching-off"
#: Rounds over all configurations; each level reports its median round.
ROUNDS = 5


def publish_demo_repository(work_dir: Path) -> Path:
    """The demo checkpoint, published for the CPU reference backend (built or reused)."""
    from loader.demo.checkpoint import build_demo_checkpoint
    from loader.parallel import Parallelism
    from loader.pipeline import RunRequest, run
    from loader.repository.key import ServingSettings

    checkpoint = build_demo_checkpoint(work_dir / "demo-checkpoint")
    result = run(
        RunRequest(
            source=str(checkpoint.resolve()),
            repository=(work_dir / "models").resolve(),
            model_name=MODEL_NAME,
            parallelism=Parallelism(tp=1, pp=1, instance_count=1),
            settings=ServingSettings(backend="python", dynamic_batching=False),
        )
    )
    return result.path


def _model_notes(work_dir: Path) -> dict[str, object]:
    from loader.demo.checkpoint import describe

    info = describe(work_dir / "demo-checkpoint")
    recipe = info.get("recipe", {})
    return {
        "model": (
            f"demo CodeGen checkpoint (n_layer={recipe.get('n_layer')}, "
            f"n_embd={recipe.get('n_embd')}, vocab={recipe.get('vocab_size')}), fp32, "
            "CPU reference backend (Triton Python backend), T=1, P=1"
        ),
    }


def run_from_args(args: argparse.Namespace, extra: tuple[str, ...]) -> tuple[list[Sweep], dict]:
    """``scripts/bench --serving-experiment``: the sweeps and the notes for the report."""
    for name, value in MEASUREMENT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    concurrency_range = args.concurrency_range or CONCURRENCY_RANGE
    args.rounds = args.rounds or ROUNDS
    options = options_from_args(args, extra_args=extra)
    concurrencies = parse_concurrency_range(concurrency_range)
    work_dir = Path(args.work_dir) / "serving-experiment"
    started = time.monotonic()
    repository = publish_demo_repository(work_dir)
    planned = plan_variants(
        INSTANCE_COUNTS,
        preferred_batch_sizes=PREFERRED_BATCH_SIZES,
        max_queue_delay_us=MAX_QUEUE_DELAY_US,
    )
    targets = [
        Target(
            label=v.label,
            repository=variants_mod.make_variant(repository, work_dir / "variants" / v.label, v),
            settings=v.settings(),
        )
        for v in planned
    ]
    printer = TablePrinter(rounds=args.rounds, per_round=len(targets))
    load_at_start: dict[str, list[float]] = {}

    def on_start(target: Target) -> None:
        load_at_start.setdefault(target.label, []).append(os.getloadavg()[0])
        printer.start(target)

    sweeps = compare(
        targets,
        concurrencies=concurrencies,
        options=options,
        model=MODEL_NAME,
        protocol=args.protocol or "http",
        perf_analyzer=args.perf_analyzer,
        log_dir=work_dir / "logs",
        on_start=on_start,
        on_measurement=printer.measurement,
        rounds=args.rounds,
    )

    by_label = {v.label: v for v in planned}
    notes: dict[str, object] = {
        "title": "Serving experiment: demo CodeGen on the CPU Triton (Python backend)",
        "baseline": BASELINE,
        **_model_notes(work_dir),
        "request": "bench/test.json (the production request: 32 output tokens)",
        "measurement": ", ".join(
            f"{k}={v}"
            for k, v in dataclasses.asdict(options).items()
            if v not in (None, (), False) and k not in ("input_data", "timeout_s")
        )
        + f", concurrency {concurrency_range}, p95 latency, {args.rounds} rounds (each level: "
        "the median-throughput round)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load average (1 min) at the start of each configuration, per round": "; ".join(
            f"{k} {' '.join(f'{v:.1f}' for v in values)}" for k, values in load_at_start.items()
        )
        + f"; at the end {os.getloadavg()[0]:.1f}",
        "duration": f"{time.monotonic() - started:.0f} s",
    }
    baseline = next(s for s in sweeps if s.label == BASELINE)
    for sweep in sweeps:
        ratio = throughput_ratio(sweep, baseline)
        if ratio is not None and sweep is not baseline:
            notes[f"{sweep.label} vs {BASELINE}"] = f"{ratio[1]:.2f}x at concurrency {ratio[0]}"
    winner = pick_winner(sweeps, by_label, max_p95_ms=args.max_p95_ms)
    if winner is not None:
        variant = by_label[winner.sweep.label]
        notes["chart default (fewest instances within 5% of the best)"] = winner.sweep.label
        notes["values"] = "\n" + values_snippet(
            variant,
            winner.measurement,
            label=winner.sweep.label,
            max_p95_ms=args.max_p95_ms,
            measured_by="make bench-serving",
        )
    return sweeps, notes
