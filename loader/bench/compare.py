"""Sweep several configurations one after the other and compare them.

A :class:`Target` is either a model repository on disk, served in turn by the local CPU Triton
(:class:`loader.serving.TritonServer`, stopped before the next one starts so they never compete
for the CPU), or an endpoint that already serves the model (a cluster's Service). On the command
line a target is ``[LABEL=]PATH`` or ``[LABEL=][http|grpc://]HOST:PORT``.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loader.bench import variants
from loader.bench.perf_analyzer import find_perf_analyzer
from loader.bench.results import Measurement, Sweep, median_sweeps
from loader.bench.settings import SweepSettings
from loader.bench.sweep import sweep
from loader.endpoint import Endpoint, parse_endpoint
from loader.errors import LoaderError, MeasurementError
from loader.repository.config import FASTERTRANSFORMER

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class Target:
    label: str
    repository: Path | None = None
    endpoint: Endpoint | None = None
    settings: Mapping[str, object] = field(default_factory=dict)


def parse_target(text: str, *, protocol: str | None = None) -> Target:
    """``[LABEL=]PATH`` (a model repository) or ``[LABEL=][scheme://]HOST:PORT`` (an endpoint)."""
    label, sep, rest = text.partition("=")
    if not sep:
        label, rest = "", text
    path = Path(rest).expanduser()
    if path.is_dir():
        return Target(label=label or path.name, repository=path.resolve())
    try:
        endpoint = parse_endpoint(rest, protocol=protocol)
    except LoaderError as exc:
        raise LoaderError(
            f"--compare target {text!r} is neither a directory nor an endpoint",
            "Pass model repositories (directories) or endpoints (host:port), "
            "optionally as LABEL=TARGET.",
        ) from exc
    return Target(label=label or endpoint.address, endpoint=endpoint)


@dataclass
class Comparison:
    """What :func:`compare` measured: each level's median over the rounds (``sweeps``), every
    round as measured (``by_round``), and whether the time cap cut the run short."""

    sweeps: list[Sweep]
    by_round: list[list[Sweep]]
    planned: int
    measured: int

    @property
    def complete(self) -> bool:
        return self.measured >= self.planned


def compare(
    targets: Sequence[Target],
    settings: SweepSettings,
    *,
    log_dir: Path | None = None,
    on_start: Callable[[Target, str], None] | None = None,
    on_measurement: Callable[[Target, Measurement], None] | None = None,
    on_partial: Callable[[Comparison], None] | None = None,
) -> Comparison:
    """One sweep per target and workload, in order; server logs go to ``log_dir`` when given.

    A repository target is served once per round and measured with every workload while it is
    up. With ``settings.rounds`` > 1 every target is swept that many times, round after round
    (so load from elsewhere on the machine spreads over all targets), and each level reports
    its median-throughput round (:func:`~loader.bench.results.median_sweeps`; rounds that
    disagree by more than the stability percentage make a level unstable). With
    ``settings.max_seconds`` no level starts once that much time has passed: the comparison
    holds what was measured. ``on_start`` gets the target and the workload's label before each
    sweep, ``on_partial`` the comparison so far after each level.
    """
    labels = [t.label for t in targets]
    duplicates = sorted({x for x in labels if labels.count(x) > 1})
    if duplicates:
        raise LoaderError(
            f"two targets share the label(s) {', '.join(duplicates)}",
            "Name them apart with LABEL=TARGET.",
        )
    if settings.model is None and any(t.repository is None for t in targets):
        raise LoaderError(
            "which model should be measured at the endpoints?",
            "Pass --model NAME (the ensemble's name, e.g. codegen).",
        )
    find_perf_analyzer(settings.perf_analyzer)  # fail before starting any server
    targets = [_with_settings(t) for t in targets]
    deadline = None if settings.max_seconds is None else time.monotonic() + settings.max_seconds
    planned = settings.rounds * len(targets) * len(settings.workloads) * len(settings.concurrencies)
    by_round: list[list[Sweep]] = []

    def state() -> Comparison:
        merged = median_sweeps(by_round, agreement_percentage=settings.agreement_percentage)
        measured = sum(len(s.measurements) for r in by_round for s in r)
        return Comparison(merged, by_round, planned, measured)

    def measured(target: Target, m: Measurement) -> None:
        if on_measurement is not None:
            on_measurement(target, m)
        if on_partial is not None:
            on_partial(state())

    for number in range(1, settings.rounds + 1):
        if deadline is not None and time.monotonic() >= deadline:
            log.warning(
                "the time is up (--max-minutes): %s of %s rounds measured",
                number - 1,
                settings.rounds,
            )
            break
        if settings.rounds > 1:
            log.info("round %s of %s", number, settings.rounds)
        round_sweeps: list[Sweep] = []
        by_round.append(round_sweeps)
        for target in targets:
            if deadline is not None and time.monotonic() >= deadline:
                break
            _sweep_target(
                target, settings, log_dir=log_dir, on_start=on_start,
                on_measurement=measured, deadline=deadline, into=round_sweeps,
            )  # fmt: skip
    return state()


def _with_settings(target: Target) -> Target:
    """A repository target described by its own configs unless settings were given."""
    if target.repository is None or target.settings:
        return target
    return replace(target, settings=variants.describe(variants.read_configs(target.repository)))


def _sweep_workloads(
    target: Target,
    endpoint: Endpoint,
    model: str,
    settings: SweepSettings,
    *,
    on_start: Callable[[Target, str], None] | None,
    on_measurement: Callable[[Target, Measurement], None] | None,
    deadline: float | None = None,
    into: list[Sweep],
    cpu_seconds: Callable[[], float | None] | None = None,
    model_counts: Callable[[], tuple[int, int] | None] | None = None,
) -> None:
    report = None if on_measurement is None else (lambda m: on_measurement(target, m))
    for workload in settings.workloads:
        if deadline is not None and time.monotonic() >= deadline:
            return
        label = settings.workload_label(workload)
        if on_start is not None:
            on_start(target, label)
        result = Sweep(target.label, settings=dict(target.settings), workload=label)
        into.append(result)
        sweep(
            endpoint,
            model,
            list(settings.concurrencies),
            options=settings.options_for(workload),
            perf_analyzer=settings.perf_analyzer,
            on_measurement=report,
            cpu_seconds=cpu_seconds,
            model_counts=model_counts,
            deadline=deadline,
            into=result,
        )


def check_drivable(label: str, config: Any, name: str, settings: SweepSettings) -> None:
    """Refuse, before a server starts, to measure a decoupled (``--streaming``) model other
    than by gRPC streaming: perf_analyzer's HTTP client cannot send it a request at all
    ("HTTP end point doesn't support models with decoupled transaction policy")."""
    decoupled = config is not None and config.model_transaction_policy.decoupled
    if decoupled and not (settings.protocol == "grpc" and settings.options.streaming):
        raise MeasurementError(
            f"{label}: the model {name!r} streams its responses (decoupled: a repository "
            "published with --streaming), and perf_analyzer can drive such a model only over "
            "gRPC with --streaming, timing the first response alone",
            "Measure a key published without --streaming (its instance count and batching "
            "apply to the streaming one too), or time streaming with scripts/bench --ttft.",
        )


def _sweep_target(
    target: Target,
    settings: SweepSettings,
    *,
    log_dir: Path | None,
    on_start: Callable[[Target, str], None] | None,
    on_measurement: Callable[[Target, Measurement], None] | None,
    deadline: float | None,
    into: list[Sweep],
) -> None:
    callbacks = {
        "on_start": on_start, "on_measurement": on_measurement, "deadline": deadline,
        "into": into,
    }  # fmt: skip
    if target.repository is None:
        assert target.endpoint is not None and settings.model is not None  # parse_target, compare
        _sweep_workloads(target, target.endpoint, settings.model, settings, **callbacks)
        return
    from loader.serving import TritonServer, restricted_protocols

    repository = Path(target.repository)
    configs = variants.read_configs(repository)
    name = settings.model or variants.ensemble_name(configs)
    check_drivable(target.label, configs.get(name), name, settings)
    log_path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"tritonserver-{_SAFE.sub('_', target.label)}.log"
    log.info("%s: serving %s with the local Triton", target.label, repository)
    with TritonServer(repository, log_path=log_path) as server:
        address = server.grpc_url if settings.protocol == "grpc" else server.http_url
        # perf_analyzer reads the model's metadata, configuration and statistics first: over
        # gRPC the chart restricts them to the admin header, which it sends (-H).
        headers = set(restricted_protocols(server.pod_args).values())
        endpoint = Endpoint(address=address, protocol=settings.protocol, headers=tuple(headers))
        counts = (
            model_counts(server.http_url, FASTERTRANSFORMER)
            if FASTERTRANSFORMER in variants.model_dirs(repository)
            else None
        )
        try:
            _sweep_workloads(
                target, endpoint, name, settings, cpu_seconds=server.cpu_seconds,
                model_counts=counts, **callbacks,
            )  # fmt: skip
        except LoaderError as exc:
            if log_path is not None:
                log.error("%s: Triton's log is %s", target.label, log_path)
            code = server.process.poll() if server.process is not None else None
            if code is not None:  # the server itself died: say so, with its log's cause
                raise server.failure(
                    f"the local tritonserver serving {target.label} exited during the "
                    f"measurement (code {code})"
                ) from exc
            raise


#: How long :func:`model_counts` waits for Triton's statistics to stop moving.
COUNTS_SETTLE_S = 2.0


def model_counts(http_url: str, model: str) -> Callable[[], tuple[int, int] | None]:
    """A reader of ``model``'s ``inference_count`` and ``execution_count`` in the statistics of
    the Triton at ``http_url`` (``host:port``; ``GET /v2/models/<model>/stats``): the requests
    it served and the executions (batches) it ran them in. Triton updates them just after a
    response goes out, so a read right after perf_analyzer's last response could miss one: the
    reader reads until two reads 50 ms apart agree (at most :data:`COUNTS_SETTLE_S`). ``None``
    when Triton does not answer or the answer holds no counts: the level is then reported
    without them."""
    url = f"http://{http_url}/v2/models/{model}/stats"

    def read() -> tuple[int, int] | None:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                stats = json.load(response)["model_stats"]
            total = [0, 0]
            for entry in stats:  # one per loaded version
                total[0] += int(entry["inference_count"])
                total[1] += int(entry["execution_count"])
            return total[0], total[1]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("no statistics of %s from %s: %s", model, url, exc)
            return None

    def settled() -> tuple[int, int] | None:
        last = read()
        deadline = time.monotonic() + COUNTS_SETTLE_S
        while last is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            now = read()
            if now == last:
                return now
            last = now
        return last

    return settled
