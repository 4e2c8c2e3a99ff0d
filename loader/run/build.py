"""Write the rest of a repository around its converted weights, in the staging directory:
the model directories (:mod:`loader.repository.layout`), then the modes and fsyncs of
:func:`loader.repository.publish.seal`, ``manifest.json`` (the weights' digests come from the
conversion, computed while writing; the seals are taken from the final files) and finally
``.ready``."""

from __future__ import annotations

import time
from pathlib import Path

from loader import __version__, fs
from loader.convert.plan import ConvertResult
from loader.repository import layout, manifest, models, publish
from loader.repository.bounds import RequestBounds
from loader.repository.config import RepositorySpec
from loader.repository.key import resolve_revision
from loader.run.request import RunRequest
from loader.run.verify import Verified
from loader.sources.fingerprint import Fingerprint

#: The manifest field holding :func:`loader.repository.models.code_digest` of the loader that
#: published the key.
MODEL_CODE = "model_code"


def build(
    staging: Path,
    request: RunRequest,
    *,
    key: str,
    source_revision: str | None,
    source_fingerprint: Fingerprint,
    verified: Verified,
    converted: ConvertResult,
    expected: publish.Identity | None = None,
) -> None:
    """Complete the repository in ``staging`` whose weights ``converted`` wrote there (with
    ``expected``, its :func:`~loader.repository.publish.identity`: sealed only while it is
    that very directory)."""
    par, settings = request.parallelism, request.settings
    spec = RepositorySpec(
        name=request.model_name,
        parallelism=par,
        settings=settings,
        data_type=converted.dtype,
        end_id=converted.config.end_id,
        start_id=converted.config.start_id,
        max_model_len=converted.config.max_pos_seq_len,
        bounds=RequestBounds.for_model(converted.config, max_batch_size=settings.max_batch_size),
    )
    made: dict[Path, fs.Stamp] = {}
    layout.write_models(
        staging, spec, tokenizer=verified.tokenizer, checked=verified.checked, written_as=made
    )
    weights = converted.output_path.relative_to(staging).as_posix()
    meta = {
        "key": key,
        "model_name": request.model_name,
        "source": request.source,
        "revision": resolve_revision(request.source, request.revision),
        "source_revision": source_revision,
        manifest.SOURCE_FINGERPRINT: source_fingerprint.as_dict(),
        "parallelism": {"tp": par.tp, "pp": par.pp, "instance_count": par.instance_count},
        "settings": settings.as_dict(),
        "data_type": spec.data_type,
        "weights": weights,
        "loader_version": __version__,
        MODEL_CODE: models.code_digest(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    known = {f"{weights}/{name}": sized for name, sized in converted.digests.items()}
    stamps = {f"{weights}/{name}": stamp for name, stamp in converted.stamps.items()}
    stamps.update((path.relative_to(staging).as_posix(), stamp) for path, stamp in made.items())
    # modes final and data durable before the manifest takes the seals
    publish.seal(staging, expected)
    manifest.write_manifest(
        staging,
        manifest.build_manifest(
            staging, meta, workers=request.workers, known=known, written=stamps
        ),
    )
    manifest.write_ready(staging, key)
