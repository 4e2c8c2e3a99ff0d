"""What Triton will load, checked before anything is published: the one place.

A repository is published only if every part Triton loads would load, so a bad input ends as
a typed error (exit 2) before the conversion, never as a repository that fails in Triton or as a
traceback:

* **the tokenizer** (:func:`check_tokenizer`): loaded by the repository's own
  ``load_tokenizer()`` (``loader/repository/models/tokenization.py``, the code the
  ``preprocessing`` and ``postprocessing`` models run) from the checkpoint's files, which the
  repository copies byte for byte; each file at most :data:`MAX_TOKENIZER_BYTES`; every id it
  produces must index the model's embedding (below ``vocab_size``): its vocabulary's, and
  those its post-processor and padding add to every encoding;
* **config.ini** (:func:`check_ft_config`): FasterTransformer reads every number of ``[gptj]``
  as a C ``int`` (``INIReader::GetInteger`` into the ``int start_id, int end_id`` and the sizes
  of ``GptJTritonModel``'s constructor, ``src/fastertransformer/triton_backend/gptj/
  GptJTritonModel.cc``), so each must fit in int32; ``start_id`` and ``end_id`` are token ids:
  below ``vocab_size`` (an end id beyond it never ends a generation); what FasterTransformer's
  kernels need of the model's numbers was checked when the plan was made
  (:func:`loader.formats.fastertransformer.check_loadable`, from ``ft_config``), and of a full
  batch after the memory plan (:func:`loader.plan.check_index_range`);
* **config.pbtxt** (:func:`check_settings`): each number within the range of its
  ``ModelConfig`` field (``max_batch_size``, ``instance_group.count`` and
  ``preferred_batch_size`` are int32, ``max_queue_delay_microseconds`` uint64), then every
  config built by the same builders the repository is written with, so protobuf itself checks
  what it accepts.

The safetensors headers get the checks of the ``safetensors`` library where they are read
(:class:`loader.checkpoint.SafetensorsFile`).

This module only reads, and only the checkpoint: its tokenizer files are opened once by path
(the user's own directory, links followed as given; or the download area, which
:mod:`loader.fs` walks from its anchor one name at a time) and the tokenizer library reads
them through those descriptors. It writes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loader import fs
from loader.errors import (
    CheckpointError,
    RepositoryError,
    ResourceExhaustedError,
    typed_os_error,
)
from loader.formats.fastertransformer import INT32_MAX, FTConfig, check_token_ids
from loader.parallel import Parallelism
from loader.repository.config import RepositorySpec, build_all
from loader.repository.key import ServingSettings, check_model_name

UINT64_MAX = 2**64 - 1
#: The largest tokenizer file copied into a repository (real ones are a few MB).
MAX_TOKENIZER_BYTES = 256 * 2**20


def check_settings(name: str, parallelism: Parallelism, settings: ServingSettings) -> None:
    """Every number of the repository's ``config.pbtxt`` files within its field's range, and
    the configs built (see the module docstring); a :class:`RepositoryError` naming the flag
    otherwise. The model name, which the configs hold, is checked first
    (:func:`~loader.repository.key.check_model_name`): a name that is not UTF-8 text failed in
    the configs' encoding, reported as a refusal of the numbers."""
    check_model_name(name)
    numbers = [
        ("--max-batch-size", settings.max_batch_size, INT32_MAX),
        ("--instance-count", parallelism.instance_count, INT32_MAX),
        ("--tp-size", parallelism.tp, INT32_MAX),
        ("--pp-size", parallelism.pp, INT32_MAX),
        ("--max-queue-delay-us", settings.max_queue_delay_us, UINT64_MAX),
        *(("--preferred-batch-size", size, INT32_MAX) for size in settings.preferred_batch_sizes),
    ]
    for flag, value, most in numbers:
        if value > most:
            raise RepositoryError(
                f"{flag} {value} is beyond what Triton's model configuration holds "
                f"(at most {most}).",
                f"Pass {flag} between 1 and {most} (values that large are a typo).",
            )
    spec = RepositorySpec(name, parallelism, settings, data_type="fp16", end_id=0)
    try:
        build_all(spec)
    except (ValueError, TypeError) as exc:
        raise RepositoryError(
            f"Triton's model configuration refuses these settings: {exc}.",
            "Check --max-batch-size, --instance-count, --preferred-batch-size and "
            "--max-queue-delay-us.",
        ) from exc


