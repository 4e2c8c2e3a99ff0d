"""API keys: ``Authorization: Bearer <key>`` checked against a keys file.

The file holds one key per line (blank lines and ``#`` comments skipped); it is the mounted
Kubernetes Secret in the chart. It is read again when it changes (a rotated Secret), at most
once a second. Without a keys file every request is admitted.
"""

from __future__ import annotations

import errno
import hmac
import os
import stat
import time
from pathlib import Path

from completions_service.errors import Unauthorized

#: Seconds between looks at the keys file's modification time.
RELOAD_INTERVAL_S = 1.0


class KeyFileError(ValueError):
    """The keys file cannot be used (missing, unreadable, no key in it)."""


#: A keys or token file larger than this is not one (a mistaken path: a log, a device).
SECRET_FILE_BYTES = 1 << 20


def read_secret_file(path: Path) -> str:
    """The text of the small regular file ``path`` (a link is followed: a mounted Secret is
    one). A FIFO, socket, device or directory is refused without being read (a FIFO would
    block the service for ever); so is a file over :data:`SECRET_FILE_BYTES`. ``OSError`` or
    ``UnicodeDecodeError`` otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, socket, device or directory)")
        if found.st_size > SECRET_FILE_BYTES:
            raise OSError(errno.EFBIG, f"larger than {SECRET_FILE_BYTES} bytes")
        data = os.read(fd, SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return data.decode("utf-8")


def read_header_value(path: Path) -> str:
    """The value of a gRPC header held in the file ``path`` (:func:`read_secret_file`), white
    space around it dropped. gRPC sends only printable ASCII as a header's value: a token
    holding a line break or another character is refused here (``ValueError``, naming what
    it holds), where gRPC failed each call to Triton with an internal error."""
    value = read_secret_file(path).strip()
    wrong = next((c for c in value if not " " <= c <= "~"), None)
    if wrong is not None:
        raise ValueError(
            f"it holds {wrong!r}, which a gRPC header cannot carry (printable ASCII only): put "
            "the token alone in the file"
        )
    return value


def read_keys(path: Path) -> tuple[str, ...]:
    try:
        text = read_secret_file(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read the API keys file {path}: {exc}") from exc
    keys = tuple(
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    )
    if not keys:
        raise KeyFileError(
            f"the API keys file {path} holds no key; put one key per line in it, or leave "
            "--api-keys-file out to admit every request"
        )
    return keys


class ApiKeys:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._keys = read_keys(path) if path is not None else ()
        self._stamp = self._mtime()
        self._checked = time.monotonic()

    def _mtime(self) -> int | None:
        if self.path is None:
            return None
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return None

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_INTERVAL_S:
            return
        self._checked = now
        stamp = self._mtime()
        if stamp != self._stamp and stamp is not None:
            try:
                self._keys = read_keys(self.path)  # type: ignore[arg-type]
                self._stamp = stamp
            except KeyFileError:
                pass  # keep the keys we have while the Secret is being rewritten

    def check(self, authorization: str | None) -> None:
        """Raise 401 unless ``authorization`` is ``Bearer <a key in the file>``."""
        if self.path is None:
            return
        self._refresh()
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
        given = token.encode()
        if not any(hmac.compare_digest(given, key.encode()) for key in self._keys):
            raise Unauthorized("incorrect API key provided")
