"""Measure serving throughput and latency with the real ``perf_analyzer``: a library.

Its command lines live in :mod:`loader.cli` (``scripts/bench`` is :mod:`loader.cli.bench`,
``model-loader tune`` is :mod:`loader.cli.tune`); nothing here parses arguments or imports
from :mod:`loader.cli`.

* :mod:`~loader.bench.perf_analyzer`: find and run perf_analyzer for one concurrency level,
  widening the windows of an unstable level; its failures become typed errors.
* :mod:`~loader.bench.settings`: :class:`~loader.bench.settings.SweepSettings`, how every
  configuration of a run is measured, and the request files (workloads).
* :mod:`~loader.bench.sweep`: a concurrency sweep of one model (one run per level).
* :mod:`~loader.bench.results`: measurements (stable or not), perf_analyzer's CSV and table
  formats.
* :mod:`~loader.bench.report`: tables, CSV, PNG plot, the best configuration, the printer.
* :mod:`~loader.bench.variants`: copies of a published repository with another instance count
  or dynamic-batching setting (weights linked, not copied).
* :mod:`~loader.bench.compare`: sweep several repositories (each served in turn by the local
  CPU Triton) or endpoints, optionally in several rounds (median per level).
* :mod:`~loader.bench.tune`: the instance-count x batching tuner and the values it prints.
* :mod:`~loader.bench.experiment`: the serving experiment behind ``make bench-serving``.
* :mod:`~loader.bench.stream`: time to first token / per output token of a streaming model.
"""
