"""Triton model repositories: config.pbtxt builders, layout, manifest and safe publishing.

* :mod:`~loader.repository.key`: the model key naming a published repository.
* :mod:`~loader.repository.tensors`: the tensor contract (names, dtypes, dims) of every model.
* :mod:`~loader.repository.config`: ``config.pbtxt`` files built as Triton's ``ModelConfig``.
* :mod:`~loader.repository.layout`: writes the model directories into a staging directory.
* :mod:`~loader.repository.manifest`: ``manifest.json`` (every file, size, digest) and ``.ready``.
* :mod:`~loader.repository.lock`: the publish lock shared by concurrent loaders.
* :mod:`~loader.repository.publish`: staging directories and the atomic rename into place.
"""
