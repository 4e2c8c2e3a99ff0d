"""Verify a checkpoint before converting it: everything that config.json, the list of its
tensors and its tokenizer tell, checked before anything is written.

:func:`verify` makes the :class:`~loader.convert.plan.ConversionPlan` (the architecture, T and P
against the model's dimensions, the tensors, the output dtype), checks the GPU memory when the
request gives one, and finds the tokenizer files the repository copies; what Triton will load
of them (the tokenizer, config.ini's numbers) is checked by :mod:`loader.repository.validate`.

It only reads, and only the checkpoint, by path: the user's own directory (links followed as
given) or the download area, which :mod:`loader.fs` walks from its anchor one name at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loader import fs
from loader.checkpoint import read_hf_config, read_inventory
from loader.convert.plan import ConversionPlan, plan_conversion
from loader.errors import CheckpointError
from loader.formats.huggingface import CONFIG_FILE, config_dtype
from loader.plan import ModelShape, check_index_range, check_memory, estimate_memory
from loader.repository import layout, validate
from loader.run.request import RunRequest

log = logging.getLogger(__name__)

#: Bytes a repository holds besides the weights and tokenizer copies (configs, the Python
#: models, the manifest), with room to spare.
REPOSITORY_EXTRA_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Verified:
    """A checkpoint that passed :func:`verify`: its plan and its tokenizer files."""

    plan: ConversionPlan
    tokenizer: list[Path]
    #: the stamps of the files a download verified (:attr:`loader.sources.FetchResult.stamps`):
    #: the tokenizer files copied into the repository must be those
    checked: Mapping[str, fs.Stamp] = field(default_factory=dict)

    @property
    def besides_weights(self) -> int:
        """Bytes the repository holds besides the converted weights: two tokenizer copies and
        the rest (:data:`REPOSITORY_EXTRA_BYTES`)."""
        sizes = (fs.stat_path(p).st_size for p in self.tokenizer)
        return 2 * sum(sizes) + REPOSITORY_EXTRA_BYTES


def verify(
    request: RunRequest,
    checkpoint: Path,
    *,
    again: Verified | None = None,
    listed: Collection[str] | None = None,
    checked: Mapping[str, fs.Stamp] | None = None,
) -> Verified:
    """Check the checkpoint in ``checkpoint`` (its weight files need not be there yet, when an
    index lists them) for ``request``; ``again``: what an earlier check of it found (a weight
    file shorter now was cut short meanwhile: a transient error, not a corrupt file);
    ``listed``: the files the source holds now, the only ones read (a download directory may
    still hold files of an earlier listing); ``checked``: the stamps of the files a download
    verified, which those read (config.json, the index) and copied later (the tokenizer) must
    be (:func:`loader.fs.as_checked`)."""
    checked = dict(checked or {})
    if listed is not None and CONFIG_FILE not in listed:
        raise CheckpointError(
            f"{request.source} holds no {CONFIG_FILE}: not a Hugging Face checkpoint.",
            f"Upload the checkpoint with its {CONFIG_FILE} (as save_pretrained writes it), then "
            "run again.",
        )
    config = read_hf_config(checkpoint, checked=checked.get(CONFIG_FILE))
    seen = again.plan.inventory.sizes if again is not None else None
    inventory = read_inventory(checkpoint, seen=seen, listed=listed, checked=checked)
    plan = plan_conversion(config, inventory, parallelism=request.parallelism, dtype=request.dtype)
    log.debug(
        "checked %s for %s: the conversion plan holds (heads, widths, layers, dtype)",
        checkpoint,
        request.parallelism,
    )
    # Without --gpu-memory-gib, still refused: what no GPU of any node can hold (an instance
    # count or batch size that large is a typo, and would be published for every pod).
    estimate = estimate_memory(
        ModelShape.from_ft_config(plan.config),
        request.parallelism,
        dtype=plan.out_dtype or config_dtype(config),
        max_batch_size=request.settings.max_batch_size,
        gpus_per_replica=request.topology.gpus_per_replica,
    )
    check_memory(estimate, request.gpu_memory_gib)
    # After the memory check, which names an absurd batch size or instance count as such.
    check_index_range(
        ModelShape.from_ft_config(plan.config),
        request.parallelism,
        max_batch_size=request.settings.max_batch_size,
    )
    if request.gpu_memory_gib is not None:
        log.info(
            "memory per GPU: about %.1f GiB of %g GiB",
            estimate.total / 2**30,
            request.gpu_memory_gib,
        )
    tokenizer = layout.tokenizer_files(checkpoint, listed)
    validate.check_ft_config(plan.config)
    validate.check_tokenizer(checkpoint, tokenizer, plan.config.vocab_size, checked)
    return Verified(plan, tokenizer, checked)
