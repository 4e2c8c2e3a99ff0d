"""FasterTransformer placement rules, GPU-memory estimates and the `model-loader plan` table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loader.cli import main
from loader.errors import PlacementError
from loader.parallel import Parallelism
from loader.plan import (
    GIB,
    MODEL_PRESETS,
    ModelShape,
    Topology,
    check_memory,
    check_placement,
    estimate_memory,
    plan_row,
)

CODEGEN_16B = MODEL_PRESETS["codegen-16b"]


def _row(tp: int, count: int = 1, *, replicas: int | None = None, gib: float = 40, pp: int = 1):
    par = Parallelism(tp, pp, count)
    topo = Topology(par.gpus_per_instance, replicas or 16 // par.gpus_per_instance, 16)
    return plan_row(CODEGEN_16B, par, topo, dtype="fp16", max_batch_size=8, gpu_memory_gib=gib)


def test_codegen_16b_has_16b_parameters_and_32_gb_of_fp16_weights():
    assert CODEGEN_16B.parameters() == pytest.approx(16.03e9, rel=0.005)
    full = estimate_memory(CODEGEN_16B, Parallelism(1), dtype="fp16", max_batch_size=1)
    assert full.weights == pytest.approx(32.1e9, rel=0.01)


def test_codegen_16b_on_a100_40gb_needs_tensor_parallel_2_or_more():
    assert _row(1).verdict == "does not fit"
    assert _row(2).verdict == "fits"
    assert _row(4).verdict == "fits"
    assert _row(2).estimate.weights < _row(1).estimate.weights / 1.8


def test_more_instances_on_the_same_gpus_add_working_memory_not_weights():
    one, two = _row(2, 1), _row(2, 2)
    assert two.estimate.weights == one.estimate.weights
    assert two.estimate.instances_per_gpu == 2
    assert two.estimate.working == 2 * one.estimate.working
    assert two.headroom_bytes < one.headroom_bytes


def test_kv_cache_grows_with_batch_and_shrinks_with_tensor_parallelism():
    def working(tp, batch):
        return estimate_memory(
            CODEGEN_16B, Parallelism(tp), dtype="fp16", max_batch_size=batch
        ).working_per_instance

    kv_16b_b8 = 2 * 34 * 8 * 2048 * 6144 * 2  # 2 x layers x batch x seq x hidden x fp16
    assert working(1, 8) > kv_16b_b8
    assert working(1, 16) > 1.9 * working(1, 8)
    assert working(2, 8) < 0.55 * working(1, 8)


def test_tight_verdict_when_headroom_is_under_a_tenth_of_the_gpu():
    total = _row(2, 2).estimate.total / GIB
    assert _row(2, 2, gib=total * 1.05).verdict == "tight"
    assert _row(2, 2, gib=total * 0.99).verdict == "does not fit"


def test_replicas_that_overflow_the_node_are_invalid_with_the_number_to_change():
    row = _row(2, replicas=9)
    assert row.verdict == "invalid"
    assert "Lower --replicas-per-node to 8" in row.problem
    with pytest.raises(PlacementError) as info:
        check_placement(Parallelism(2), Topology(2, 9, 16))
    assert "--replicas-per-node to 8" in info.value.remediation


def test_a_head_size_without_a_generation_kernel_is_invalid():
    """FasterTransformer generates garbage for head sizes its kernel has no case for."""
    shape = dataclasses.replace(CODEGEN_16B, n_head=96)  # 6144 / 96 = 64: supported
    assert plan_row(shape, Parallelism(2), Topology(2, 8, 16), dtype="fp16", max_batch_size=8,
                    gpu_memory_gib=40).verdict == "fits"  # fmt: skip
    odd = dataclasses.replace(CODEGEN_16B, n_head=384)  # 6144 / 384 = 16
    row = plan_row(odd, Parallelism(2), Topology(2, 8, 16), dtype="fp16", max_batch_size=8,
                   gpu_memory_gib=40)  # fmt: skip
    assert row.verdict == "invalid"
    assert "heads of size 16" in row.problem


def test_tensor_parallel_size_must_divide_the_heads():
    row = _row(16)
    assert row.verdict == "invalid"
    assert "24" in row.problem


@pytest.mark.parametrize(
    ("par", "gpus", "needle"),
    [
        (Parallelism(2, 1, 1), 3, "--gpus-per-replica to a multiple of 2"),
        (Parallelism(2, 1, 1), 4, "--instance-count to 2"),
        (Parallelism(1, 2, 1), 8, "--instance-count to 4"),
    ],
)
def test_ft_placement_rules_name_the_number_to_change(par, gpus, needle):
    with pytest.raises(PlacementError) as info:
        check_placement(par, Topology(gpus))
    assert needle in info.value.remediation


def test_visible_gpus_may_be_a_multiple_of_the_group_when_instances_cover_them():
    check_placement(Parallelism(2, 1, 4), Topology(4))  # instances on [0,1],[2,3],[0,1],[2,3]
    check_placement(Parallelism(2, 2, 1), Topology(4))


def test_layers_must_divide_by_the_pipeline_size():
    with pytest.raises(PlacementError) as info:
        check_placement(Parallelism(1, 4, 1), Topology(4), n_layer=34)
    assert "--pp-size" in info.value.remediation
    assert "2" in info.value.remediation


def test_memory_check_refuses_with_the_numbers_and_what_to_change():
    estimate = estimate_memory(CODEGEN_16B, Parallelism(1), dtype="fp16", max_batch_size=8)
    with pytest.raises(PlacementError) as info:
        check_memory(estimate, 40)
    assert "GiB" in info.value.message
    assert "--tp-size" in info.value.remediation
    check_memory(estimate, 80)


def test_shape_comes_from_config_json_with_n_inner_defaulting_to_4h():
    shape = ModelShape.from_hf_config(
        {"n_embd": 64, "n_layer": 2, "n_head": 8, "vocab_size": 320, "n_positions": 64}
    )
    assert shape.n_inner == 256
    assert ModelShape.from_hf_config({**shape.__dict__, "n_inner": 100}).n_inner == 100


def _table(capsys, *argv: str) -> list[str]:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_plan_command_prints_an_aligned_table_with_verdicts(capsys):
    lines = _table(
        capsys, "--model", "codegen-16b", "--gpus-per-node", "16", "--gpu-memory-gib", "40",
        "--tp-size", "1", "2", "4",
    )  # fmt: skip
    header = next(i for i, line in enumerate(lines) if line.startswith("TP"))
    rows = lines[header + 1 :]
    assert len(rows) == 3
    for column in ("GPUS/REPLICA", "REPLICAS/NODE", "WEIGHTS/GPU GiB", "HEADROOM GiB", "VERDICT"):
        assert column in lines[header]
    verdict_at = lines[header].index("VERDICT")
    assert [r[verdict_at:] for r in rows] == ["does not fit", "fits", "fits"]
    replicas = [r.split()[4] for r in rows]
    assert replicas == ["16", "8", "4"]
    # The total is the sum of the columns before it: the runtime's 1 GiB is shown, not hidden.
    assert "RUNTIME/GPU GiB" in lines[header]
    for row in rows:
        weights, working, runtime, total = (float(x) for x in row.split()[5:9])
        assert runtime == 1.0
        assert abs(weights + working + runtime - total) <= 0.15  # each rounded to 0.1
    # Right-aligned numeric columns: every row has the same length up to the verdict.
    assert len({len(r[:verdict_at]) for r in rows}) == 1


def test_plan_reads_the_model_from_a_local_checkpoint(tmp_path: Path, capsys):
    config = {
        "model_type": "codegen", "n_embd": 6144, "n_layer": 34, "n_head": 24,
        "vocab_size": 51200, "n_positions": 2048, "n_inner": None, "torch_dtype": "float16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    lines = _table(
        capsys, "--source", str(tmp_path), "--gpus-per-node", "2", "--gpu-memory-gib", "40",
        "--tp-size", "2", "--replicas-per-node", "1", "--instance-count", "1", "2",
    )  # fmt: skip
    assert "16.03B parameters" in lines[0]
    assert "weights fp16" in lines[0]
    assert lines[-2].endswith("fits") and lines[-1].endswith("fits")


def test_plan_without_a_model_is_a_user_error(capsys):
    assert main(["plan", "--gpus-per-node", "8"]) == 2
    assert "hint:" in capsys.readouterr().err


def test_plan_refuses_remote_sources_with_a_hint(capsys):
    assert main(["plan", "--source", "gs://bucket/model", "--gpus-per-node", "8"]) == 2
    assert "local" in capsys.readouterr().err


def test_plan_exits_2_when_nothing_fits_and_says_what_to_change(capsys):
    code = main(
        ["plan", "--model", "codegen-16b", "--gpus-per-node", "16", "--gpu-memory-gib", "40",
         "--tp-size", "1"]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2
    assert "does not fit" in captured.out  # the table is still printed
    assert "error: no candidate fits a node of 16 GPUs of 40 GiB" in captured.err
    assert "hint: " in captured.err


def test_plan_json_has_one_object_per_candidate(capsys):
    code = main(
        ["plan", "--model", "codegen-16b", "--gpus-per-node", "16", "--gpu-memory-gib", "40",
         "--tp-size", "1", "2", "--json"]
    )  # fmt: skip
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tp"], r["verdict"]) for r in rows] == [(1, "does not fit"), (2, "fits")]
    assert rows[1]["replicas_per_node"] == 8 and rows[1]["headroom_bytes"] > 0


def test_a_replica_larger_than_the_node_never_suggests_zero_replicas():
    par = Parallelism(4)
    row = plan_row(
        CODEGEN_16B, par, Topology(4, 1, 2), dtype="fp16", max_batch_size=8, gpu_memory_gib=40
    )
    assert row.verdict == "invalid"
    assert "to 0" not in row.problem and "lower --tp-size" in row.problem


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    from tests.tinymodels import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("four-layers") / "ckpt", n_layer=4)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)])
def test_the_weights_estimate_is_what_the_busiest_gpu_loads_of_the_converted_files(
    four_layers, tmp_path, tp, pp
):
    """Differential: the planner's weights per GPU against the files the converter writes. A
    GPU of pipeline stage 0 and tensor rank 0 loads its n_layer / P layers (their rank-0 and
    replicated files) and the embeddings, the final layer norm and the head."""
    from loader.checkpoint import read_hf_config
    from loader.convert import convert_checkpoint

    result = convert_checkpoint(four_layers, tmp_path, tp_size=tp)
    stage = range(4 // pp)
    loaded = 0
    for path in result.output_path.glob("*.bin"):
        parts = path.name.split(".")
        if parts[1] == "layers" and (
            int(parts[2]) not in stage or (parts[-2].isdigit() and parts[-2] != "0")
        ):
            continue
        loaded += path.stat().st_size
    shape = ModelShape.from_hf_config(read_hf_config(four_layers))
    estimate = estimate_memory(shape, Parallelism(tp, pp), dtype="fp32", max_batch_size=1)
    assert estimate.weights == loaded  # vocab 320 needs no padding for T = 1, 2
