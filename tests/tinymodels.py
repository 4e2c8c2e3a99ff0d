"""Tiny, real Hugging Face checkpoints (GPT-J and CodeGen) built from ``transformers`` configs.

:func:`make_tiny_checkpoint` builds a small random model with a fixed seed, randomises *every*
parameter (LayerNorm weights and biases included, so a swapped or dropped tensor changes the
output), and saves it as a Hugging Face checkpoint directory in the requested file format:

* ``fmt="safetensors"``: ``model.safetensors`` (or shards + ``model.safetensors.index.json``),
  written by ``save_pretrained``;
* ``fmt="bin"``: ``pytorch_model.bin`` (or shards + ``pytorch_model.bin.index.json``), written with
  ``torch.save`` because transformers 5 only writes safetensors.

:func:`load_hf_model` loads such a directory back into the ``transformers`` model class in fp32
eval mode, reading the weight files with ``safetensors``/``torch`` directly (independently of the
loader's own checkpoint reader).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ARCHS = ("gptj", "codegen")
#: The context (n_positions) of the checkpoint the serving tests publish: room for their long
#: generations, which the repository's bounds hold to the model's context.
SERVING_CONTEXT = 512
#: start_id / end_id of the serving tests' requests: the users' ``bench/test.json`` names
#: CodeGen's 50256, outside the tiny vocabulary of 320, which ``preprocessing`` refuses; this id
#: is inside it and, at the seed request's temperature and top-p, never sampled in the tests.
TINY_END_ID = 319
#: ``bench/test.json`` with :data:`TINY_END_ID` (a test checks it differs in nothing else).
TINY_REQUEST_FILE = Path(__file__).resolve().parent / "data" / "tiny" / "test.json"


def for_tiny_model(request: dict) -> dict:
    """A request for a published tiny model: ``start_id`` and ``end_id`` inside its vocabulary."""
    return {**request, "start_id": [TINY_END_ID], "end_id": [TINY_END_ID]}


DTYPES = {"fp32": torch.float32, "fp16": torch.float16}

#: Small defaults: fast on a CPU, yet every dimension is distinct and divisible by 1, 2, 4 and
#: (for CodeGen) by the 4 fused groups. The head size (256 / 8 = 32) is the smallest one
#: FasterTransformer's generation kernel supports.
TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 320,
    "n_positions": 64,
    "n_embd": 256,
    "n_layer": 2,
    "n_head": 8,
    "rotary_dim": 4,
    "activation_function": "gelu_new",
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "layer_norm_epsilon": 1e-6,  # FasterTransformer's fixed GPT-J epsilon
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def _classes(arch: str) -> tuple[type, type]:
    if arch == "gptj":
        from transformers import GPTJConfig, GPTJForCausalLM

        return GPTJConfig, GPTJForCausalLM
    if arch == "codegen":
        from transformers import CodeGenConfig, CodeGenForCausalLM

        return CodeGenConfig, CodeGenForCausalLM
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a random value (no ones/zeros), reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith(("ln_1.weight", "ln_f.weight")):
                value = 1.0 + 0.2 * noise
            elif name.endswith(".bias"):
                value = 0.1 * noise
            elif name.endswith("wte.weight"):
                value = 0.5 * noise
            else:
                value = noise / (param.shape[-1] ** 0.5)
            param.copy_(value.to(param.dtype))


def build_tiny_model(
    *, arch: str = "gptj", n_inner: int | None = None, seed: int = 0, **config_overrides: Any
) -> torch.nn.Module:
    """The random fp32 ``transformers`` model (not saved)."""
    config_cls, model_cls = _classes(arch)
    kwargs = {**TINY_DEFAULTS, "n_inner": n_inner, **config_overrides}
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomise(model, seed)
    return model.eval()


def make_tiny_checkpoint(
    path: Path | str,
    *,
    arch: str = "gptj",
    dtype: str = "fp32",
    n_inner: int | None = None,
    fmt: str = "safetensors",
    sharded: bool = False,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Build a tiny random checkpoint in ``path`` (created) and return ``path``.

    ``sharded=True`` writes several weight files plus the index (``*.index.json``).
    ``config_overrides`` are passed to the ``transformers`` config class.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if fmt not in ("safetensors", "bin"):
        raise ValueError(f"unknown fmt {fmt!r}; expected 'safetensors' or 'bin'")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(arch=arch, n_inner=n_inner, seed=seed, **config_overrides)
    model = model.to(DTYPES[dtype])
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_size = max(total // 3, 1) if sharded else 50 * 2**30
    if fmt == "safetensors":
        model.save_pretrained(path, max_shard_size=shard_size)
    else:
        model.config.save_pretrained(path)
        _save_bin(model, path, shard_size=shard_size, sharded=sharded)
    return path


def _save_bin(model: torch.nn.Module, path: Path, *, shard_size: int, sharded: bool) -> None:
    state = {
        k: v.detach().clone().contiguous()
        for k, v in model.state_dict().items()
        if not k.endswith(("attn.bias", "attn.masked_bias"))
    }
    if not sharded:
        torch.save(state, path / "pytorch_model.bin")
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, path / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


def read_state_dict(path: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read with ``safetensors``/``torch`` directly."""
    from safetensors.torch import load_file

    path = Path(path)
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no weight files in {path}")
    for f in files:
        if f.suffix == ".safetensors":
            state.update(load_file(f))
        else:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def load_hf_model(path: Path | str) -> torch.nn.Module:
    """The ``transformers`` model of a checkpoint directory, in fp32 eval mode. A parameter
    tied to one the checkpoint holds (``tie_word_embeddings``: ``lm_head.weight`` is the input
    embedding, which ``save_pretrained`` writes once) is not missing."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    config_cls, model_cls = _classes(config["model_type"])
    cfg = config_cls.from_pretrained(path)
    model = model_cls(cfg).to(torch.float32)
    state = {k: v.to(torch.float32) for k, v in read_state_dict(path).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"unexpected tensors in {path}: {unexpected}")
    persistent = set(model.state_dict())
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    really_missing = [
        k for k in missing if k in persistent and not (k in params and id(params[k]) in loaded)
    ]
    if really_missing:
        raise ValueError(f"tensors missing from {path}: {really_missing}")
    return model.eval()


def make_sharded_fp16_checkpoint(path: Path | str) -> Path:
    """A tiny fp16 CodeGen checkpoint in about 12 safetensors shards, with its tokenizer (the
    overlapped-conversion tests: enough shards that a window of two is a small part of it)."""
    from loader.demo.tokenizer import train_tokenizer
    from tests.conftest import TOKENIZER_CORPUS

    path = Path(path)
    model = build_tiny_model(arch="codegen", seed=3).half()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=total // 12)
    train_tokenizer(TOKENIZER_CORPUS, 320, path)
    return path


def make_sharded_checkpoint(path: Path, *, seed: int) -> Path:
    """A tiny fp16 GPT-J checkpoint at ``path`` in three safetensors shards, with its tokenizer."""
    from loader.demo.tokenizer import train_tokenizer
    from tests.conftest import TOKENIZER_CORPUS

    model = build_tiny_model(seed=seed).half()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=total // 3)
    train_tokenizer(TOKENIZER_CORPUS, 320, path)
    return path
