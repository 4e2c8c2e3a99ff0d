"""model-triton loader: fetch, convert and publish LLM checkpoints for Triton."""

__version__ = "0.1.0"