def check_ft_config(config: FTConfig) -> None:
    """``config.ini``'s numbers as FasterTransformer reads them (see the module docstring)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, int) and not 0 <= value <= INT32_MAX:
            raise CheckpointError(
                f"config.json gives {field.name} = {value}, beyond the 32-bit integer "
                "FasterTransformer reads it into.",
                "Use the checkpoint's original config.json.",
            )
    check_token_ids(config)


#: Texts encoded to see the ids a tokenizer adds to every encoding (a post-processor's
#: special tokens): an empty one, a short one, and two in a batch of different lengths.
_PROBES = ("", "a", "Hello, world: a probe of the tokenizer.")


def _ids(tokenizer: Any) -> list[int]:
    """Every id ``tokenizer`` can put in an encoding as the ``preprocessing`` model encodes
    (``encode_batch``, special tokens added): its vocabulary's (added tokens included), the ids
    its post-processor adds (encoded probes, padding and truncation off: whatever the
    post-processor's kind) and the id it pads with."""
    ids = list(tokenizer.get_vocab(with_added_tokens=True).values())
    padding = tokenizer.padding
    if padding is not None:
        ids.append(padding["pad_id"])
    probe = type(tokenizer).from_str(tokenizer.to_str())
    probe.no_padding()
    probe.no_truncation()
    ids += [i for encoding in probe.encode_batch(list(_PROBES)) for i in encoding.ids]
    return ids


#: How the tokenizers library (Rust's std::io::Error) ends a message about a failed call.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _os_error_code(exc: BaseException) -> int | None:
    """The errno behind ``exc``: an OSError's, or the one a tokenizers message ends with
    (``Too many open files (os error 24)``: the library raises a plain Exception)."""
    if isinstance(exc, OSError):
        return exc.errno
    found = _RUST_OS_ERROR.search(str(exc))
    return int(found.group(1)) if found else None


def check_tokenizer(
    checkpoint: Path,
    files: list[Path],
    vocab_size: int,
    checked: Mapping[str, fs.Stamp] | None = None,
) -> None:
    """Load the tokenizer the repository will hold, as its models will (see the module
    docstring); a :class:`CheckpointError` naming the file otherwise. ``checked``: the stamps
    of the files a download verified, which those loaded must be (:func:`loader.fs.as_checked`:
    another file put there is not the source's, whether it loads or not)."""
    from loader.repository.models.tokenization import tokenizer_from

    stamps = checked or {}
    with contextlib.ExitStack() as opened:
        read: dict[str, str] = {}
        held: list[tuple[int, Path]] = []

        def as_checked() -> None:  # each file still the one verified: it was loaded
            for fd, path in held:
                fs.as_checked(fd, path, stamps.get(path.name))

        for path in files:
            # Opened once (anything but a regular file refused, never read), and loaded from
            # this descriptor: the library opened the path again, and a FIFO put there
            # meanwhile held the run for good, another file was loaded unchecked.
            fh = opened.enter_context(fs.open_read(path))
            held.append((fh.fileno(), path))
            fs.as_checked(fh.fileno(), path, stamps.get(path.name))
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_TOKENIZER_BYTES:
                raise CheckpointError(
                    f"{path} holds {size} bytes, more than a tokenizer file can "
                    f"({MAX_TOKENIZER_BYTES // 2**20} MiB).",
                    "Use the checkpoint's own tokenizer files (as save_pretrained writes them).",
                )
            read[path.name] = fs.by_descriptor(path, fh.fileno())
        try:
            # the files the repository will hold, never another file beside them (a download
            # directory may still hold one an earlier listing put there)
            tokenizer = tokenizer_from(read, checkpoint)
            largest = max(_ids(tokenizer), default=-1)
        except BaseException as exc:  # the tokenizers library raises plain Exceptions, and a
            # panic of its Rust code (pyo3's PanicException, no Exception) on some hostile files
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            as_checked()  # written over while it was loaded: not the source's fault
            if isinstance(exc, MemoryError):  # each file within its limit: the machine's
                raise ResourceExhaustedError(
                    f"The loader ran out of memory loading the tokenizer of {checkpoint}."
                ) from exc
            code = _os_error_code(exc)
            if code in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):  # the process's or machine's
                raise typed_os_error(OSError(code, os.strerror(code), checkpoint)) from exc
            names = ", ".join(p.name for p in files)
            raise CheckpointError(
                f"The tokenizer of {checkpoint} ({names}) does not load: {str(exc)[:300]}.",
                "Use the checkpoint's own tokenizer files (as save_pretrained writes them); the "
                "preprocessing and postprocessing models load them the same way.",
            ) from exc
        as_checked()
    if largest >= vocab_size:
        raise CheckpointError(
            f"The tokenizer of {checkpoint} produces ids up to {largest}, beyond the model's "
            f"vocabulary (vocab_size {vocab_size}).",
            "Use the tokenizer the checkpoint was trained with.",
        )
