"""The demo's locally built tokenizer and CodeGen checkpoint (loader.demo)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from loader.convert import convert_checkpoint
from loader.demo.checkpoint import RECIPE_FILE, DemoRecipe, build_demo_checkpoint, describe
from loader.demo.tokenizer import END_OF_TEXT, TOKENIZER_FILES, train_tokenizer

CORPUS = ["def is_even(n: int) -> bool:\n    return n % 2 == 0\n"] * 3
SMALL = DemoRecipe(vocab_size=384, n_embd=128, n_layer=1, n_head=4, rotary_dim=4,
                   n_positions=64, corpus_bytes=30_000, seq_len=16, batch_size=2,
                   train_steps=3)  # fmt: skip


def test_the_tokenizer_has_exactly_the_asked_vocabulary_and_round_trips(tmp_path):
    out = train_tokenizer(CORPUS, 320, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == sorted(TOKENIZER_FILES)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 320  # padded with filler tokens: the corpus is tiny
    assert tokenizer.token_to_id(END_OF_TEXT) == 0
    text = "<python>def is_even(na: int) ->"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert len(json.loads((out / "vocab.json").read_text())) >= 256 + 1


def test_the_tokenizer_refuses_a_vocabulary_smaller_than_the_byte_alphabet(tmp_path):
    with pytest.raises(ValueError, match="at least 300"):
        train_tokenizer(CORPUS, 100, tmp_path)


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    return build_demo_checkpoint(tmp_path_factory.mktemp("demo") / "checkpoint", recipe=SMALL)


def test_the_demo_checkpoint_is_a_trained_codegen_model_with_its_tokenizer(demo_checkpoint):
    from transformers import CodeGenForCausalLM

    config = json.loads((demo_checkpoint / "config.json").read_text())
    assert config["model_type"] == "codegen"
    assert config["vocab_size"] == SMALL.vocab_size
    for name in TOKENIZER_FILES:
        assert (demo_checkpoint / name).is_file(), name
    info = describe(demo_checkpoint)
    assert info["steps"] == SMALL.train_steps and info["digest"] == SMALL.digest()
    model = CodeGenForCausalLM.from_pretrained(demo_checkpoint).eval()
    ids = torch.tensor([Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))
                        .encode("def f(x):").ids])  # fmt: skip
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], SMALL.vocab_size)


def test_the_demo_checkpoint_converts_for_tp2(demo_checkpoint, tmp_path):
    result = convert_checkpoint(demo_checkpoint, tmp_path, tp_size=2)
    assert (result.output_path / "config.ini").is_file()
    assert result.output_path.name == "2-gpu"


def test_an_unchanged_recipe_reuses_the_checkpoint_and_a_changed_one_rebuilds(demo_checkpoint):
    stamp = (demo_checkpoint / RECIPE_FILE).stat().st_mtime_ns
    assert build_demo_checkpoint(demo_checkpoint, recipe=SMALL) == demo_checkpoint
    assert (demo_checkpoint / RECIPE_FILE).stat().st_mtime_ns == stamp
    changed = DemoRecipe(**{**SMALL.__dict__, "train_steps": 2})
    build_demo_checkpoint(demo_checkpoint, recipe=changed)
    assert describe(demo_checkpoint)["steps"] == 2
    assert not list(demo_checkpoint.parent.glob(".checkpoint.*"))  # no staging left behind
