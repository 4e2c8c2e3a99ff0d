"""Build the demo's CodeGen checkpoint: a tiny model trained briefly on Python sources.

:func:`build_demo_checkpoint` trains a byte-level BPE tokenizer on this interpreter's standard
library (``sysconfig``'s ``stdlib`` directory), builds a small ``CodeGenForCausalLM`` with a
fixed seed, trains it with torch on the CPU for a few hundred steps (capped in time) on the same sources, and
saves a Hugging Face checkpoint directory (``config.json``, ``model.safetensors``, tokenizer
files). The directory is published atomically and reused while its recipe is unchanged
(``demo-recipe.json`` records it), so a second ``make demo`` skips the work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loader.demo.tokenizer import END_OF_TEXT, train_tokenizer

log = logging.getLogger(__name__)

RECIPE_FILE = "demo-recipe.json"


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that determines the demo checkpoint (hashed to decide whether to rebuild)."""

    vocab_size: int = 512
    n_embd: int = 128
    n_layer: int = 2
    n_head: int = 4  # head size 32: the smallest FasterTransformer's generation kernel supports
    rotary_dim: int = 8
    n_positions: int = 256
    corpus_bytes: int = 800_000
    seq_len: int = 64
    batch_size: int = 16
    learning_rate: float = 2e-2
    train_steps: int = 250
    max_train_seconds: float = 40.0
    seed: int = 0

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def python_corpus(limit_bytes: int) -> list[str]:
    """Python sources of the standard library, in a fixed order, up to ``limit_bytes``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    if not texts:
        raise RuntimeError(f"no Python sources found in {stdlib}")
    return texts


def _train(model, ids, recipe: DemoRecipe) -> tuple[int, float]:
    """Train on random windows of ``ids``: ``train_steps`` steps, cut short at the time cap."""
    import torch

    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.01)
    # Short linear warm-up, then cosine decay to a tenth over the planned steps.
    warmup = max(1, recipe.train_steps // 12)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, recipe.train_steps - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    steps, loss_value = 0, float("nan")
    deadline = time.monotonic() + recipe.max_train_seconds
    last_log = time.monotonic()
    while steps < recipe.train_steps and time.monotonic() < deadline:
        starts = torch.randint(
            0, ids.numel() - recipe.seq_len - 1, (recipe.batch_size,), generator=generator
        )
        batch = torch.stack([ids[s : s + recipe.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        steps += 1
        loss_value = float(loss.detach())
        if time.monotonic() - last_log >= 5.0:
            last_log = time.monotonic()
            log.info("training step %d, loss %.3f", steps, loss_value)
    model.eval()
    return steps, loss_value


def build_demo_checkpoint(dest: Path | str, *, recipe: DemoRecipe | None = None) -> Path:
    """Return ``dest``, a trained CodeGen checkpoint; build it unless it matches ``recipe``."""
    recipe = recipe or DemoRecipe()
    dest = Path(dest)
    recorded = dest / RECIPE_FILE
    if recorded.is_file() and json.loads(recorded.read_text()).get("digest") == recipe.digest():
        log.info("reusing the demo checkpoint in %s", dest)
        return dest

    import torch
    from tokenizers import Tokenizer
    from transformers import CodeGenConfig, CodeGenForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        started = time.monotonic()
        corpus = python_corpus(recipe.corpus_bytes)
        train_tokenizer(corpus, recipe.vocab_size, staging)
        tokenizer = Tokenizer.from_file(str(staging / "tokenizer.json"))
        eos = tokenizer.token_to_id(END_OF_TEXT)
        ids = [i for enc in tokenizer.encode_batch(corpus) for i in (*enc.ids, eos)]
        torch.manual_seed(recipe.seed)
        torch.set_num_threads(1)  # more threads spin on a busy 2-core machine and run slower
        config = CodeGenConfig(
            vocab_size=recipe.vocab_size,
            n_positions=recipe.n_positions,
            n_ctx=recipe.n_positions,
            n_embd=recipe.n_embd,
            n_layer=recipe.n_layer,
            n_head=recipe.n_head,
            rotary_dim=recipe.rotary_dim,
            n_inner=4 * recipe.n_embd,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=eos,
            eos_token_id=eos,
            tie_word_embeddings=False,
        )
        model = CodeGenForCausalLM(config).to(torch.float32)
        steps, loss = _train(model, torch.tensor(ids, dtype=torch.long), recipe)
        model.save_pretrained(staging)
        info = {
            "digest": recipe.digest(),
            "recipe": asdict(recipe),
            "steps": steps,
            "final_loss": loss,
            "corpus_tokens": len(ids),
            "seconds": round(time.monotonic() - started, 1),
        }
        (staging / RECIPE_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
        log.info("trained the demo checkpoint: %d steps, final loss %.3f", steps, loss)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def describe(dest: Path | str) -> dict:
    """The recorded training summary of a demo checkpoint."""
    return json.loads((Path(dest) / RECIPE_FILE).read_text())
