"""Hugging Face Hub: ``hf://org/name`` and ``hf://org/name@revision`` with ``huggingface_hub``.

* The revision (default ``main``) is resolved to a commit first; everything after that is
  pinned to the commit, which :class:`~loader.sources.FetchResult` records as ``revision``.
* Only the files a conversion needs are fetched (:func:`select_files`): ``config.json``, the
  weights in ONE format (safetensors with its index if present, else PyTorch ``.bin`` with its
  index), the tokenizer files and ``generation_config.json``. Other formats (``*.msgpack``,
  ``*.h5``, ``*.onnx``, ...) and sub-folders are left out.
* ``snapshot_download`` writes into ``dest/.partial/hf.<owner>/`` (its own metadata there makes a
  rerun resume; named after this process, :mod:`loader.sources.transfer`, so a loader that lost
  its lock never writes into its successor's downloads); each file is then verified against the Hub's listing (SHA-256 for LFS files, the git
  blob id otherwise) and only then moved to ``dest/<path>``. Files already in ``dest`` that
  verify are not downloaded again.
* With :class:`~loader.sources.ArrivalHooks` a caller consumes the files while the fetch goes
  on: the small files (config, index, tokenizer) come first, then the weight shards one at a
  time in name order, each started once the caller admits it; the caller hears of every file
  as soon as it is verified and in place.
* Token: ``hf_token``, else the file ``hf_token_file``, else ``$HF_TOKEN``, else the file named by
  huggingface_hub's ``$HF_TOKEN_PATH`` (``$HF_TOKEN_FILE`` is read as another name for it; a
  mounted Kubernetes Secret), else the library's own stored login. It is passed to the Hub,
  never logged. ``$HF_ENDPOINT`` selects a mirror of the Hub.
* Transient failures (connection errors, 429, 5xx) are retried with tenacity within the retry
  deadline, ``Retry-After`` honoured (:mod:`loader.sources.failures`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loader import fs
from loader.errors import (
    CheckpointError,
    ChecksumMismatchError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
)
from loader.formats.huggingface import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    WEIGHT_FILES,
    is_weight_file,
)
from loader.progress import Progress, byte_progress, human_bytes
from loader.sources import ArrivalHooks, FetchOptions, FetchResult, SourceURI, settings
from loader.sources.failures import Funnel
from loader.sources.fingerprint import Fingerprint
from loader.sources.transfer import (
    adopt,
    ensure_disk_space,
    own_partial,
    place,
    remove_own_partials,
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
    if not token_file:
        return None
    return _read_token_file(token_file, source)


def _read_token_file(token_file: str, source: str) -> str:
    try:  # a regular file only (a FIFO would block), and a token's size at most
        token = fs.read_file(Path(token_file), limit=64 * 1024).decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise SourcePermissionError(
            f"The Hugging Face token file {token_file} ({source}) is not text (it is not UTF-8).",
            "Put the token itself in the file (hf_...), as one line of text.",
        ) from exc
    except OSError as exc:
        raise SourcePermissionError(
            f"Cannot read the Hugging Face token file {token_file} ({source}: {exc.strerror}).",
            f"Check {source} and that the Secret is mounted there.",
        ) from exc
    if not token:
        raise SourcePermissionError(
            f"The Hugging Face token file {token_file} ({source}) is empty.",
            "Put the token in the file (or the Kubernetes Secret).",
        )
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise SourcePermissionError(
            f"The Hugging Face token file {token_file} ({source}) holds more than one printable "
            "word.",
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
                f"{uri.raw}: the Hub does not accept {repo!r} as a repository id ({exc}).",
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
                f"{uri.raw}: a file listed by the Hub is missing ({exc}).",
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

    def verify(self, local: Path) -> bool:
        if not local.is_file() or local.stat().st_size != self.size:
            return False
        if self.sha256:
            return _hash_file(local, hashlib.sha256()) == self.sha256
        if self.blob_id:
            header = f"blob {self.size}\0".encode()
            return _hash_file(local, hashlib.sha1(header, usedforsecurity=False)) == self.blob_id
        return True


def _hash_file(path: Path, digest: Any) -> str:
    with fs.open_read(path) as fh:
        while chunk := fh.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def _listing(api: Any, uri: SourceURI, commit: str, token: str | None) -> dict[str, RemoteFile]:
    files = {}
    for entry in api.list_repo_tree(uri.location, revision=commit, recursive=True, token=token):
        if not hasattr(entry, "size") or getattr(entry, "blob_id", None) is None:
            continue  # a folder
        lfs = getattr(entry, "lfs", None)
        sha256 = getattr(lfs, "sha256", None) if lfs is not None else None
        files[entry.path] = RemoteFile(entry.path, int(entry.size), entry.blob_id, sha256)
    return files


@contextmanager
def _watch_bytes(root: Path, progress: Progress, *, interval: float = 0.5) -> Iterator[None]:
    """Report the growth of the files under ``root`` to ``progress`` while the block runs
    (huggingface_hub counts bytes only on its own tqdm bars, which it draws per file and
    never hands to a caller)."""
    stop = threading.Event()

    def size() -> int:
        # The downloaded files and the Hub's ``*.incomplete`` files, not its metadata.
        return sum(
            p.stat().st_size
            for p in root.rglob("*")
            if p.is_file() and (p.suffix == ".incomplete" or ".cache" not in p.parts)
        )

    base = size()
    seen = 0

    def loop() -> None:
        nonlocal seen
        while not stop.wait(interval):
            try:
                now = size() - base
            except FileNotFoundError:
                continue
            if now > seen:
                progress.update(now - seen)
                seen = now

    thread = threading.Thread(target=loop, name="hf-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        final = size() - base
        if final > seen:
            progress.update(final - seen)


# --- fetch -------------------------------------------------------------------------------

#: A full git commit id: a revision naming it is pinned.
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _resolve_commit(
    api: Any, uri: SourceURI, revision: str, token: str | None, funnel: Funnel
) -> str:
    info = funnel(
        lambda: api.model_info(uri.location, revision=revision, token=token),
        what=f"{uri.raw} (model info)",
    )
    return info.sha


def fingerprint_source(
    uri: SourceURI, options: FetchOptions, *, recorded: Fingerprint | None = None
) -> Fingerprint:
    """The commit the URI's revision (default ``main``) names now (no call for a commit id)."""
    revision = uri.revision or DEFAULT_REVISION
    if _COMMIT.fullmatch(revision):
        return Fingerprint(uri=uri.canonical, commit=revision)
    settings.import_hub("huggingface_hub.hf_api")
    from huggingface_hub import HfApi

    token = resolve_token(options)
    api = HfApi(endpoint=settings.endpoint("HF_ENDPOINT"))
    commit = _resolve_commit(api, uri, revision, token, _funnel(uri, revision, options))
    return Fingerprint(uri=uri.canonical, commit=commit)


