"""Hugging Face Hub: ``hf://org/name`` and ``hf://org/name@revision`` with ``huggingface_hub``.

* The revision (default ``main``) is resolved to a commit first; everything after that is
  pinned to the commit, which :class:`~loader.sources.FetchResult` records as ``revision``.
* Only the files a conversion needs are fetched (:func:`select_files`): ``config.json``, the
  weights in ONE format (safetensors with its index if present, else PyTorch ``.bin`` with its
  index), the tokenizer files and ``generation_config.json``. Other formats (``*.msgpack``,
  ``*.h5``, ``*.onnx``, ...) and sub-folders are left out.
* Each file is streamed with huggingface_hub's own HTTP session (its URL from ``hf_hub_url``,
  its headers from ``build_hf_headers``; redirects to the Hub's storage host are followed here,
  and the token is sent to the Hub's origin only, by the library's own requests too) into
  ``<path>.incomplete`` under ``dest/.partial/hf.<owner>/`` (named after this process,
  :mod:`loader.sources.transfer`, so a loader that lost its lock never writes into its
  successor's downloads). Everything below ``dest`` is reached through directory descriptors,
  one name at a time (:class:`loader.fs.Dir`): a file is created with ``O_EXCL``, nothing is
  opened through a link, and a name from the Hub's listing that is not a plain relative path is
  refused. A rerun resumes a stopped run's file with a ``Range`` request; if the file then fails
  its hash, the stopped run's bytes were not the file's (another commit's file of that name, or
  bytes lost in a crash) and it is downloaded again from its start before it is judged corrupt.
  Each file's hash is computed as its bytes arrive and checked against the Hub's listing
  (SHA-256 for LFS files, the git blob id otherwise); only then is the file renamed to
  ``dest/<path>``. Files already in ``dest`` that verify are not downloaded again. What the Hub
  (or a mirror) answers is checked before it is used: the revision's commit must be a git commit
  id (the one the URI names, if it names one), every listed file needs a size and a well-formed
  hash, no path is listed twice, and a name must print, fit the file system with ``.incomplete``
  and differ from the others in more than case or Unicode composition; else a
  :class:`~loader.errors.SourceError` (exit 2), nothing listed unpinned or taken unverified.
* With :class:`~loader.sources.ArrivalHooks` a caller consumes the files while the fetch goes
  on: the small files (config, index, tokenizer) come first, then the weight shards one at a
  time in name order, each started once the caller admits it; the caller hears of every file
  as soon as it is verified and in place.
* Token: ``hf_token``, else the file ``hf_token_file``, else ``$HF_TOKEN``, else the file named
  by huggingface_hub's ``$HF_TOKEN_PATH`` (``$HF_TOKEN_FILE`` is read as another name for it; a
  mounted Kubernetes Secret), else the library's own stored login (looked at first: anything
  there but a regular file is refused). It is passed to the Hub, never logged. ``$HF_ENDPOINT``
  selects a mirror of the Hub.
* Transient failures (connection errors, 429, 5xx, a connection cut mid-file) are retried with
  tenacity within the retry deadline, ``Retry-After`` honoured (:mod:`loader.sources.failures`);
  a retry resumes the file from its last byte. A body that ends cleanly before the listed size
  (closed, or a chunked one cut short) is such a cut too (:class:`CutShort`), and so is one
  that trickles (:class:`~loader.sources.transfer.Pace`). ``--workers``
  files download at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from loader import fs
from loader.errors import (
    CheckpointError,
    ChecksumMismatchError,
    NotOursError,
    ReplacedDownloadError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    TransientSourceError,
    one_line,
    redacted,
    shown,
)
from loader.formats.huggingface import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    WEIGHT_FILES,
    is_weight_file,
)
from loader.fs import Dir
from loader.progress import Progress, byte_progress, human_bytes
from loader.sources import (
    ArrivalHooks,
    FetchOptions,
    FetchResult,
    SourceURI,
    answers,
    check_planned,
    settings,
)
from loader.sources.failures import Funnel
from loader.sources.fingerprint import Fingerprint
from loader.sources.names import colliding, listed_parts
from loader.sources.transfer import (
    PARTIAL_DIR,
    Pace,
    adopt_in,
    clear_partials,
    ensure_disk_space,
    mark_dest,
    refuse_what_is_in_the_way,
    remove_own_partials_in,
)

log = logging.getLogger(__name__)

DEFAULT_REVISION = "main"
DEFAULT_WORKERS = 8
#: Small metadata fetched when present (default generation settings such as bos/eos ids).
METADATA_FILES = ("generation_config.json",)
#: Seconds between two questions to ``ArrivalHooks.admit`` about one shard.
ADMIT_POLL_S = 0.01


def select_files(names: Iterable[str], *, repo: str = "the repository") -> list[str]:
    """The files of a repository listing that a conversion needs, sorted.

    Raises :class:`~loader.errors.CheckpointError` when there is no ``config.json`` or no
    weights in a supported format.
    """
    top = {n for n in names if "/" not in n}
    if CONFIG_FILE not in top:
        raise CheckpointError(f"{repo} has no {CONFIG_FILE}; it is not a transformers checkpoint.")
    for fmt in WEIGHT_FILES:
        weights = [n for n in fmt.files(top) if n != fmt.index]
        if weights:
            chosen = fmt.files(top)
            break
    else:
        raise CheckpointError(
            f"{repo} has no weights in a supported format (found: {', '.join(sorted(top))}).",
            "Use a repository with model.safetensors or pytorch_model.bin (or their sharded "
            "form with an index); Flax, TensorFlow and ONNX weights are not converted.",
        )
    log.debug("weights format %s: %s", fmt.name, chosen)
    return sorted(
        {CONFIG_FILE, *chosen, *(t for t in (*TOKENIZER_FILES, *METADATA_FILES) if t in top)}
    )


# --- token and errors --------------------------------------------------------------------


#: Environment variables naming a token file: huggingface_hub's own, then our older name (the
#: chart's loader Job sets it for a mounted Secret).
TOKEN_FILE_VARIABLES = ("HF_TOKEN_PATH", "HF_TOKEN_FILE")


def resolve_token(options: FetchOptions) -> str | None:
    """The Hub token: ``options.hf_token``, the file ``options.hf_token_file``, ``$HF_TOKEN``,
    the file named by ``$HF_TOKEN_PATH`` (or ``$HF_TOKEN_FILE``); ``None`` leaves it to
    huggingface_hub (the token ``hf auth login`` stored, if any). Never logged.

    The file is read here, not by huggingface_hub: the library reads ``HF_TOKEN_PATH`` once at
    import and treats an unreadable or empty file as no token, where a mounted Secret that is
    missing deserves an error naming it."""
    if options.hf_token:
        return settings.token(options.hf_token, "the hf_token given")
    token_file, source = options.hf_token_file, "--hf-token-file"
    if not token_file and os.environ.get("HF_TOKEN", "").strip():
        return settings.token(os.environ["HF_TOKEN"].strip(), "HF_TOKEN")
    if not token_file:
        source = next((v for v in TOKEN_FILE_VARIABLES if os.environ.get(v)), "")
        token_file = os.environ.get(source) if source else None
        if token_file and source == "HF_TOKEN_PATH":  # as the library reads it: ~ and $NAME
            token_file = os.path.expandvars(os.path.expanduser(token_file))
    if not token_file:
        _stored_login_is_a_file()
        return None
    return _read_token_file(token_file, source)


def _stored_login_is_a_file() -> None:
    """With no token named, huggingface_hub reads the one ``hf auth login`` stored (its
    ``HF_TOKEN_PATH``, ``$HF_HOME/token``) by opening it as it is: a FIFO there would hold the
    fetch forever, a directory fail as a library error. Anything there but a regular file (a
    link to one is one: a mounted Secret) is refused first, named (exit 2); the library still
    reads the file itself (it refreshes a stored OAuth token)."""
    constants = settings.import_hub("huggingface_hub.constants")
    if constants.HF_HUB_DISABLE_IMPLICIT_TOKEN:
        return  # the library does not look for it
    if os.environ.get("HF_TOKEN_PATH") == "":  # the library takes it for the file "."
        raise SourcePermissionError(
            "HF_TOKEN_PATH is set but empty: the Hugging Face Hub library would read the "
            "working directory as its token file.",
            "Unset HF_TOKEN_PATH, or set it to the file holding the token.",
        )
    path = Path(constants.HF_TOKEN_PATH)
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return  # no stored login: no token
    except NotADirectoryError as exc:  # the library's own read fails on it, as no token
        set_by = [v for v in ("HF_TOKEN_PATH", "HF_HOME", "XDG_CACHE_HOME", "HOME")
                  if os.environ.get(v)][:1] or ["HOME"]  # fmt: skip
        raise SourcePermissionError(
            f"The stored Hugging Face login {shown(path)} (where `hf auth login` keeps the "
            f"token; from {set_by[0]}) cannot be looked at: a level of that path is a file, "
            "not a directory.",
            f"Set {set_by[0]} to a directory (HF_HOME) or to the token file (HF_TOKEN_PATH), "
            f"or unset it; or pass a token ({TOKEN_HINT}).",
        ) from exc
    except OSError as exc:
        raise SourcePermissionError(
            f"Cannot look at the stored Hugging Face login {shown(path)} ({exc.strerror}).",
            f"Pass a token ({TOKEN_HINT}), or fix or remove {shown(path)}.",
        ) from exc
    if not stat.S_ISREG(found.st_mode):
        mode = found.st_mode
        kind = (
            "a directory" if stat.S_ISDIR(mode)
            else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode)
            else "a device"
        )  # fmt: skip
        raise SourcePermissionError(
            f"The stored Hugging Face login {shown(path)} (where `hf auth login` keeps the "
            f"token, under HF_HOME) is {kind}, not a file; the loader never reads it.",
            f"Remove {shown(path)}, or pass a token ({TOKEN_HINT}).",
        )


def _read_token_file(token_file: str, source: str) -> str:
    try:  # a regular file only (a FIFO would block), and a token's size at most
        token = fs.read_file(Path(token_file), limit=64 * 1024).decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise SourcePermissionError(
            f"The Hugging Face token file {shown(token_file)} ({source}) is not text (it is not "
            "UTF-8).",
            "Put the token itself in the file (hf_...), as one line of text.",
        ) from exc
    except OSError as exc:
        raise SourcePermissionError(
            f"Cannot read the Hugging Face token file {shown(token_file)} ({source}: "
            f"{exc.strerror}).",
            f"Check {source} and that the Secret is mounted there.",
        ) from exc
    if not token:
        raise SourcePermissionError(
            f"The Hugging Face token file {shown(token_file)} ({source}) is empty.",
            "Put the token in the file (or the Kubernetes Secret).",
        )
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise SourcePermissionError(
            f"The Hugging Face token file {shown(token_file)} ({source}) holds more than one "
            "printable word.",
            "Put the token itself in the file (hf_...), as one line of text.",
        )
    return token


TOKEN_HINT = "HF_TOKEN, HF_TOKEN_PATH or --hf-token-file"


def _specific(uri: SourceURI, revision: str):
    """The Hub's own failures (gated, missing repository, revision or file) as typed errors."""

    def typed(exc: BaseException, what: str) -> SourceError | None:
        from huggingface_hub.errors import (
            GatedRepoError,
            HFValidationError,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        repo = uri.location
        if isinstance(exc, HFValidationError):
            return SourceError(
                f"{uri.raw}: the Hub does not accept {repo!r} as a repository id ({one_line(str(exc))}).",
                "Write hf://<org>/<name>[@revision] with letters, digits, '-', '_' and '.' "
                "(no '--' or '..', not starting or ending with '-' or '.').",
            )
        if isinstance(exc, GatedRepoError):
            return SourcePermissionError(
                f"{uri.raw}: the repository {repo} is gated and the token in use has no access.",
                "Accept the model's terms on the Hub with the token's account, and pass the "
                f"token ({TOKEN_HINT}).",
            )
        if isinstance(exc, RevisionNotFoundError):
            return SourceNotFoundError(
                f"{uri.raw}: the repository {repo} has no revision {revision!r}.",
                "Check the branch, tag or commit after '@' in the hf:// URI.",
            )
        if isinstance(exc, RepositoryNotFoundError):
            return SourceNotFoundError(
                f"{uri.raw}: repository {repo} at revision {revision!r} was not found, or it is "
                "private and the token in use may not read it.",
                "Check the repository id and the revision in the hf:// URI; for a private "
                f"repository pass a token ({TOKEN_HINT}).",
            )
        if isinstance(exc, RemoteEntryNotFoundError):
            return SourceNotFoundError(
                f"{uri.raw}: a file listed by the Hub is missing ({one_line(redacted(str(exc)))}).",
                "Check the repository's files at that revision.",
            )
        return None

    return typed


def _funnel(uri: SourceURI, revision: str, options: FetchOptions) -> Funnel:
    return Funnel(
        options.retry_deadline_s,
        specific=_specific(uri, revision),
        permission_hint=f"Pass a token that may read {uri.location} ({TOKEN_HINT}).",
    )


# --- verification ------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    """A file in the Hub's listing: size and the hash it must have."""

    path: str
    size: int
    blob_id: str | None
    sha256: str | None

    def hasher(self) -> Any:
        """A digest to feed the file's bytes: SHA-256 for an LFS file, else the git blob id
        (SHA-1 of ``blob <size>\\0`` and the bytes); None when the listing names neither."""
        if self.sha256:
            return hashlib.sha256()
        if self.blob_id:
            return hashlib.sha1(f"blob {self.size}\0".encode(), usedforsecurity=False)
        return None

    def matches(self, size: int, digest: Any) -> bool:
        """Whether ``size`` bytes whose digest (:meth:`hasher`) is ``digest`` are this file."""
        if size != self.size:
            return False
        return digest is None or digest.hexdigest() == (self.sha256 or self.blob_id)


#: Entries of one repository's file list at most (the largest models list a few thousand).
MAX_LISTED = 1_000_000
#: The hashes a listing entry must carry: a git blob id (SHA-1) and, for an LFS file, SHA-256.
_BLOB_ID = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _forged(uri: SourceURI, what: str) -> SourceError:
    return SourceError(
        f"{uri.raw}: the Hub's file list {what}; nothing can be verified against it, so "
        "nothing was downloaded.",
        "Check HF_ENDPOINT: the Hub, or the mirror or proxy it names, answers a file list "
        "that is not the Hub's.",
    )


def _listing(api: Any, uri: SourceURI, commit: str, token: str | None) -> dict[str, RemoteFile]:
    """The files of the listing at ``commit``, each with a size and a hash the downloaded
    bytes are checked against: an entry without them (a size that is no count of bytes, no
    well-formed blob id or SHA-256), a path that is no text, one path listed twice (pages
    that repeat would never end) or more than :data:`MAX_LISTED` entries is a forged listing
    (:class:`~loader.errors.SourceError`), never a file taken unverified."""
    files: dict[str, RemoteFile] = {}
    listed: set[str] = set()
    for entry in api.list_repo_tree(uri.location, revision=commit, recursive=True, token=token):
        path = getattr(entry, "path", None)
        seen = path if isinstance(path, str) else repr(path)  # JSON may give a list
        if seen in listed:  # pages that repeat (a loop of Link headers) never end otherwise
            raise _forged(uri, f"lists {shown(seen)} twice")
        if len(listed) >= MAX_LISTED:
            raise _forged(uri, f"lists more than {MAX_LISTED} files and folders")
        listed.add(seen)
        if not hasattr(entry, "size") or getattr(entry, "blob_id", None) is None:
            continue  # a folder
        size = entry.size
        if not isinstance(path, str):
            raise _forged(uri, f"names a file {path!r}, which is not a path")
        if type(size) is not int or size < 0:
            raise _forged(uri, f"gives {shown(path)} the size {size!r}")
        blob_id = str(entry.blob_id).lower()
        lfs = getattr(entry, "lfs", None)
        sha256 = getattr(lfs, "sha256", None) if lfs is not None else None
        if lfs is not None and not (isinstance(sha256, str) and _SHA256.fullmatch(sha256.lower())):
            raise _forged(uri, f"gives the LFS file {shown(path)} no SHA-256 ({sha256!r})")
        if lfs is None and not _BLOB_ID.fullmatch(blob_id):
            raise _forged(uri, f"gives {shown(path)} no git blob id ({entry.blob_id!r})")
        files[path] = RemoteFile(path, size, blob_id, sha256.lower() if sha256 else None)
    return files


# --- fetch -------------------------------------------------------------------------------

#: A full git commit id: a revision naming it is pinned.
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _resolve_commit(
    api: Any, uri: SourceURI, revision: str, token: str | None, funnel: Funnel
) -> str:
    """The commit ``revision`` names now: a full git commit id, or a
    :class:`~loader.errors.SourceError` (nothing is listed or downloaded unpinned, nor
    recorded under another commit than the one a commit id in the URI names)."""
    info = funnel(
        lambda: api.model_info(uri.location, revision=revision, token=token),
        what=f"{uri.raw} (model info)",
    )
    commit = getattr(info, "sha", None)
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit.lower()):
        raise SourceError(
            f"{uri.raw}: the Hub answered {commit!r} as the commit of revision {revision!r}, "
            "which is not a git commit id; nothing was downloaded.",
            "Check HF_ENDPOINT: the Hub, or the mirror or proxy it names, answers a model "
            "info that is not the Hub's.",
        )
    commit = commit.lower()
    if _COMMIT.fullmatch(revision) and commit != revision:
        raise SourceError(
            f"{uri.raw}: the Hub answered commit {commit} for the commit id {revision}; "
            "nothing was downloaded.",
            "Check HF_ENDPOINT: the Hub, or the mirror or proxy it names, answers a model "
            "info that is not the Hub's.",
        )
    return commit


