"""The README of the serving experiment's results, written from those results alone.

``make bench-serving`` writes ``README.md`` beside ``results.csv``, ``summary.txt`` and
``tables.txt`` after writing them, by reading them back (:func:`read_run`) and turning them into
prose (:func:`readme_text`): every number in the README is one of the run's, and the README of a
results directory can be regenerated from its files at any time (a test does, for the committed
one). The explanatory text (what the files are, why the stability setting, how to count Triton's
batches by hand) is part of this module and carries no number of its own.

What the README reports:

* the run: its command, duration, machine (CPU count included) and the load it ran under, the
  model, request files and measurement settings (the notes of ``summary.txt``);
* the configurations and concurrency levels measured, and how many levels stayed unstable;
* the batching gain on each request file, per instance count: batching on against off, best
  stable level against best stable level, and at the highest level both measured stably
  (naming the levels above it that one of them did not);
* Triton's average batch per configuration and request file at the top concurrency: the
  ``inference_count`` and ``execution_count`` differences of the generating model's
  statistics around that level's perf_analyzer run (``results.csv``), where the run counted them.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loader.bench.report import CSV_FILE, SUMMARY_FILE, TABLES_FILE
from loader.bench.results import Measurement, Sweep, format_number, sweeps_from_csv
from loader.errors import MeasurementError

#: The model whose statistics count the batches (the one ``dynamic_batching`` applies to).
GENERATING_MODEL = "fastertransformer"
#: The first words of a summary's status line (``loader.bench.experiment``).
_STATUS_WORDS = ("Complete", "PARTIAL", "CUT SHORT", "INTERRUPTED")
_LABEL = re.compile(r"^i(?P<instances>\d+)-batching-(?P<batching>on|off)$")
_HEADING = re.compile(r"^Benchmark \d+: (?P<label>\S+)(?: \((?P<workload>[^)]*)\))?$")
_BULLET = re.compile(r"^• (?P<key>[^=]+?) = (?P<value>.*)$")
_NOTE = re.compile(r"^(?P<key>[^\s:][^:]*): (?P<value>.*)$")

#: Notes of ``summary.txt`` the README shows, by the start of their key, in this order.
RUN_NOTES = (
    ("command", "command"),
    ("duration", "duration"),
    ("machine", "machine"),
    ("load average", "load average (1 min)"),
    ("model", "model"),
    ("requests", "request files"),
    ("measurement", "measurement"),
)


@dataclass(frozen=True)
class ServingRun:
    """What one run of the serving experiment left: its levels, the notes of its summary
    (``key: value`` lines), its status line, and each configuration's settings."""

    sweeps: Sequence[Sweep]
    notes: Mapping[str, str] = field(default_factory=dict)
    status: str = ""
    settings: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def note(self, prefix: str) -> list[tuple[str, str]]:
        """The notes whose key starts with ``prefix``, in the summary's order."""
        return [(k, v) for k, v in self.notes.items() if k.startswith(prefix)]


def parse_summary(text: str) -> tuple[str, dict[str, str]]:
    """The status (its lines joined; empty if none) and the ``key: value`` notes of a
    ``summary.txt``: status lines, a blank line, the summary proper (whose own lines, such as
    ``Best configuration ...: label``, are not notes), a blank line, the notes, and the
    ``values:`` block that ends them."""
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if line == "values:":
            break
        if line == "":
            blocks.append([])
        else:
            blocks[-1].append(line)
    blocks = [b for b in blocks if b]
    status = ""
    if blocks and blocks[0][0].startswith(_STATUS_WORDS):
        status = " ".join(blocks.pop(0))
    notes: dict[str, str] = {}
    for line in (line for block in blocks[1:] for line in block):
        match = _NOTE.match(line)
        if match:
            notes[match["key"]] = match["value"]
    return status, notes


def parse_settings(text: str) -> dict[str, dict[str, str]]:
    """Each configuration's settings from the bullets of ``tables.txt``, by label."""
    settings: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in text.splitlines():
        heading = _HEADING.match(line)
        if heading:
            current = settings.setdefault(heading["label"], {})
            continue
        bullet = _BULLET.match(line)
        if bullet and current is not None:
            current[bullet["key"]] = bullet["value"]
    return settings


