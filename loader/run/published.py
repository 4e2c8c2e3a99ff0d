"""Is a key already published, complete, and built from what its source holds now?"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from loader.errors import SourceChangedError
from loader.repository import manifest, models
from loader.repository.publish import open_published
from loader.run.build import MODEL_CODE
from loader.run.request import RunRequest
from loader.sources import fingerprint
from loader.sources.fingerprint import Fingerprint, describe_changes

log = logging.getLogger(__name__)


class Warnings:
    """Warnings said once per run: ``run`` checks a published key before taking its lock and
    again under it, and the second look would repeat the first one's words."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def __call__(self, message: str, *args: object) -> None:
        text = message % args if args else message
        if text not in self._said:
            self._said.add(text)
            log.warning("%s", text)


def _complete(target: Path, key: str, request: RunRequest, warn: Warnings) -> dict | None:
    """The manifest of the key published at ``target`` if it is complete, else None."""
    published = open_published(request.root, key)
    if published is None:
        return None
    with published:
        problems = manifest.verify_in(
            published,
            key=key,
            checksums=request.verify_checksums,
            workers=request.workers,
            quick=request.verify == "quick",
            seals=True,  # without checksums: a file written since it was published is found
        )
        data = manifest.read_manifest_in(published)
    if problems or data is None:
        warn(
            "%s exists but is not a complete repository (%s); publishing it again",
            target,
            "; ".join(problems[:3]),
        )
        return None
    return data


def _same_model_code(target: Path, data: dict, warn: Warnings) -> bool:
    """Whether the key was published with this loader's Python models; checked once its source
    is known unchanged (a changed source is refused first: rebuilding must not publish new
    weights under the old key)."""
    if data.get(MODEL_CODE) == models.code_digest():
        return True
    warn(
        "%s was published by a loader with other model code (loader %s); its Python models "
        "would not match this loader's tools: publishing it again from the unchanged source",
        target,
        data.get("loader_version", "unknown"),
    )
    return False


def up_to_date(target: Path, key: str, request: RunRequest, warn: Warnings | None = None) -> bool:
    """Whether ``target`` is complete, was published with this loader's model code
    (:func:`loader.repository.models.code_digest`), and its source still holds what it was
    built from (the source fingerprint in its manifest, :mod:`loader.sources.fingerprint`).
    A source that changed is a :class:`~loader.errors.SourceChangedError`, unless ``request.follow_source``
    asks to publish it again (then False)."""
    warn = warn or Warnings()
    data = _complete(target, key, request, warn)
    if data is None:
        return False
    recorded = Fingerprint.from_dict(data.get(manifest.SOURCE_FINGERPRINT))
    if recorded is None:
        warn(
            "%s records no source fingerprint (an older loader published it): whether %s "
            "changed since cannot be told; --force publishes it again",
            target,
            request.source,
        )
        return True
    current = fingerprint(
        request.source,
        # a full verification reads every file of a local source again: a write through a
        # shared mapping changes bytes without moving the stamps the quick one trusts
        recorded=recorded
        if request.verify == "quick"
        else dataclasses.replace(recorded, stamps={}),
        workers=request.workers,
        retry_deadline_s=request.retry_deadline_s,
    )
    changes = recorded.changes(current)
    if not changes:
        log.debug("the source %s still holds what %s was built from", request.source, target)
        return _same_model_code(target, data, warn)
    if request.follow_source:
        warn(
            "the source %s changed since %s was published (%s); following it "
            "(--follow-source): publishing it again",
            request.source,
            target,
            describe_changes(changes),
        )
        return False
    raise SourceChangedError(
        f"The source {request.source} no longer holds what {target} was built from: "
        f"{describe_changes(changes)}. That key keeps serving the old weights."
    )
