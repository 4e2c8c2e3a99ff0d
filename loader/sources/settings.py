"""The environment settings a remote source's libraries read, checked before they read them.

A value these libraries cannot use fails inside them in ways that say nothing of the setting:
huggingface_hub parses ``HF_ENDPOINT`` and its ``HF_HUB_*`` numbers when it is imported (a
``ValueError`` from the standard library), httpx refuses a token it cannot encode as a header
(``UnicodeEncodeError``), httpx refuses a negative timeout (``HF_HUB_DOWNLOAD_TIMEOUT``) only
at the first download. Each is a :class:`~loader.errors.SourceError` naming the setting here.
The Cloud Storage client reads its key file (``GOOGLE_APPLICATION_CREDENTIALS``, else gcloud's
``application_default_credentials.json``) whole, with no bound and no timeout: a FIFO there
blocks it for good, a device such as ``/dev/zero`` until memory runs out; :func:`key_files`
checks them first. The certificate authorities the HTTP libraries trust (``SSL_CERT_FILE``,
``REQUESTS_CA_BUNDLE``, ...) are read the same way, when a client is made or at each https
request: :func:`trust_files` checks them first; and so is requests' login file (``NETRC``,
``~/.netrc``), at each request: :func:`netrc_file`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import ssl
import stat
import urllib.parse
import urllib.request
from pathlib import Path
from types import ModuleType

from loader.endpoint import host_problem
from loader.errors import LoaderError, SourceError, SourcePermissionError, shown
from loader.formats import jsondoc
from loader.fs import kind_of, read_file

#: The schemes an endpoint may use.
SCHEMES = ("http", "https")


def endpoint(variable: str) -> str | None:
    """The URL in the environment variable ``variable`` (None: unset or empty), refused unless
    it is ``http(s)://HOST[:PORT][/PATH]``."""
    value = os.environ.get(variable) or None
    if value is None:
        return None
    why = _url_problem(value)
    if why is not None:
        raise SourceError(
            f"{variable}={_without_password(value)!r} is not a URL the loader can use ({why}).",
            f"Set {variable} to http://HOST[:PORT] or https://HOST[:PORT], or unset it.",
        )
    return value


def _without_password(value: str) -> str:
    """``value`` with what a URL holds before ``@`` (a user name and password) as ``***``."""
    scheme, sep, rest = value.partition("://")
    return (
        f"{scheme}{sep}***@{rest.split('@', 1)[1]}" if sep and "@" in rest.split("/")[0] else value
    )


def _url_problem(value: str, schemes: tuple[str, ...] = SCHEMES) -> str | None:
    if not value.isprintable() or any(c.isspace() for c in value):
        return "it holds a space or a control character"
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port  # parsed on access: out of range or not a number raises
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in schemes:
        return f"the scheme must be {', '.join(schemes[:-1])} or {schemes[-1]}"
    if not parts.hostname:
        return "it names no host"
    if port == 0:
        return "port 0 is no port"
    return host_problem(parts.hostname)  # None: a name a resolver can look up


def import_hub(name: str = "huggingface_hub") -> ModuleType:
    """Import huggingface_hub (or one of its modules): it reads its ``HF_*`` settings at import,
    and a value it cannot parse is an error naming them, not a traceback."""
    if os.environ.get("HF_ENDPOINT") == "":  # the library takes it as its endpoint
        raise SourceError(
            "HF_ENDPOINT is set but empty: the Hugging Face Hub library would send its requests "
            "to no host.",
            "Unset HF_ENDPOINT (https://huggingface.co), or set it to http://HOST[:PORT] or "
            "https://HOST[:PORT].",
        )
    endpoint("HF_ENDPOINT")
    trust_files(HUB_TRUST)
    proxies(HUB_PROXIES)
    try:
        module = importlib.import_module(name)
    except (ValueError, TypeError) as exc:
        settings = sorted(k for k in os.environ if k.startswith(("HF_", "HUGGINGFACE_")))
        raise SourceError(
            f"The Hugging Face Hub library refuses its settings in the environment ({exc}).",
            f"Check these environment variables, or unset them: {', '.join(settings)}.",
        ) from exc
    _hub_timeouts()
    return module


#: The Hub library's timeouts (seconds) read from the environment at its import: a negative
#: one is taken as it is (0 or unset is its default), and refused by the HTTP library only at
#: the first download, as a failure of "the source".
HUB_TIMEOUTS = ("HF_HUB_DOWNLOAD_TIMEOUT", "HF_HUB_ETAG_TIMEOUT")


def _hub_timeouts() -> None:
    from huggingface_hub import constants

    for variable in HUB_TIMEOUTS:
        value = getattr(constants, variable, None)
        if isinstance(value, int | float) and not value > 0:
            raise SourceError(
                f"{variable}={os.environ.get(variable, str(value))!r} is no timeout (the Hugging "
                "Face Hub library reads it in seconds).",
                f"Set {variable} to a number of seconds more than 0, or unset it (10 s).",
            )


