"""The service's settings, their defaults and bounds (the command line reads them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Defaults of the command line's flags.
DEFAULT_MODEL = "llm"
DEFAULT_LISTEN = "0.0.0.0:8080"
#: Requests in flight to Triton at once: enough to keep Triton's dynamic batcher full.
DEFAULT_MAX_CONCURRENCY = 64
#: Requests waiting for a slot beyond that before a 429.
DEFAULT_MAX_QUEUE = 256
#: A completion request's body: a prompt of a whole context is tens of kilobytes.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
#: Seconds one completion may take, end to end on Triton.
DEFAULT_REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Settings:
    triton_url: str  # host:port of Triton's gRPC endpoint
    triton_model: str = DEFAULT_MODEL
    host: str = "0.0.0.0"
    port: int = 8080
    api_keys_file: Path | None = None
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    #: gRPC metadata for Triton's restricted protocols: the header's full name
    #: (``triton-grpc-protocol-<key>``) and a file holding its value.
    triton_protocol_header: str | None = None
    triton_protocol_token_file: Path | None = None

    def __post_init__(self) -> None:
        for name, low in (("max_concurrency", 1), ("max_queue", 0), ("max_body_bytes", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low} (got {getattr(self, name)})")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be above 0 (got {self.request_timeout_s})")
