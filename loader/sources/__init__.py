"""Checkpoint sources: fetch a checkpoint named by a URI into a local directory.

A registry maps each URI scheme to the module that handles it; a scheme's module (and its SDK)
is imported only when a URI of that scheme is fetched.

========================  =====================================================================
URI                       handled by
========================  =====================================================================
``/abs/path``, ``rel``    :mod:`loader.sources.local` (returned in place; ``copy=True`` copies)
``file:///abs/path``      :mod:`loader.sources.local`
``gs://bucket/prefix``    :mod:`loader.sources.gcs` (google-cloud-storage)
``hf://org/name@rev``     :mod:`loader.sources.hf` (huggingface_hub)
========================  =====================================================================

:func:`fetch` is the one entry point: ``fetch(uri, dest) -> FetchResult``. Objects under a
URI's prefix land under ``dest`` with paths relative to the prefix. Every backend downloads to
temporary names and moves a file into place only after it was verified, so a rerun skips what
is complete and fetches only what is missing.
"""

from __future__ import annotations

import importlib
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from loader import fs
from loader.errors import SourceError, TransientSourceError
from loader.limits import RETRY_DEADLINE_S, WORKERS
from loader.sources.fingerprint import Fingerprint

#: URI scheme -> module that implements ``fetch_source(uri: SourceURI, dest, options)``.
SCHEMES: dict[str, str] = {
    "file": "loader.sources.local",
    "gs": "loader.sources.gcs",
    "hf": "loader.sources.hf",
}


@dataclass(frozen=True)
class SourceURI:
    """A parsed source URI.

    ``location`` is scheme specific: the absolute path for ``file``, the bucket for ``gs``, the
    repository id (``org/name``) for ``hf``. ``path`` is the object prefix within a bucket
    (``""`` for the whole bucket and for other schemes). ``revision`` is the revision written
    in the URI (``hf://org/name@rev``), else ``None``.
    """

    raw: str
    scheme: str
    location: str
    path: str = ""
    revision: str | None = None

    @property
    def canonical(self) -> str:
        """One spelling per source: ``file:///normalised/absolute/path`` (a relative path, its
        absolute form and its ``file://`` form are the same source), ``gs://BUCKET[/PREFIX]``
        (no trailing slash), ``hf://ORG/NAME[@REVISION]``. The model key hashes this string."""
        if self.scheme == "file":
            return f"file://{self.location}"
        if self.scheme == "gs":
            return f"gs://{self.location}/{self.path}" if self.path else f"gs://{self.location}"
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.scheme}://{self.location}{rev}"


@dataclass
class FetchResult:
    """What a fetch produced.

    ``path`` is the local checkpoint directory; ``revision`` the resolved source revision (a
    Hugging Face commit, a digest of GCS object generations) or ``None`` for local paths;
    ``files`` the fetched files as POSIX paths relative to ``path``; ``bytes`` their total size.
    ``downloaded_bytes`` counts only what was transferred by this call (0 when everything was
    already present and verified). ``fingerprint`` is what was fetched (see
    :mod:`loader.sources.fingerprint`); ``None`` for local sources (see :func:`fingerprint`).
    ``origins``: the remote object each file was verified against (empty for local sources).
    """

    path: Path
    revision: str | None
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    downloaded_bytes: int = 0
    fingerprint: Fingerprint | None = None
    #: Each file (relative to ``path``) that was compared with the checksum its remote source
    #: lists, with the object it came from (``gs://bucket/name``, ``hf://repo@commit/file``):
    #: a file that matched it yet does not parse is corrupt at that source.
    origins: dict[str, str] = field(default_factory=dict)
    #: Each file (relative to ``path``) a remote fetch verified, with its
    #: :data:`~loader.fs.Stamp` then: a reader opening another (renamed over it, written
    #: since) refuses it (:func:`loader.fs.as_checked`). Empty for local sources.
    stamps: dict[str, fs.Stamp] = field(default_factory=dict)


@dataclass(frozen=True)
class FetchOptions:
    """Options every backend receives; each backend reads the ones that concern it."""

    copy: bool = False
    workers: int | None = None
    hf_token: str | None = None
    hf_token_file: str | None = None
    check_disk_space: bool = True
    retry_deadline_s: float = RETRY_DEADLINE_S.default
    slice_bytes: int | None = None
    #: Hooks a caller that consumes files as they arrive gives (gs:// and hf:// read them; see
    #: :class:`ArrivalHooks`).
    hooks: ArrivalHooks | None = None


