"""What a failed storage or Hub call means, and the one place that retries it.

gs:// and hf:// sources run every remote call through a :class:`Funnel`:

* :func:`is_transient` says whether a failure is worth retrying: connection problems and
  timeouts (requests, urllib3, httpx and httpcore, huggingface_hub's forks of them httpx2 and
  httpcore2, the standard library's), HTTP 408, 429 and 5xx.
* :func:`retry_after_s` reads the server's ``Retry-After`` (seconds or an HTTP date); the
  funnel never asks again sooner than that.
* A permanent failure becomes a typed :class:`~loader.errors.SourceError` naming what was
  read: a host name that does not resolve first (:func:`dns_error`: never retried), a
  failure of the settings next (:func:`settings_error`: a URL without a usable scheme,
  offline mode, a certificate that does not verify; never retried), the source's own
  mapping (:data:`Specific`: credentials, gated repositories, missing revisions), then the
  HTTP status (401/403 permission, 404 not found; 412, replaced meanwhile, is transient: the
  upload is in progress), and any other failure of the source's libraries
  (:func:`library_error`: a value they refuse). ``tests/test_failure_classes.py`` checks
  every exception class those libraries define.
* Retrying ends at the deadline (``--retry-deadline``) with a
  :class:`~loader.errors.TransientSourceError` (exit code 75) quoting the last failure.

The retrying itself is the libraries': ``google.api_core.retry.Retry`` handed to
google-cloud-storage's calls (:meth:`Funnel.gcs`; the library then resumes an
interrupted ranged read from its last byte), tenacity around everything else
(:meth:`Funnel.__call__`).
"""

from __future__ import annotations