#: What git refuses in a reference name (``git check-ref-format``): ``..``, ``@{``, a space or
#: any of ``~^:?*[\``, a part ending in ``.lock``, an empty part.
_NOT_IN_REF = re.compile(r"\.\.|@\{|[\s~^:?*\[\\]|\.lock(/|$)|//|^/|/$")


def _usable(uri: SourceURI) -> None:
    """Refuse (exit 2) an hf:// URI that would be quoted as it is in every message (a
    character that does not print: a line break, a tab, a line separator) or whose revision
    is no name git gives a branch, tag or commit: the Hub's URLs would read ``.`` and ``..``
    as path steps (``@..`` asked for the repository's own page: ``main``'s commit). The key
    takes such a source (as the chart does); it is refused here, before the Hub is asked."""
    if not uri.raw.isprintable():
        raise SourceError(
            f"hf:// URI {uri.raw!r} holds a character that does not print (a line break, a tab).",
            "Write Hugging Face sources as hf://ORG/NAME or hf://ORG/NAME@REVISION, nothing "
            "around them.",
        )
    revision = uri.revision
    if revision is not None and (
        _NOT_IN_REF.search(revision)
        or any(part.startswith(".") for part in revision.split("/"))
        or revision.endswith(".")
        or revision == "@"
    ):
        raise SourceError(
            f"{uri.raw}: no branch, tag or commit of a repository can be called {revision!r}.",
            "Write the branch, tag or commit after '@' as git names it (refs/pr/N for a pull "
            "request): no '..', no part starting with '.', no space or any of ~^:?*[\\.",
        )


