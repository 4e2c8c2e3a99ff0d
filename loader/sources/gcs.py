"""Google Cloud Storage: ``gs://bucket/prefix`` with the official ``google-cloud-storage`` client.

Every object under ``prefix/`` lands under ``dest`` with its path relative to the prefix; a URI
that names one object (``gs://b/ckpt/model.safetensors``) gives ``dest/model.safetensors``.

How a fetch runs:

* The objects are listed once; their sizes, CRC32C checksums and generations are the plan.
  Files already in ``dest`` with the same size and CRC32C are kept (a rerun downloads only
  what is missing).
* Large objects are split into byte-range slices (one ranged GET each, the request
  ``Blob.download_to_file(start=, end=, raw_download=True)`` makes),
  and slices of all objects are downloaded by one pool of threads into
  ``dest/.partial/<path>.<generation>.<owner>`` (:mod:`loader.sources.transfer`: never another
  loader's file). Each finished slice is appended to a journal beside
  it, so a killed download resumes with the slices it is missing instead of restarting the
  object. (``transfer_manager.download_chunks_concurrently`` slices one object at a time,
  restarts a killed download from zero and cannot wait for a caller's admission, hence our
  own pool and journal.) Downloads pin the generation listed, so an object replaced meanwhile
  cannot mix two versions: its next slice fails (412) and the fetch ends as transient (exit
  75), as does a download whose bytes miss the object's checksum (a proxy answering with a
  page of its own): running again fetches it again.
* Each slice is one request whose body is read in pieces of 1 MiB (:data:`PIECE_BYTES`), each
  written at its offset and added to the slice's CRC32C while it is still in the CPU's cache:
  a few hundred Python calls per gigabyte, memory the allocator reuses, so the CPU a gigabyte
  costs is mostly the kernel's copies (a slice read whole was fresh memory every time). Once
  the object is complete the slices' values are
  combined (:func:`~loader.sources.transfer.crc32c_combine`) and compared with the object's
  CRC32C, and only then is the file renamed into place: nothing is read back (slices a killed
  run wrote are the exception: they are read back, never trusted). An object without a CRC32C
  is read back for its MD5. A mismatch is a :class:`~loader.errors.ChecksumMismatchError`.
  An object with neither (no Cloud Storage object lacks a CRC32C; a server standing in for it
  may) is refused before anything is downloaded (exit 2): no retry could verify it.
* With :class:`~loader.sources.ArrivalHooks` a caller consumes the files while the fetch goes
  on: small objects are fetched first, then large ones in name order, each started only when
  the caller admits it, and the caller hears of every verified file at once.
* Transient failures (connection errors, 429, 5xx) are retried per call (the listing by the
  library with a ``google.api_core.retry.Retry``, a slice by tenacity; exponential backoff,
  ``Retry-After`` honoured) within a total deadline (:mod:`loader.sources.failures`); a missing bucket or object and permission
  problems fail at once with the URI in the message.

Credentials: Application Default Credentials (GKE Workload Identity, or
``GOOGLE_APPLICATION_CREDENTIALS``); with ``STORAGE_EMULATOR_HOST`` set (a local emulator),
anonymous credentials. Nothing secret is logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import google_crc32c

from loader import fs, stages
from loader.errors import (
    ChecksumMismatchError,
    ReplacedDownloadError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    TransientSourceError,
    shown,
)
from loader.fs import Dir
from loader.limits import SLICE_MIB
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
from loader.sources.failures import Funnel, sentence, status_of
from loader.sources.fingerprint import Fingerprint
from loader.sources.names import NAME_MAX, colliding, listed_parts
from loader.sources.transfer import (
    PARTIAL_DIR,
    Pace,
    adopt_in,
    beside_other_fetches,
    clear_partials,
    crc32c_combine,
    crc32c_of,
    crc32c_text,
    ensure_disk_space,
    mark_dest,
    md5_of,
    own_partial,
    refuse_what_is_in_the_way,
    remove_own_partials,
    safe_path,
)
from loader.waits import wait_in_steps

log = logging.getLogger(__name__)

#: Byte-range slice size for large objects (one request each; a failed one is asked again whole).
SLICE_BYTES = int(SLICE_MIB.default or 16) * 1024 * 1024
#: Parallel downloads when the caller does not choose.
DEFAULT_WORKERS = 16


# --- plan --------------------------------------------------------------------------------


@dataclass
class _Object:
    """One object to fetch and its slices, with a journal of the ones already written."""

    blob: Any
    rel: str
    final: Path
    partial: Path
    slices: list[tuple[int, int]]
    #: the partial file's directory, open (every step on the partial file and its journal is
    #: this descriptor and one name: nothing below it is followed)
    where: Dir | None = None
    done: set[int] = field(default_factory=set)
    resumed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: slice index -> CRC32C of the bytes this run received for it
    crcs: dict[int, int] = field(default_factory=dict)
    #: the file verified, once moved into place (:data:`loader.fs.Stamp`)
    stamp: fs.Stamp | None = None
    #: the :data:`~loader.fs.Stamp` of the descriptor each slice this run wrote was written
    #: through, taken after its last write: what the verified file must be
    written: list[fs.Stamp] = field(default_factory=list)
    #: the :data:`~loader.fs.Stamp` of the descriptor the bytes an earlier run wrote were read
    #: back through (for the checksum), taken before they were read: what the verified file
    #: must still be
    read_back: fs.Stamp | None = None

    @property
    def name(self) -> str:
        """The partial file's name in :attr:`where`."""
        return self.partial.name

    @property
    def journal(self) -> str:
        """The journal's name in :attr:`where` (beside the partial file)."""
        return self.partial.name + ".slices"

    @property
    def d(self) -> Dir:
        assert self.where is not None, "prepared first"
        return self.where

    @property
    def size(self) -> int:
        return int(self.blob.size or 0)


