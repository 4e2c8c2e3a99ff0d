"""Variants of a published model repository: another instance count or dynamic-batching setting.

A published repository is never modified. A variant is a new directory holding the same model
directories with rewritten ``config.pbtxt`` files: ``instance_group`` and ``dynamic_batching``
exactly as ``model-loader run --instance-count I --[no-]dynamic-batching ...`` would write them
(the settings go through :func:`loader.repository.config.build_all`, and only those fields, with
the ragged ``input_ids`` that dynamic batching brings, are taken over). Small files are copied;
large ones (the weights) are symbolic links to the original, so a variant costs almost no disk
space. Each variant is written to a temporary directory and renamed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loader import fs
from loader.errors import RepositoryError
from loader.parallel import Parallelism
from loader.repository.config import (
    FASTERTRANSFORMER,
    RepositorySpec,
    build_all,
    mc,
    read_config,
    to_text,
)
from loader.repository.key import RESERVED_MODEL_NAMES, ServingSettings

log = logging.getLogger(__name__)

#: Files at least this large are linked into a variant instead of copied.
LINK_THRESHOLD_BYTES = 1 << 20

ENSEMBLE_PLATFORM = "ensemble"


@dataclass(frozen=True)
class Variant:
    """Instance count and dynamic batching of the models of a repository."""

    instance_count: int
    dynamic_batching: bool
    preferred_batch_sizes: tuple[int, ...] = field(default_factory=tuple)
    max_queue_delay_us: int = 100

    @property
    def label(self) -> str:
        batching = "batching-on" if self.dynamic_batching else "batching-off"
        return f"i{self.instance_count}-{batching}"

    def settings(self) -> dict[str, object]:
        """Bullet points for reports (the seed's benchmark headings)."""
        out: dict[str, object] = {
            "instance_group": self.instance_count,
            "dynamic_batching": self.dynamic_batching,
        }
        if self.dynamic_batching:
            out["preferred_batch_size"] = list(self.preferred_batch_sizes)
            out["max_queue_delay_microseconds"] = self.max_queue_delay_us
        return out


def model_dirs(repository: Path) -> dict[str, Path]:
    """Model name -> directory, for every directory of ``repository`` with a ``config.pbtxt``."""
    repository = Path(repository)
    if not repository.is_dir():
        raise RepositoryError(
            f"model repository {repository} {fs.not_a_directory(Path(repository))}",
            "Pass the directory `model-loader run` printed as its last line.",
        )
    found = {
        p.name: p
        for p in sorted(repository.iterdir())
        if p.is_dir() and (p / "config.pbtxt").is_file()
    }
    if not found:
        raise RepositoryError(
            f"{repository} holds no model (no */config.pbtxt)",
            "Pass the directory `model-loader run` printed as its last line.",
        )
    return found


def read_configs(repository: Path) -> dict[str, mc.ModelConfig]:
    return {
        name: read_config(path / "config.pbtxt") for name, path in model_dirs(repository).items()
    }


def ensemble_name(configs: Mapping[str, mc.ModelConfig]) -> str:
    """The model clients call: the ensemble, the streaming model of a ``--streaming``
    repository (the one model besides the composing ones), or the only model there is."""
    ensembles = [n for n, c in configs.items() if c.platform == ENSEMBLE_PLATFORM]
    if len(ensembles) == 1:
        return ensembles[0]
    if not ensembles and len(configs) == 1:
        return next(iter(configs))
    front = [n for n in configs if n not in RESERVED_MODEL_NAMES]
    if not ensembles and len(front) == 1:
        return front[0]
    raise RepositoryError(
        f"cannot tell which model to measure (ensembles: {', '.join(ensembles) or 'none'}; "
        f"models: {', '.join(configs)})",
        "Pass --model NAME.",
    )


def describe(configs: Mapping[str, mc.ModelConfig]) -> dict[str, object]:
    """Instance count and batching of the generating model (``fastertransformer``, or any)."""
    config = configs.get(FASTERTRANSFORMER) or next(
        (c for c in configs.values() if c.platform != ENSEMBLE_PLATFORM), None
    )
    if config is None:
        return {}
    out: dict[str, object] = {
        "instance_group": sum(g.count or 1 for g in config.instance_group) or 1,
        "dynamic_batching": config.HasField("dynamic_batching"),
    }
    if config.HasField("dynamic_batching"):
        out["preferred_batch_size"] = list(config.dynamic_batching.preferred_batch_size)
        out["max_queue_delay_microseconds"] = config.dynamic_batching.max_queue_delay_microseconds
    out["max_batch_size"] = config.max_batch_size
    return out


def _spec_for(configs: Mapping[str, mc.ModelConfig], variant: Variant) -> RepositorySpec:
    ft = configs.get(FASTERTRANSFORMER)
    if ft is None:
        raise RepositoryError(
            f"the repository has no {FASTERTRANSFORMER!r} model (models: {', '.join(configs)})",
            "Pass a repository published by `model-loader run`.",
        )
    params = {k: v.string_value for k, v in ft.parameters.items()}
    settings = ServingSettings(
        backend=ft.backend or "fastertransformer",
        max_batch_size=ft.max_batch_size,
        dynamic_batching=variant.dynamic_batching,
        preferred_batch_sizes=variant.preferred_batch_sizes if variant.dynamic_batching else (),
        max_queue_delay_us=variant.max_queue_delay_us,
        streaming=ft.model_transaction_policy.decoupled,
    )
    return RepositorySpec(
        name=ensemble_name(configs),
        parallelism=Parallelism(
            tp=int(params.get("tensor_para_size", "1")),
            pp=int(params.get("pipeline_para_size", "1")),
            instance_count=variant.instance_count,
        ),
        settings=settings,
        data_type=params.get("data_type", "fp32"),
        end_id=0,  # only instance_group and batching are taken from the built configs
        checkpoint_path=params.get("model_checkpoint_path") or None,
    )


def variant_configs(
    configs: Mapping[str, mc.ModelConfig], variant: Variant
) -> dict[str, mc.ModelConfig]:
    """``configs`` with ``instance_group`` and ``dynamic_batching`` as ``run`` writes them."""
    built = build_all(_spec_for(configs, variant))
    out = {}
    for name, original in configs.items():
        config = mc.ModelConfig()
        config.CopyFrom(original)
        reference = built.get(name)
        if reference is not None and original.platform != ENSEMBLE_PLATFORM:
            config.ClearField("instance_group")
            config.instance_group.extend(reference.instance_group)
            config.ClearField("dynamic_batching")
            if reference.HasField("dynamic_batching"):
                config.dynamic_batching.CopyFrom(reference.dynamic_batching)
            config.ClearField("batch_input")
            config.batch_input.extend(reference.batch_input)
            ragged = {t.name: t.allow_ragged_batch for t in reference.input}
            for tensor in config.input:
                tensor.allow_ragged_batch = ragged.get(tensor.name, False)
        out[name] = config
    return out


def _link_or_copy(threshold: int):
    def copy(src: str, dst: str) -> str:
        if os.path.getsize(src) >= threshold:
            os.symlink(os.path.realpath(src), dst)
        else:
            shutil.copy2(src, dst)
        return dst

    return copy


def _ignore(top: str):
    def ignore(directory: str, names: list[str]) -> list[str]:
        skip = [n for n in names if n == "__pycache__"]
        if directory == top:
            skip.append("config.pbtxt")
        return skip

    return ignore


def make_variant(
    repository: Path,
    dest: Path,
    variant: Variant,
    *,
    link_threshold_bytes: int = LINK_THRESHOLD_BYTES,
) -> Path:
    """Write the variant of ``repository`` to ``dest`` (replaced if present); return ``dest``.

    Files of ``link_threshold_bytes`` or more are symbolic links to the originals.
    """
    repository = Path(repository).resolve()
    dest = Path(dest)
    dirs = model_dirs(repository)
    configs = variant_configs(read_configs(repository), variant)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for name, source in dirs.items():
            shutil.copytree(
                source,
                staging / name,
                symlinks=True,
                copy_function=_link_or_copy(link_threshold_bytes),
                ignore=_ignore(str(source)),
            )
            (staging / name / "config.pbtxt").write_text(to_text(configs[name]), encoding="utf-8")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("variant %s of %s written to %s", variant.label, repository, dest)
    return dest
