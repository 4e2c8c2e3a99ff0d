"""Reports of one or more sweeps: the seed's tables, a CSV, a PNG plot and the winner.

* :func:`tables_text`: per configuration a heading, its settings as bullets and the table
  (``Concurrency: 11, throughput: 10.9983 infer/sec, latency 1029421 usec``).
* :func:`write_plot`: throughput against p95 latency, one line per configuration, points
  labelled with their concurrency (matplotlib's Agg canvas; no display needed).
* :func:`best_configuration`: the highest throughput any configuration reaches with a p95
  latency within the budget; :func:`peak_ratio`: its gain over a baseline (best stable level
  against best stable level).
* :func:`write_report`: all of the above into a directory, each file written atomically.
* :class:`TablePrinter`: the heading and table lines printed while a sweep runs.

Unstable levels (perf_analyzer's windows never agreed) appear everywhere, marked: ``(unstable)``
after their table line with perf_analyzer's words below the table, ``stable=no`` in the CSV,
hollow markers in the plot. They never make a configuration the best one.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from loader.bench.results import (
    TABLE_HEADER,
    Measurement,
    Sweep,
    format_line,
    format_number,
    format_table,
    sweeps_to_csv,
)

TABLES_FILE = "tables.txt"
CSV_FILE = "results.csv"
PLOT_FILE = "throughput_vs_p95_latency.png"
SUMMARY_FILE = "summary.txt"


def bullet(key: str, value: object) -> str:
    if isinstance(value, bool):
        value = "on" if value else "off"
    elif isinstance(value, list | tuple):
        value = ", ".join(map(str, value)) or "-"
    return f"• {key} = {value}"


def unstable_text(sweep: Sweep) -> str:
    """perf_analyzer's words for each unstable level of ``sweep`` (empty if none)."""
    return "".join(
        f"(unstable at concurrency {m.concurrency}: {m.note or 'no stable measurement'})\n"
        for m in sweep.unstable
    )


def table_text(sweep: Sweep, *, number: int | None = None) -> str:
    title = f"Benchmark {number}: {sweep.name}" if number is not None else sweep.name
    lines = [title, ""]
    lines.extend(bullet(k, v) for k, v in sweep.settings.items())
    if sweep.settings:
        lines.append("")
    return "\n".join(lines) + "\n" + format_table(sweep) + unstable_text(sweep)


def tables_text(sweeps: Sequence[Sweep]) -> str:
    return "\n".join(table_text(s, number=i) for i, s in enumerate(sweeps, start=1))


@dataclass(frozen=True)
class Report:
    """What a bench run hands to :func:`write_report` and prints: the sweeps, the plot's
    title, the configuration the summary compares against, notes for the summary (``key:
    value`` lines), the chart values to paste (may be empty) and files the run already wrote."""

    sweeps: list[Sweep]
    title: str = "Throughput vs. client p95 latency"
    baseline: str | None = None
    notes: Mapping[str, str] = field(default_factory=dict)
    values: str = ""
    files: Mapping[str, Path] = field(default_factory=dict)
    rounds: int = 1


@dataclass(frozen=True)
class Winner:
    sweep: Sweep
    measurement: Measurement


def best_configuration(
    sweeps: Sequence[Sweep], *, max_p95_ms: float | None = None
) -> Winner | None:
    """The configuration and level with the highest throughput within the p95 budget."""
    candidates = [Winner(s, m) for s in sweeps if (m := s.best(max_p95_ms=max_p95_ms)) is not None]
    return max(candidates, key=lambda w: w.measurement.throughput, default=None)


def peak_ratio(
    sweep: Sweep, baseline: Sweep, *, max_p95_ms: float | None = None
) -> tuple[Measurement, Measurement, float] | None:
    """Each one's best stable level within the budget and the ratio of their throughputs
    (``None`` when either has no such level): the capacity gain over ``baseline``."""
    top, base = sweep.best(max_p95_ms=max_p95_ms), baseline.best(max_p95_ms=max_p95_ms)
    if top is None or base is None or base.throughput <= 0:
        return None
    return top, base, top.throughput / base.throughput


def ratio_text(sweep: Sweep, baseline: Sweep, *, max_p95_ms: float | None = None) -> str | None:
    """``2.91x the best stable throughput of <baseline> (9.4 infer/sec at concurrency 6)``."""
    found = peak_ratio(sweep, baseline, max_p95_ms=max_p95_ms)
    if found is None:
        return None
    _, base, value = found
    return (
        f"{value:.2f}x the best stable throughput of {baseline.label} "
        f"({format_number(base.throughput)} infer/sec at concurrency {base.concurrency})"
    )


def _workload_summary(
    sweeps: Sequence[Sweep], *, budget: str, max_p95_ms: float | None, baseline: str | None
) -> list[str]:
    workload = sweeps[0].workload
    requests = f" with {workload}" if workload else ""
    winner = best_configuration(sweeps, max_p95_ms=max_p95_ms)
    if winner is None:
        return [f"No configuration has a stable level within {budget}{requests}."]
    m = winner.measurement
    lines = [
        f"Best configuration{requests} ({budget}): {winner.sweep.label}",
        f"  at concurrency {m.concurrency}: {format_number(m.throughput)} infer/sec, "
        f"p95 latency {m.p95_ms:.1f} ms",
    ]
    base = next((s for s in sweeps if s.label == baseline), None)
    if base is not None and base is not winner.sweep:
        text = ratio_text(winner.sweep, base, max_p95_ms=max_p95_ms)
        if text is not None:
            lines.append(f"  {text}")
    return lines


