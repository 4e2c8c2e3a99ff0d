"""An OpenAI-compatible completions service in front of Triton's ``llm`` model.

It speaks OpenAI's completions API over HTTP (``/v1/completions``, the legacy
``/v1/engines/{engine}/completions``, ``/v1/models``) and calls Triton over gRPC streaming, one
stream per request, to the repository's ``llm`` model (``text_input`` -> ``text_output``). It
is a package of its own with its own image: it never imports the loader (``docs/completions.md``).
"""

__version__ = "0.1.0"
