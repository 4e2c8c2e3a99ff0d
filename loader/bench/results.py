"""Measurements of a perf_analyzer sweep, its CSV and table formats.

A :class:`Measurement` is one concurrency level; a :class:`Sweep` is one configuration measured
over a range of levels. perf_analyzer writes two forms we read:

* its ``-f out.csv`` file (one row per level, sorted by throughput, not by concurrency), and
* the table at the end of its stdout, one line per level, in the format our production
  benchmarks were published in::

      Concurrency: 11, throughput: 10.9983 infer/sec, latency 1029421 usec

  With ``--percentile=95`` the latency is the client's p95. :func:`format_line` prints the same
  line (numbers in C++'s default stream format, which is Python's ``%g``).

A level perf_analyzer could not measure stably is still a :class:`Measurement`, with
``stable=False`` and perf_analyzer's own words in ``note``; its table line ends in
``(unstable)`` and the CSV says so in its ``stable`` column. Nothing measured is thrown away.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from loader.errors import MeasurementError

#: Header of perf_analyzer's table (and of ours).
TABLE_HEADER = "Inferences/Second vs. Client p95 Batch Latency"

_LINE = re.compile(
    r"^Concurrency: (?P<concurrency>\d+), throughput: (?P<throughput>[0-9.eE+-]+) infer/sec, "
    r"latency (?P<latency>\d+) usec(?P<unstable> \(unstable\))?$"
)

#: perf_analyzer CSV column -> Measurement field (latencies and times are microseconds).
CSV_COLUMNS: dict[str, str] = {
    "Concurrency": "concurrency",
    "Inferences/Second": "throughput",
    "p50 latency": "p50_us",
    "p90 latency": "p90_us",
    "p95 latency": "p95_us",
    "p99 latency": "p99_us",
    "Server Queue": "server_queue_us",
    "Server Compute Infer": "server_compute_infer_us",
}
_REQUIRED_CSV_COLUMNS = ("Concurrency", "Inferences/Second", "p95 latency")


@dataclass(frozen=True)
class Measurement:
    """One concurrency level: throughput in inferences/s, latencies in microseconds."""

    concurrency: int
    throughput: float
    p95_us: int
    p50_us: int | None = None
    p90_us: int | None = None
    p99_us: int | None = None
    server_queue_us: int | None = None
    server_compute_infer_us: int | None = None
    #: False when the level's windows never agreed (see :mod:`loader.bench.perf_analyzer`), or
    #: its rounds did not (:func:`median_sweeps`).
    stable: bool = True
    #: Why a level is unstable, in words.
    note: str = ""
    #: The server's CPU time (all its processes) per completed request, in milliseconds: a
    #: figure other load on the machine barely moves, unlike throughput (local servers only).
    cpu_ms_per_request: float | None = None
    #: Rounds merged into this level, and the lowest and highest throughput among them.
    rounds: int = 1
    throughput_low: float | None = None
    throughput_high: float | None = None
    #: Triton's own statistics of the generating model (``/v2/models/<name>/stats``) read
    #: before and after the level's perf_analyzer run: the requests it counted and the
    #: executions (batches) it ran them in (local servers only).
    inference_count: int | None = None
    execution_count: int | None = None

    @property
    def p95_ms(self) -> float:
        return self.p95_us / 1000.0

    @property
    def average_batch(self) -> float | None:
        """Requests per execution of the generating model (None where not counted)."""
        if self.inference_count is None or not self.execution_count:
            return None
        return self.inference_count / self.execution_count


@dataclass
class Sweep:
    """One configuration measured at several concurrency levels.

    ``settings`` describe the configuration (instance count, batching, ...) for reports;
    ``workload`` names the request file it was measured with (empty when there is only one).
    """

    label: str
    measurements: list[Measurement] = field(default_factory=list)
    settings: Mapping[str, object] = field(default_factory=dict)
    workload: str = ""

    @property
    def name(self) -> str:
        """The label, with the workload when there is one (headings, plot legends)."""
        return f"{self.label} ({self.workload})" if self.workload else self.label

    def sorted(self) -> list[Measurement]:
        return sorted(self.measurements, key=lambda m: m.concurrency)

    def at(self, concurrency: int) -> Measurement | None:
        return next((m for m in self.measurements if m.concurrency == concurrency), None)

    @property
    def unstable(self) -> list[Measurement]:
        """The levels perf_analyzer could not measure stably, by concurrency."""
        return [m for m in self.sorted() if not m.stable]

    def best(self, *, max_p95_ms: float | None = None) -> Measurement | None:
        """The highest-throughput stable level whose p95 latency fits the budget (if any)."""
        fitting = [
            m
            for m in self.measurements
            if m.stable and (max_p95_ms is None or m.p95_ms <= max_p95_ms)
        ]
        return max(fitting, key=lambda m: m.throughput, default=None)


def format_number(value: float) -> str:
    """A float as perf_analyzer prints it (C++ default stream format: 6 significant digits)."""
    return f"{value:g}"


def format_line(m: Measurement) -> str:
    return (
        f"Concurrency: {m.concurrency}, throughput: {format_number(m.throughput)} infer/sec, "
        f"latency {m.p95_us} usec" + ("" if m.stable else " (unstable)")
    )


def format_table(sweep: Sweep, *, header: bool = True) -> str:
    """The seed's table: an optional header line, then one line per level, by concurrency."""
    lines = [TABLE_HEADER] if header else []
    lines.extend(format_line(m) for m in sweep.sorted())
    return "\n".join(lines) + "\n"