def fetch_source(uri: SourceURI, dest: Path | None, options: FetchOptions) -> FetchResult:
    if dest is None:
        raise SourceError(
            f"Fetching {uri.raw} needs a destination directory.",
            "Pass a destination (model-loader fetch URI DEST).",
        )
    settings.import_hub("huggingface_hub.hf_api")
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    token = resolve_token(options)
    revision = uri.revision or DEFAULT_REVISION
    funnel = _funnel(uri, revision, options)
    # Read at call time (the Hub library reads it once, at import).
    endpoint = settings.endpoint("HF_ENDPOINT")
    api = HfApi(endpoint=endpoint)
    commit = _resolve_commit(api, uri, revision, token, funnel)
    log.info("%s: revision %s is commit %s", uri.location, revision, commit)
    remote = funnel(lambda: _listing(api, uri, commit, token), what=f"{uri.raw} (file list)")
    wanted = select_files(remote, repo=f"{uri.location}@{commit}")

    fs.makedirs(dest)
    hooks = options.hooks or ArrivalHooks()
    chosen = [
        f for f in wanted if f not in hooks.skip and (hooks.include is None or hooks.include(f))
    ]
    present = [f for f in chosen if remote[f].verify(dest / f)]
    missing = [f for f in chosen if f not in present]
    total = sum(remote[f].size for f in wanted)
    needed = sum(remote[f].size for f in missing)
    if options.check_disk_space:
        ensure_disk_space(dest, needed, what=uri.raw)
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
            hooks.arrived(rel, dest / rel)
    if missing:
        staging = own_partial(dest, "hf")
        adopt(staging)
        fs.makedirs(staging)
        disable_progress_bars()

        def download(files: list[str], progress: Progress) -> None:
            with _watch_bytes(staging, progress):
                funnel(
                    lambda: _interruptible(
                        lambda: snapshot_download(
                            uri.location,
                            revision=commit,
                            local_dir=staging,
                            allow_patterns=files,
                            token=token,
                            endpoint=endpoint,
                            max_workers=options.workers or DEFAULT_WORKERS,
                        )
                    ),
                    what=f"{uri.raw} (download)",
                )
            for rel in files:
                _verify_and_place(
                    uri, commit, remote[rel], staging / rel, dest, rel, durable=not hooks.transient
                )
                if hooks.arrived is not None:
                    hooks.arrived(rel, dest / rel)

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
        remove_own_partials(dest)
    return FetchResult(
        path=dest,
        revision=commit,
        files=wanted,
        bytes=total,
        downloaded_bytes=needed,
        fingerprint=Fingerprint(uri=uri.canonical, commit=commit),
    )


def _interruptible(fn: Any) -> Any:
    """Run ``fn`` in a daemon thread and wait for it here, so SIGTERM or Ctrl-C in the main
    thread unwinds at once (the Hub library's own thread pool would first finish every queued
    download); what the abandoned thread still writes lands under ``.partial/`` only."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="hf-download", daemon=True).start()
    while not done.wait(0.2):
        pass
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _verify_and_place(
    uri: SourceURI,
    commit: str,
    remote: RemoteFile,
    staged: Path,
    dest: Path,
    rel: str,
    *,
    durable: bool = True,
) -> None:
    final = dest / rel
    if not staged.is_file():
        raise SourceNotFoundError(
            f"{uri.raw}: {remote.path} was not downloaded.",
            "Check the repository's files at that revision.",
        )
    if not remote.verify(staged):
        fs.unlink(staged)
        raise ChecksumMismatchError(
            f"hf://{uri.location}@{commit}/{remote.path}: downloaded bytes do not match the "
            "Hub's hash for the file; the download was discarded.",
            "Run the loader again; if this repeats, the repository file or a mirror in between "
            "is corrupt.",
        )
    place(staged, final, dest=dest, durable=durable)
