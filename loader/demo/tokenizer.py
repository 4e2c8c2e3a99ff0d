"""Train a small byte-level BPE tokenizer locally and save it the way Hugging Face does.

:func:`train_tokenizer` writes ``tokenizer.json`` (the ``tokenizers`` format), ``vocab.json`` +
``merges.txt`` (the GPT-2 / CodeGen pair), ``tokenizer_config.json`` and
``special_tokens_map.json`` into a checkpoint directory. The vocabulary has exactly
``vocab_size`` entries (filler tokens pad it when the corpus yields fewer merges), so it matches
the model's embedding table. ``<|endoftext|>`` has id 0 and is the end-of-text token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from loader.formats.huggingface import TOKENIZER_FILES as HF_TOKENIZER_FILES

log = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
#: Files a checkpoint directory receives: every tokenizer file but ``added_tokens.json`` (the
#: one special token is in the vocabulary).
TOKENIZER_FILES = tuple(n for n in HF_TOKENIZER_FILES if n != "added_tokens.json")


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path | str) -> Path:
    """Train on ``texts``, save into ``out_dir`` (created) and return ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ValueError(
            "a byte-level BPE vocabulary needs at least 300 entries (256 bytes + merges)"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} entries, not {vocab_size}")
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer.model.save(str(out))  # vocab.json + merges.txt
    eos_id = tokenizer.token_to_id(END_OF_TEXT)
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": 2048,
        "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "unk_token": END_OF_TEXT,
        "add_prefix_space": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    log.info("trained a %d-token BPE tokenizer (end of text = %d) in %s", vocab_size, eos_id, out)
    return out
