"""``config.pbtxt`` builders: Triton's own ``ModelConfig`` protobuf, written with ``text_format``.

One builder per model of a repository, chosen from :data:`BUILDERS` by model role:

* ``ensemble``: platform ``ensemble`` named after the model; the client's inputs ->
  ``preprocessing`` -> ``fastertransformer`` -> ``postprocessing``, which produces every output
  the client sees. ``preprocessing`` sends ``fastertransformer`` every input of its contract,
  FasterTransformer's default where the client sent nothing (so any two requests may share a
  batch: Triton's dynamic batcher joins only requests with the same input set) and
  ``is_return_log_probs`` true (``postprocessing`` reads FasterTransformer's layout from the log
  probabilities' width, and an ensemble fails a request, "unexpected deadlock, at least one
  output is not set", when a step leaves out a tensor it maps). ``fastertransformer``'s results
  travel under internal names; ``postprocessing`` cuts them to the tokens the request asked for
  (``loader/repository/models/README.md``).
* ``preprocessing`` / ``postprocessing``: Python backend, tokenise / detokenise.
* ``fastertransformer``: the FasterTransformer backend (``docs/fastertransformer.md``), or with
  ``backend="python"`` the CPU reference model with the same inputs, outputs and parameters.
  With dynamic batching ``input_ids`` is ragged, so prompts of different lengths share a batch.
  ``model_checkpoint_path`` is left out: the backend then reads ``<model dir>/<version>/<T>-gpu``
  (BE ``ModelState::ModelFactory``), so a repository works wherever it is mounted.
* with ``streaming``: ``fastertransformer`` is decoupled and the model named after the model is
  a decoupled Python model (:func:`build_streaming`) in place of the ensemble, same inputs and
  outputs, streaming text increments.
* ``llm`` (:data:`LLM`), in every repository: Triton's LLM convention (``text_input`` ->
  ``text_output``, the names of the TensorRT-LLM and vLLM backends), a decoupled Python model
  that calls ``preprocessing``, ``fastertransformer`` and ``postprocessing`` (:func:`build_llm`).

Optional ensemble inputs feed optional ``preprocessing`` inputs: Triton's ensemble scheduler
(core >= 22.04, so the 2.51 server we run) accepts an optional ensemble input and, when a request
leaves it out, passes nothing to the step input it maps to; ``preprocessing`` then fills in
FasterTransformer's default.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from google.protobuf import text_format

from loader import fs
from loader.fs import Dir
from loader.parallel import Parallelism
from loader.repository import tensors
from loader.repository.bounds import RequestBounds
from loader.repository.key import ServingSettings
from loader.repository.tensors import Tensor


def model_config_module() -> ModuleType:
    """Triton's ``ModelConfig`` protobuf classes, ``tritonclient.grpc.model_config_pb2``, loaded
    without the package around them: importing ``tritonclient.grpc`` starts gRPC and NumPy's
    type tables, a quarter of a CPU second that writing a config.pbtxt never uses. The module
    is registered under its own name, so a later ``import tritonclient.grpc`` in the same
    process takes this one (one set of classes, one descriptor pool entry)."""
    name = "tritonclient.grpc.model_config_pb2"
    if name not in sys.modules:
        package = importlib.util.find_spec("tritonclient")  # finds it, imports nothing
        if package is None or not package.submodule_search_locations:
            raise ModuleNotFoundError("No module named 'tritonclient'", name="tritonclient")
        path = Path(next(iter(package.submodule_search_locations))) / "grpc" / "model_config_pb2.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


mc = model_config_module()

PREPROCESSING = "preprocessing"
FASTERTRANSFORMER = "fastertransformer"
POSTPROCESSING = "postprocessing"
ENSEMBLE = "ensemble"
#: The model with Triton's LLM convention (``text_input``, ``max_tokens`` -> ``text_output``).
LLM = "llm"
#: The file of a model directory that holds its config.
CONFIG_FILE = "config.pbtxt"


#: Internal ensemble tensor names (between steps; never seen by clients).
def _internal(name: str) -> str:
    """The ensemble's name for a tensor between two steps (an input of ``fastertransformer`` or
    one of its results; the two sets of names are disjoint)."""
    return "_" + name


@dataclass(frozen=True)
class RepositorySpec:
    """Everything the config builders need.

    ``data_type`` is the runtime precision (``fp16``/``fp32``, the weights' dtype); ``end_id``
    and ``start_id`` the checkpoint's ids (``config.ini``), what FasterTransformer uses when a
    request sends none (``preprocessing`` fills them in; ``start_id`` None: ``end_id``).
    ``checkpoint_path``: the ``<T>-gpu`` directory when it is not FT's default (a benchmark
    variant that reuses another repository's weights); ``None`` for a published repository.
    ``max_model_len``: the model's context length (``config.ini``'s ``max_pos_seq_len``, the
    checkpoint's ``n_positions``), which the ``llm`` model holds requests to; ``None`` where
    only the batching settings are built (validation, benchmark variants).
    ``bounds``: what a request may ask for (:mod:`loader.repository.bounds`), written as
    ``preprocessing``'s parameters; ``None`` only where no repository is written from the spec
    (the settings check, benchmark variants, which keep the published parameters).
    """

    name: str
    parallelism: Parallelism
    settings: ServingSettings
    data_type: str
    end_id: int
    checkpoint_path: str | None = None
    start_id: int | None = None
    max_model_len: int | None = None
    bounds: RequestBounds | None = None


#: Protocol dtype names that config.pbtxt spells differently (BYTES is TYPE_STRING there).
_CONFIG_DTYPE = {"BYTES": "STRING"}


def _tensor(message: mc.ModelInput | mc.ModelOutput, spec: Tensor) -> None:
    message.name = spec.name
    message.data_type = mc.DataType.Value("TYPE_" + _CONFIG_DTYPE.get(spec.dtype, spec.dtype))
    message.dims.extend(spec.dims)
    if spec.reshape is not None:
        message.reshape.SetInParent()
        message.reshape.shape.extend(spec.reshape)


def _add_io(config: mc.ModelConfig, inputs: Iterable[Tensor], outputs: Iterable[Tensor]) -> None:
    for spec in inputs:
        _tensor(config.input.add(), spec)
        if spec.optional:
            config.input[-1].optional = True
    for spec in outputs:
        _tensor(config.output.add(), spec)


def _cpu_instances(config: mc.ModelConfig, count: int) -> None:
    group = config.instance_group.add()
    group.count = count
    group.kind = mc.ModelInstanceGroup.KIND_CPU


def _python_model(name: str, spec: RepositorySpec, inputs, outputs) -> mc.ModelConfig:
    config = mc.ModelConfig(
        name=name, backend="python", max_batch_size=spec.settings.max_batch_size
    )
    _add_io(config, inputs, outputs)
    _cpu_instances(config, spec.parallelism.instance_count)
    if spec.settings.dynamic_batching:
        config.dynamic_batching.SetInParent()
    return config


def build_preprocessing(spec: RepositorySpec) -> mc.ModelConfig:
    config = _python_model(
        PREPROCESSING, spec, tensors.PREPROCESSING_INPUTS, tensors.PREPROCESSING_OUTPUTS
    )
    start_id = spec.end_id if spec.start_id is None else spec.start_id
    config.parameters["start_id"].string_value = str(start_id)
    config.parameters["end_id"].string_value = str(spec.end_id)
    if spec.bounds is not None:
        for key, value in spec.bounds.parameters().items():
            config.parameters[key].string_value = value
    return config


def build_postprocessing(spec: RepositorySpec) -> mc.ModelConfig:
    return _python_model(
        POSTPROCESSING, spec, tensors.POSTPROCESSING_INPUTS, tensors.POSTPROCESSING_OUTPUTS
    )


def _ragged(config: mc.ModelConfig, name: str) -> None:
    """Let requests whose ``name`` differ in length share a batch (BE's ragged batching)."""
    for message in config.input:
        if message.name == name:
            message.allow_ragged_batch = True
    batch_input = config.batch_input.add()
    batch_input.kind = mc.BatchInput.BATCH_ITEM_SHAPE
    batch_input.target_name.append(f"{name}_item_shape")
    batch_input.data_type = mc.TYPE_INT32
    batch_input.source_input.append(name)


#: Model backend -> the ``backend`` field of the ``fastertransformer`` model.
FASTERTRANSFORMER_BACKENDS: dict[str, str] = {
    "fastertransformer": "fastertransformer",
    "python": "python",
}


def build_fastertransformer(spec: RepositorySpec) -> mc.ModelConfig:
    settings = spec.settings
    config = mc.ModelConfig(
        name=FASTERTRANSFORMER,
        backend=FASTERTRANSFORMER_BACKENDS[settings.backend],
        max_batch_size=settings.max_batch_size,
    )
    _add_io(config, tensors.FASTERTRANSFORMER_INPUTS, tensors.FASTERTRANSFORMER_OUTPUTS)
    # FT places instances on GPUs itself and accepts exactly one KIND_CPU group
    # (docs/fastertransformer.md, "Instances").
    _cpu_instances(config, spec.parallelism.instance_count)
    if settings.dynamic_batching:
        batching = config.dynamic_batching
        batching.preferred_batch_size.extend(settings.preferred_batch_sizes)
        batching.max_queue_delay_microseconds = settings.max_queue_delay_us
        _ragged(config, tensors.RAGGED_INPUT)
    if settings.streaming:
        config.model_transaction_policy.decoupled = True
    parameters = {
        "model_type": "GPT-J",
        "tensor_para_size": str(spec.parallelism.tp),
        "pipeline_para_size": str(spec.parallelism.pp),
        "data_type": spec.data_type,
        "enable_custom_all_reduce": "0",
    }
    if spec.checkpoint_path:
        parameters["model_checkpoint_path"] = spec.checkpoint_path
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def _step(config: mc.ModelConfig, model: str, inputs: dict[str, str], outputs: dict[str, str]):
    step = config.ensemble_scheduling.step.add()
    step.model_name = model
    step.model_version = -1
    step.input_map.update(inputs)
    step.output_map.update(outputs)


def build_streaming(spec: RepositorySpec) -> mc.ModelConfig:
    """With ``--streaming``: the model clients call is a decoupled Python model with the
    ensemble's inputs and outputs (plus ``is_final``), sending text increments (``models/streaming/model.py`` says
    why an ensemble cannot). One instance serves every stream, a thread per request."""
    config = mc.ModelConfig(
        name=spec.name, backend="python", max_batch_size=spec.settings.max_batch_size
    )
    _add_io(config, tensors.ENSEMBLE_INPUTS, tensors.STREAMING_OUTPUTS)
    _cpu_instances(config, 1)
    config.model_transaction_policy.decoupled = True
    return config


def build_llm(spec: RepositorySpec) -> mc.ModelConfig:
    """``llm``: the inputs and outputs of :data:`tensors.LLM_INPUTS` / ``LLM_OUTPUTS``, decoupled
    (one model answers ``stream`` true and false), one request of one prompt at a time
    (``max_batch_size`` 1: a request is one prompt, Triton refuses more), one instance serving
    every request in a thread of its own. Parameters: ``max_model_len`` (the model's context
    length, ``n_positions``, when known), ``served_model_name`` (the repository's model name)
    for clients to read with ``get_model_config``, and ``streaming`` (whether
    ``fastertransformer`` is decoupled: only then can the model stream)."""
    config = mc.ModelConfig(name=LLM, backend="python", max_batch_size=1)
    _add_io(config, tensors.LLM_INPUTS, tensors.LLM_OUTPUTS)
    _cpu_instances(config, 1)
    config.model_transaction_policy.decoupled = True
    parameters = {
        "served_model_name": spec.name,
        "streaming": "true" if spec.settings.streaming else "false",
    }
    if spec.max_model_len is not None:
        parameters["max_model_len"] = str(spec.max_model_len)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def build_ensemble(spec: RepositorySpec) -> mc.ModelConfig:
    if spec.settings.streaming:
        return build_streaming(spec)
    config = mc.ModelConfig(
        name=spec.name, platform="ensemble", max_batch_size=spec.settings.max_batch_size
    )
    _add_io(config, tensors.ENSEMBLE_INPUTS, tensors.ENSEMBLE_OUTPUTS)
    ft_inputs = {t.name: _internal(t.name) for t in tensors.PREPROCESSING_OUTPUTS}
    _step(
        config,
        PREPROCESSING,
        {t.name: t.name for t in tensors.PREPROCESSING_INPUTS},
        ft_inputs,
    )
    _step(
        config,
        FASTERTRANSFORMER,
        {t.name: _internal(t.name) for t in tensors.FASTERTRANSFORMER_INPUTS},
        {t.name: _internal(t.name) for t in tensors.FASTERTRANSFORMER_OUTPUTS},
    )
    post_inputs = {t.name: _internal(t.name) for t in tensors.FT_RESULTS}
    for name in ("input_lengths", "request_output_len", "end_id"):
        post_inputs[name] = ft_inputs[name]
    _step(
        config,
        POSTPROCESSING,
        post_inputs,
        {t.name: t.name for t in tensors.POSTPROCESSING_OUTPUTS},
    )
    return config


#: Model role -> builder. The ensemble's directory is named after the model; the others after
#: their role.
BUILDERS: dict[str, Callable[[RepositorySpec], mc.ModelConfig]] = {
    ENSEMBLE: build_ensemble,
    PREPROCESSING: build_preprocessing,
    FASTERTRANSFORMER: build_fastertransformer,
    POSTPROCESSING: build_postprocessing,
    LLM: build_llm,
}


def build_all(spec: RepositorySpec) -> dict[str, mc.ModelConfig]:
    """Model directory name -> its config, for every model of the repository."""
    configs = {}
    for builder in BUILDERS.values():
        config = builder(spec)
        configs[config.name] = config
    return configs


def to_text(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def write_config(
    config: mc.ModelConfig, model_dir: Path | Dir, stamps: dict[Path, fs.Stamp] | None = None
) -> Path:
    """Write ``model_dir/config.pbtxt``: a name in the directory open as ``model_dir``, or in
    the directory at that path (created if absent, :meth:`loader.fs.Dir.open`). ``stamps``
    gets the file's :data:`~loader.fs.Stamp` as written (:meth:`loader.fs.Dir.write`)."""
    if isinstance(model_dir, Dir):
        data = to_text(config).encode("utf-8")
        written = model_dir.write(CONFIG_FILE, data, exclusive=False, sync=False)
        if stamps is not None:
            stamps[model_dir.path / CONFIG_FILE] = written
        return model_dir.path / CONFIG_FILE
    with Dir.open(model_dir, create=True) as d:
        return write_config(config, d, stamps)


def read_config(path: Path) -> mc.ModelConfig:
    """Parse a ``config.pbtxt`` back into a ``ModelConfig``."""
    return text_format.Parse(Path(path).read_text(encoding="utf-8"), mc.ModelConfig())
