"""What ``model-loader run`` is asked to do, and what it did."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from loader.errors import LoaderError, RepositoryError, shown
from loader.limits import (
    GPU_MEMORY_GIB,
    LOCK_EXPIRY_S,
    LOCK_TIMEOUT_S,
    PRUNE_KEEP,
    RETRY_DEADLINE_S,
    WORKERS,
)
from loader.parallel import Parallelism
from loader.plan import Topology
from loader.repository.key import ServingSettings, model_key
from loader.repository.validate import check_settings
from loader.sources import parse_uri

#: Ways of verifying a published key (see :attr:`RunRequest.verify`).
VERIFY_MODES = ("quick", "full")


@dataclass(frozen=True)
class RunRequest:
    """What ``model-loader run`` was asked to do (see ``model-loader run --help``). Every
    setting is checked when the request is made, before anything is read or written."""

    source: str
    repository: Path
    model_name: str
    parallelism: Parallelism
    settings: ServingSettings
    revision: str | None = None
    gpus_per_replica: int | None = None
    gpu_memory_gib: float | None = None
    force: bool = False
    work_dir: Path | None = None
    workers: int | None = None
    verify_checksums: bool = True
    #: How a published key is verified before "nothing to do": "quick" re-hashes only files
    #: whose seal changed since they were written (:func:`loader.repository.manifest.verify`),
    #: "full" re-hashes every file, and every file of a local source (never trusting its stat
    #: stamps).
    verify: str = "quick"
    lock_expiry_s: float = LOCK_EXPIRY_S.default
    lock_timeout_s: float = LOCK_TIMEOUT_S.default
    follow_source: bool = False
    retry_deadline_s: float = RETRY_DEADLINE_S.default
    prune_keep: int | None = None
    overlap: bool = True

    def __post_init__(self) -> None:
        LOCK_EXPIRY_S.check(self.lock_expiry_s)
        LOCK_TIMEOUT_S.check(self.lock_timeout_s)
        RETRY_DEADLINE_S.check(self.retry_deadline_s)
        PRUNE_KEEP.check(self.prune_keep)
        WORKERS.check(self.workers)
        GPU_MEMORY_GIB.check(self.gpu_memory_gib)
        check_settings(self.model_name, self.parallelism, self.settings)
        for flag, value in (("--repository", self.repository), ("--work-dir", self.work_dir)):
            if value is not None and any(c in str(value) for c in "\n\r\0"):
                raise RepositoryError(
                    f"{flag} {str(value)!r} holds a line break or a NUL: the last line the "
                    "loader prints is the published path, which must be one line.",
                    f"Use a {flag} path without line breaks.",
                )
        self._check_apart()
        if self.verify not in VERIFY_MODES:
            raise RepositoryError(
                f"The verification mode must be one of {', '.join(VERIFY_MODES)}, got "
                f"{self.verify!r}.",
                "Verify quick (the default) or full (re-hash every file).",
            )

    def _check_apart(self) -> None:
        """A local source must not hold the repository root or the work directory: what the
        loader writes there would become part of the source, and every later run would find
        the source changed (its fingerprint covers every file below it)."""
        try:
            uri = parse_uri(self.source)
        except LoaderError:
            return  # said by the fetch, with its own hint
        if uri.scheme != "file" or not os.path.isdir(uri.location):
            return  # a missing source is said by the fetch
        source = Path(os.path.realpath(uri.location))
        for flag, value in (("--repository", self.repository), ("--work-dir", self.work_dir)):
            if value is None:
                continue
            where = Path(os.path.realpath(Path(value).absolute()))
            if where == source or source in where.parents:
                raise RepositoryError(
                    f"{flag} {shown(value)} lies in the local source {shown(source)}: what the "
                    "loader writes there would become part of the source, which every later "
                    "run would then find changed.",
                    f"Point {flag} outside the checkpoint directory.",
                )

    @property
    def root(self) -> Path:
        """The repository root, absolute."""
        return Path(self.repository).absolute()

    @property
    def topology(self) -> Topology:
        gpus = self.gpus_per_replica
        return Topology(
            gpus_per_replica=self.parallelism.gpus_per_instance if gpus is None else gpus
        )

    @property
    def key(self) -> str:
        """The model key this request publishes under (:func:`loader.repository.key.model_key`)."""
        return model_key(
            self.model_name, self.source, self.parallelism, self.settings, revision=self.revision
        )

    @property
    def dtype(self) -> str | None:
        """The output dtype asked for; None keeps the source's (``--dtype`` auto)."""
        return None if self.settings.dtype == "auto" else self.settings.dtype


@dataclass(frozen=True)
class RunResult:
    path: Path
    key: str
    published: bool  # False: an identical, verified repository was already there
    seconds: float