def read_run(directory: Path) -> ServingRun:
    """A run from its results directory: ``results.csv`` and ``summary.txt`` (both needed) and
    ``tables.txt`` (the settings; optional)."""
    directory = Path(directory)
    missing = [n for n in (CSV_FILE, SUMMARY_FILE) if not (directory / n).is_file()]
    if missing:
        raise MeasurementError(
            f"{directory} holds no {' or '.join(missing)}",
            "Pass the output directory of a `scripts/bench --serving-experiment` run.",
        )
    status, notes = parse_summary((directory / SUMMARY_FILE).read_text(encoding="utf-8"))
    tables = directory / TABLES_FILE
    return ServingRun(
        sweeps=sweeps_from_csv((directory / CSV_FILE).read_text(encoding="utf-8")),
        notes=notes,
        status=status,
        settings=parse_settings(tables.read_text(encoding="utf-8")) if tables.is_file() else {},
    )


# --- the text ---------------------------------------------------------------------------------


def _workloads(run: ServingRun) -> list[str]:
    return list(dict.fromkeys(s.workload for s in run.sweeps))


def _levels(run: ServingRun) -> list[int]:
    return sorted({m.concurrency for s in run.sweeps for m in s.measurements})


def _requests(run: ServingRun) -> dict[str, str]:
    """Request file by workload label, from the ``requests`` note (``test: bench/x.json; ...``)."""
    found: dict[str, str] = {}
    for _, value in run.note("requests"):
        for part in value.split("; "):
            label, sep, path = part.partition(": ")
            if sep:
                found[label] = path
    return found


def _named(workload: str, requests: Mapping[str, str]) -> str:
    if not workload:
        only = next(iter(requests.values()), "")
        return f"`{only}`" if only else "the request file"
    path = requests.get(workload)
    return f"`{path}` ({workload})" if path else f"`{workload}`"


def _find(run: ServingRun, label: str, workload: str) -> Sweep | None:
    return next((s for s in run.sweeps if s.label == label and s.workload == workload), None)


def _pairs(run: ServingRun) -> list[tuple[str, str]]:
    """(batching off, batching on) labels of each instance count that has both."""
    labels = list(dict.fromkeys(s.label for s in run.sweeps))
    pairs = []
    for label in labels:
        match = _LABEL.match(label)
        if match and match["batching"] == "off":
            on = f"i{match['instances']}-batching-on"
            if on in labels:
                pairs.append((label, on))
    return pairs


def _level(m: Measurement) -> str:
    return (
        f"{format_number(m.throughput)} infer/s at concurrency {m.concurrency} "
        f"(p95 {m.p95_ms:.1f} ms)"
    )


def _ratio(a: float, b: float) -> str:
    return f"**{a / b:.2f}x**" if b > 0 else "no ratio (the baseline measured 0 infer/s)"


def _stable_at(sweep: Sweep, concurrency: int) -> bool:
    m = sweep.at(concurrency)
    return m is not None and m.stable


def gain_lines(off: Sweep, on: Sweep) -> list[str]:
    """Batching on against off on one request file: best stable level against best stable
    level, then at the highest level both measured stably (and which levels above it were not)."""
    lines = []
    best_on, best_off = on.best(), off.best()
    if best_on is None or best_off is None:
        lacking = " and ".join(s.label for s, b in ((on, best_on), (off, best_off)) if b is None)
        lines.append(f"- best stable level against best stable level: none ({lacking} measured "
                     "no level stably)")  # fmt: skip
    else:
        lines.append(
            f"- best stable level against best stable level: {on.label} {_level(best_on)} "
            f"against {off.label} {_level(best_off)}: "
            f"{_ratio(best_on.throughput, best_off.throughput)}"
        )
    shared = sorted(
        {m.concurrency for m in on.measurements} & {m.concurrency for m in off.measurements}
    )
    both = [c for c in shared if _stable_at(on, c) and _stable_at(off, c)]
    if not both:
        lines.append("- at the same level: no level that both measured stably")
        return lines
    top = both[-1]
    a, b = on.at(top), off.at(top)
    assert a is not None and b is not None  # both measured it
    text = (
        f"- at concurrency {top}, the highest level both measured stably: "
        f"{format_number(a.throughput)} against {format_number(b.throughput)} infer/s "
        f"(p95 {a.p95_ms:.1f} against {b.p95_ms:.1f} ms): {_ratio(a.throughput, b.throughput)}"
    )
    above = []
    for level in (c for c in shared if c > top):
        shaky = [s.label for s in (on, off) if not _stable_at(s, level)]
        above.append(f"concurrency {level} ({' and '.join(shaky)} unstable)")
    if above:
        text += "; higher levels not compared: " + ", ".join(above)
    lines.append(text)
    return lines


