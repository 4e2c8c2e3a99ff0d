"""config.pbtxt builders: written with text_format, parsed back into Triton's ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from loader.parallel import Parallelism
from loader.repository import tensors
from loader.repository.config import (
    RepositorySpec,
    build_all,
    read_config,
    write_config,
)
from loader.repository.key import ServingSettings

SEED_TEST_JSON = (
    '{"data": [{"prompt": {"content": ["<python>def is_even(na: int) ->"], "shape": [1]}, '
    '"request_output_len": {"content": [32], "shape": [1]}, "temperature": [0.20000000298023224], '
    '"repetition_penalty": [1.0], "runtime_top_k": [0], "runtime_top_p": [0.9800000190734863], '
    '"start_id": [50256], "end_id": [50256], "random_seed": [1594506369], '
    '"is_return_log_probs": [true]}]}'
)

#: What a JSON value in perf_analyzer's input data must be for each Triton type.
JSON_TYPES = {
    mc.TYPE_STRING: str,
    mc.TYPE_UINT32: int,
    mc.TYPE_UINT64: int,
    mc.TYPE_FP32: float,
    mc.TYPE_BOOL: bool,
}


def _spec(**settings) -> RepositorySpec:
    return RepositorySpec(
        name="codegen",
        parallelism=Parallelism(2, 1, 3),
        settings=ServingSettings(**settings),
        data_type="fp16",
        end_id=50256,
    )


@pytest.fixture
def written(tmp_path: Path):
    """Write every config for a spec, parse each back and return name -> ModelConfig."""

    def write(**settings) -> dict[str, mc.ModelConfig]:
        parsed = {}
        for name, config in build_all(_spec(**settings)).items():
            path = write_config(config, tmp_path / name)
            parsed[name] = read_config(path)
            assert parsed[name] == config
        return parsed

    return write


def _inputs(config: mc.ModelConfig) -> dict[str, mc.ModelInput]:
    return {i.name: i for i in config.input}


def test_the_repository_holds_the_ensemble_three_composing_models_and_llm(written):
    assert set(written()) == {
        "codegen", "preprocessing", "fastertransformer", "postprocessing", "llm",
    }  # fmt: skip


def test_ensemble_inputs_match_the_seed_test_json_exactly(written):
    ensemble = written(preferred_batch_sizes=(4, 8))["codegen"]
    assert ensemble.platform == "ensemble"
    assert ensemble.max_batch_size == 8
    request = json.loads(SEED_TEST_JSON)["data"][0]
    inputs = _inputs(ensemble)
    assert set(inputs) == set(request)
    for name, value in request.items():
        content = value["content"] if isinstance(value, dict) else value
        assert list(inputs[name].dims) == [1], name
        assert isinstance(content[0], JSON_TYPES[inputs[name].data_type]), name
        assert inputs[name].optional == (name not in ("prompt", "request_output_len")), name
    assert inputs["random_seed"].data_type == mc.TYPE_UINT64
    assert inputs["is_return_log_probs"].data_type == mc.TYPE_BOOL


def test_ensemble_outputs_are_the_contract(written):
    outputs = {o.name: (o.data_type, list(o.dims)) for o in written()["codegen"].output}
    assert outputs == {
        "completion": (mc.TYPE_STRING, [-1]),
        "output_ids": (mc.TYPE_UINT32, [-1, -1]),
        "sequence_length": (mc.TYPE_INT32, [-1]),  # what FT sends, whatever configs declare
        "cum_log_probs": (mc.TYPE_FP32, [-1]),
        # no output_log_probs: FT's layout of them depends on the batch (models README)
    }


def test_ensemble_steps_wire_preprocessing_to_fastertransformer_to_postprocessing(written):
    configs = written()
    steps = configs["codegen"].ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["preprocessing", "fastertransformer", "postprocessing"]
    pre, ft, post = steps
    client = {i.name for i in configs["codegen"].input}
    assert dict(pre.input_map) == {name: name for name in client}  # every client input
    # preprocessing produces every input of fastertransformer, always: one input set per batch
    ft_inputs = {i.name for i in configs["fastertransformer"].input}
    assert set(pre.output_map) == ft_inputs == {o.name for o in configs["preprocessing"].output}
    assert dict(ft.input_map) == dict(pre.output_map)
    results = ("output_ids", "sequence_length", "cum_log_probs", "output_log_probs")
    internal = dict(ft.output_map)
    assert set(internal) == set(results)
    client_facing = {o.name for o in configs["codegen"].output}
    assert not set(internal.values()) & client_facing  # no FT tensor reaches a client directly
    assert not set(pre.output_map.values()) & (client | client_facing)
    assert dict(post.input_map) == {
        **{n: internal[n] for n in results},
        "input_lengths": pre.output_map["input_lengths"],
        "request_output_len": pre.output_map["request_output_len"],
        "end_id": pre.output_map["end_id"],
    }
    assert dict(post.output_map) == {n: n for n in client_facing}


def test_preprocessing_knows_the_checkpoints_start_and_end_ids(written, tmp_path):
    pre = written()["preprocessing"]
    assert pre.parameters["end_id"].string_value == "50256"
    assert pre.parameters["start_id"].string_value == "50256"  # no start_id given: end_id
    spec = RepositorySpec(
        name="codegen",
        parallelism=Parallelism(1, 1, 1),
        settings=ServingSettings(),
        data_type="fp32",
        end_id=2,
        start_id=1,
    )
    params = build_all(spec)["preprocessing"].parameters
    assert (params["start_id"].string_value, params["end_id"].string_value) == ("1", "2")


def test_every_step_mapping_agrees_on_dtype_and_optionality(written):
    configs = written()
    ensemble = configs["codegen"]
    tensor_types = {i.name: i.data_type for i in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = configs[step.model_name]
        for out in model.output:
            if out.name in step.output_map:
                tensor_types.setdefault(step.output_map[out.name], out.data_type)
    for step in ensemble.ensemble_scheduling.step:
        model_inputs = _inputs(configs[step.model_name])
        for key, value in step.input_map.items():
            assert model_inputs[key].data_type == tensor_types[value], (step.model_name, key)
        for name, inp in model_inputs.items():
            assert name in step.input_map or inp.optional, (step.model_name, name)
    ensemble_inputs = _inputs(ensemble)
    ft_inputs = _inputs(configs["fastertransformer"])
    for t in tensors.SAMPLING_INPUTS:
        # An optional ensemble input may only feed an optional step input.
        assert ensemble_inputs[t.name].optional and ft_inputs[t.name].optional


def test_fastertransformer_model_has_the_ft_parameters_instances_and_batching(written):
    ft = written(preferred_batch_sizes=(4, 8), max_queue_delay_us=250)["fastertransformer"]
    assert ft.backend == "fastertransformer"
    assert ft.max_batch_size == 8
    assert [(g.count, g.kind) for g in ft.instance_group] == [(3, mc.ModelInstanceGroup.KIND_CPU)]
    assert list(ft.dynamic_batching.preferred_batch_size) == [4, 8]
    assert ft.dynamic_batching.max_queue_delay_microseconds == 250
    # No model_checkpoint_path: the backend's default (1/<T>-gpu) keeps the repository movable.
    assert {k: v.string_value for k, v in ft.parameters.items()} == {
        "model_type": "GPT-J",
        "tensor_para_size": "2",
        "pipeline_para_size": "1",
        "data_type": "fp16",
        "enable_custom_all_reduce": "0",
    }
    assert not ft.model_transaction_policy.decoupled


@pytest.mark.parametrize("backend", ["fastertransformer", "python"])
def test_dynamic_batching_makes_input_ids_ragged(written, backend):
    ft = written(backend=backend)["fastertransformer"]
    assert _inputs(ft)["input_ids"].allow_ragged_batch
    assert not any(i.allow_ragged_batch for i in ft.input if i.name != "input_ids")
    [batch_input] = ft.batch_input
    assert batch_input.kind == mc.BatchInput.BATCH_ITEM_SHAPE
    assert list(batch_input.target_name) == ["input_ids_item_shape"]
    assert batch_input.data_type == mc.TYPE_INT32
    assert list(batch_input.source_input) == ["input_ids"]
    plain = written(backend=backend, dynamic_batching=False)["fastertransformer"]
    assert not plain.batch_input and not _inputs(plain)["input_ids"].allow_ragged_batch


def test_fastertransformer_inputs_follow_ft_format_3_2(written):
    inputs = _inputs(written()["fastertransformer"])
    assert list(inputs["input_ids"].dims) == [-1]
    assert not inputs["input_ids"].optional
    assert inputs["input_lengths"].HasField("reshape")
    assert list(inputs["input_lengths"].reshape.shape) == []
    assert list(inputs["request_output_len"].dims) == [-1]
    assert inputs["random_seed"].data_type == mc.TYPE_UINT64
    assert list(inputs["stop_words_list"].dims) == [2, -1]
    assert inputs["stop_words_list"].data_type == mc.TYPE_INT32
    for name in ("runtime_top_k", "temperature", "beam_width", "is_return_log_probs"):
        assert inputs[name].optional and list(inputs[name].reshape.shape) == [], name


def test_python_backend_keeps_the_same_directory_io_and_parameters(written):
    ft = written()["fastertransformer"]
    py = written(backend="python")["fastertransformer"]
    assert py.backend == "python"
    assert py.name == ft.name == "fastertransformer"
    assert list(py.input) == list(ft.input)
    assert list(py.output) == list(ft.output)
    assert dict(py.parameters) == dict(ft.parameters)


def test_no_dynamic_batching_leaves_the_field_out_everywhere(written):
    for name, config in written(dynamic_batching=False).items():
        assert not config.HasField("dynamic_batching"), name


def test_streaming_makes_the_model_decoupled(written):
    assert written(streaming=True)["fastertransformer"].model_transaction_policy.decoupled


@pytest.mark.parametrize("name", ["preprocessing", "postprocessing"])
def test_processing_models_are_python_cpu_models_with_the_contract_io(written, name):
    config = written(max_batch_size=4)[name]
    assert config.backend == "python"
    assert config.max_batch_size == 4
    assert [(g.count, g.kind) for g in config.instance_group] == [
        (3, mc.ModelInstanceGroup.KIND_CPU)
    ]
    table = {
        "preprocessing": (tensors.PREPROCESSING_INPUTS, tensors.PREPROCESSING_OUTPUTS),
        "postprocessing": (tensors.POSTPROCESSING_INPUTS, tensors.POSTPROCESSING_OUTPUTS),
    }[name]
    assert [i.name for i in config.input] == [t.name for t in table[0]]
    assert [o.name for o in config.output] == [t.name for t in table[1]]


def test_written_file_is_protobuf_text_not_a_template(tmp_path: Path):
    config = build_all(_spec())["fastertransformer"]
    path = write_config(config, tmp_path / "fastertransformer")
    text = path.read_text()
    assert 'backend: "fastertransformer"' in text
    assert "kind: KIND_CPU" in text
    assert read_config(path).parameters["tensor_para_size"].string_value == "2"
