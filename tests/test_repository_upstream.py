"""A published FasterTransformer-backend repository, field by field against upstream's configs.

Each expected field below is stated with the upstream file it comes from (fastertransformer_backend
``main``, commit c6936c39): ``all_models/gptj/fastertransformer/config.pbtxt`` (GPTJ) for the
GPT-J model, ``all_models/gpt/fastertransformer/config.pbtxt`` (GPT) for ragged batching, which
upstream ships for GPT and the backend applies to every model type. Where we depart from the
example config on purpose, the reason is the C++ (``loader/repository/models/README.md``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from loader.parallel import Parallelism
from loader.repository.config import read_config
from loader.repository.key import ServingSettings
from loader.run import RunRequest, run

GPTJ = "all_models/gptj/fastertransformer/config.pbtxt"
GPT = "all_models/gpt/fastertransformer/config.pbtxt"

# name -> (data_type, dims, reshape to a scalar, optional); upstream file: GPTJ.
UPSTREAM_INPUTS = {
    "input_ids": (mc.TYPE_UINT32, [-1], False, False),
    "start_id": (mc.TYPE_UINT32, [1], True, True),
    "end_id": (mc.TYPE_UINT32, [1], True, True),
    "input_lengths": (mc.TYPE_UINT32, [1], True, False),
    "request_output_len": (mc.TYPE_UINT32, [-1], False, False),
    "runtime_top_k": (mc.TYPE_UINT32, [1], True, True),
    "runtime_top_p": (mc.TYPE_FP32, [1], True, True),
    "beam_search_diversity_rate": (mc.TYPE_FP32, [1], True, True),
    "temperature": (mc.TYPE_FP32, [1], True, True),
    "len_penalty": (mc.TYPE_FP32, [1], True, True),
    "repetition_penalty": (mc.TYPE_FP32, [1], True, True),
    "random_seed": (mc.TYPE_UINT64, [1], True, True),
    "is_return_log_probs": (mc.TYPE_BOOL, [1], True, True),
    "beam_width": (mc.TYPE_UINT32, [1], True, True),
    "bad_words_list": (mc.TYPE_INT32, [2, -1], False, True),
    "stop_words_list": (mc.TYPE_INT32, [2, -1], False, True),
}
#: GPTJ inputs we do not declare (prompt learning and top-p decay are not exposed).
UPSTREAM_ONLY_INPUTS = {
    "prompt_learning_task_name_ids",
    "top_p_decay",
    "top_p_min",
    "top_p_reset_ids",
}

# name -> (data_type, dims); upstream file: GPTJ, except sequence_length's type (see below).
UPSTREAM_OUTPUTS = {
    "output_ids": (mc.TYPE_UINT32, [-1, -1]),
    # GPTJ declares TYPE_UINT32, but FasterTransformer sends INT32
    # (GptJTritonModelInstance::forward) and the backend answers with the tensor's own type.
    "sequence_length": (mc.TYPE_INT32, [-1]),
    "cum_log_probs": (mc.TYPE_FP32, [-1]),
    "output_log_probs": (mc.TYPE_FP32, [-1, -1]),
}


@pytest.fixture(scope="module")
def published(tiny_checkpoint_with_tokenizer: Path, tmp_path_factory) -> Path:
    request = RunRequest(
        source=str(tiny_checkpoint_with_tokenizer),
        repository=tmp_path_factory.mktemp("upstream") / "models",
        model_name="codegen",
        parallelism=Parallelism(tp=2, pp=1, instance_count=2),
        settings=ServingSettings(backend="fastertransformer", dynamic_batching=True),
    )
    return run(request).path


@pytest.fixture(scope="module")
def ft_config(published: Path) -> mc.ModelConfig:
    return read_config(published / "fastertransformer" / "config.pbtxt")


def test_name_backend_and_transaction_policy_follow_gptj(ft_config):
    assert ft_config.name == "fastertransformer"  # GPTJ: name
    assert ft_config.backend == "fastertransformer"  # GPTJ: backend
    assert ft_config.model_transaction_policy.decoupled is False  # GPTJ: decoupled: False
    # GPTJ sets default_model_filename "gpt-j-6b"; we leave it out so the backend's default
    # directory is "<tensor_para_size>-gpu", the converter's output (ModelState::ModelState).
    assert ft_config.default_model_filename == ""


def test_inputs_match_gptj_field_by_field(ft_config):
    inputs = {i.name: i for i in ft_config.input}
    assert set(inputs) == set(UPSTREAM_INPUTS)
    assert not set(inputs) & UPSTREAM_ONLY_INPUTS
    for name, (dtype, dims, scalar, optional) in UPSTREAM_INPUTS.items():
        tensor = inputs[name]
        assert tensor.data_type == dtype, name
        assert list(tensor.dims) == dims, name
        assert tensor.HasField("reshape") is scalar, name
        if scalar:
            assert list(tensor.reshape.shape) == [], name
        assert tensor.optional is optional, name


def test_ragged_input_ids_follow_gpt(ft_config):
    """GPT: input_ids allow_ragged_batch: true, and the BATCH_ITEM_SHAPE batch input."""
    ragged = {i.name for i in ft_config.input if i.allow_ragged_batch}
    assert ragged == {"input_ids"}
    [batch_input] = ft_config.batch_input
    assert batch_input.kind == mc.BatchInput.BATCH_ITEM_SHAPE
    assert list(batch_input.target_name) == ["input_ids_item_shape"]
    assert batch_input.data_type == mc.TYPE_INT32
    assert list(batch_input.source_input) == ["input_ids"]


def test_outputs_match_gptj_except_the_type_ft_really_sends(ft_config):
    outputs = {o.name: (o.data_type, list(o.dims)) for o in ft_config.output}
    assert outputs == UPSTREAM_OUTPUTS


def test_instance_group_and_parameters_follow_gptj(ft_config):
    # GPTJ: one instance_group, kind KIND_CPU (the count is ours: --instance-count).
    assert [(g.count, g.kind) for g in ft_config.instance_group] == [
        (2, mc.ModelInstanceGroup.KIND_CPU)
    ]
    params = {k: v.string_value for k, v in ft_config.parameters.items()}
    assert params == {
        "tensor_para_size": "2",  # GPTJ: tensor_para_size (the example has 4)
        "pipeline_para_size": "1",  # GPTJ: pipeline_para_size
        "data_type": "fp32",  # GPTJ: data_type (the example has fp16); ours: the weights'
        "model_type": "GPT-J",  # GPTJ: model_type
        "enable_custom_all_reduce": "0",  # GPTJ: enable_custom_all_reduce
        # GPTJ's model_checkpoint_path is an absolute path; we leave it out on purpose.
    }


def test_the_weights_sit_where_the_backend_looks_by_default(ft_config, published):
    """Without model_checkpoint_path the backend reads <model dir>/<version>/<T>-gpu."""
    assert "model_checkpoint_path" not in ft_config.parameters
    tp = ft_config.parameters["tensor_para_size"].string_value
    assert (published / "fastertransformer" / "1" / f"{tp}-gpu" / "config.ini").is_file()
