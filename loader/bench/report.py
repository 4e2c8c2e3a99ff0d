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
from collections.abc import Callable, Mapping, Sequence
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
from loader.bench.settings import RequestShape, request_shape
from loader.errors import LoaderError

TABLES_FILE = "tables.txt"
CSV_FILE = "results.csv"
PLOT_FILE = "throughput_vs_p95_latency.png"
SUMMARY_FILE = "summary.txt"
README_FILE = "README.md"


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
    #: Every round as measured (for the per-round gains); empty for a single sweep.
    by_round: Sequence[Sequence[Sweep]] = ()
    #: The first line of the summary: how complete the run is, and the verdict.
    status: str = ""
    #: Each workload's request file, by the workload's label in the sweeps ("" for a run with
    #: one): the plot shows what was asked and generated tokens per second.
    request_files: Mapping[str, Path] = field(default_factory=dict)
    #: Writes ``README.md`` from the files already written to the output directory (its
    #: argument), so that the README says what they say (the serving experiment's).
    readme: Callable[[Path], str] | None = None


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
    top, base, value = found
    text = (
        f"{value:.2f}x the best stable throughput of {baseline.label} "
        f"({format_number(base.throughput)} infer/sec at concurrency {base.concurrency})"
    )
    if top.cpu_ms_per_request and base.cpu_ms_per_request:
        text += (
            f"; server CPU per request {top.cpu_ms_per_request:.3g} ms against "
            f"{base.cpu_ms_per_request:.3g} ms "
            f"({top.cpu_ms_per_request / base.cpu_ms_per_request:.2f}x)"
        )
    return text


def gain_text(
    sweep: Sweep,
    baseline: Sweep,
    by_round: Sequence[Sequence[Sweep]] = (),
    *,
    max_p95_ms: float | None = None,
) -> str | None:
    """:func:`ratio_text` with the same ratio in each round alone, and plainly whether it
    holds: ``certain`` only when at least two rounds put it on the same side of 1."""
    text = ratio_text(sweep, baseline, max_p95_ms=max_p95_ms)
    if text is None:
        return None
    ratios = []
    for round_sweeps in by_round:
        own = _find(round_sweeps, sweep.label, sweep.workload)
        base = _find(round_sweeps, baseline.label, baseline.workload)
        found = (
            None if own is None or base is None else peak_ratio(own, base, max_p95_ms=max_p95_ms)
        )
        if found is not None:
            ratios.append(found[2])
    if len(ratios) < 2:
        return f"{text}; uncertain: {len(ratios)} round(s) with stable levels of both"
    shown = f"{min(ratios):.2f}x to {max(ratios):.2f}x over {len(ratios)} rounds"
    if all(r > 1 for r in ratios) or all(r < 1 for r in ratios):
        side = "higher" if ratios[0] > 1 else "lower"
        return f"{text}; {side} in every round ({shown})"
    return f"{text}; uncertain: the rounds disagree ({shown})"


def _find(sweeps: Sequence[Sweep], label: str, workload: str) -> Sweep | None:
    return next((s for s in sweeps if s.label == label and s.workload == workload), None)


def _workload_summary(
    sweeps: Sequence[Sweep],
    *,
    budget: str,
    max_p95_ms: float | None,
    baseline: str | None,
    by_round: Sequence[Sequence[Sweep]] = (),
) -> list[str]:
    workload = sweeps[0].workload
    requests = f" with {workload}" if workload else ""
    winner = best_configuration(sweeps, max_p95_ms=max_p95_ms)
    if winner is None:
        within = "" if max_p95_ms is None else f" within {budget}"
        return [f"No configuration has a stable level{within}{requests}."]
    m = winner.measurement
    lines = [
        f"Best configuration{requests} ({budget}): {winner.sweep.label}",
        f"  at concurrency {m.concurrency}: {format_number(m.throughput)} infer/sec, "
        f"p95 latency {m.p95_ms:.1f} ms"
        + (
            f", server CPU {m.cpu_ms_per_request:.3g} ms per request"
            if m.cpu_ms_per_request
            else ""
        ),
    ]
    # The choice is only as sure as its lead: over the baseline when one is named (and lost),
    # else over the runner-up, per round; one round or rounds that disagree say "uncertain".
    base = next((s for s in sweeps if s.label == baseline), None)
    rival = (
        base
        if base is not None and base is not winner.sweep
        else _runner_up(sweeps, winner.sweep, max_p95_ms=max_p95_ms)
    )
    if rival is not None:
        text = gain_text(winner.sweep, rival, by_round, max_p95_ms=max_p95_ms)
        if text is not None:
            lines.append(f"  {text}")
    return lines