import email.utils
import logging
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from loader.errors import (
    LoaderError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    TransientSourceError,
    one_line,
    redacted,
    resource_exhaustion,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: HTTP statuses worth retrying.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Backoff: the first pause, its growth per attempt and its ceiling (seconds).
INITIAL_S = 0.5
MULTIPLIER = 2.0
MAX_DELAY_S = 30.0

#: A source's own reading of a failure: ``(exc, what) -> typed error`` or ``None``.
Specific = Callable[[BaseException, str], SourceError | None]


def _causes(exc: BaseException):
    """``exc`` and the exceptions it was raised from or during, innermost last."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )


def described(exc: BaseException) -> str:
    """``Type: message`` of a failure for a message or the log, on one line
    (:func:`~loader.errors.one_line`), credentials in URLs :func:`redacted`."""
    try:
        text = str(exc)
    except Exception:  # an exception built without the fields its __str__ reads
        text = "(no message)"
    return f"{type(exc).__name__}: {one_line(redacted(text))}"


def _response(exc: BaseException) -> Any:
    """The HTTP response an exception carries (``exc.response`` or, for google-cloud-storage's
    ``InvalidResponse``, its first argument), else ``None``."""
    response = getattr(exc, "response", None)
    if response is not None:
        return response
    return next((a for a in getattr(exc, "args", ()) if hasattr(a, "status_code")), None)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status behind a failure (google.api_core's ``code``, a ``response``'s
    ``status_code``), looking through the exceptions it was raised from."""
    for current in _causes(exc):
        code = getattr(current, "code", None)
        if isinstance(code, int) and 100 <= code < 600:
            return code
        code = getattr(_response(current), "status_code", None)
        if isinstance(code, int):
            return code
    return None


def retry_after_s(exc: BaseException, *, now: float | None = None) -> float | None:
    """The wait a ``Retry-After`` header of the failure's response asks for, in seconds."""
    for current in _causes(exc):
        headers = getattr(_response(current), "headers", None)
        value = headers.get("Retry-After") if headers is not None else None
        if value is None:
            continue
        value = str(value).strip()
        if value.isascii() and value.isdigit():  # (int() and float() refuse "²")
            return float(value)
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection and timeout errors of the HTTP stacks the SDKs use (those installed)."""
    import http.client

    errors: list[type[BaseException]] = [
        ConnectionError,
        TimeoutError,
        http.client.IncompleteRead,
        http.client.RemoteDisconnected,
    ]
    try:
        import requests
        import urllib3

        errors += [
            requests.exceptions.ConnectionError,
            requests.exceptions.Timeout,
            requests.exceptions.ChunkedEncodingError,
            urllib3.exceptions.ProtocolError,
            urllib3.exceptions.TimeoutError,
        ]
    except ImportError:
        pass
    try:  # a token request of the Google credentials (a metadata server, a token URL) that
        # failed to connect or timed out: google.auth wraps the HTTP stack's error in its own
        import google.auth.exceptions

        errors.append(google.auth.exceptions.TransportError)
    except ImportError:
        pass
    for name in ("httpx", "httpx2"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        errors += [module.TransportError, module.RemoteProtocolError]
    for name in ("httpcore", "httpcore2"):  # what httpx wraps, should one come through as is
        try:
            module = __import__(name)
        except ImportError:
            continue
        errors += [module.NetworkError, module.TimeoutException, module.RemoteProtocolError]
    return tuple(errors)


def _everything_in(exc: BaseException):
    """``exc``, its causes and contexts, and the exceptions the HTTP stacks keep as an
    attribute (``reason``) or an argument (requests wraps urllib3's error that way)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        found = [current.__cause__, current.__context__, getattr(current, "reason", None),
                 *getattr(current, "args", ())]  # fmt: skip
        todo += [e for e in found if isinstance(e, BaseException)]


def name_resolution_failure(exc: BaseException) -> BaseException | None:
    """The DNS failure behind ``exc``, if any: a host name that does not resolve is a wrong
    host or a missing egress rule (DNS blocked), never worth retrying for minutes."""
    for found in _everything_in(exc):
        if isinstance(found, socket.gaierror) or type(found).__name__ == "NameResolutionError":
            return found
    return None


def dns_error(exc: BaseException, what: str) -> SourceError | None:
    """The typed error of a DNS failure while reading ``what`` (None: not one)."""
    found = name_resolution_failure(exc)
    if found is None:
        return None
    return SourceError(
        f"Cannot resolve the host of {what}: {one_line(redacted(str(found)))}.",
        "Check the host name (the URI, HF_ENDPOINT, STORAGE_EMULATOR_HOST or a proxy "
        "setting) and that this pod may reach DNS and that host (a NetworkPolicy egress "
        "rule for port 53 and for the storage endpoint).",
    )


#: Failures of the settings, not of the network: retrying cannot help. Class names, as each
#: HTTP stack (httpx and its fork, requests, huggingface_hub) spells them, each with its hint.
_SETTINGS_FAILURES: dict[str, str] = {
    "UnsupportedProtocol": "Write the endpoint as http://HOST[:PORT] or https://HOST[:PORT] "
    "(HF_ENDPOINT, STORAGE_EMULATOR_HOST, a proxy setting).",
    "OfflineModeIsEnabled": "Unset HF_HUB_OFFLINE (the Hub library refuses every request while "
    "it is set).",
    "SSLCertVerificationError": "Check the endpoint's host name and certificate; behind a proxy "
    "that presents its own certificate, point REQUESTS_CA_BUNDLE / SSL_CERT_FILE at its CA.",
}


def settings_failure(exc: BaseException) -> tuple[BaseException, str] | None:
    """The failure behind ``exc`` that a setting causes (a URL without a usable scheme,
    offline mode, a certificate that does not verify) and its hint; None if none."""
    for found in _everything_in(exc):
        for cls in type(found).__mro__:
            if cls.__name__ in _SETTINGS_FAILURES:
                return found, _SETTINGS_FAILURES[cls.__name__]
    return None


def settings_error(exc: BaseException, what: str) -> SourceError | None:
    """The typed error of a failure a setting causes while reading ``what`` (None: not one)."""
    found = settings_failure(exc)
    if found is None:
        return None
    cause, hint = found
    return SourceError(f"Reading {what} cannot work as set up: {described(cause)}", hint)


#: The libraries a remote source calls (their top-level packages): an exception of theirs, or
#: one raised from their code (a ``ValueError`` about an option), is about the source or the
#: options given, never a bug of the loader.
LIBRARIES = ("google", "requests", "urllib3", "huggingface_hub", "httpx", "httpcore", "httpx2",
             "httpcore2", "tenacity")  # fmt: skip


def _from_libraries(exc: BaseException) -> bool:
    """Whether a source's library raised ``exc``: its class is one of theirs, or the innermost
    frame of its traceback outside Python's standard library is theirs (a response's body
    decoded by ``json`` or ``codecs`` on a library's behalf fails in the standard library)."""
    if type(exc).__module__.split(".")[0] in LIBRARIES:
        return True
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0])
        tb = tb.tb_next
    for module in reversed(frames):
        if module not in sys.stdlib_module_names:
            return module in LIBRARIES
    return False