def token(value: str, source: str) -> str:
    """A Hub token from ``source`` (a flag or a variable), refused unless it is one word of
    visible ASCII: it travels as an HTTP header, which holds nothing else."""
    if not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
        raise SourcePermissionError(
            f"The Hugging Face token from {source} holds more than one word of visible ASCII "
            "(a space, a line break, a control or non-ASCII character).",
            f"Set {source} to the token itself (hf_...), nothing around it.",
        )
    return value


#: The largest key file the Cloud Storage client is let read: a service account key or an
#: external account's configuration is a few kB.
MAX_KEY_FILE_BYTES = 2**20

_KEY_FIX = (
    "Set GOOGLE_APPLICATION_CREDENTIALS to a service account key file (JSON), or unset it to "
    "use the environment's credentials (Workload Identity in GKE)."
)


def key_files() -> None:
    """Refuse a Google credentials file the client would read unbounded: what
    ``GOOGLE_APPLICATION_CREDENTIALS`` names (set and not empty), and gcloud's default
    credentials file where it exists, must each be a regular file (through links) of at most
    :data:`MAX_KEY_FILE_BYTES`; so must the file an external account's configuration (workload
    identity federation) names for its subject token (``credential_source.file``), which the
    client reads at each token refresh. A missing file is left to the client (its own error)."""
    named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or None
    if named is not None:
        _key_file(named, f"GOOGLE_APPLICATION_CREDENTIALS={named!r} names", _KEY_FIX)
        _token_files(named, "GOOGLE_APPLICATION_CREDENTIALS")
        return  # the client reads only this one
    from google.auth import _cloud_sdk

    default = _cloud_sdk.get_application_default_credentials_path()
    fix = (
        "Remove it or replace it with the file `gcloud auth application-default login` "
        "writes, or set GOOGLE_APPLICATION_CREDENTIALS to a key file."
    )
    _key_file(default, f"gcloud's default credentials file {shown(default)} is", fix)
    _token_files(default, f"gcloud's default credentials file {shown(default)}")


def _key_file(path: str, subject: str, fix: str, kind: str = "a key file") -> None:
    try:
        found = os.stat(path)
    except (OSError, ValueError):
        return  # missing, a dangling link, a NUL: the client's own error names it
    _small_file(found, subject, fix, kind, kind)


def _small_file(found: os.stat_result, subject: str, fix: str, kind: str, not_kind: str) -> None:
    """Refuse what ``found`` describes unless it is a regular file of at most
    :data:`MAX_KEY_FILE_BYTES` (``subject``: "<the setting> names", ``not_kind``: what it
    then is not, "a key file" or "a file")."""
    if not stat.S_ISREG(found.st_mode):
        raise SourcePermissionError(f"{subject} {kind_of(found.st_mode)}, not {not_kind}.", fix)
    if found.st_size > MAX_KEY_FILE_BYTES:
        raise SourcePermissionError(
            f"{subject} a file of {found.st_size} bytes, too large to be {kind} "
            f"(at most {MAX_KEY_FILE_BYTES} bytes).",
            fix,
        )


def _token_files(path: str, named_by: str) -> None:
    """Check the subject-token file the credentials file ``path`` (already checked) names, as
    :func:`_key_file` checks a key file. A file that cannot be read or parsed here is left to
    the client (its own error)."""
    try:
        info = jsondoc.loads(read_file(Path(path), limit=MAX_KEY_FILE_BYTES))
    except (OSError, ValueError, LoaderError):
        return
    source = info.get("credential_source") if isinstance(info, dict) else None
    token = source.get("file") if isinstance(source, dict) else None
    if isinstance(token, str) and token:
        _key_file(
            token,
            f"The subject token file {shown(token)} that {named_by} names "
            "(credential_source.file) is",
            "Point credential_source.file at the file holding the identity provider's token "
            "(a regular file, which the platform rewrites), or set "
            "GOOGLE_APPLICATION_CREDENTIALS to another credentials file.",
            kind="a token file",
        )


#: The login files requests (``gs://``) reads for the credentials of each host it asks: the
#: one ``NETRC`` names, else the first of these in the home directory that exists.
NETRC_FILES = (".netrc", "_netrc")
#: The device number of ``/dev/null``: a login file there reads empty (the usual way to turn
#: the login file off).
_DEV_NULL = os.makedev(1, 3)


def netrc_file() -> None:
    """Refuse the login file requests would read (:data:`NETRC_FILES`) unless it is a regular
    file (through links) of at most :data:`MAX_KEY_FILE_BYTES`: requests reads it whole, with
    no timeout, before each request. A FIFO there held ``fetch gs://`` for good, past
    ``--retry-deadline`` (a device such as ``/dev/zero``: until memory ran out). A missing one,
    or a directory, is skipped, as requests skips it; ``/dev/null`` holds no logins, as requests
    reads it. ``NETRC=~/...`` is the file in the home directory, as requests reads it (it was
    looked for under a directory named ``~``)."""
    named = os.environ.get("NETRC")
    if named is not None:  # requests expands a leading ~ of it too
        path = os.path.expanduser(named)
        subject = f"NETRC={named!r}" + ("" if path == named else f" ({shown(path)})")
        candidates = [(path, f"{subject} names")]
    else:
        candidates = [(os.path.expanduser(f"~/{name}"), None) for name in NETRC_FILES]
    for path, subject in candidates:
        try:
            found = os.stat(path)
        except (OSError, ValueError):
            continue  # missing, a dangling link: requests looks no further at it either
        if stat.S_ISDIR(found.st_mode):
            return  # requests fails to open it and goes on without
        if stat.S_ISCHR(found.st_mode) and found.st_rdev == _DEV_NULL:
            return  # NETRC=/dev/null (or a link to it): no logins, as requests reads it
        subject = subject or f"The login file {shown(path)} (read for gs:// sources) is"
        fix = (
            "Replace it with a netrc file (machine HOST login NAME password SECRET lines), "
            "remove it, or set NETRC to the path of another one."
        )
        _small_file(found, subject, fix, "a netrc file", "a file")
        return  # requests reads the first one there


