"""Sweep several configurations one after the other and compare them.

A :class:`Target` is either a model repository on disk, served in turn by the local CPU Triton
(:class:`loader.serving.TritonServer`, stopped before the next one starts so they never compete
for the CPU), or an endpoint that already serves the model (a cluster's Service). On the command
line a target is ``[LABEL=]PATH`` or ``[LABEL=][http|grpc://]HOST:PORT``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from loader.bench import variants
from loader.bench.endpoint import Endpoint, parse_endpoint
from loader.bench.perf_analyzer import find_perf_analyzer
from loader.bench.results import Measurement, Sweep, median_sweeps
from loader.bench.settings import SweepSettings
from loader.bench.sweep import sweep
from loader.errors import LoaderError

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


def compare(
    targets: Sequence[Target],
    settings: SweepSettings,
    *,
    log_dir: Path | None = None,
    on_start: Callable[[Target, str], None] | None = None,
    on_measurement: Callable[[Target, Measurement], None] | None = None,
) -> list[Sweep]:
    """One sweep per target and workload, in order; server logs go to ``log_dir`` when given.

    A repository target is served once per round and measured with every workload while it is
    up. With ``settings.rounds`` > 1 every target is swept that many times, round after round
    (so load from elsewhere on the machine spreads over all targets), and each level reports
    its median-throughput round (:func:`~loader.bench.results.median_sweeps`). ``on_start``
    gets the target and the workload's label before each sweep.
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
    results = []
    for number in range(1, settings.rounds + 1):
        if settings.rounds > 1:
            log.info("round %s of %s", number, settings.rounds)
        round_sweeps = []
        for target in targets:
            round_sweeps.extend(
                _sweep_target(
                    target, settings, log_dir=log_dir, on_start=on_start,
                    on_measurement=on_measurement,
                )
            )  # fmt: skip
        results.append(round_sweeps)
    return results[0] if settings.rounds == 1 else median_sweeps(results)


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
) -> list[Sweep]:
    report = None if on_measurement is None else (lambda m: on_measurement(target, m))
    sweeps = []
    for workload in settings.workloads:
        label = settings.workload_label(workload)
        if on_start is not None:
            on_start(target, label)
        sweeps.append(
            sweep(
                endpoint,
                model,
                list(settings.concurrencies),
                options=settings.options_for(workload),
                label=target.label,
                settings=target.settings,
                workload=label,
                perf_analyzer=settings.perf_analyzer,
                on_measurement=report,
            )
        )
    return sweeps


def _sweep_target(
    target: Target,
    settings: SweepSettings,
    *,
    log_dir: Path | None,
    on_start: Callable[[Target, str], None] | None,
    on_measurement: Callable[[Target, Measurement], None] | None,
) -> list[Sweep]:
    callbacks = {"on_start": on_start, "on_measurement": on_measurement}
    if target.repository is None:
        assert target.endpoint is not None and settings.model is not None  # parse_target, compare
        return _sweep_workloads(target, target.endpoint, settings.model, settings, **callbacks)
    from loader.serving import TritonServer

    repository = Path(target.repository)
    name = settings.model or variants.ensemble_name(variants.read_configs(repository))
    log_path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"tritonserver-{_SAFE.sub('_', target.label)}.log"
    log.info("%s: serving %s with the local Triton", target.label, repository)
    with TritonServer(repository, log_path=log_path) as server:
        address = server.grpc_url if settings.protocol == "grpc" else server.http_url
        endpoint = Endpoint(address=address, protocol=settings.protocol)
        try:
            return _sweep_workloads(target, endpoint, name, settings, **callbacks)
        except LoaderError:
            if log_path is not None:
                log.error("%s: Triton's log is %s", target.label, log_path)
            raise
