"""One module per file format the loader reads or writes, with no third-party dependencies.

* :mod:`loader.formats.fastertransformer`: FasterTransformer's GPT-J format (``config.ini``, the
  limits of its kernels) and the wire contract of the FasterTransformer Triton backend.

The converter, the CPU reference, the repository writer and the planner import these facts from
here rather than defining them again.
"""