def _slices(size: int, slice_bytes: int) -> list[tuple[int, int]]:
    """Inclusive byte ranges covering ``size`` bytes; one empty range for an empty object."""
    if size == 0:
        return [(0, -1)]
    return [(start, min(start + slice_bytes, size) - 1) for start in range(0, size, slice_bytes)]


#: What an object's name grows by while it downloads: ``.<generation>`` (an int64, 19 digits),
#: ``.<pid>-<host digest>`` (:func:`loader.fs.owner`: a pid of up to 7 digits) and, for its
#: journal, ``.slices``.
_PARTIAL_SUFFIX = len(".") + 19 + len(".") + 7 + len("-") + 8 + len(".slices")


def _relpath(uri: SourceURI, name: str) -> str:
    """The object ``name``'s path below DEST (:func:`loader.sources.names.listed_parts`); a
    listing naming an object outside the prefix it was asked for is forged (two such names
    could land on one file: ``p/x`` and ``q/x`` would both be ``x``)."""
    if uri.path and name != uri.path and not name.startswith(f"{uri.path}/"):
        raise _endless(uri, f"names the object {name[:120]!r}, which is not below that prefix")
    rest = name[len(uri.path) :]
    rel = PurePosixPath(name).name if name == uri.path else rest[1:] if uri.path else rest
    listed_parts(
        rel,
        what=f"Object gs://{uri.location}/{name[:120]!r}",
        remedy="Rename the object (plain names of at most "
        f"{NAME_MAX - _PARTIAL_SUFFIX} bytes, no '.' or '..' level, no '//', nested at most "
        f"{fs.MAX_NAME_LEVELS} levels, outside {PARTIAL_DIR}/), or fetch the prefix of the "
        "checkpoint itself, and run again.",
        suffix=_PARTIAL_SUFFIX,
    )
    return rel


def _check_layout(uri: SourceURI, rels: list[str]) -> None:
    """Refuse objects that cannot all be files at once (``a`` and ``a/b``), on every file system
    (:func:`loader.sources.names.colliding`: ``a/b`` and ``A/B`` are one file where case or
    Unicode composition is not told apart, ``a`` and ``A/b`` a file and a directory)."""
    found = colliding(rels)
    if found is None:
        return
    first, second, nested = found
    where = (
        "one would have to be both a file and a directory locally"
        if nested
        else "they differ only in case or in how their letters are written, and some file "
        "systems keep one file for both"
    )
    raise SourceError(
        f"Objects gs://{uri.location}/{_join(uri.path, first)} and "
        f"gs://{uri.location}/{_join(uri.path, second)} collide: {where}; nothing was "
        "downloaded.",
        "Rename one of them (or fetch a narrower prefix) and run again.",
    )


def _check_checksums(uri: SourceURI, blobs: Iterable[Any]) -> None:
    """Refuse, before anything is written, an object whose metadata holds neither a CRC32C nor
    an MD5: its bytes could never be verified, so no run would ever publish them (Cloud
    Storage computes a CRC32C for every object it stores, a composite one included; only the
    MD5 may be missing, and then the CRC32C is checked). The object is named by its own
    name (a URI naming one object is its whole name, not a prefix to join to it)."""
    for blob in blobs:
        if not blob.crc32c and not blob.md5_hash:
            raise SourceError(
                f"Object gs://{uri.location}/{blob.name} has neither a CRC32C nor "
                "an MD5 checksum in its metadata: its download could not be verified, so it is "
                "not fetched; nothing was downloaded.",
                "Upload the object again (gcloud storage cp) so that Cloud Storage computes its "
                "checksums, or check that STORAGE_EMULATOR_HOST names a server that reports "
                "them, then run again.",
            )


