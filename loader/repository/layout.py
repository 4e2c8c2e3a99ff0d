"""Write a Triton model repository's model directories into a staging directory.

::

    <staging>/
      <NAME>/config.pbtxt, 1/                 the ensemble (version directory empty)
      preprocessing/config.pbtxt, 1/model.py, 1/tokenization.py, 1/tokenizer/*
      fastertransformer/config.pbtxt, 1/<T>-gpu/*   (+ 1/model.py, 1/loader/ with --backend python)
      postprocessing/config.pbtxt, 1/model.py, 1/tokenization.py, 1/tokenizer/*
      llm/config.pbtxt, 1/model.py, 1/bls.py, 1/tokenization.py, 1/tokenizer/*

The ``<T>-gpu`` weights are converted straight into ``fastertransformer/1/`` by the pipeline
(written once); this module writes everything else. A model whose config names the Python
backend gets its files from :mod:`loader.repository.models`; the tokenising models get the
checkpoint's own tokenizer files.

The staging directory is the loader's: it is entered once and everything in it is written as a
descriptor and one name (:class:`loader.fs.Dir`). The checkpoint's tokenizer files are a source
the loader only reads, by path (:func:`tokenizer_files`): the user's own directory, whose links
are followed as given, or the download area, which :mod:`loader.fs` walks from its anchor one
name at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from pathlib import Path

from loader import fs
from loader.errors import CheckpointError
from loader.formats.huggingface import TOKENIZER_FILES
from loader.fs import Dir
from loader.repository.config import (
    FASTERTRANSFORMER,
    LLM,
    POSTPROCESSING,
    PREPROCESSING,
    RepositorySpec,
    build_all,
    write_config,
)
from loader.repository.models import STREAMING, model_files

log = logging.getLogger(__name__)

VERSION = "1"
TOKENIZER_DIR = "tokenizer"
#: Models that tokenise or detokenise and so need the tokenizer files.
TOKENIZING_MODELS: tuple[str, ...] = (PREPROCESSING, POSTPROCESSING, LLM)


def weights_dir(staging: Path) -> Path:
    """Where the converter writes ``<T>-gpu/`` inside a staging repository."""
    return Path(staging) / FASTERTRANSFORMER / VERSION


def tokenizer_files(checkpoint_dir: Path, listed: Collection[str] | None = None) -> list[Path]:
    """The checkpoint's tokenizer files (of those ``listed``, the files the source holds now,
    if given: a download directory may still hold an earlier listing's); a
    :class:`CheckpointError` if it has no tokenizer."""
    checkpoint_dir = Path(checkpoint_dir)
    present = [
        checkpoint_dir / n
        for n in TOKENIZER_FILES
        if (listed is None or n in listed) and fs.regular_size(checkpoint_dir / n) is not None
    ]
    names = {p.name for p in present}
    if "tokenizer.json" not in names and not {"vocab.json", "merges.txt"} <= names:
        raise CheckpointError(
            f"{checkpoint_dir} has no tokenizer (tokenizer.json, or vocab.json + merges.txt); "
            "the preprocessing and postprocessing models need it.",
            "Add the model's tokenizer files to the checkpoint (as save_pretrained writes them), "
            "then run the loader again.",
        )
    return present


def write_models(
    staging: Path,
    spec: RepositorySpec,
    *,
    tokenizer: list[Path],
    checked: Mapping[str, fs.Stamp] | None = None,
    written_as: dict[Path, fs.Stamp] | None = None,
) -> list[Path]:
    """Write every model directory (configs last) into ``staging``; returns the written files.
    ``checked``: the stamps of the tokenizer files a download verified, which those copied
    must be (:func:`loader.fs.as_checked`). ``written_as`` gets each written file's
    :data:`~loader.fs.Stamp` after its last write (the manifest seals only those files).
    ``staging`` is opened once (below ROOT from ROOT, one name at a time); every directory and
    file below it is a descriptor and one name (:class:`loader.fs.Dir`), never a path."""
    written: list[Path] = []
    stamps = checked or {}
    made = written_as if written_as is not None else {}
    configs = build_all(spec)
    with Dir.open(staging) as base:
        for name, config in configs.items():
            with base.sub(name, create=True) as model_dir:
                model_dir.mkdir(VERSION, exist_ok=True)
                if config.backend == "python":
                    # The model clients call is a Python model only when it streams.
                    role = STREAMING if name == spec.name else name
                    for source, relative in model_files(role):
                        *levels, file_name = relative.split("/")
                        with model_dir.makedirs(levels) as d:
                            made[d.path / file_name] = d.copy_in(file_name, source)
                            written.append(d.path / file_name)
                if name in TOKENIZING_MODELS:
                    with model_dir.makedirs((VERSION, TOKENIZER_DIR)) as d:
                        for source in tokenizer:
                            copied = d.copy_in(source.name, source, checked=stamps.get(source.name))
                            made[d.path / source.name] = copied
                            written.append(d.path / source.name)
        for name, config in configs.items():
            with base.sub(name) as model_dir:
                written.append(write_config(config, model_dir, made))
        log.info("wrote %d model directories into %s", len(configs), base.path)
    return written
