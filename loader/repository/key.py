"""The model key: the name of one published model repository under the repository root.

``{name}@{revision}/tp{T}-pp{P}-i{I}-{variant}``, a two-level path:

* ``revision`` is ``--revision`` if given; else the revision written in the source URI
  (``hf://org/name@rev`` gives ``rev``); else ``src-`` + the first 10 hex digits of the sha256
  of the source's canonical URI (:attr:`loader.sources.SourceURI.canonical`: a local path,
  its absolute form and its ``file://`` form are one source, ``file:///abs/path``; a gs://
  prefix without trailing slash).
* The model name and the revision are at most :data:`MAX_PART_BYTES` bytes each (the key's
  file names, lock and staging names included, stay within the 255 bytes a file system takes),
  made of the characters :data:`NAME_PATTERN` and :data:`REVISION_PATTERN` allow.
* The source is one the loader can fetch (:func:`check_source`), with or without a revision:
  a key is never computed for a source the run would refuse. A ``file://`` URI is a path
  written as is: percent-escapes, ``?`` and ``#`` are refused rather than decoded or dropped,
  and no source may hold a control character.
* ``variant`` is the first 8 hex digits of the sha256 of the canonical settings string (UTF-8,
  no spaces)::

    backend=B;dtype=D;max_batch_size=N;dynamic_batching=0|1;preferred_batch_size=4,8;max_queue_delay_us=100;streaming=0|1

  ``dtype`` is ``auto`` when no ``--dtype`` was given; ``preferred_batch_size`` and
  ``max_queue_delay_us`` are empty when dynamic batching is off. The Helm chart computes the same
  string with ``sha256sum | trunc 8``, so any change here must change the chart too.

The Helm chart computes the same key (``charts/model-triton/templates/_modelkey.tpl``) and refuses
what this module refuses; ``tests/test_chart_key.py`` renders thousands of generated sources,
names, revisions and settings through the real Helm and compares them with this module, and reads
the limits below against the chart's ``values.schema.json``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from loader.errors import RepositoryError, SourceError
from loader.parallel import Parallelism
from loader.sources import SourceURI, parse_uri

#: Backends the loader writes the ``fastertransformer`` model for.
BACKENDS: tuple[str, ...] = ("fastertransformer", "python")
#: ``--dtype`` values; ``auto`` keeps the source checkpoint's dtype.
DTYPES: tuple[str, ...] = ("auto", "fp16", "fp32")
#: Names of the models a repository holds besides the ensemble.
RESERVED_MODEL_NAMES: frozenset[str] = frozenset(
    {"preprocessing", "fastertransformer", "postprocessing", "llm"}
)

#: What a model name is made of (the whole name; the chart's schema has ``^...$``).
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
#: What a revision is made of (the whole revision).
REVISION_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME = re.compile(NAME_PATTERN)
_REVISION = re.compile(REVISION_PATTERN)
#: Longest model name and longest revision, in bytes.
MAX_PART_BYTES = 64
#: Characters no source may hold: ASCII control characters and DEL.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: A ``file://`` URI the key accepts: no host but ``localhost``, an absolute path, and none of the
#: characters a URL parser would decode (``%``) or cut off (``?``, ``#``).
_FILE_URI = re.compile(r"(?i:file)://(localhost)?/[^%?#]*")


@dataclass(frozen=True)
class ServingSettings:
    """The serving settings that change what a repository contains (hashed into the variant)."""

    backend: str = "fastertransformer"
    dtype: str = "auto"
    max_batch_size: int = 8
    dynamic_batching: bool = True
    preferred_batch_sizes: tuple[int, ...] = field(default_factory=tuple)
    max_queue_delay_us: int = 100
    streaming: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise RepositoryError(
                f"Unknown backend {self.backend!r}.",
                f"Use --backend with one of: {', '.join(BACKENDS)}.",
            )
        if self.dtype not in DTYPES:
            raise RepositoryError(
                f"Unknown dtype {self.dtype!r}.",
                "Use --dtype fp16 or --dtype fp32, or leave it out to keep the source's dtype.",
            )
        if self.max_batch_size < 1:
            raise RepositoryError(
                f"--max-batch-size must be at least 1, got {self.max_batch_size}.",
                "Pass --max-batch-size 1 or more (8 is the default).",
            )
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                raise RepositoryError(
                    f"Preferred batch size {size} is outside 1..{self.max_batch_size} "
                    "(the max batch size).",
                    "Pass --preferred-batch-size values between 1 and --max-batch-size.",
                )
        if self.max_queue_delay_us < 0:
            raise RepositoryError(
                f"--max-queue-delay-us must not be negative, got {self.max_queue_delay_us}.",
                "Pass --max-queue-delay-us 0 or more (microseconds).",
            )
        object.__setattr__(self, "preferred_batch_sizes", tuple(self.preferred_batch_sizes))
        if not self.dynamic_batching:
            # Batching settings mean nothing without dynamic batching; the key ignores them too.
            object.__setattr__(self, "preferred_batch_sizes", ())

    def canonical(self) -> str:
        """The canonical settings string the variant hashes (see the module docstring)."""
        if self.dynamic_batching:
            preferred = ",".join(str(s) for s in self.preferred_batch_sizes)
            delay = str(self.max_queue_delay_us)
        else:
            preferred = delay = ""
        return (
            f"backend={self.backend};dtype={self.dtype};max_batch_size={self.max_batch_size};"
            f"dynamic_batching={int(self.dynamic_batching)};preferred_batch_size={preferred};"
            f"max_queue_delay_us={delay};streaming={int(self.streaming)}"
        )

    def variant(self) -> str:
        return hashlib.sha256(self.canonical().encode("utf-8")).hexdigest()[:8]

    def as_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "dtype": self.dtype,
            "max_batch_size": self.max_batch_size,
            "dynamic_batching": self.dynamic_batching,
            "preferred_batch_sizes": list(self.preferred_batch_sizes),
            "max_queue_delay_us": self.max_queue_delay_us if self.dynamic_batching else None,
            "streaming": self.streaming,
            "canonical": self.canonical(),
        }


def check_model_name(name: str) -> str:
    """A model name usable as a Triton model name and a directory name."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RepositoryError(
            f"Model name {name!r} is not usable as a Triton model and directory name.",
            "Use letters, digits, '.', '_' and '-' only, starting with a letter or digit "
            "(e.g. --model-name codegen-350m-mono).",
        )
    if len(name.encode("utf-8")) > MAX_PART_BYTES:
        raise RepositoryError(
            f"Model name {name[:40]!r}... is {len(name)} characters long; at most "
            f"{MAX_PART_BYTES} fit in the model key's file names.",
            f"Choose a --model-name of at most {MAX_PART_BYTES} characters.",
        )
    if name in RESERVED_MODEL_NAMES:
        raise RepositoryError(
            f"Model name {name!r} clashes with a model the repository already holds.",
            f"Choose a --model-name other than {', '.join(sorted(RESERVED_MODEL_NAMES))}.",
        )
    return name


