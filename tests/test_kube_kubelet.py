"""The fake kubelet's container-command handling, without a cluster: Kubernetes' `$(VAR)`
expansion and the mapping of volume mount paths to local directories (tests/kube/kubelet.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kube.kubelet import command_of, expand, map_paths, runs_here

MOUNTS = [("/models", Path("/local/pv")), ("/tmp", Path("/local/scratch"))]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "1"),
        ("x$(A)y$(B)", "x1y2"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(A)", "$(A)"),
        ("$$$(A)", "$1"),
        ("$A", "$A"),
        ("--model=$(A)", "--model=1"),
    ],
)
def test_expansion_follows_kubernetes(text, expected):
    assert expand(text, {"A": "1", "B": "2"}) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/models", "/local/pv"),
        ("/models/", "/local/pv/"),
        ("/models/codegen@v1/.ready", "/local/pv/codegen@v1/.ready"),
        ("--repository=/models", "--repository=/local/pv"),
        ("file:///models/ckpt", "file:///local/pv/ckpt"),
        ("HF_HOME=/tmp/huggingface", "HF_HOME=/local/scratch/huggingface"),
        ("a:/tmp:/models", "a:/local/scratch:/local/pv"),
        # Not a mount path: inside another path or URI, or a longer name.
        ("gs://models/codegen", "gs://models/codegen"),
        ("hf://org/models", "hf://org/models"),
        ("/data/models", "/data/models"),
        ("/modelsx", "/modelsx"),
        ("/models.bak", "/models.bak"),
        ("models", "models"),
    ],
)
def test_mount_paths_are_mapped_only_where_they_start_a_path(text, expected):
    assert map_paths(text, MOUNTS) == expected


def test_the_longest_mount_path_wins():
    mounts = [("/models", Path("/a")), ("/models/cache", Path("/b"))]
    assert map_paths("/models/cache/x /models/y", mounts) == "/b/x /a/y"


def test_the_loader_image_entrypoint_stands_in_for_a_missing_command():
    loader = {"image": "registry.example/model-triton-loader:0.1.0@sha256:ab", "args": ["run"]}
    assert command_of(loader) == ["model-loader", "run"]
    assert runs_here(loader)
    triton = {"image": "model-triton-ft:23.05", "command": ["tritonserver", "--x"]}
    assert not runs_here(triton)
    assert not runs_here({"image": "unknown:1", "args": ["x"]})