def _runner_up(sweeps: Sequence[Sweep], winner: Sweep, *, max_p95_ms: float | None) -> Sweep | None:
    """The configuration with the next best stable throughput within the budget."""
    others = [
        (m.throughput, s)
        for s in sweeps
        if s is not winner and (m := s.best(max_p95_ms=max_p95_ms)) is not None
    ]
    return max(others, key=lambda pair: pair[0])[1] if others else None


def summary_text(
    sweeps: Sequence[Sweep],
    *,
    max_p95_ms: float | None = None,
    baseline: str | None = None,
    by_round: Sequence[Sequence[Sweep]] = (),
) -> str:
    """The best stable configuration per workload, its gain over ``baseline`` (per round too,
    and whether it holds), and every level that stayed unstable."""
    budget = f"p95 latency <= {max_p95_ms:g} ms" if max_p95_ms is not None else "no latency budget"
    by_workload: dict[str, list[Sweep]] = {}
    for sweep in sweeps:
        by_workload.setdefault(sweep.workload, []).append(sweep)
    lines: list[str] = []
    for group in by_workload.values():
        lines += _workload_summary(
            group, budget=budget, max_p95_ms=max_p95_ms, baseline=baseline, by_round=by_round
        )
    unstable = [(s, m) for s in sweeps for m in s.unstable]
    if unstable:
        lines.append(
            f"Unstable levels (reported, never chosen): {len(unstable)} of "
            f"{sum(len(s.measurements) for s in sweeps)}"
        )
        lines += [f"  {s.name} at concurrency {m.concurrency}: {m.note}" for s, m in unstable]
    return "\n".join(lines) + "\n"


#: Markers and line styles told apart without colour (the colour differs too).
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_STYLES = ("-", "--", "-.", ":")