def batch_lines(run: ServingRun) -> list[str]:
    """Triton's average batch per configuration and request file at the top concurrency."""
    levels = _levels(run)
    if not levels:
        return []
    top = levels[-1]
    requests = _requests(run)
    counted = [
        (s, m)
        for s in run.sweeps
        if (m := s.at(top)) is not None and m.inference_count is not None and m.execution_count
    ]
    if not counted:
        return [
            f"This run did not count Triton's batches: its `results.csv` has no "
            "`inference_count` and `execution_count` at the top concurrency (the experiment "
            f"reads the `{GENERATING_MODEL}` model's statistics before and after each level)."
        ]
    lines = [
        f"Triton's own statistics of the `{GENERATING_MODEL}` model, read before and after "
        f"the perf_analyzer run of concurrency {top} (the last run of the level, where an "
        "unstable one was measured again with longer windows), give the requests it served and "
        "the executions (batches) it ran them in:",
        "",
        "| configuration | request file | requests | executions | average batch |",
        "|---|---|---|---|---|",
    ]
    for sweep, m in counted:
        lines.append(
            f"| {sweep.label} | {_named(sweep.workload, requests)} | {m.inference_count} | "
            f"{m.execution_count} | {m.average_batch:.2f} |"
        )
    missing = [s.name for s in run.sweeps if all(s is not c for c, _ in counted)]
    if missing:
        lines += ["", f"Not counted at concurrency {top}: {', '.join(missing)}."]
    return lines


def _configurations(run: ServingRun) -> list[str]:
    lines = []
    for label in dict.fromkeys(s.label for s in run.sweeps):
        settings = run.settings.get(label, {})
        shown = ", ".join(f"{k} {v}" for k, v in settings.items())
        lines.append(f"- `{label}`" + (f": {shown}" if shown else ""))
    return lines


def _hand_count(run: ServingRun) -> list[str]:
    """How to count the batches by hand, with this run's top level and a batching variant."""
    levels = _levels(run)
    labels = [on for _, on in _pairs(run)] or [s.label for s in run.sweeps]
    if not levels or not labels:
        return []
    requests = _requests(run)
    request = (
        next(reversed(requests.values()), "bench/demo/mixed.json")
        if requests
        else ("bench/demo/mixed.json")
    )
    top = levels[-1]
    return [
        "## Counting the batches by hand",
        "",
        "Serve a variant the experiment wrote (under its work directory, `bench/work` unless "
        "`--work-dir` says otherwise), drive it with perf_analyzer and read the statistics "
        "before and after; the differences of `inference_count` and `execution_count` are the "
        "requests and the executions:",
        "",
        "```bash",
        f"scripts/serve-local bench/work/serving-experiment/variants/{labels[0]} --http-port 8000 &",
        f"curl -s localhost:8000/v2/models/{GENERATING_MODEL}/stats",
        f".tools/bin/perf_analyzer -m codegen -u localhost:8000 --concurrency-range={top}:{top} \\",
        f"    --input-data={request} --measurement-mode=count_windows",
        f"curl -s localhost:8000/v2/models/{GENERATING_MODEL}/stats",
        "```",
    ]


_FILES = """\
## The files

- `tables.txt`: one table per configuration and request file, in the format of our production
  benchmarks; a level perf_analyzer could not measure stably ends in `(unstable)`, with
  perf_analyzer's words below the table.
- `results.csv`: every configuration, request file and level (throughput, p50/p90/p95/p99,
  server queue and compute times, Triton's request and execution counts of the generating
  model, `stable`, perf_analyzer's note).
- `throughput_vs_p95_latency.png`: throughput against p95 latency; unstable levels are hollow
  markers.
- `summary.txt`: the best stable configuration per request file, each one's gain over the naive
  one (best stable level against best stable level), every unstable level, what `tune` would
  choose, the machine and its load average while measuring.
- `README.md`: this page, written by the experiment from the files above
  (`loader/bench/serving_readme.py`); every number in it is one of theirs.
"""