def fingerprint_source(
    uri: SourceURI, options: FetchOptions, *, recorded: Fingerprint | None = None
) -> Fingerprint:
    """The commit the URI's revision (default ``main``) names now (no call for a commit id)."""
    _usable(uri)
    revision = uri.revision or DEFAULT_REVISION
    if _COMMIT.fullmatch(revision):
        return Fingerprint(uri=uri.canonical, commit=revision)
    settings.import_hub("huggingface_hub.hf_api")
    from huggingface_hub import HfApi

    token = resolve_token(options)
    _token_to_the_hub_only()
    _waits_bounded(options.retry_deadline_s)
    api = HfApi(endpoint=settings.endpoint("HF_ENDPOINT"))
    commit = _resolve_commit(api, uri, revision, token, _funnel(uri, revision, options))
    return Fingerprint(uri=uri.canonical, commit=commit)


def _names(uri: SourceURI, rel: str) -> list[str]:
    """The levels of the Hub file ``rel`` (:func:`loader.sources.names.listed_parts`): what
    the Hub's listing says reaches the file system only as names relative to a descriptor."""
    return listed_parts(
        rel,
        what=f"{uri.raw}: the Hub lists a file that",
        remedy="Rename or move the file in the repository (or use a copy of the checkpoint), "
        "or check the mirror HF_ENDPOINT names.",
        suffix=len(INCOMPLETE),
    )