def _join(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


# --- errors ------------------------------------------------------------------------------

PERMISSION_HINT = (
    "Grant the loader's service account roles/storage.objectViewer on the bucket "
    "(Workload Identity in GKE, or the key in GOOGLE_APPLICATION_CREDENTIALS)."
)


def _specific(exc: BaseException, what: str) -> SourceError | None:
    """Failures only Cloud Storage has: no credentials, a missing bucket or object."""
    from google.auth.exceptions import DefaultCredentialsError, RefreshError

    if isinstance(exc, DefaultCredentialsError | RefreshError):
        return SourcePermissionError(
            f"No usable Google Cloud credentials to read {what} ({type(exc).__name__}).",
            "Run inside GKE with Workload Identity bound to a service account that can read the "
            "bucket, or set GOOGLE_APPLICATION_CREDENTIALS to a key file.",
        )
    if status_of(exc) == 404:
        return SourceNotFoundError(
            f"{sentence(what)} does not exist (404).",
            "Check the bucket and object names in the gs:// URI.",
        )
    return None


def _funnel(options: FetchOptions) -> Funnel:
    return Funnel(options.retry_deadline_s, specific=_specific, permission_hint=PERMISSION_HINT)


# --- client ------------------------------------------------------------------------------


def make_client(*, pool_size: int = DEFAULT_WORKERS) -> Any:
    """A storage client: anonymous against ``STORAGE_EMULATOR_HOST``, else ADC. The settings
    it reads are checked before the client's libraries are imported (about a second): a bad
    one is refused at once."""
    settings.trust_files(settings.STORAGE_TRUST)
    settings.proxies(settings.STORAGE_PROXIES)
    settings.netrc_file()
    emulated = settings.endpoint("STORAGE_EMULATOR_HOST")
    if not emulated:
        settings.key_files()
    from google.cloud import storage
    from requests.adapters import HTTPAdapter

    if emulated:
        from google.auth.credentials import AnonymousCredentials

        client = storage.Client(credentials=AnonymousCredentials(), project="emulator")
    else:
        client = storage.Client()
    # The client has no public setting for its connection pool (10 connections), which the
    # download threads would otherwise outnumber.
    adapter = HTTPAdapter(pool_connections=4, pool_maxsize=pool_size + 4)
    client._http.mount("https://", adapter)
    client._http.mount("http://", adapter)
    client._http.hooks["response"].append(_refuse_more_than_the_range)
    client._http.hooks["response"].append(answers.requests_hook("STORAGE_EMULATOR_HOST"))
    return client


def _refuse_more_than_the_range(response: Any, *args: Any, **kwargs: Any) -> None:
    """A byte-range request answered with more bytes than it asked for (a server that ignores
    ``Range``) is refused from its headers, before its body is read: a slice is read into
    memory whole, and a whole object in its place would not be bounded."""
    asked = response.request.headers.get("Range", "")
    if not asked.startswith("bytes=") or response.status_code >= 300:
        return
    first, _, last = asked.removeprefix("bytes=").partition("-")
    if not (first.isascii() and last.isascii() and first.isdigit() and last.isdigit()):
        return
    wanted = int(last) - int(first) + 1
    length = response.headers.get("Content-Length", "")
    within = length.isascii() and length.isdigit() and int(length) <= wanted
    if response.status_code == 206 and (within or not length):
        return
    if response.status_code == 200 and first == "0" and within:  # the whole object was asked
        return
    response.close()
    raise TransientSourceError(  # as the slice's own check classes it (a proxy's page)
        f"{response.request.url.split('?')[0]}: the server answered a request for {wanted} "
        f"bytes at offset {first} with {length or 'an unknown number of'} bytes (status "
        f"{response.status_code}: it ignored the byte range).",
        "Point STORAGE_EMULATOR_HOST at a server that honours Range requests, or pass a "
        "--slice-mib larger than the largest object.",
    )


#: Objects one listing holds at most (a checkpoint has a few thousand files at most).
MAX_LISTED = 1_000_000
#: Pages of one listing at most: the server's pages hold up to 1000 objects each, so this many
#: hold :data:`MAX_LISTED`; a server paging one object at a time is stopped as soon.
MAX_PAGES = 1_000


def _bounded(uri: SourceURI, pages: Iterable[Iterable[Any]]) -> list[Any]:
    """The objects of a listing's ``pages``, or a :class:`~loader.errors.SourceError` once it
    names an object twice or goes past :data:`MAX_PAGES` pages or :data:`MAX_LISTED` objects:
    a server (``STORAGE_EMULATOR_HOST``, a proxy) whose pages never end held the loader for
    ever, with no failure for the retry deadline to end."""
    objects: list[Any] = []
    names: set[str] = set()
    for number, page in enumerate(pages, 1):
        if number > MAX_PAGES:
            raise _endless(uri, f"goes on past {MAX_PAGES} pages")
        for blob in page:
            name = getattr(blob, "name", None)
            if name in names:
                raise _endless(uri, f"lists {shown(name)} twice")
            if len(names) >= MAX_LISTED:
                raise _endless(uri, f"lists more than {MAX_LISTED} objects")
            names.add(name)
            objects.append(blob)
    return objects


def _endless(uri: SourceURI, what: str) -> SourceError:
    return SourceError(
        f"The listing of gs://{uri.location}/{uri.path} {what}; nothing was downloaded.",
        "Check STORAGE_EMULATOR_HOST, or the proxy in between: the server answers a listing "
        "that is not Cloud Storage's; or fetch a narrower prefix.",
    )


def _list_objects(client: Any, uri: SourceURI, funnel: Funnel) -> list[Any]:
    bucket_uri = f"gs://{uri.location}"
    prefix = f"{uri.path}/" if uri.path else ""
    timeout = _timeout(funnel, 60)

    def listing(retry: Any) -> list[Any]:
        pages = client.list_blobs(uri.location, prefix=prefix, retry=retry, timeout=timeout).pages
        return _bounded(uri, pages)

    listed = funnel.gcs(listing, what=f"bucket {bucket_uri}")
    blobs = [b for b in listed if not b.name.endswith("/")]
    if blobs or not uri.path:
        if not blobs:
            raise SourceNotFoundError(
                f"Bucket {bucket_uri} holds no objects.",
                "Upload the checkpoint or fix the gs:// URI.",
            )
        return blobs
    single = funnel.gcs(
        lambda retry: client.bucket(uri.location).get_blob(uri.path, retry=retry, timeout=timeout),
        what=f"object {uri.raw}",
    )
    if single is None:
        parent = uri.path.rsplit("/", 1)[0] + "/" if "/" in uri.path else ""
        raise SourceNotFoundError(
            f"No object {uri.raw} and no objects under {uri.raw.rstrip('/')}/.",
            f"Check the prefix: `gcloud storage ls {bucket_uri}/{parent}`.",
        )
    return [single]


def _fingerprint(uri: SourceURI, blobs: list[Any]) -> Fingerprint:
    files = {}
    for blob in blobs:
        info: dict[str, object] = {"size": int(blob.size or 0), "generation": str(blob.generation)}
        if blob.crc32c:
            info["crc32c"] = blob.crc32c
        elif blob.md5_hash:
            info["md5"] = blob.md5_hash
        files[_relpath(uri, blob.name)] = info
    return Fingerprint(uri=uri.canonical, files=files)


def fingerprint_source(
    uri: SourceURI, options: FetchOptions, *, recorded: Fingerprint | None = None
) -> Fingerprint:
    """Name, size, generation and CRC32C of every object (one listing, nothing downloaded)."""
    funnel = _funnel(options)
    client = funnel.gcs(lambda _: make_client(pool_size=4), what=f"gs://{uri.location}")
    return _fingerprint(uri, _list_objects(client, uri, funnel))


def _revision(blobs: list[Any]) -> str:
    """A digest of object names and generations: changes when any object is replaced."""
    digest = hashlib.sha256()
    for blob in sorted(blobs, key=lambda b: b.name):
        digest.update(f"{blob.name}\0{blob.generation}\n".encode())
    return "gen-" + digest.hexdigest()[:16]


# --- download ----------------------------------------------------------------------------


class _SliceWriter:
    """The file object a slice downloads into: writes at the slice's offset, keeps the CRC32C
    of the bytes it was given, reports them to the progress, and refuses bytes past the slice
    (a server that ignored the range)."""

    def __init__(
        self, fh: Any, start: int, length: int, progress: Progress, what: str, path: Path
    ) -> None:
        self._fh = fh
        self._path = path
        self._start = start
        self._length = length
        self._progress = progress
        self._what = what
        self.written = 0
        #: CRC32C of the bytes written so far (the very bytes handed to the file)
        self.crc = 0

    def write(self, data: bytes) -> int:
        if self.written + len(data) > self._length:
            raise TransientSourceError(
                f"{self._what}: the server sent more than the {self._length} bytes asked for "
                f"at offset {self._start} (it ignored the byte range).",
                "Point STORAGE_EMULATOR_HOST at a server that honours Range requests, or pass "
                "a --slice-mib larger than the largest object.",
            )
        with stages.stage("fetch: write slice", len(data)):
            fs.write_fd(self._fh.fileno(), data, self._path)
        with stages.stage("fetch: crc32c", len(data)):
            self.crc = google_crc32c.extend(self.crc, data)
        self.written += len(data)
        self._progress.update(len(data))
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        """Back to the slice's start (the library restarts a transcoded download from 0)."""
        if (offset, whence) != (0, 0):
            raise OSError("a slice can only be rewound to its start")
        self._progress.update(-self.written)
        self.written = 0
        self.crc = 0
        return self._fh.seek(self._start) - self._start

    def check_complete(self) -> None:
        if self.written != self._length:
            raise TransientSourceError(
                f"{self._what}: the connection ended after {self.written} of {self._length} "
                f"bytes at offset {self._start}.",
            )


def _verified(top: Dir, rel: str, blob: Any) -> fs.Stamp | None:
    """The :data:`~loader.fs.Stamp` of the file read if ``rel`` below ``top`` holds exactly
    the object's bytes (size, then CRC32C or MD5); None if it does not."""
    *parents, name = rel.split("/")
    try:
        d = top.enter(parents)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with d:
        if d.regular_size(name) != int(blob.size or 0) or not (blob.crc32c or blob.md5_hash):
            return None
        with d.open_read(name) as fh:
            read = os.fstat(fh.fileno())
            if blob.crc32c:
                intact = crc32c_text(crc32c_of(fh)) == blob.crc32c
            else:
                intact = md5_of(fh) == blob.md5_hash
            return fs.stamp(read) if intact and read.st_size == int(blob.size or 0) else None


_SLICE_LINE = re.compile(r"(\d{1,20}) (\d{1,20})")


def _load_journal(obj: _Object) -> None:
    """Mark slices recorded by an earlier run as done (only if the partial file is intact;
    a line that is not two numbers naming one of the object's slices is ignored)."""
    d = obj.d
    if d.regular_size(obj.journal) is None or d.regular_size(obj.name) != obj.size:
        d.unlink(obj.name, missing_ok=True)
        d.unlink(obj.journal, missing_ok=True)
        return
    index = {s: i for i, s in enumerate(obj.slices)}
    try:
        journal = (d.read(obj.journal) or b"").decode("ascii", "replace")
    except fs.TooLargeError:
        journal = ""  # grown past any journal the loader writes: it tells nothing
    for line in journal.splitlines():
        match = _SLICE_LINE.fullmatch(line.strip())
        if match and (key := (int(match[1]), int(match[2]))) in index:
            obj.done.add(index[key])
    obj.resumed = sum(obj.slices[i][1] - obj.slices[i][0] + 1 for i in obj.done)


def _prepare(obj: _Object, dest: Path, dirs: _Dirs) -> None:
    """Open the partial file's directory (created), take over a stopped run's partial file,
    read its journal, or start an empty partial file and journal."""
    rel = obj.partial.relative_to(dest).as_posix()
    safe_path(dest, rel)  # a link or file on the way: a SourceError saying so
    dirs.drop_removed(rel)  # (tried again: another fetch removed it meanwhile)
    obj.where = dirs.get(rel)
    d = obj.d
    adopt_in(d, obj.name, companions=(".slices",))
    _load_journal(obj)
    if d.lstat(obj.name) is None:
        with d.create(obj.name) as fh:
            fs.truncate(fh.fileno(), obj.size, obj.partial)
        d.write(obj.journal, b"", exclusive=False, sync=False)


class _Dirs:
    """The directories of a fetch's files below ``dest``, each opened once (one name at a
    time from ``dest``, never through a link) and shared by the objects in it."""

    def __init__(self, top: Dir) -> None:
        self.top = top
        self._open: dict[tuple[str, ...], Dir] = {}
        self._lock = threading.Lock()

    def get(self, rel: str) -> Dir:
        """The open directory holding the file ``rel`` (a path below ``dest``)."""
        parents = tuple(rel.split("/")[:-1])
        with self._lock:
            found = self._open.get(parents)
            if found is None:
                found = self._open[parents] = self.top.enter(parents)
            return found

    def drop_removed(self, rel: str) -> None:
        """Forget the open directory holding ``rel`` if it was removed since it was opened
        (another fetch into the same DEST removed it empty): the next :meth:`get` opens it
        anew."""
        parents = tuple(rel.split("/")[:-1])
        with self._lock:
            found = self._open.get(parents)
            if found is not None and found.stat().st_nlink == 0:
                found.close()
                del self._open[parents]

    def close(self) -> None:
        for d in self._open.values():
            d.close()
        self._open.clear()
        self.top.close()


#: Longest single network wait (connect, one read) when the retry deadline leaves more time.
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 300.0


def _timeout(funnel: Funnel, longest: float) -> float:
    """A network wait: at most ``longest``, and never longer than the retry deadline."""
    return max(0.5, min(longest, funnel.deadline_s))


def _download_slice(
    obj: _Object, index: int, funnel: Funnel, progress: Progress, *, durable: bool = True
) -> None:
    """Bytes ``start..end`` of the object into its partial file, then a journal line.

    One ranged GET (:func:`_get_range`), pinned to the listed generation (412 if the object was
    replaced meanwhile); a transient failure asks for the slice again, until the retry
    deadline, and every wait (the connection, each read of the body) ends by then too. The
    slice's CRC32C, from the bytes received, goes to ``obj.crcs``. An object gone or replaced
    since the listing (404, 412) is a source still being uploaded: transient.
    """
    start, end = obj.slices[index]
    what = f"object gs://{obj.blob.bucket.name}/{obj.blob.name}"
    if end >= start:
        timeout = (_timeout(funnel, CONNECT_TIMEOUT_S), _timeout(funnel, READ_TIMEOUT_S))
        with obj.d.open_update(obj.name) as fh:
            fh.seek(start)
            writer = _SliceWriter(fh, start, end - start + 1, progress, what, obj.partial)
            try:
                with stages.stage("fetch: HTTP GET slice (incl. write, crc)", end - start + 1):
                    _while_uploaded(what, lambda: funnel(
                        lambda: _get_range(obj, start, end, writer, timeout), what=what
                    ))  # fmt: skip
                writer.check_complete()
            except BaseException:
                progress.update(-writer.written)
                raise
            if durable:
                with stages.stage("fetch: fsync slice", end - start + 1):
                    fs.fsync_fd(fh.fileno(), obj.partial)
            written = fs.stamp(os.fstat(fh.fileno()))
        crc = writer.crc
    else:
        crc, written = 0, None  # an empty object
    with obj.lock:
        obj.d.append(obj.journal, f"{start} {end}\n".encode())
        obj.done.add(index)
        obj.crcs[index] = crc
        if written is not None:
            obj.written.append(written)


#: How much of a response body one read takes and one write hands to the file: a piece stays
#: in the CPU's cache from the socket to the page cache and its memory is reused by the
#: allocator, where a whole 16 MiB slice read at once is fresh memory every time (one page
#: fault per page received); Python's cost per piece is nothing at this size.
PIECE_BYTES = 1024 * 1024


def _get_range(obj: _Object, start: int, end: int, writer: _SliceWriter, timeout: Any) -> None:
    """One attempt at bytes ``start..end`` of the listed generation, streamed into ``writer``
    piece by piece (a retry starts the slice again). The request is the one
    ``Blob.download_to_file(raw_download=True)`` makes: the object's media link pinned with
    ``ifGenerationMatch``, ``accept-encoding: gzip`` (the stored bytes, never transcoded), on
    the client's authorized session (whose hook refuses a response longer than the range);
    an error status is the library's exception for it (``from_http_response``)."""
    from google.api_core.exceptions import from_http_response

    blob = obj.blob
    writer.seek(0)
    url = blob.media_link or blob._get_download_url(blob.client)
    separator = "&" if "?" in url else "?"
    response = blob.client._http.get(
        f"{url}{separator}ifGenerationMatch={int(blob.generation)}",
        headers={"accept-encoding": "gzip", "Range": f"bytes={start}-{end}"},
        stream=True,
        timeout=timeout,
    )
    with response:
        if response.status_code >= 300:
            raise from_http_response(response)
        remaining = end - start + 1
        what = f"the answer for bytes {start}-{end} of gs://{blob.bucket.name}/{blob.name}"
        pace, held = Pace(what), bytearray()
        while remaining > 0:
            # What one read of the socket holds (each read within the read timeout; a body that
            # trickles is noticed: Pace), handed to the file a quarter of PIECE_BYTES or more
            # at a time.
            piece = response.raw.read1(min(PIECE_BYTES, remaining), decode_content=False)
            if not piece:
                break
            pace.arrived(len(piece))
            remaining -= len(piece)
            if not held and (len(piece) >= PIECE_BYTES // 4 or not remaining):
                writer.write(piece)  # large enough on its own: no copy
                continue
            held += piece
            if len(held) >= PIECE_BYTES // 4 or not remaining:
                writer.write(bytes(held))
                held.clear()
        if held:
            writer.write(bytes(held))
        if remaining == 0:  # all read: the connection goes back to the pool (as the library does)
            response._content_consumed = True
    writer.check_complete()


def _while_uploaded(what: str, call: Any) -> None:
    """Run ``call``; an object that vanished or was replaced since the listing (a 404 or a
    412 while downloading) is a :class:`TransientSourceError`: the upload is in progress."""
    try:
        call()
    except SourceError as exc:
        statuses = {status_of(exc), status_of(exc.__cause__) if exc.__cause__ else None}
        if isinstance(exc, TransientSourceError) or not statuses & {404, 412}:
            raise
        raise TransientSourceError(
            f"{what} was replaced or removed while it was being downloaded; nothing was published.",
            "Run the loader again once the upload has finished (it resumes).",
        ) from exc


def _received_crc32c(obj: _Object) -> int:
    """The CRC32C of the complete partial file, combined from its slices' values: those this run
    received, and, read back from the file, those a killed run wrote."""
    crc = 0
    with contextlib.ExitStack() as stack:
        fh = None
        for index, (start, end) in enumerate(obj.slices):
            length = end - start + 1
            part = obj.crcs.get(index)
            if part is None:
                fh = fh or _read_back(obj, stack)
                part = crc32c_of(fh, start, length)
            crc = crc32c_combine(crc, part, length)
    return crc


def _arrived_intact(obj: _Object) -> bool:
    """True if the partial file holds exactly the object's bytes: size, then the CRC32C of
    what arrived, or the MD5 read back for an object that records no CRC32C."""
    if obj.d.regular_size(obj.name) != obj.size:
        return False
    if obj.blob.crc32c:
        return crc32c_text(_received_crc32c(obj)) == obj.blob.crc32c
    if obj.blob.md5_hash:
        with contextlib.ExitStack() as stack:
            return md5_of(_read_back(obj, stack)) == obj.blob.md5_hash
    return False


def _read_back(obj: _Object, stack: contextlib.ExitStack) -> Any:
    """The partial file open for reading its bytes back (kept open by ``stack``), its
    :data:`~loader.fs.Stamp` taken first (:attr:`_Object.read_back`)."""
    fh = stack.enter_context(obj.d.open_read(obj.name))
    obj.read_back = fs.stamp(os.fstat(fh.fileno()))
    return fh


def _as_written(obj: _Object, found: fs.Stamp) -> bool:
    """Whether ``found`` (the partial file's :data:`~loader.fs.Stamp` by its name) is the file
    this run's slices were written through, unwritten since: its size the object's, its mtime
    the latest they saw after their writes (the CRC32C checked is of the bytes received, not
    read back: a file written in place after the last slice was written would pass it); and
    the file an earlier run's slices were read back from, unwritten since it was opened for
    that (bytes written in place after they were read were stamped as verified)."""
    if obj.read_back is not None and found != obj.read_back:
        return False
    if not obj.written:
        return found[2] == obj.size  # every slice an earlier run's (or an empty object)
    return found[2] == obj.size and found[3] == max(w[3] for w in obj.written)


def _finish(obj: _Object, dest: Path, dirs: _Dirs, *, durable: bool = True) -> None:
    """Verify the complete temporary file and move it into place (``durable``: fsynced)."""
    d = obj.d
    if not _arrived_intact(obj):
        expected = obj.blob.crc32c or obj.blob.md5_hash
        d.unlink(obj.name, missing_ok=True)
        d.unlink(obj.journal, missing_ok=True)
        message = (
            f"gs://{obj.blob.bucket.name}/{obj.blob.name}: downloaded bytes do not match "
            f"the checksum in the object's metadata ({expected}); the download was "
            "discarded."
        )
        if obj.resumed:
            raise ChecksumMismatchError(
                message,
                "Run the loader again: it downloads this object "
                "from scratch; if that fails too, re-upload the object.",
            )
        raise ChecksumMismatchError(message)
    safe_path(dest, obj.rel)  # its directories: real ones (a SourceError otherwise)
    if durable:
        d.fsync_file(obj.name)
    verified = d.lstat(obj.name)  # a rename keeps the file's inode, size and mtime
    if verified is None or any(w[:2] != fs.stamp(verified)[:2] for w in obj.written):
        raise d.not_ours(obj.name, "the file the loader downloaded")  # renamed over it
    if not _as_written(obj, fs.stamp(verified)):
        raise ReplacedDownloadError(obj.partial)
    obj.stamp = fs.stamp(verified)
    d.rename(obj.name, dirs.get(obj.rel), obj.final.name, how="replace")
    d.unlink(obj.journal, missing_ok=True)
    log.debug("verified %s (%s)", obj.final, human_bytes(obj.size))


def fetch_source(uri: SourceURI, dest: Path | None, options: FetchOptions) -> FetchResult:
    if dest is None:
        raise SourceError(
            f"Fetching {uri.raw} needs a destination directory.",
            "Pass a destination (model-loader fetch URI DEST).",
        )
    workers = options.workers or DEFAULT_WORKERS
    slice_bytes = options.slice_bytes or SLICE_BYTES
    if slice_bytes < 1:
        raise SourceError(
            f"Slice size {slice_bytes} is not a positive number of bytes.",
            "Pass a slice size of at least 1 MiB (--slice-mib).",
        )
    funnel = _funnel(options)
    client = funnel.gcs(lambda _: make_client(pool_size=workers), what=f"gs://{uri.location}")
    blobs = _list_objects(client, uri, funnel)
    check_planned(uri, options.hooks, _revision(blobs))  # before anything of it is written
    dirs = _Dirs(Dir.open(dest, create=True))
    abandoned = threading.Event()
    try:
        return _fetch_into(uri, dest, dirs, blobs, options, funnel, workers, abandoned)
    finally:
        if not abandoned.is_set():  # else threads still write there: the process is ending
            dirs.close()


def _fetch_into(
    uri: SourceURI,
    dest: Path,
    dirs: _Dirs,
    blobs: list[Any],
    options: FetchOptions,
    funnel: Funnel,
    workers: int,
    abandoned: threading.Event,
) -> FetchResult:
    slice_bytes = options.slice_bytes or SLICE_BYTES

    hooks = options.hooks or ArrivalHooks()
    objects: list[_Object] = []
    present: list[tuple[str, Path, fs.Stamp]] = []
    files = [_relpath(uri, blob.name) for blob in blobs]
    _check_layout(uri, files)
    kept = [(b, rel) for b, rel in zip(blobs, files, strict=True) if rel not in hooks.skip]
    _check_checksums(uri, [b for b, _ in kept])
    todo: list[tuple[Any, str]] = []
    for blob, rel in zip(blobs, files, strict=True):
        if rel in hooks.skip or (hooks.include is not None and not hooks.include(rel)):
            continue
        stamp = _verified(dirs.top, rel, blob)
        if stamp is not None:
            log.debug("already present and verified: %s", dest / rel)
            present.append((rel, dest / rel, stamp))
            continue
        todo.append((blob, rel))
    if todo:
        mark_dest(dirs.top)  # before its first partial file: what it makes is recorded
        refuse_what_is_in_the_way(dirs.top, [rel for _, rel in todo])
    for blob, rel in todo:
        objects.append(
            _Object(
                blob=blob,
                rel=rel,
                final=dest / rel,
                partial=own_partial(dest, f"{rel}.{blob.generation}"),
                slices=_slices(int(blob.size or 0), slice_bytes),
            )
        )
    total = sum(int(b.size or 0) for b in blobs)
    objects.sort(key=lambda obj: (obj.size > slice_bytes, obj.rel))
    for obj in objects:
        beside_other_fetches(dest, lambda obj=obj: _prepare(obj, dest, dirs))
    needed = sum(obj.size - obj.resumed for obj in objects)
    if options.check_disk_space:
        ensure_disk_space(dest, needed, what=uri.raw)
    log.info(
        "fetching %s: %s objects (%s); %s to download, %s already present",
        uri.raw,
        len(blobs),
        human_bytes(total),
        human_bytes(needed),
        len(blobs) - len(objects),
    )

    if hooks.arrived is not None:
        for rel, final, stamp in present:
            hooks.arrived(rel, final, stamp)
    with byte_progress(f"gs://{uri.location}/{uri.path}", needed) as progress:
        _run(objects, funnel, progress, workers, dest, dirs, hooks, abandoned)
    remove_own_partials(dest)
    if options.hooks is None:  # all of it fetched: what stopped runs left, nothing resumes now
        clear_partials(dest)
    return FetchResult(
        path=dest,
        revision=_revision(blobs),
        files=sorted(files),
        bytes=total,
        downloaded_bytes=needed,
        fingerprint=_fingerprint(uri, blobs),
        # every object fetched was compared with its CRC32C or MD5 (_check_checksums)
        origins={
            rel: f"gs://{uri.location}/{blob.name}" for blob, rel in zip(blobs, files, strict=True)
        },
        stamps={rel: stamp for rel, _, stamp in present}
        | {obj.rel: obj.stamp for obj in objects if obj.stamp is not None},
    )


#: Seconds between two questions to ``ArrivalHooks.admit`` about one object.
ADMIT_POLL_S = 0.01


def _run(
    objects: list[_Object],
    funnel: Funnel,
    progress: Progress,
    workers: int,
    dest: Path,
    dirs: _Dirs,
    hooks: ArrivalHooks,
    abandoned: threading.Event,
) -> None:
    """Download every missing slice with one thread pool; finish each object on its last slice
    (and tell ``hooks.arrived``); an object starts once ``hooks.admit`` lets it."""
    remaining = {id(obj): len(obj.slices) - len(obj.done) for obj in objects}
    counter_lock = threading.Lock()
    stop = threading.Event()

    def job(obj: _Object, index: int | None) -> None:
        if stop.is_set():
            return
        if index is not None:
            _download_slice(obj, index, funnel, progress, durable=not hooks.transient)
            with counter_lock:
                remaining[id(obj)] -= 1
                last = remaining[id(obj)] == 0
        else:
            last = True
        if last:
            _finish(obj, dest, dirs, durable=not hooks.transient)
            if hooks.arrived is not None:
                assert obj.stamp is not None, "verified"
                hooks.arrived(obj.rel, obj.final, obj.stamp)

    def admitted(obj: _Object) -> bool:
        """Wait until ``hooks.admit`` lets ``obj`` start; False if a download failed meanwhile."""
        while hooks.admit is not None and not hooks.admit(obj.rel):
            if any(f.done() and f.exception() is not None for f in futures):
                return False
            stop.wait(ADMIT_POLL_S)
        return True

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gcs")
    futures = []
    try:
        for obj in objects:
            if not admitted(obj):
                break
            missing = [i for i in range(len(obj.slices)) if i not in obj.done]
            futures += [pool.submit(job, obj, i) for i in missing] or [pool.submit(job, obj, None)]
        done, pending = wait_in_steps(futures)  # a stop a download thread took, in time
    except BaseException:
        # Interrupted (SIGTERM, Ctrl-C): start no further slice and do not wait for the ones in
        # flight (they write under .partial/ only; the journal keeps what they finished).
        stop.set()
        abandoned.set()  # the directories stay open for the slices still in flight
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    stop.set()
    for future in pending:
        future.cancel()
    pool.shutdown(wait=True)
    for future in done:
        if future.exception() is not None:
            raise future.exception()
