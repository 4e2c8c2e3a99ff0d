"""The serving experiment of our production merge request, on this machine's CPU Triton.

``make bench-serving`` runs it: the demo's small CodeGen checkpoint
(:func:`loader.demo.checkpoint.build_demo_checkpoint`) is published by the loader with the CPU
reference backend (``model-loader run --backend python``); variants with instance count 1 and 2
and dynamic batching off and on (the chart's preferred batch sizes and queue delay) are measured
by :func:`loader.bench.tune.tune` at concurrency 1 to 16 with two workloads: the production
request and a realistic mix of prompt lengths, with start and end ids inside the demo model's
vocabulary (``bench/demo/test.json``, ``bench/demo/mixed.json``: the repository's bounds refuse
CodeGen's 50256 there). The
report (tables, CSV, PNG, summary) goes to the output directory; the summary names the best
configuration per workload, the gain of each over the naive one (I=1, no batching; best stable
level against best stable level), the unstable levels, and the values the chart should
default to, with the command, the machine and the load it ran under. ``README.md`` is written
last, from those files (:mod:`loader.bench.serving_readme`), with Triton's own count of the
batches each level ran (:mod:`loader.bench.compare` reads them around every level).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

from loader.bench.compare import Target
from loader.bench.machine import LoadWatch
from loader.bench.perf_analyzer import PerfAnalyzerOptions
from loader.bench.report import Report, gain_text
from loader.bench.results import Measurement
from loader.bench.serving_readme import readme_from_directory
from loader.bench.settings import SweepSettings
from loader.bench.tune import TuneResult, plan_variants, tune, values_snippet

log = logging.getLogger(__name__)

MODEL_NAME = "codegen"
#: Concurrency 1 to 16 (perf_analyzer's START:END:STEP, END included).
CONCURRENCY_RANGE = "1:16:5"
INSTANCE_COUNTS = (1, 2)
#: The chart's defaults for dynamic batching (charts/model-triton/values.yaml).
PREFERRED_BATCH_SIZES = (4, 8)
MAX_QUEUE_DELAY_US = 100
#: How the experiment measures where the command line leaves the defaults. Windows of a fixed
#: number of requests keep the p95 of slow levels (a few requests a second) meaningful. The
#: stability test stays on, at 25 % instead of perf_analyzer's 10 %: our 2-core machines are
#: shared with other work, and at 10 % almost no level settles there. A level that misses it is
#: measured once more with windows twice as long, then reported as unstable (never chosen).
MEASUREMENT_DEFAULTS = PerfAnalyzerOptions(
    measurement_mode="count_windows",
    measurement_request_count=16,
    stability_percentage=25.0,
    widenings=1,
)
BASELINE = "i1-batching-off"
#: The variant the chart ships (charts/model-triton/values.yaml: triton.instanceCount and
#: triton.dynamicBatching.enabled; a test keeps the two in step).
CHART_DEFAULT = "i1-batching-on"
#: Rounds over all configurations; each level reports its median round, and a choice or a gain
#: is called certain only when every round agrees (so at least two are needed).
ROUNDS = 3
#: The cap on the whole run (README: `make bench-serving` answers within 15 minutes): no level
#: starts after it, and the summary says what was left unmeasured.
MAX_MINUTES = 13.0


def publish_demo_repository(work_dir: Path) -> Path:
    """The demo checkpoint, published for the CPU reference backend (built or reused)."""
    from loader.demo.checkpoint import build_demo_checkpoint, describe
    from loader.parallel import Parallelism
    from loader.repository.key import ServingSettings
    from loader.run import RunRequest, run

    checkpoint = build_demo_checkpoint(work_dir / "demo-checkpoint")
    result = run(
        RunRequest(
            source=str(checkpoint.resolve()),
            repository=(work_dir / "models").resolve(),
            model_name=MODEL_NAME,
            # The recipe digest is the checkpoint's revision: a rebuilt checkpoint (another
            # recipe) gets a new key instead of the copy published from the old one.
            revision=f"demo-{describe(checkpoint)['digest']}",
            parallelism=Parallelism(tp=1, pp=1, instance_count=1),
            settings=ServingSettings(backend="python", dynamic_batching=False),
        )
    )
    return result.path


def _model_note(work_dir: Path) -> str:
    from loader.demo.checkpoint import describe

    recipe = describe(work_dir / "demo-checkpoint").get("recipe", {})
    return (
        f"demo CodeGen checkpoint (n_layer={recipe.get('n_layer')}, "
        f"n_embd={recipe.get('n_embd')}, vocab={recipe.get('vocab_size')}), fp32, "
        "CPU reference backend (Triton Python backend), T=1, P=1"
    )


def _measurement_note(settings: SweepSettings, concurrency_range: str) -> str:
    options = dataclasses.asdict(settings.options)
    shown = ", ".join(
        f"{k}={v}"
        for k, v in options.items()
        if v not in (None, (), False) and k not in ("input_data", "timeout_s")
    )
    return (
        f"{shown}, concurrency {concurrency_range}, p95 latency, {settings.rounds} round(s) "
        "(each level: the median-throughput round among the stable ones)"
    )


def _shown(path: Path) -> str:
    """A request file as the report names it: ``bench/...`` when it is in the checkout's bench."""
    parts = path.parts
    return (
        "/".join(parts[len(parts) - 1 - parts[::-1].index("bench") :])
        if "bench" in parts
        else str(path)
    )