@dataclass(frozen=True)
class ArrivalHooks:
    """How a caller that consumes a checkpoint while it downloads steers a fetch (gs://, hf://).

    ``include(relpath)``: whether to fetch that file now (others are listed, fingerprinted and
    left alone). ``skip``: files not to download (their content is already used). ``arrived
    (relpath, path, stamp)``: called from a download thread once a file is verified and in place
    (also for files found already present), with the :data:`~loader.fs.Stamp` of the file
    verified (what is at ``path`` when it is opened may be another's); an exception it raises
    stops the fetch.
    ``admit(relpath)``: called before a file's download starts; False means "not yet" and is
    asked again a moment later (an exception it raises stops the fetch). Small files are
    fetched first, then large ones in name order. ``transient``: the caller deletes the files
    soon after they arrive, so neither their downloaded slices nor the verified files are
    fsynced (a file the kernel drops before writing it back never costs a disk write; after a
    power loss the next run reads back the slices a killed run wrote, so its checksum still
    catches one that was lost, and the file is downloaded again). ``planned``: the revision
    (:attr:`FetchResult.revision`) of the fetch the caller planned from (an earlier fetch of
    the small files): a fetch that finds the source at another revision downloads nothing
    (:func:`check_planned`), so what the caller consumes is always of the revision it planned
    from and records.
    """

    include: Callable[[str], bool] | None = None
    skip: frozenset[str] = frozenset()
    arrived: Callable[[str, Path, fs.Stamp], None] | None = None
    admit: Callable[[str], bool] | None = None
    transient: bool = False
    planned: str | None = None


def check_planned(uri: SourceURI, hooks: ArrivalHooks | None, revision: str) -> None:
    """A :class:`~loader.errors.TransientSourceError` when ``revision``, what the source holds
    now, is not the revision the caller planned from (``hooks.planned``): the source changed
    while it was loading (a branch moved, an object was uploaded again); nothing of the new
    revision is downloaded, so nothing of it is converted under the old one's name."""
    planned = hooks.planned if hooks is not None else None
    if planned is not None and revision != planned:
        raise TransientSourceError(
            f"The source {uri.raw} changed while it was loading (revision {planned} is now "
            f"{revision}); nothing of the new revision was downloaded or published.",
            "Run the loader again once the upload (or copy) is complete.",
        )


def parse_uri(uri: str) -> SourceURI:
    """Parse a source URI (or a plain path) into a :class:`SourceURI`.

    Raises :class:`~loader.errors.SourceError` for an empty URI, an unknown scheme or a URI
    without the parts its scheme needs.
    """
    if not uri or not uri.strip():
        raise SourceError("The source URI is empty.")
    if "://" not in uri:
        _refuse_a_mistyped_scheme(uri)
        try:
            path = Path(uri).expanduser()
        except RuntimeError:  # ~USER of no user on this machine
            raise SourceError(
                f"The source {uri!r} starts with {uri.split('/', 1)[0]!r}, the home directory "
                "of a user this machine does not have.",
                "Write the path in full (or ~/PATH for your own home directory).",
            ) from None
        return SourceURI(raw=uri, scheme="file", location=_normal_path(path))
    scheme = uri.split("://", 1)[0].lower()
    parser = _PARSERS.get(scheme)
    if parser is None:
        raise SourceError(
            f"Unsupported source URI scheme {scheme!r} in {uri!r}.",
            f"Use one of: {', '.join(s + '://' for s in sorted(SCHEMES))}, or a plain local path.",
        )
    return parser(uri)


_MISTYPED = re.compile(r"^(?P<scheme>[A-Za-z]+):/{0,3}(?P<rest>.*)$")


def _refuse_a_mistyped_scheme(uri: str) -> None:
    """``hf:/org/name`` or ``gs:bucket`` is a URI with its slashes wrong, not a local path
    (unless a path of that name exists)."""
    match = _MISTYPED.match(uri)
    if not match or match["scheme"].lower() not in SCHEMES or Path(uri).exists():
        return
    scheme, rest = match["scheme"].lower(), match["rest"]
    fixed = f"file:///{rest.lstrip('/')}" if scheme == "file" else f"{scheme}://{rest}"
    raise SourceError(
        f"Source {uri!r} is neither a {scheme}:// URI (two slashes after '{scheme}:') nor an existing "
        "local path.",
        f"Did you mean {fixed}?",
    )


def _parse_file(uri: str) -> SourceURI:
    try:
        parts = urlsplit(uri)
    except ValueError as exc:  # a '[' or ']' in the host part: "Invalid IPv6 URL"
        raise SourceError(
            f"file:// URI {uri!r} does not parse ({exc}).",
            "Write local paths as file:///absolute/path (three slashes) or as a plain path.",
        ) from None
    if parts.netloc not in ("", "localhost"):
        raise SourceError(
            f"file:// URI {uri!r} names a host ({parts.netloc!r}).",
            "Write local paths as file:///absolute/path (three slashes) or as a plain path.",
        )
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise SourceError(
            f"file:// URI {uri!r} has no absolute path.",
            "Write local paths as file:///absolute/path (three slashes).",
        )
    return SourceURI(raw=uri, scheme="file", location=_normal_path(Path(path)))