def library_error(exc: BaseException, what: str) -> SourceError | None:
    """The typed error of a failure a source's library raised that nothing more specific
    names (a value it refuses, a response it cannot parse); None for anything else."""
    if not isinstance(exc, Exception) or not _from_libraries(exc):
        return None
    return SourceError(
        f"Reading {what} failed: {described(exc)}",
        "Check the source URI and the options given for it (run with -v for the library's "
        "details).",
    )


def is_transient(exc: BaseException) -> bool:
    """Connection problems, timeouts, 408/429/5xx: worth retrying. A typed error of ours
    never is (it was already judged permanent), nor a host name that does not resolve, nor a
    failure of the settings (:func:`settings_failure`)."""
    if isinstance(exc, SourceError):
        return False
    if name_resolution_failure(exc) is not None or settings_failure(exc) is not None:
        return False
    if isinstance(exc, _transport_errors()) or _retryable_by_its_library(exc):
        return True
    return status_of(exc) in TRANSIENT_STATUS


def _retryable_by_its_library(exc: BaseException) -> bool:
    """google.auth's own word that a failure may pass (``retryable``: a token endpoint that
    answered 429 or 5xx, after its own retries): a :class:`RefreshError` otherwise means
    credentials that cannot work."""
    try:
        from google.auth.exceptions import GoogleAuthError
    except ImportError:
        return False
    return isinstance(exc, GoogleAuthError) and getattr(exc, "retryable", False) is True


def sentence(what: str) -> str:
    """``what`` to start a sentence: its first letter capitalised, unless it starts with a
    URI (``hf://``, ``gs://``), which keeps its spelling."""
    if "://" in what.split(" ", 1)[0]:
        return what
    return what[:1].upper() + what[1:]


def by_status(exc: BaseException, what: str, *, permission_hint: str) -> SourceError | None:
    """The typed error an HTTP status stands for; ``None`` if it names none."""
    status = status_of(exc)
    if status in (401, 403):
        return SourcePermissionError(
            f"Permission denied reading {what} ({status}).", permission_hint
        )
    if status == 404:
        return SourceNotFoundError(
            f"{sentence(what)} does not exist (404).", "Check the names in the URI."
        )
    if status == 412:
        return TransientSourceError(
            f"{what} was replaced while it was being downloaded (412).",
            "Run the loader again once the upload has finished.",
        )
    return None


def _gave_up(what: str, attempts: int, started: float, exc: BaseException) -> TransientSourceError:
    return TransientSourceError(
        f"{what} kept failing for {time.monotonic() - started:.0f} s ({attempts} attempts); "
        f"last error: {described(exc)}",
    )


