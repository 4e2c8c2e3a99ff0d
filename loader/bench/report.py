"""Reports of one or more sweeps: the seed's tables, a CSV, a PNG plot and the winner.

* :func:`tables_text`: per configuration a heading, its settings as bullets and the table
  (``Concurrency: 11, throughput: 10.9983 infer/sec, latency 1029421 usec``).
* :func:`write_plot`: throughput against p95 latency, one line per configuration, points
  labelled with their concurrency (matplotlib's Agg canvas; no display needed).
* :func:`best_configuration`: the highest throughput any configuration reaches with a p95
  latency within the budget.
* :func:`write_report`: all of the above into a directory, each file written atomically.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loader.bench.results import Measurement, Sweep, format_number, format_table, sweeps_to_csv

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


def table_text(sweep: Sweep, *, number: int | None = None) -> str:
    title = f"Benchmark {number}: {sweep.label}" if number is not None else sweep.label
    lines = [title, ""]
    lines.extend(bullet(k, v) for k, v in sweep.settings.items())
    if sweep.settings:
        lines.append("")
    text = "\n".join(lines) + "\n" + format_table(sweep)
    if sweep.unstable:
        levels = ", ".join(map(str, sweep.unstable))
        text += f"(no stable measurement at concurrency {levels})\n"
    return text


def tables_text(sweeps: Sequence[Sweep]) -> str:
    return "\n".join(table_text(s, number=i) for i, s in enumerate(sweeps, start=1))


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


def throughput_ratio(best: Sweep, baseline: Sweep) -> tuple[int, float] | None:
    """``(concurrency, best / baseline throughput)`` at the highest level both measured."""
    common = {m.concurrency for m in best.measurements} & {
        m.concurrency for m in baseline.measurements
    }
    if not common:
        return None
    level = max(common)
    top, base = best.at(level), baseline.at(level)
    if top is None or base is None or base.throughput <= 0:
        return None
    return level, top.throughput / base.throughput


def summary_text(
    sweeps: Sequence[Sweep],
    *,
    max_p95_ms: float | None = None,
    baseline: str | None = None,
) -> str:
    budget = f"p95 latency <= {max_p95_ms:g} ms" if max_p95_ms is not None else "no latency budget"
    winner = best_configuration(sweeps, max_p95_ms=max_p95_ms)
    if winner is None:
        return f"No configuration stays within {budget}.\n"
    m = winner.measurement
    lines = [
        f"Best configuration ({budget}): {winner.sweep.label}",
        f"  at concurrency {m.concurrency}: {format_number(m.throughput)} infer/sec, "
        f"p95 latency {m.p95_ms:.1f} ms",
    ]
    base = next((s for s in sweeps if s.label == baseline), None)
    if base is not None and base is not winner.sweep:
        ratio = throughput_ratio(winner.sweep, base)
        if ratio is not None:
            level, value = ratio
            lines.append(
                f"  {value:.2f}x the throughput of {base.label} at concurrency {level} "
                "(the highest level both measured)"
            )
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
        (line,) = by_latency.plot(xs, ys, marker="o", label=sweep.label)
        by_concurrency.plot(
            [m.concurrency for m in points],
            ys,
            marker="o",
            color=line.get_color(),
            label=sweep.label,
        )
        for m in points:
            by_latency.annotate(
                f"c{m.concurrency}",
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
    sweeps: Sequence[Sweep],
    output_dir: Path,
    *,
    max_p95_ms: float | None = None,
    baseline: str | None = None,
    title: str = "Throughput vs. client p95 latency",
    notes: Mapping[str, object] | None = None,
) -> dict[str, Path]:
    """Write tables, CSV, plot and summary into ``output_dir``; their paths by kind."""
    output_dir = Path(output_dir)
    summary = summary_text(sweeps, max_p95_ms=max_p95_ms, baseline=baseline)
    if notes:
        summary += "\n" + "".join(f"{k}: {v}\n" for k, v in notes.items())
    paths = {
        "tables": write_text(output_dir / TABLES_FILE, tables_text(sweeps)),
        "csv": write_text(output_dir / CSV_FILE, sweeps_to_csv(sweeps)),
        "plot": write_plot(sweeps, output_dir / PLOT_FILE, title=title, max_p95_ms=max_p95_ms),
        "summary": write_text(output_dir / SUMMARY_FILE, summary),
    }
    return paths