def _normal_path(path: Path) -> str:
    """Absolute, with ``.``, ``..`` and repeated slashes collapsed (symbolic links are kept:
    the Helm chart computes the same string without a file system)."""
    text = re.sub("/+", "/", str(path.absolute()))
    return posixpath.normpath(text)


def _parse_gs(uri: str) -> SourceURI:
    rest = uri.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise SourceError(
            f"gs:// URI {uri!r} has no bucket name.",
            "Write Cloud Storage sources as gs://BUCKET/PREFIX.",
        )
    return SourceURI(raw=uri, scheme="gs", location=bucket, path=prefix.strip("/"))


def _parse_hf(uri: str) -> SourceURI:
    rest = uri.split("://", 1)[1]
    repo_id, at, revision = rest.partition("@")
    repo_id = repo_id.strip("/")
    parts = repo_id.split("/")
    if not repo_id or len(parts) > 2 or not all(parts):
        raise SourceError(
            f"hf:// URI {uri!r} does not name a repository.",
            "Write Hugging Face sources as hf://ORG/NAME or hf://ORG/NAME@REVISION.",
        )
    if at and not revision:
        raise SourceError(
            f"hf:// URI {uri!r} has an empty revision after '@'.",
            "Write the revision (branch, tag or commit) after '@', or drop the '@'.",
        )
    return SourceURI(raw=uri, scheme="hf", location=repo_id, revision=revision or None)


_PARSERS = {"file": _parse_file, "gs": _parse_gs, "hf": _parse_hf}


def fetch(
    uri: str,
    dest: str | Path | None = None,
    *,
    copy: bool = False,
    workers: int | None = None,
    hf_token: str | None = None,
    hf_token_file: str | None = None,
    check_disk_space: bool = True,
    retry_deadline_s: float = RETRY_DEADLINE_S.default,
    slice_bytes: int | None = None,
    hooks: ArrivalHooks | None = None,
) -> FetchResult:
    """Fetch the checkpoint at ``uri`` into ``dest`` and return where it is.

    Local directories are returned in place (``dest`` unused) unless ``copy`` is true. Remote
    sources need ``dest``; files there that are already complete and verified are kept.
    ``workers`` bounds parallel downloads (default: a per-backend choice). Hugging Face tokens
    come from ``hf_token``, the file ``hf_token_file``, or the ``HF_TOKEN`` / ``HF_TOKEN_FILE``
    environment variables. ``retry_deadline_s`` bounds the total time spent retrying transient
    failures. ``slice_bytes`` sets the byte-range size large gs:// objects are split into (each
    slice is one request and the unit a killed download resumes from). Below ``dest`` no
    symbolic link is followed, whoever calls (:func:`loader.fs.confined_within`).
    """
    parsed = parse_uri(uri)
    RETRY_DEADLINE_S.check(retry_deadline_s)
    WORKERS.check(workers)  # a pool of 0 or fewer threads is a ValueError deep in a backend
    options = FetchOptions(
        copy=copy,
        workers=workers,
        hf_token=hf_token,
        hf_token_file=hf_token_file,
        check_disk_space=check_disk_space,
        retry_deadline_s=retry_deadline_s,
        slice_bytes=slice_bytes,
        hooks=hooks,
    )
    backend = importlib.import_module(SCHEMES[parsed.scheme])
    dest_path = Path(dest).absolute() if dest is not None else None
    with fs.confined_within(dest_path):  # below DEST no link is followed, whoever calls
        return backend.fetch_source(parsed, dest_path, options)


def fingerprint(
    uri: str,
    *,
    recorded: Fingerprint | None = None,
    workers: int | None = None,
    hf_token_file: str | None = None,
    retry_deadline_s: float = RETRY_DEADLINE_S.default,
) -> Fingerprint:
    """What the source at ``uri`` holds now, without downloading it (see
    :mod:`loader.sources.fingerprint`). ``recorded``, an earlier fingerprint of the same source,
    lets a local source skip hashing files whose stat stamps did not change."""
    parsed = parse_uri(uri)
    WORKERS.check(workers)
    options = FetchOptions(
        workers=workers, hf_token_file=hf_token_file, retry_deadline_s=retry_deadline_s
    )
    backend = importlib.import_module(SCHEMES[parsed.scheme])
    return backend.fingerprint_source(parsed, options, recorded=recorded)


__all__ = [
    "SCHEMES",
    "ArrivalHooks",
    "FetchOptions",
    "FetchResult",
    "Fingerprint",
    "SourceURI",
    "check_planned",
    "fetch",
    "fingerprint",
    "parse_uri",
]