def summary_text(
    sweeps: Sequence[Sweep],
    *,
    max_p95_ms: float | None = None,
    baseline: str | None = None,
) -> str:
    """The best stable configuration per workload, its gain over ``baseline``, and every level
    that stayed unstable."""
    budget = f"p95 latency <= {max_p95_ms:g} ms" if max_p95_ms is not None else "no latency budget"
    by_workload: dict[str, list[Sweep]] = {}
    for sweep in sweeps:
        by_workload.setdefault(sweep.workload, []).append(sweep)
    lines: list[str] = []
    for group in by_workload.values():
        lines += _workload_summary(group, budget=budget, max_p95_ms=max_p95_ms, baseline=baseline)
    unstable = [(s, m) for s in sweeps for m in s.unstable]
    if unstable:
        lines.append(
            f"Unstable levels (reported, never chosen): {len(unstable)} of "
            f"{sum(len(s.measurements) for s in sweeps)}"
        )
        lines += [f"  {s.name} at concurrency {m.concurrency}: {m.note}" for s, m in unstable]
    return "\n".join(lines) + "\n"


def write_plot(
    sweeps: Sequence[Sweep],
    path: Path,
    *,
    title: str = "Throughput vs. client p95 latency",
    max_p95_ms: float | None = None,
) -> Path:
    """A PNG, one line per configuration in both panels.

    Left: throughput (inferences/s) against client p95 latency (ms), points labelled with their
    concurrency; the trade-off a latency budget (dashed) cuts. Right: throughput against
    concurrency, where batching and instance count show how far a configuration scales.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 5.5), dpi=100)
    FigureCanvasAgg(figure)
    by_latency, by_concurrency = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    latencies = []
    for sweep in sweeps:
        points = sweep.sorted()
        xs = [m.p95_ms for m in points]
        ys = [m.throughput for m in points]
        latencies.extend(xs)
        (line,) = by_latency.plot(xs, ys, marker="o", label=sweep.name)
        by_concurrency.plot(
            [m.concurrency for m in points],
            ys,
            marker="o",
            color=line.get_color(),
            label=sweep.name,
        )
        shaky = [m for m in points if not m.stable]
        if shaky:
            for axes, x in ((by_latency, "p95_ms"), (by_concurrency, "concurrency")):
                axes.scatter(
                    [getattr(m, x) for m in shaky],
                    [m.throughput for m in shaky],
                    s=90,
                    facecolors="white",
                    edgecolors=line.get_color(),
                    zorder=3,
                    label=f"{sweep.name}: unstable",
                )
        for m in points:
            by_latency.annotate(
                f"c{m.concurrency}" + ("" if m.stable else "?"),
                (m.p95_ms, m.throughput),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=line.get_color(),
            )
    if max_p95_ms is not None:
        by_latency.axvline(
            max_p95_ms,
            color="grey",
            linestyle="--",
            linewidth=1,
            label=f"p95 budget {max_p95_ms:g} ms",
        )
    if latencies and min(latencies) > 0 and max(latencies) / min(latencies) > 20:
        by_latency.set_xscale("log")
    by_latency.set_xlabel("client p95 latency (ms)")
    by_latency.set_ylabel("throughput (inferences/s)")
    by_latency.set_title("throughput vs. p95 latency (points: concurrency)", fontsize=10)
    by_concurrency.set_xlabel("concurrency (requests in flight)")
    by_concurrency.set_ylabel("throughput (inferences/s)")
    by_concurrency.set_title("throughput vs. concurrency", fontsize=10)
    for axes in (by_latency, by_concurrency):
        axes.set_ylim(bottom=0)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    return _atomic_write(path, lambda f: figure.savefig(f, format="png"), binary=True)


def _atomic_write(path: Path, write, *, binary: bool = False) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; results are for everyone
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> Path:
    return _atomic_write(path, lambda f: f.write(text))


def write_report(
    report: Report, output_dir: Path, *, max_p95_ms: float | None = None
) -> dict[str, Path]:
    """Write tables, CSV, plot and summary (with the notes and values) into ``output_dir``;
    their paths by kind."""
    output_dir = Path(output_dir)
    summary = summary_text(report.sweeps, max_p95_ms=max_p95_ms, baseline=report.baseline)
    if report.notes:
        summary += "\n" + "".join(f"{k}: {v}\n" for k, v in report.notes.items())
    if report.values:
        summary += "values:\n" + report.values
    return {
        "tables": write_text(output_dir / TABLES_FILE, tables_text(report.sweeps)),
        "csv": write_text(output_dir / CSV_FILE, sweeps_to_csv(report.sweeps)),
        "plot": write_plot(
            report.sweeps, output_dir / PLOT_FILE, title=report.title, max_p95_ms=max_p95_ms
        ),
        "summary": write_text(output_dir / SUMMARY_FILE, summary),
    }


class TablePrinter:
    """Prints a heading per configuration and the table lines as they are measured."""

    def __init__(
        self, stream: IO[str] | None = None, *, rounds: int = 1, per_round: int = 1
    ) -> None:
        self.stream = stream or sys.stdout
        self.count = 0
        self.rounds = rounds
        self.per_round = per_round

    def _print(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def start(self, label: str, settings: Mapping[str, object], workload: str = "") -> None:
        self.count += 1
        if self.count > 1:
            self._print()
        heading = f"Benchmark {self.count}: {label}" + (f" ({workload})" if workload else "")
        if self.rounds > 1:
            heading += f" (round {(self.count - 1) // self.per_round + 1} of {self.rounds})"
        self._print(heading)
        if settings:
            self._print()
            for key, value in settings.items():
                self._print(bullet(key, value))
        self._print()
        self._print(TABLE_HEADER)

    def measurement(self, m: Measurement) -> None:
        self._print(format_line(m))
        if not m.stable and m.note:
            self._print(f"  ({m.note})")
