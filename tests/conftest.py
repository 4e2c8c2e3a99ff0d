"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

# The local Kubernetes control plane (tests/kube): `kube`, `kubelet`, `sandbox`.
from tests.kube.fixtures import kube, kubelet, sandbox  # noqa: F401

#: Text the tiny test tokenizers are trained on.
TOKENIZER_CORPUS = [
    "def is_even(n: int) -> bool:\n    return n % 2 == 0\n",
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i)\n",
    "<python>def is_even(na: int) ->",
]


@pytest.fixture(scope="session")
def tiny_checkpoint_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-J checkpoint (fp32 safetensors, vocab 320) with a trained tokenizer.

    Session-scoped and shared: tests must not modify it.
    """
    from loader.demo.tokenizer import train_tokenizer
    from tests.tinymodels import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gptj") / "ckpt", arch="gptj")
    train_tokenizer(TOKENIZER_CORPUS, 320, path)
    return path


@pytest.fixture(scope="session")
def published_tiny_python_repository(
    tiny_checkpoint_with_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny checkpoint published by ``model-loader run --backend python`` (model ``codegen``,
    T=1, P=1, I=1, dynamic batching off); the path Triton serves.

    Session-scoped and shared: tests must not modify it (serve it, or make variants of it).
    """
    from loader.parallel import Parallelism
    from loader.repository.key import ServingSettings
    from loader.run import RunRequest, run

    request = RunRequest(
        source=str(tiny_checkpoint_with_tokenizer),
        repository=tmp_path_factory.mktemp("published") / "models",
        model_name="codegen",
        parallelism=Parallelism(tp=1, pp=1, instance_count=1),
        settings=ServingSettings(backend="python", dynamic_batching=False),
    )
    return run(request).path


@pytest.fixture(scope="session")
def tiny_sharded_bin_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-J checkpoint as sharded ``pytorch_model-*.bin`` files plus the index.

    Session-scoped and shared: tests must not modify it.
    """
    from tests.tinymodels import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny-bin") / "ckpt"
    return make_tiny_checkpoint(path, fmt="bin", sharded=True)