def _distinct(uri: SourceURI, wanted: list[str]) -> None:
    """Refuse two files to fetch whose names differ only in case or in how their letters are
    composed (:func:`loader.sources.names.colliding`): a case-insensitive or normalising file
    system (SMB, some NFS servers) keeps one file for both, and each would be taken for the
    other."""
    found = colliding(wanted)
    if found is not None:
        raise SourceError(
            f"{uri.raw}: the Hub lists {shown(found[0])} and {shown(found[1])}, which differ "
            "only in case or in how their letters are written; some file systems keep one "
            "file for both, so neither was downloaded.",
            "Remove or rename one of them in the repository.",
        )


@contextmanager
def _level(d: Dir, parts: list[str], *, create: bool) -> Iterator[Dir | None]:
    """The directory holding ``parts[-1]`` below ``d``, entered one name at a time (created
    level by level with ``create``); None when a level is missing and ``create`` is False."""
    if len(parts) == 1:
        yield d
        return
    try:
        sub = d.walk("/".join(parts[:-1]), create=create)
    except FileNotFoundError:
        if create:
            raise
        yield None
        return
    with sub:
        yield sub


def _intact(d: Dir, parts: list[str], remote: RemoteFile) -> fs.Stamp | None:
    """The :data:`~loader.fs.Stamp` of the regular file ``parts`` below ``d`` if it is
    ``remote``'s; None if it is not (a link, or anything but a regular file there, is not)."""
    with _level(d, parts, create=False) as parent:
        if parent is None:
            return None
        try:
            fd = parent.open_file(parts[-1], os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotOursError):
            return None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_size != remote.size:
                return None
            digest = remote.hasher()
            _feed(digest, fd, remote.size, parent.path / parts[-1])
            return fs.stamp(found) if remote.matches(found.st_size, digest) else None
        finally:
            os.close(fd)