def write_plot(
    sweeps: Sequence[Sweep],
    path: Path,
    *,
    title: str = "Throughput vs. client p95 latency",
    max_p95_ms: float | None = None,
    shapes: Mapping[str, RequestShape] | None = None,
) -> Path:
    """A PNG: one panel per request file, throughput against client p95 latency, one line per
    configuration through its concurrency levels.

    Each panel names its request file and, from ``shapes`` (by workload label), what its
    requests ask for; where they all ask for the same number of tokens, a second axis gives
    the generated tokens per second (requests/s x tokens; an end token met earlier makes it
    fewer).

    Each configuration has its own colour, marker and line style, and its name written at the
    end of its line; the points carry their concurrency (``c6``); unstable levels are hollow.
    One legend, below the panels, repeats the names and explains the hollow markers; the
    latency budget is a dashed line.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    workloads = list(dict.fromkeys(s.workload for s in sweeps)) or [""]
    labels = list(dict.fromkeys(s.label for s in sweeps))
    looks = {
        label: {
            "color": f"C{i % 10}",
            "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": _STYLES[(i // 2) % len(_STYLES)],
        }
        for i, label in enumerate(labels)
    }
    figure = Figure(figsize=(6.4 * len(workloads) + 1.2, 6.2), dpi=100)
    FigureCanvasAgg(figure)
    panels = figure.subplots(1, len(workloads), squeeze=False, sharey=True)[0]
    latencies = [m.p95_ms for s in sweeps for m in s.measurements if m.p95_ms > 0]
    log_x = bool(latencies) and max(latencies) / min(latencies) > 20
    for axes, workload in zip(panels, workloads, strict=True):
        for sweep in (s for s in sweeps if s.workload == workload):
            look = looks[sweep.label]
            points = [m for m in sweep.sorted() if m.p95_us > 0]  # not measured: no point
            xs, ys = [m.p95_ms for m in points], [m.throughput for m in points]
            axes.plot(xs, ys, color=look["color"], linestyle=look["linestyle"], linewidth=1.6)
            for m in points:
                axes.plot(
                    m.p95_ms, m.throughput, marker=look["marker"], markersize=8,
                    color=look["color"],
                    markerfacecolor=look["color"] if m.stable else "white",
                )  # fmt: skip
                axes.annotate(
                    f"c{m.concurrency}", (m.p95_ms, m.throughput), textcoords="offset points",
                    xytext=(0, -13), ha="center", fontsize=7, color="dimgray",
                )  # fmt: skip
            if points:
                axes.annotate(
                    sweep.label, (xs[-1], ys[-1]), textcoords="offset points", xytext=(7, 3),
                    fontsize=8, color=look["color"], fontweight="bold",
                )  # fmt: skip
        if max_p95_ms is not None:
            axes.axvline(max_p95_ms, color="grey", linestyle="--", linewidth=1)
        if log_x:
            axes.set_xscale("log")
            axes.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axes.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axes.xaxis.set_minor_formatter(NullFormatter())
        axes.margins(x=0.25)
        axes.set_xlabel("client p95 latency (ms)")
        shape = (shapes or {}).get(workload)
        named = f"requests: {workload}" if workload else ""
        described = shape.text if shape is not None else ""
        if named or described:
            axes.set_title(" - ".join(x for x in (named, described) if x), fontsize=10)
        if shape is not None and shape.output_tokens[0] == shape.output_tokens[1]:
            tokens = shape.output_tokens[0]
            twin = axes.secondary_yaxis(
                "right", functions=(lambda y, t=tokens: y * t, lambda y, t=tokens: y / t)
            )
            twin.set_ylabel(f"output tokens/s (x {tokens} per request, at most)")
        axes.set_ylim(bottom=0)
        axes.grid(True, which="major", alpha=0.3)
    panels[0].set_ylabel("throughput (inferences/s)")
    handles = [
        Line2D([], [], color=look["color"], marker=look["marker"], linestyle=look["linestyle"],
               label=label)
        for label, look in looks.items()
    ]  # fmt: skip
    handles.append(
        Line2D([], [], color="grey", marker="o", markerfacecolor="white", linestyle="",
               label="hollow: unstable level (never chosen)")
    )  # fmt: skip
    if max_p95_ms is not None:
        handles.append(
            Line2D([], [], color="grey", linestyle="--", label=f"p95 budget {max_p95_ms:g} ms")
        )
    figure.legend(
        handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=9, frameon=False
    )
    figure.suptitle(f"{title}\n(points: concurrency; up and to the left is better)", fontsize=11)
    figure.tight_layout(rect=(0, 0.08 + 0.035 * ((len(handles) - 1) // 4), 1, 1))
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


RESULT_FILES = (TABLES_FILE, CSV_FILE, PLOT_FILE, SUMMARY_FILE)


def check_output_dir(output_dir: Path, *, overwrite: bool) -> None:
    """Refuse to write over the results of an earlier run unless ``overwrite``."""
    found = [name for name in RESULT_FILES if (Path(output_dir) / name).exists()]
    if found and not overwrite:
        raise LoaderError(
            f"{output_dir} already holds results of an earlier run ({', '.join(found)})",
            "Pass another --output-dir (the default is a new folder under bench/work), or "
            "--overwrite to replace them (committed results are regenerated that way on "
            "purpose, from one run on a quiet machine).",
        )


def write_report(
    report: Report, output_dir: Path, *, max_p95_ms: float | None = None, plot: bool = True
) -> dict[str, Path]:
    """Write tables, CSV, plot and summary (with the notes and values) into ``output_dir``, then
    the README when the report has a writer for one (read from those files); their paths by
    kind. Without ``plot`` (partial results written while measuring, where drawing would
    compete for the CPU) the plot is left as it is."""
    output_dir = Path(output_dir)
    summary = summary_text(
        report.sweeps, max_p95_ms=max_p95_ms, baseline=report.baseline, by_round=report.by_round
    )
    if report.status:
        summary = report.status.rstrip("\n") + "\n\n" + summary
    if report.notes:
        summary += "\n" + "".join(f"{k}: {v}\n" for k, v in report.notes.items())
    if report.values:
        summary += "values:\n" + report.values
    paths = {
        "tables": write_text(output_dir / TABLES_FILE, tables_text(report.sweeps)),
        "csv": write_text(output_dir / CSV_FILE, sweeps_to_csv(report.sweeps)),
        "summary": write_text(output_dir / SUMMARY_FILE, summary),
    }
    if plot:
        shapes = {label: request_shape(path) for label, path in report.request_files.items()}
        paths["plot"] = write_plot(
            report.sweeps,
            output_dir / PLOT_FILE,
            title=report.title,
            max_p95_ms=max_p95_ms,
            shapes={label: shape for label, shape in shapes.items() if shape is not None},
        )
    if report.readme is not None:
        paths["readme"] = write_text(output_dir / README_FILE, report.readme(output_dir))
    return paths


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
