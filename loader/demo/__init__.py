"""The small local model of ``make demo``: a tokenizer and a briefly trained CodeGen checkpoint.

Everything is built on this machine (no hub): :mod:`loader.demo.tokenizer` trains a byte-level
BPE tokenizer on Python sources, :mod:`loader.demo.checkpoint` builds and trains a tiny CodeGen
model with it and saves a Hugging Face checkpoint directory.
"""