def _feed(digest: Any, fd: int, size: int, path: Path) -> None:
    """Feed the first ``size`` bytes of the file open at ``fd`` to ``digest`` (if any)."""
    offset = 0
    while digest is not None and offset < size:
        chunk = fs.pread(fd, min(_CHUNK, size - offset), offset, path)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)


#: What a file being downloaded is called in the staging directory, after its own name.
INCOMPLETE = ".incomplete"
_CHUNK = 8 * 1024 * 1024
#: Redirects followed for one file (the Hub sends large files to its storage host).
MAX_REDIRECTS = 10


def _pieces(response: Any, what: str) -> Iterator[bytes]:
    """The body of ``response`` in pieces of :data:`_CHUNK` bytes (the last may be shorter),
    read as it arrives so that a stalled body is noticed (:class:`~loader.sources.transfer.Pace`)
    while a piece fills."""
    pace, held = Pace(f"the Hub's answer for {what}"), bytearray()
    for piece in response.iter_bytes():
        pace.arrived(len(piece))
        held += piece
        if len(held) >= _CHUNK:
            yield bytes(held)
            held.clear()
    if held:
        yield bytes(held)


class _Stopped(BaseException):
    """Another download failed, or the fetch was interrupted: this one stops at its next
    chunk (what it wrote stays under ``.partial/`` for a rerun to resume)."""


class CutShort(ConnectionError):
    """A file's answer ended before its listed size without an error of the connection (a
    body delimited by the connection's close, or a chunked one, cut short): a transient
    failure, retried from the last byte written (:class:`~loader.sources.failures.Funnel`)."""


def _token_to_the_hub_only() -> None:
    """Every request of the Hub library's HTTP session (model info, each page of the file
    list) carries the token to the Hub's origin only: the library sends its headers to
    whatever URL a page's ``Link: <URL>; rel="next"`` names. A request hook on the session
    (added once; a new session gets it again) drops ``Authorization`` elsewhere."""
    from huggingface_hub.utils import get_session

    hooks = get_session().event_hooks["request"]
    if _drop_token_elsewhere not in hooks:
        hooks.append(_drop_token_elsewhere)


def _waits_bounded(deadline_s: float) -> None:
    """Every request of the Hub library's HTTP session waits at most ``deadline_s`` (the retry
    deadline, as for gs://) to connect and for each read: the session has no timeout, and the
    library asks for none (model info, each page of the file list), so a Hub or mirror that
    accepted the connection and never answered held the loader for ever. A request hook on the
    session (one, replaced by each fetch) fills in every wait the request leaves unbounded."""
    from huggingface_hub.utils import get_session

    hooks = get_session().event_hooks["request"]
    hooks[:] = [hook for hook in hooks if not isinstance(hook, _BoundedWaits)]
    hooks.append(_BoundedWaits(deadline_s))
    # and every answer the library reads whole is bounded in size and pace (answers.py)
    hooks = get_session().event_hooks["response"]
    hooks[:] = [hook for hook in hooks if not getattr(hook, "bounds_answers", False)]
    hooks.append(answers.httpx_hook("HF_ENDPOINT"))