def parse_table(text: str) -> list[Measurement]:
    """Measurements from table lines (perf_analyzer's stdout or our own tables); others ignored."""
    out = []
    for raw in text.splitlines():
        match = _LINE.match(raw.strip())
        if match:
            out.append(
                Measurement(
                    concurrency=int(match["concurrency"]),
                    throughput=float(match["throughput"]),
                    p95_us=int(match["latency"]),
                    stable=match["unstable"] is None,
                )
            )
    return out


def _int_or_none(value: str | None) -> int | None:
    if value is None or value.strip() == "":
        return None
    return int(float(value))


def _float_or_none(value: str | None) -> float | None:
    return None if value is None or value.strip() == "" else float(value)


def parse_csv(text: str, *, source: str = "perf_analyzer CSV") -> list[Measurement]:
    """Measurements from perf_analyzer's ``-f`` CSV, sorted by concurrency."""
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [c for c in _REQUIRED_CSV_COLUMNS if c not in header]
    if missing:
        raise MeasurementError(
            f"{source} lacks the column(s) {', '.join(missing)} (header: {','.join(header)})",
            "Run perf_analyzer with --percentile=95 and -f <file>.csv (scripts/bench does).",
        )
    out = []
    for row in reader:
        if not row.get("Concurrency"):
            continue
        values: dict[str, object] = {}
        for column, name in CSV_COLUMNS.items():
            if column in row:
                values[name] = _int_or_none(row[column])
        values["throughput"] = float(row["Inferences/Second"])
        out.append(Measurement(**values))  # type: ignore[arg-type]
    return sorted(out, key=lambda m: m.concurrency)