def run_experiment(
    work_dir: Path,
    settings: SweepSettings,
    *,
    concurrency_range: str = CONCURRENCY_RANGE,
    command: str = "",
    on_start: Callable[[Target, str], None] | None = None,
    on_measurement: Callable[[Target, Measurement], None] | None = None,
    on_partial: Callable[[Report], None] | None = None,
) -> Report:
    """Publish the demo model, tune its variants under ``settings``; the report to write
    (``on_partial`` gets the report so far after every level). ``command`` is the command
    line that started the run, for the summary and the README."""
    work_dir = Path(work_dir) / "serving-experiment"
    started = time.monotonic()
    watch = LoadWatch()
    repository = publish_demo_repository(work_dir)
    load_at_start: dict[str, list[float]] = {}

    def starting(target: Target, workload: str) -> None:
        load_at_start.setdefault(target.label, []).append(os.getloadavg()[0])
        if on_start is not None:
            on_start(target, workload)

    def report(result: TuneResult, *, final: bool) -> Report:
        notes: dict[str, str] = {"command": command} if command else {}
        notes |= {
            "model": _model_note(work_dir),
            "requests": "; ".join(f"{w.name}: {_shown(w.path)}" for w in settings.workloads),
            "measurement": _measurement_note(settings, concurrency_range),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}",
            "load average (1 min) at the start of each sweep": "; ".join(
                f"{k} {' '.join(f'{v:.1f}' for v in values)}" for k, values in load_at_start.items()
            )
            + f"; now {os.getloadavg()[0]:.1f}",
            "load average (1 min) of the whole run": f"{watch.before:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end",
            "duration": f"{time.monotonic() - started:.0f} s",
        }
        for sweep in result.sweeps:
            base = next(
                (s for s in result.sweeps if s.label == BASELINE and s.workload == sweep.workload),
                None,
            )
            text = (
                None
                if base is None or base is sweep
                else gain_text(sweep, base, result.by_round, max_p95_ms=settings.max_p95_ms)
            )
            if text is not None:
                notes[f"{sweep.name}"] = text
        choice = result.choice.variant.label if result.choice is not None else "none"
        notes["chart default (fewest instances within 5% of the best on every workload)"] = (
            f"{choice}; {result.verdict}"
        )
        if result.certain and choice != CHART_DEFAULT:
            notes["against the chart"] = (
                f"the chart ships {CHART_DEFAULT}; this run, on this machine, chose {choice}"
            )
        elif result.certain:
            notes["against the chart"] = f"the chart ships {CHART_DEFAULT}, the choice here too"
        values = ""
        if result.certain:
            values = values_snippet(
                result.choice, max_p95_ms=settings.max_p95_ms, measured_by="make bench-serving"
            )
        return Report(
            sweeps=result.sweeps,
            title="Serving experiment: demo CodeGen on the CPU Triton (Python backend)",
            baseline=BASELINE,
            notes=notes,
            values=values,
            by_round=result.by_round,
            status=_status(result, final=final),
            request_files=settings.request_files(),
            readme=readme_from_directory,
        )

    planned = plan_variants(
        INSTANCE_COUNTS,
        preferred_batch_sizes=PREFERRED_BATCH_SIZES,
        max_queue_delay_us=MAX_QUEUE_DELAY_US,
    )
    result = tune(
        repository,
        dataclasses.replace(settings, model=MODEL_NAME),
        work_dir=work_dir / "variants",
        planned=planned,
        on_start=starting,
        on_measurement=on_measurement,
        on_partial=None if on_partial is None else lambda r: on_partial(report(r, final=False)),
    )
    return report(result, final=True)


def _status(result: TuneResult, *, final: bool) -> str:
    measured = sum(len(s.measurements) for r in result.by_round for s in r)
    if not final:
        head = f"PARTIAL: {measured} measurements so far; the run goes on."
    elif not result.complete:
        head = f"CUT SHORT by the time cap after {measured} measurements."
    else:
        head = f"Complete: {measured} measurements in {len(result.by_round)} round(s)."
    if not final:
        return f"{head}\nRecommendation: none yet."
    return f"{head}\nRecommendation: {result.verdict}" + (
        "" if result.certain else "; no values to paste: keep the chart's defaults."
    )