#: The settings naming the certificate authorities an HTTP library trusts, in the order it
#: reads them (only the first one set counts), and what each may name. httpx (``hf://``)
#: reads ``SSL_CERT_FILE``, else ``SSL_CERT_DIR``, as it makes its client; requests
#: (``gs://``) reads ``REQUESTS_CA_BUNDLE``, else ``CURL_CA_BUNDLE`` (a file or a directory
#: of certificates), at each https request. Each opens a file by its path with no timeout: a
#: FIFO there held the loader for good (past every deadline); a missing file, or one holding no
#: certificate, failed as a traceback (exit 1).
HUB_TRUST = (("SSL_CERT_FILE", ("a file",)), ("SSL_CERT_DIR", ("a directory",)))
STORAGE_TRUST = (
    ("REQUESTS_CA_BUNDLE", ("a file", "a directory")),
    ("CURL_CA_BUNDLE", ("a file", "a directory")),
)

#: The largest certificate file the loader lets a library read (a system bundle is ~200 kB).
MAX_TRUST_FILE_BYTES = 16 * 2**20


def trust_files(settings: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
    """Refuse the first of ``settings`` set (not empty) unless it names what its library can
    read: an existing file of PEM certificates (through links, at most
    :data:`MAX_TRUST_FILE_BYTES`), or a directory where the setting takes one."""
    variable, kinds = next(((v, k) for v, k in settings if os.environ.get(v)), (None, ()))
    if variable is None:
        return
    value = os.environ[variable]
    fix = (
        f"Set {variable} to the PEM file of the certificate authorities to trust (a proxy's CA "
        f"bundle), or unset it to trust the bundled ones."
    )
    try:
        found = os.stat(value)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise SourceError(
            f"{variable}={value!r} names nothing the loader can read ({reason}).", fix
        ) from None
    what = kind_of(found.st_mode)
    if what not in kinds:
        raise SourceError(f"{variable}={value!r} names {what}, not {' or '.join(kinds)}.", fix)
    if what != "a file":
        return
    if found.st_size > MAX_TRUST_FILE_BYTES:
        raise SourceError(
            f"{variable}={value!r} names a file of {found.st_size} bytes, too large to be a "
            f"certificate bundle (at most {MAX_TRUST_FILE_BYTES} bytes).",
            fix,
        )
    try:
        ssl.create_default_context(cafile=value)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
        raise SourceError(
            f"{variable}={value!r} names a file that holds no certificate the TLS library "
            f"can read ({reason}).",
            fix,
        ) from None


#: The proxy schemes each HTTP library can use, and the package a SOCKS proxy needs there:
#: httpx (``hf://``) takes socks5 with socksio, requests (``gs://``) socks4 and socks5 with
#: PySocks.
HUB_PROXIES = ("socksio", ("socks5", "socks5h"))
STORAGE_PROXIES = ("socks", ("socks4", "socks4a", "socks5", "socks5h"))


def proxies(library: tuple[str, tuple[str, ...]]) -> None:
    """Refuse a proxy setting (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, in either case)
    the HTTP library cannot use: both read them through ``urllib.request.getproxies`` (a value
    without a scheme is ``http://`` + it), httpx all of them as it makes its client. An
    unknown scheme, a port out of range or a SOCKS proxy without its package failed inside
    httpx as a traceback (exit 1), and inside requests as a failure of "the source"."""
    package, socks = library
    schemes = (*SCHEMES, *(socks if importlib.util.find_spec(package) else ()))
    found = urllib.request.getproxies()
    for scheme in ("http", "https", "all"):
        value = found.get(scheme)
        if not value:
            continue
        url = value if "://" in value else f"http://{value}"
        why = _url_problem(url, schemes)
        if why is None:
            continue
        if url.partition("://")[0].lower() in socks and url.partition("://")[0] not in schemes:
            why = f"a SOCKS proxy needs the Python module {package}, which is not installed"
        names = (f"{scheme}_proxy", f"{scheme.upper()}_PROXY")
        variable = next((n for n in names if os.environ.get(n) == value), names[1])
        raise SourceError(
            f"{variable}={_without_password(url)[len(url) - len(value) :]!r} is not a proxy "
            "the loader can use "
            f"({why}).",
            f"Set {variable} to http://HOST:PORT (the proxy's address), or unset it.",
        )