@dataclass(frozen=True)
class _BoundedWaits:
    """A request hook: each wait of a request (connect, read, write, pool) that is unbounded
    becomes ``deadline_s``."""

    deadline_s: float

    def __call__(self, request: Any) -> None:
        waits = dict(request.extensions.get("timeout") or {})
        for wait in ("connect", "read", "write", "pool"):
            if waits.get(wait) is None:
                waits[wait] = self.deadline_s
        request.extensions["timeout"] = waits


def _drop_token_elsewhere(request: Any) -> None:
    from huggingface_hub import constants

    hub = settings.endpoint("HF_ENDPOINT") or constants.ENDPOINT
    if _origin(str(request.url)) != _origin(hub):
        request.headers.pop("Authorization", None)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


@dataclass
class _Hub:
    """How every file of one fetch is requested: its URL, the headers (the token only to the
    Hub's own origin), the library's HTTP session and timeout."""

    repo: str
    commit: str
    endpoint: str | None
    headers: dict[str, str]
    stop: threading.Event

    def get(self, rel: str, start: int) -> Any:
        """The streamed response to ``GET`` of ``rel`` from byte ``start``, redirects
        followed here: the ``Authorization`` header goes to the Hub's origin only, never to
        the storage or CDN host a redirect names."""
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import get_session

        url = hf_hub_url(self.repo, rel, revision=self.commit, endpoint=self.endpoint)
        origin = _origin(url)
        headers = dict(self.headers)
        if start:
            headers["Range"] = f"bytes={start}-"
        session = get_session()
        for _ in range(MAX_REDIRECTS + 1):
            request = session.build_request(
                "GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                extensions={answers.STREAMED: True},  # paced here, bounded by its listed size
            )  # fmt: skip
            response = session.send(request, stream=True, follow_redirects=False)
            if not response.has_redirect_location:
                return response
            location = response.headers["Location"]
            response.close()
            try:
                target = urljoin(url, location)
                leaves = _origin(target) != origin
            except ValueError:  # a port out of range, a broken IPv6 address
                raise SourceError(
                    f"hf://{self.repo}@{self.commit}/{rel}: the Hub redirected the download to "
                    f"{redacted(location)!r}, which is not a URL.",
                    "Check HF_ENDPOINT and any proxy in between.",
                ) from None
            if leaves:
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            url = target
        raise SourceError(
            f"hf://{self.repo}@{self.commit}/{rel}: more than {MAX_REDIRECTS} redirects.",
            "Check HF_ENDPOINT and any proxy in between.",
        )