def median_sweeps(
    rounds: Sequence[Sequence[Sweep]], *, agreement_percentage: float | None = None
) -> list[Sweep]:
    """Merge repeated sweeps of the same configurations: per level, the median-throughput round.

    The chosen round's whole measurement is kept (so throughput and latencies stay consistent);
    with an even number of rounds the lower median is taken. The median is taken over the rounds
    that measured the level stably; a level no round measured stably keeps the median of its
    unstable rounds, still marked unstable. Each level records how many rounds it merged and
    their lowest and highest throughput; with ``agreement_percentage``, a level whose stable
    rounds differ by more than that from their median is marked unstable (the rounds
    disagree). Configurations keep the order of the first round.
    """
    by_key: dict[tuple[str, str], list[Sweep]] = {}
    for sweeps in rounds:
        for sweep in sweeps:
            by_key.setdefault((sweep.label, sweep.workload), []).append(sweep)
    merged = []
    for (label, _), sweeps in by_key.items():
        levels = sorted({m.concurrency for s in sweeps for m in s.measurements})
        measurements = []
        for level in levels:
            found = [m for s in sweeps if (m := s.at(level)) is not None]
            pool = sorted([m for m in found if m.stable] or found, key=lambda m: m.throughput)
            median = pool[(len(pool) - 1) // 2]
            low, high = pool[0].throughput, pool[-1].throughput
            level_m = replace(median, rounds=len(pool), throughput_low=low, throughput_high=high)
            spread = max(median.throughput - low, high - median.throughput)
            if (
                agreement_percentage is not None
                and len(pool) > 1
                and level_m.stable
                and spread > median.throughput * agreement_percentage / 100
            ):
                level_m = replace(
                    level_m,
                    stable=False,
                    note=f"its {len(pool)} rounds disagree: {format_number(low)} to "
                    f"{format_number(high)} infer/sec (limit {agreement_percentage:g} % of "
                    "the median)",
                )
            measurements.append(level_m)
        first = sweeps[0]
        merged.append(
            Sweep(label, measurements, settings=dict(first.settings), workload=first.workload)
        )
    return merged


# --- our combined CSV (every configuration, every level) -------------------------------------

#: Columns of the CSV :func:`sweeps_to_csv` writes.
RESULT_COLUMNS: tuple[str, ...] = (
    "configuration",
    "workload",
    "concurrency",
    "throughput_infer_per_sec",
    "p50_latency_us",
    "p90_latency_us",
    "p95_latency_us",
    "p99_latency_us",
    "server_queue_us",
    "server_compute_infer_us",
    "cpu_ms_per_request",
    "rounds",
    "throughput_low",
    "throughput_high",
    "inference_count",
    "execution_count",
    "stable",
    "note",
)
#: The columns every results CSV has had; the others may be missing from one written by an
#: earlier version (read as not measured).
REQUIRED_RESULT_COLUMNS: tuple[str, ...] = (
    "configuration",
    "workload",
    "concurrency",
    "throughput_infer_per_sec",
    "p95_latency_us",
    "stable",
)


def sweeps_to_csv(sweeps: Iterable[Sweep]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(RESULT_COLUMNS)
    for sweep in sweeps:
        for m in sweep.sorted():
            writer.writerow(
                (
                    sweep.label,
                    sweep.workload,
                    m.concurrency,
                    format_number(m.throughput),
                    *("" if v is None else v for v in (m.p50_us, m.p90_us, m.p95_us, m.p99_us)),
                    "" if m.server_queue_us is None else m.server_queue_us,
                    "" if m.server_compute_infer_us is None else m.server_compute_infer_us,
                    "" if m.cpu_ms_per_request is None else f"{m.cpu_ms_per_request:.3g}",
                    m.rounds,
                    "" if m.throughput_low is None else format_number(m.throughput_low),
                    "" if m.throughput_high is None else format_number(m.throughput_high),
                    "" if m.inference_count is None else m.inference_count,
                    "" if m.execution_count is None else m.execution_count,
                    "yes" if m.stable else "no",
                    m.note,
                )
            )
    return buffer.getvalue()


def sweeps_from_csv(text: str) -> list[Sweep]:
    """Read back what :func:`sweeps_to_csv` wrote (configurations in first-seen order); a CSV
    of an earlier version, without some of the optional columns, reads them as not measured."""
    reader = csv.DictReader(io.StringIO(text))
    header = tuple(reader.fieldnames or ())
    unknown = [c for c in header if c not in RESULT_COLUMNS]
    if (
        unknown
        or any(c not in header for c in REQUIRED_RESULT_COLUMNS)
        or len(set(header)) < len(header)
    ):
        raise MeasurementError(
            f"not a bench results CSV (header: {','.join(header)})",
            "Pass a results.csv written by scripts/bench.",
        )
    sweeps: dict[tuple[str, str], Sweep] = {}
    for found in reader:
        row = {c: found.get(c) or "" for c in RESULT_COLUMNS}
        key = (row["configuration"], row["workload"])
        sweep = sweeps.setdefault(key, Sweep(key[0], workload=key[1]))
        sweep.measurements.append(
            Measurement(
                concurrency=int(row["concurrency"]),
                throughput=float(row["throughput_infer_per_sec"]),
                p95_us=int(row["p95_latency_us"]),
                p50_us=_int_or_none(row["p50_latency_us"]),
                p90_us=_int_or_none(row["p90_latency_us"]),
                p99_us=_int_or_none(row["p99_latency_us"]),
                server_queue_us=_int_or_none(row["server_queue_us"]),
                server_compute_infer_us=_int_or_none(row["server_compute_infer_us"]),
                cpu_ms_per_request=_float_or_none(row["cpu_ms_per_request"]),
                rounds=int(row["rounds"] or 1),
                throughput_low=_float_or_none(row["throughput_low"]),
                throughput_high=_float_or_none(row["throughput_high"]),
                inference_count=_int_or_none(row["inference_count"]),
                execution_count=_int_or_none(row["execution_count"]),
                stable=row["stable"] != "no",
                note=row["note"],
            )
        )
    return list(sweeps.values())