class Funnel:
    """Runs a source's remote calls: transient failures retried until ``deadline_s`` (honouring
    ``Retry-After``), permanent ones turned into typed errors (``specific`` first, then
    :func:`by_status` with ``permission_hint``)."""

    def __init__(
        self,
        deadline_s: float,
        *,
        specific: Specific | None = None,
        permission_hint: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.deadline_s = deadline_s
        self.specific = specific
        self.permission_hint = permission_hint
        self.sleep = sleep

    # --- typed errors ---------------------------------------------------------------------

    def typed(self, exc: BaseException, what: str) -> LoaderError | None:
        """The typed error a permanent failure stands for (``None``: not one we can name);
        memory or threads running out, even inside a library, is transient
        (:func:`~loader.errors.resource_exhaustion`), never a permanent source error."""
        if isinstance(exc, SourceError):
            return exc
        if (exhausted := resource_exhaustion(exc)) is not None:
            return exhausted
        if (dns := dns_error(exc, what) or settings_error(exc, what)) is not None:
            return dns
        if self.specific is not None and (found := self.specific(exc, what)) is not None:
            return found
        hint = self.permission_hint or SourcePermissionError.default_remediation
        return by_status(exc, what, permission_hint=hint) or library_error(exc, what)

    # --- retrying -------------------------------------------------------------------------

    def _on_error(self, what: str, attempts: list[int], started: float) -> Callable:
        def on_error(exc: BaseException) -> None:
            attempts[0] += 1
            wait = retry_after_s(exc)
            log.warning(
                "%s failed (attempt %s: %s); retrying%s",
                what,
                attempts[0],
                described(exc),
                f" after the server's Retry-After of {wait:g} s" if wait else "",
            )
            if wait:
                # The backoff pause follows; together they wait at least what the server asked
                # for, never past the deadline.
                left = started + self.deadline_s - time.monotonic()
                self.sleep(max(0.0, min(wait, left)))

        return on_error

    def _typed_or_raise(self, exc: Exception, what: str) -> LoaderError:
        typed = self.typed(exc, what)
        if typed is None or typed is exc:
            raise exc
        return typed

    def gcs(self, call: Callable[[Any], T], *, what: str) -> T:
        """``call(retry)``: a google-cloud-storage call given a ``google.api_core.retry.Retry``
        that retries :func:`is_transient` failures with exponential backoff until the
        deadline; failures typed, one still failing at the deadline a
        :class:`TransientSourceError`."""
        from google.api_core.exceptions import RetryError
        from google.api_core.retry import Retry

        attempts = [0]
        started = time.monotonic()
        retry = Retry(
            predicate=is_transient,
            initial=INITIAL_S,
            maximum=MAX_DELAY_S,
            multiplier=MULTIPLIER,
            timeout=self.deadline_s,
            on_error=self._on_error(what, attempts, started),
        )
        try:
            return call(retry)
        except RetryError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            raise _gave_up(what, attempts[0], started, cause) from exc
        except Exception as exc:
            raise self._typed_or_raise(exc, what) from exc

    def __call__(self, fn: Callable[[], T], *, what: str) -> T:
        """Run ``fn`` until it succeeds (tenacity: exponential backoff with jitter,
        ``Retry-After`` honoured); permanent failures typed at once."""
        import tenacity

        started = time.monotonic()
        attempts = [0]
        on_error = self._on_error(what, attempts, started)
        backoff = tenacity.wait_random_exponential(multiplier=INITIAL_S, max=MAX_DELAY_S)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_before_delay(self.deadline_s),
            wait=backoff,
            before_sleep=lambda state: on_error(state.outcome.exception()),
            sleep=self.sleep,
        )
        try:
            return retrying(fn)
        except tenacity.RetryError as exc:
            last = exc.last_attempt.exception()
            assert last is not None  # only failed attempts are retried
            raise _gave_up(what, exc.last_attempt.attempt_number, started, last) from last
        except Exception as exc:
            raise self._typed_or_raise(exc, what) from exc
