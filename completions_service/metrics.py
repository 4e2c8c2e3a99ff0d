"""The service's Prometheus metrics (``GET /metrics``), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

# One sample per counter: the *_created series only repeat the start time.
disable_created_metrics()

#: Seconds: from a few milliseconds (a short unary answer) to minutes (a long generation).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "completions_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.errors = Counter(
            "completions_errors",
            "Requests answered with an error, by OpenAI error type and code",
            ["type", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "completions_request_duration_seconds",
            "Completion requests: from arrival to the last byte sent, by streaming or not",
            ["stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "completions_time_to_first_token_seconds",
            "Streamed completions: from arrival to the first text sent",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "completions_prompt_tokens", "Prompt tokens of finished completions", registry=r
        )
        self.completion_tokens = Counter(
            "completions_completion_tokens", "Tokens generated for finished completions", registry=r
        )
        self.cancelled = Counter(
            "completions_cancelled",
            "Completions whose client left before the end (their Triton stream was closed)",
            registry=r,
        )
        self.in_flight = Gauge(
            "completions_in_flight", "Requests holding a slot to Triton", registry=r
        )
        self.queued = Gauge(
            "completions_queued", "Requests waiting for a slot to Triton", registry=r
        )