def check_source(source: str) -> SourceURI:
    """The parsed source, or :class:`~loader.errors.SourceError` for a source the key does not
    take: empty, an unknown scheme, missing parts (``parse_uri``), a control character, or a
    ``file://`` URI with a host, a relative path, a percent-escape, ``?`` or ``#``."""
    if isinstance(source, str) and _CONTROL.search(source):
        raise SourceError(
            f"The source {source!r} contains a control character.",
            "Write the source URI or path without control characters (tabs, newlines).",
        )
    if (
        isinstance(source, str)
        and source[:7].lower() == "file://"
        and not _FILE_URI.fullmatch(source)
    ):
        raise SourceError(
            f"file:// URI {source!r} is not a plain absolute path.",
            "Write file:///absolute/path with the path as it is on disk (no %-escapes, '?' or "
            "'#'), or give the plain path.",
        )
    return parse_uri(source)


def resolve_revision(source: str, revision: str | None = None) -> str:
    """The key's revision: ``revision``, else the URI's ``@rev``, else a hash of the URI. The
    source is checked either way (:func:`check_source`)."""
    parsed = check_source(source)
    if revision is None:
        revision = parsed.revision
    if revision is None:
        # A local path's bytes as they are on disk (a name that is not UTF-8 is still a path).
        spelled = parsed.canonical.encode("utf-8", "surrogateescape")
        return "src-" + hashlib.sha256(spelled).hexdigest()[:10]
    if not _REVISION.fullmatch(revision):
        raise RepositoryError(
            f"Revision {revision!r} cannot be part of a model key (a directory name).",
            "Pass --revision with a commit hash or tag made of letters, digits, '.', '_', '-'.",
        )
    if len(revision.encode("utf-8")) > MAX_PART_BYTES:
        raise RepositoryError(
            f"Revision {revision[:40]!r}... is {len(revision)} characters long; at most "
            f"{MAX_PART_BYTES} fit in the model key's file names.",
            f"Pass a --revision of at most {MAX_PART_BYTES} characters (a commit id has 40).",
        )
    return revision


def model_key(
    name: str,
    source: str,
    parallelism: Parallelism,
    settings: ServingSettings,
    *,
    revision: str | None = None,
) -> str:
    """``{name}@{revision}/tp{T}-pp{P}-i{I}-{variant}`` (see the module docstring)."""
    check_model_name(name)
    rev = resolve_revision(source, revision)
    return f"{name}@{rev}/{parallelism.key()}-{settings.variant()}"


def key_filename(key: str) -> str:
    """A single path component naming ``key`` (for lock and staging names)."""
    return key.replace("/", "__")
