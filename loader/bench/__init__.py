"""Measure serving throughput and latency with the real ``perf_analyzer``.

* :mod:`~loader.bench.endpoint`: ``--url`` parsing (``host:port``, HTTP or gRPC).
* :mod:`~loader.bench.perf_analyzer`: find and run perf_analyzer for one concurrency level;
  its failures become typed errors.
* :mod:`~loader.bench.sweep`: a concurrency sweep of one model (one run per level).
* :mod:`~loader.bench.results`: measurements, perf_analyzer's CSV and table formats.
* :mod:`~loader.bench.report`: tables, CSV, PNG plot, the best configuration.
* :mod:`~loader.bench.variants`: copies of a published repository with another instance count
  or dynamic-batching setting (weights linked, not copied).
* :mod:`~loader.bench.compare`: sweep several repositories (each served in turn by the local
  CPU Triton) or endpoints, optionally in several rounds (median per level).
* :mod:`~loader.bench.experiment`: the serving experiment behind ``make bench-serving``.
* :mod:`~loader.bench.stream`: time to first token / per output token of a streaming model.
* :mod:`~loader.bench.arguments`: flags shared with ``model-loader tune``; the table printer.
* :mod:`~loader.bench.cli`: ``scripts/bench``.

The instance-count tuner built on these is :mod:`loader.tune` (``model-loader tune``).
"""