_STABILITY = """\
Our machines have few cores and are shared with other work, so perf_analyzer's stability check
stays on but looser than perf_analyzer's default (the `stability_percentage` of the measurement
line above); a level that misses it is measured again with longer windows, and if it still does
not settle it is kept, marked unstable, with its numbers. Unstable levels never decide: neither
the gains above nor `tune`'s choice rests on them. On a loaded machine, run `tune` with more
rounds (`--rounds N`: each level keeps the median of its stable rounds) or longer windows
(`--measurement-request-count`) before taking its values; on GPUs the balance differs: measure
your cluster with `model-loader tune`."""


def _wrap(line: str) -> str:
    """A paragraph or list item of generated text, wrapped at 100 columns (tables, headings,
    code and the unwrapped constant text pass as they are)."""
    if len(line) <= 100 or line.startswith(("|", "#", "```", "    ")):
        return line
    indent = "  " if line.startswith("- ") else ""
    return textwrap.fill(
        line, width=100, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def readme_text(run: ServingRun) -> str:
    """The README of ``run``: every number in it comes from ``run``."""
    return "\n".join(_wrap(line) for line in _lines(run)).rstrip("\n") + "\n"


def _lines(run: ServingRun) -> list[str]:
    requests = _requests(run)
    workloads = _workloads(run)
    levels = _levels(run)
    measured = sum(len(s.measurements) for s in run.sweeps)
    unstable = [(s, m) for s in run.sweeps for m in s.unstable]
    out = [
        "# Serving experiment: instance count x dynamic batching on the CPU Triton",
        "",
        "Written by `make bench-serving` (`scripts/bench --serving-experiment`) from this run's "
        "`results.csv`, `summary.txt` and `tables.txt`: every number below is this run's.",
        "",
    ]
    if run.status:
        out += [f"Status: {run.status}", ""]
    for prefix, shown in RUN_NOTES:
        found = run.note(prefix)
        if prefix == "command" and not found:
            out.append("- command: not recorded in this run's `summary.txt`")
        for key, value in found:
            name = shown if key == prefix else key
            out.append(f"- {name}: `{value}`" if prefix == "command" else f"- {name}: {value}")
    out += [
        "",
        "## What was measured",
        "",
        f"{len({s.label for s in run.sweeps})} configurations, each with "
        f"{' and '.join(_named(w, requests) for w in workloads)} at concurrency "
        f"{', '.join(map(str, levels))}; latency is the client's p95. {measured} levels in all, "
        + (
            f"{len(unstable)} of them unstable (in the tables, never chosen)."
            if unstable
            else "every one stable."
        ),
        "",
        *_configurations(run),
        "",
        "## The batching gain",
        "",
    ]
    pairs = _pairs(run)
    if not pairs:
        out.append("No instance count was measured with batching both off and on.")
    for off_label, on_label in pairs:
        for workload in workloads:
            off, on = _find(run, off_label, workload), _find(run, on_label, workload)
            if off is None or on is None:
                continue
            out.append(f"`{on_label}` against `{off_label}` with {_named(workload, requests)}:")
            out.append("")
            out += gain_lines(off, on)
            out.append("")
    out += ["## Triton's average batch", "", *batch_lines(run), ""]
    out += ["## What a busy machine does to the numbers", ""]
    if unstable:
        out.append(f"{len(unstable)} of the {measured} levels did not settle:")
        out.append("")
        out += [f"- {s.name} at concurrency {m.concurrency}" for s, m in unstable]
        out.append("")
    choice = run.note("chart default")
    if choice:
        out += [f"`tune`'s choice from this run: {choice[0][1]}.", ""]
    out += [_STABILITY, "", _FILES]
    return out + _hand_count(run)


def readme_from_directory(directory: Path) -> str:
    """The README of the results in ``directory`` (see :func:`read_run`)."""
    return readme_text(read_run(directory))
