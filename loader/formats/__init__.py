"""One module per file format the loader reads or writes, with no third-party dependencies.

* :mod:`loader.formats.fastertransformer`: FasterTransformer's GPT-J format (``config.ini``, the
  limits of its kernels, its constants);
* :mod:`loader.formats.huggingface`: the checkpoints we read (``config.json``, weight layouts,
  tokenizer files, dtype names).

The converter, the CPU reference, the checkpoint reader, the sources, the repository writer and
the planner import these facts from here rather than defining them again.
"""