def _open_incomplete(d: Dir, name: str) -> int:
    """This fetch's file being downloaded, ``name`` in ``d``: an existing regular file (a
    stopped run's, resumed) or a new one (``O_EXCL``); never through a link."""
    try:
        fd = d.open_file(name, os.O_RDWR | os.O_NONBLOCK)
    except FileNotFoundError:
        return d.open_file(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise d.not_ours(name, "a file the loader downloads")
    os.set_blocking(fd, True)
    return fd


def _download(
    hub: _Hub,
    remote: RemoteFile,
    parent: Dir,
    name: str,
    progress: Progress,
    reported: list[int],
    *,
    durable: bool,
) -> tuple[int, Any, fs.Stamp]:
    """Download ``remote`` into ``name`` in ``parent`` (``<file>.incomplete`` in the staging
    directory), resuming what is there; its size and digest (:meth:`RemoteFile.hasher`),
    computed as the bytes arrive, and the :data:`~loader.fs.Stamp` of the descriptor they were
    read and written through, after the last write (a file an earlier run wrote whole: before
    its bytes were read back). ``reported``: the bytes of this file told
    to ``progress`` so far (a retry does not count them again)."""
    path = parent.path / name
    fd = _open_incomplete(parent, name)
    try:
        size = os.fstat(fd).st_size
        if size > remote.size:
            fs.truncate(fd, 0, path)
            size = 0
        digest = remote.hasher()
        # taken before what an earlier run wrote is read back: bytes written in place over
        # them once they were hashed must not be stamped as the ones verified
        written = fs.stamp(os.fstat(fd))
        _feed(digest, fd, size, path)
        streamed = size < remote.size
        if streamed:
            size, digest = _stream(hub, remote, fd, path, size, digest, progress, reported)
        if size > reported[0]:
            progress.update(size - reported[0])
            reported[0] = size
        if durable:
            fs.fsync_fd(fd, path)
        if streamed:
            written = fs.stamp(os.fstat(fd))
    finally:
        os.close(fd)
    return size, digest, written


def _stream(
    hub: _Hub,
    remote: RemoteFile,
    fd: int,
    path: Path,
    size: int,
    digest: Any,
    progress: Progress,
    reported: list[int],
) -> tuple[int, Any]:
    from huggingface_hub.utils import hf_raise_for_status

    response = hub.get(remote.path, size)
    try:
        if response.status_code == 416 and size:  # the range is past the end: start over
            response.close()
            fs.truncate(fd, 0, path)
            return _stream(hub, remote, fd, path, 0, remote.hasher(), progress, reported)
        hf_raise_for_status(response)
        resumed = response.status_code == 206 and response.headers.get(
            "Content-Range", ""
        ).startswith(f"bytes {size}-")
        if not size and response.status_code == 206 and not resumed:
            raise TransientSourceError(  # a part it was not asked for: nothing of it written
                f"hf://{hub.repo}@{hub.commit}/{remote.path}: the Hub answered a part of the file "
                f"({response.headers.get('Content-Range')!r}) when asked for all of it.",
                "Check HF_ENDPOINT and any proxy in between, then run the loader again.",
            )
        if size and not resumed:  # the server sent the whole file (or another range)
            if response.status_code == 206:
                response.close()
                fs.truncate(fd, 0, path)
                return _stream(hub, remote, fd, path, 0, remote.hasher(), progress, reported)
            fs.truncate(fd, 0, path)
            size, digest = 0, remote.hasher()
        os.lseek(fd, size, os.SEEK_SET)
        for chunk in _pieces(response, remote.path):
            if hub.stop.is_set():
                raise _Stopped
            if size + len(chunk) > remote.size:
                break  # more than the listing says: judged by the size check
            fs.write_fd(fd, chunk, path)
            if digest is not None:
                digest.update(chunk)
            size += len(chunk)
            if size > reported[0]:
                progress.update(size - reported[0])
                reported[0] = size
        else:
            if size < remote.size:  # the body ended early: retried from this byte
                raise CutShort(
                    f"the Hub's answer for {remote.path} ended after {size} of its "
                    f"{remote.size} bytes"
                )
            return size, digest
        return size + 1, digest  # one byte too many: never matches
    finally:
        response.close()


def fetch_source(uri: SourceURI, dest: Path | None, options: FetchOptions) -> FetchResult:
    """Download the files a conversion needs into ``dest``: each one streamed with the Hub
    library's HTTP session into a file created relative to a descriptor of this fetch's
    staging directory (``dest/.partial/hf.<owner>/``, entered one name at a time, never
    through a link), verified as it arrives, then renamed into ``dest``."""
    if dest is None:
        raise SourceError(
            f"Fetching {uri.raw} needs a destination directory.",
            "Pass a destination (model-loader fetch URI DEST).",
        )
    _usable(uri)
    settings.import_hub("huggingface_hub.hf_api")
    from huggingface_hub import HfApi
    from huggingface_hub.utils import build_hf_headers

    token = resolve_token(options)
    revision = uri.revision or DEFAULT_REVISION
    funnel = _funnel(uri, revision, options)
    # Read at call time (the Hub library reads it once, at import).
    endpoint = settings.endpoint("HF_ENDPOINT")
    _token_to_the_hub_only()
    _waits_bounded(options.retry_deadline_s)
    api = HfApi(endpoint=endpoint)
    commit = _resolve_commit(api, uri, revision, token, funnel)
    log.info("%s: revision %s is commit %s", uri.location, revision, commit)
    check_planned(uri, options.hooks, commit)  # before anything of it is listed
    remote = funnel(lambda: _listing(api, uri, commit, token), what=f"{uri.raw} (file list)")
    wanted = select_files(remote, repo=f"{uri.location}@{commit}")
    names = {rel: _names(uri, rel) for rel in wanted}
    _distinct(uri, wanted)

    hooks = options.hooks or ArrivalHooks()
    chosen = [
        f for f in wanted if f not in hooks.skip and (hooks.include is None or hooks.include(f))
    ]
    #: each file verified (present, or downloaded by this call) -> its stamp then
    stamps: dict[str, fs.Stamp] = {}
    with Dir.open(dest, create=True) as target:
        for f in chosen:
            if (stamp := _intact(target, names[f], remote[f])) is not None:
                stamps[f] = stamp
        present = [f for f in chosen if f in stamps]
        missing = [f for f in chosen if f not in present]
        total = sum(remote[f].size for f in wanted)
        needed = sum(remote[f].size for f in missing)
        if options.check_disk_space:
            ensure_disk_space(dest, needed, what=uri.raw, directory=target)
        log.info(
            "fetching %s@%s: %s files (%s); %s to download, %s already present",
            uri.location,
            commit[:12],
            len(wanted),
            human_bytes(total),
            human_bytes(needed),
            len(chosen) - len(missing),
        )
        if hooks.arrived is not None:
            for rel in present:
                hooks.arrived(rel, dest / rel, stamps[rel])
        if missing:
            mark_dest(target)  # before its first download: what it creates is recorded
            refuse_what_is_in_the_way(target, ["/".join(names[f]) for f in missing])
            headers = build_hf_headers(token=token)
            headers["Accept-Encoding"] = "identity"  # the bytes as listed, resumable by range
            hub = _Hub(uri.location, commit, endpoint, headers, threading.Event())
            with target.sub(PARTIAL_DIR, create=True) as partial:
                ours = f"hf.{fs.owner()}"
                adopt_in(partial, ours)
                with partial.sub(ours, create=True) as staging:
                    _fetch_missing(
                        uri, hub, remote, names, missing, staging, target, funnel, options, stamps
                    )
            remove_own_partials_in(target)
    if options.hooks is None:  # all of it fetched: what stopped runs left, nothing resumes now
        clear_partials(dest)
    return FetchResult(
        path=dest,
        revision=commit,
        files=wanted,
        bytes=total,
        downloaded_bytes=needed,
        fingerprint=Fingerprint(uri=uri.canonical, commit=commit),
        # every file fetched was compared with the listing's SHA-256 or git blob id
        origins={rel: f"hf://{uri.location}@{commit}/{rel}" for rel in wanted},
        stamps=stamps,
    )


def _fetch_missing(
    uri: SourceURI,
    hub: _Hub,
    remote: dict[str, RemoteFile],
    names: dict[str, list[str]],
    missing: list[str],
    staging: Dir,
    target: Dir,
    funnel: Funnel,
    options: FetchOptions,
    stamps: dict[str, fs.Stamp],
) -> None:
    """Download ``missing``; the stamp of each file verified goes into ``stamps``."""
    hooks = options.hooks or ArrivalHooks()
    durable = not hooks.transient
    dest = target.path

    def one(rel: str, progress: Progress) -> None:
        parts = names[rel]
        reported = [0]
        with _level(staging, parts, create=True) as parent:
            assert parent is not None
            name = parts[-1] + INCOMPLETE

            def fetched() -> tuple[int, Any, fs.Stamp]:
                return funnel(
                    lambda: _download(
                        hub, remote[rel], parent, name, progress, reported, durable=durable
                    ),
                    what=f"{uri.raw} ({rel})",
                )

            left = parent.regular_size(name)  # what a stopped run wrote, resumed
            size, digest, written = fetched()
            if left and not remote[rel].matches(size, digest):
                # The stopped run's bytes may be another commit's file of that name (the
                # branch moved since) or lost in a crash before they reached the disk: the
                # file is downloaded again from its start before it is judged corrupt.
                log.warning(
                    "%s: the %s bytes a stopped run downloaded of %s are not the file's now; "
                    "downloading it again from its start",
                    uri.raw,
                    left,
                    shown(rel),
                )
                parent.unlink(name)
                size, digest, written = fetched()
            stamps[rel] = _verify_and_place(
                uri, hub.commit, remote[rel], (size, digest, written), parent, name, target, parts
            )
        if hooks.arrived is not None:
            hooks.arrived(rel, dest / rel, stamps[rel])

    def download(files: list[str], progress: Progress) -> None:
        _in_parallel(files, lambda rel: one(rel, progress), hub.stop, options.workers)

    needed = sum(remote[f].size for f in missing)
    with byte_progress(f"hf://{uri.location}", needed) as progress:
        if options.hooks is None:
            download(missing, progress)
        else:
            # The small files together first, then the shards one at a time.
            small = [f for f in missing if not is_weight_file(f)]
            if small:
                download(small, progress)
            for rel in sorted(f for f in missing if is_weight_file(f)):
                while hooks.admit is not None and not hooks.admit(rel):
                    time.sleep(ADMIT_POLL_S)
                download([rel], progress)


def _in_parallel(files: list[str], job: Any, stop: threading.Event, workers: int | None) -> None:
    """``job(rel)`` for every file, on up to ``workers`` daemon threads, waited for here: a
    SIGTERM or Ctrl-C in the main thread unwinds at once (the threads stop at their next
    chunk; what they wrote lands under ``.partial/`` only), and the first failure stops the
    others and is raised."""
    todo = list(files)
    lock = threading.Lock()
    failures: list[BaseException] = []

    def worker() -> None:
        while not stop.is_set():
            with lock:
                if not todo:
                    return
                rel = todo.pop(0)
            try:
                job(rel)
            except _Stopped:
                return
            except BaseException as exc:
                failures.append(exc)
                stop.set()
                return

    threads = [
        threading.Thread(target=worker, name="hf-download", daemon=True)
        for _ in range(max(1, min(workers or DEFAULT_WORKERS, len(todo))))
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)
    except BaseException:
        stop.set()
        raise
    if failures:
        raise failures[0]


def _verify_and_place(
    uri: SourceURI,
    commit: str,
    remote: RemoteFile,
    downloaded: tuple[int, Any, fs.Stamp],
    parent: Dir,
    name: str,
    target: Dir,
    parts: list[str],
) -> fs.Stamp:
    """Rename the downloaded ``name`` in ``parent`` to ``parts`` below ``target`` if its size
    and hash (``downloaded``: as :func:`_download` returns them) are the Hub's (its
    :data:`~loader.fs.Stamp`, which the rename keeps); else discard it
    (:class:`ChecksumMismatchError`). The hash is of the bytes as they arrived: a file renamed
    over ``name`` since the download's last write is refused as another's
    (:class:`~loader.errors.NotOursError`), the file written in place since (its stamp by name
    is not the descriptor's then) as replaced (:class:`ReplacedDownloadError`)."""
    size, digest, written = downloaded
    if not remote.matches(size, digest):
        parent.unlink(name, missing_ok=True)
        raise ChecksumMismatchError(
            f"hf://{uri.location}@{commit}/{remote.path}: downloaded bytes do not match the "
            "Hub's hash for the file; the download was discarded.",
            "Run the loader again; if this repeats, the repository file or a mirror in between "
            "is corrupt.",
        )
    verified = parent.lstat(name)
    if verified is None or fs.stamp(verified)[:2] != written[:2]:
        raise parent.not_ours(name, "the file the loader downloaded")  # renamed over it
    if fs.stamp(verified) != written:
        raise ReplacedDownloadError(parent.path / name)  # written in place
    with _level(target, parts, create=True) as final:
        assert final is not None
        parent.rename(name, final, parts[-1], how="replace")
    return fs.stamp(verified)
