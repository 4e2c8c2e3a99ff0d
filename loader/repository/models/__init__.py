"""Triton Python-backend models copied into a published repository.

The files of this package are not imported by the loader; they run inside Triton's Python
backend. :func:`model_files` says which source file goes where inside a model directory, and
the repository writer (:mod:`loader.repository.layout`) copies them, so every repository is
self-contained (the Python that runs Triton needs numpy and tokenizers, not this project):

======================  ==================================================================
model directory         files (destination relative to the model directory)
======================  ==================================================================
``preprocessing``       ``1/model.py``, ``1/tokenization.py`` (+ ``1/tokenizer/*``, the
                        checkpoint's tokenizer files, copied by the repository writer)
``postprocessing``      same as ``preprocessing``
``fastertransformer``   with ``--backend python`` only: ``1/model.py`` (the CPU reference)
                        and ``1/loader/``: ``__init__.py``, ``errors.py``,
                        ``formats/fastertransformer.py`` and every module of
                        ``loader/reference/`` (the package the model imports)
``<NAME>`` (streaming)  with ``--streaming`` only, in place of the ensemble: ``1/model.py``
                        (from ``streaming/model.py``) and ``1/bls.py`` (the steps it shares
                        with ``llm``), installed under the role name ``streaming``
``llm``                 in every repository: ``1/model.py`` (from ``llm/model.py``),
                        ``1/bls.py``, ``1/tokenization.py`` (+ ``1/tokenizer/*``: it
                        tokenizes stop and bad words and decodes text)
======================  ==================================================================
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: The ``loader`` package directory (the source of the copied modules).
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = Path(__file__).resolve().parent

_TOKENIZING = ("preprocessing", "postprocessing", "llm")
#: The decoupled model a streaming repository serves under the model's name.
STREAMING = "streaming"
PYTHON_MODELS = (*_TOKENIZING, "fastertransformer", STREAMING)
#: The models that call the others through BLS get the steps they share.
_BLS = {model: [(MODELS_DIR / "bls.py", "1/bls.py")] for model in ("llm", STREAMING)}


def model_files(model: str) -> list[tuple[Path, str]]:
    """``(source file, destination relative to the model directory)`` for one model."""
    if model in _TOKENIZING:
        return [
            (MODELS_DIR / model / "model.py", "1/model.py"),
            *_BLS.get(model, []),
            (MODELS_DIR / "tokenization.py", "1/tokenization.py"),
        ]
    if model == STREAMING:
        return [(MODELS_DIR / model / "model.py", "1/model.py"), *_BLS[model]]
    if model == "fastertransformer":
        files = [
            (MODELS_DIR / model / "model.py", "1/model.py"),
            (PACKAGE_ROOT / "__init__.py", "1/loader/__init__.py"),
            (PACKAGE_ROOT / "errors.py", "1/loader/errors.py"),
            (PACKAGE_ROOT / "formats" / "__init__.py", "1/loader/formats/__init__.py"),
            (
                PACKAGE_ROOT / "formats" / "fastertransformer.py",
                "1/loader/formats/fastertransformer.py",
            ),
        ]
        for source in sorted((PACKAGE_ROOT / "reference").glob("*.py")):
            files.append((source, f"1/loader/reference/{source.name}"))
        return files
    raise KeyError(f"no Python-backend model named {model!r}; expected one of {PYTHON_MODELS}")


def code_digest() -> str:
    """One SHA-256 over every file :func:`model_files` copies (destination names and bytes):
    what a published repository's Python code is. A key published by a loader whose model code
    differs is published again (:mod:`loader.run.published`), never reported as up to date."""
    digest = hashlib.sha256()
    for model in PYTHON_MODELS:
        for source, relative in model_files(model):
            data = source.read_bytes()
            digest.update(f"{model}/{relative}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()
