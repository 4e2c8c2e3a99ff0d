"""The FasterTransformer wire contract on the real CPU Triton (loader/repository/models/README.md).

A repository written by ``model-loader run --backend python --dynamic-batching`` is served once;
the ``fastertransformer`` model (the CPU reference) must send what the C++ backend sends, and
the model clients call must answer every request a client can make.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tokenizers import Tokenizer

from loader.completion import complete, load_request
from loader.errors import ServerStartError
from loader.serving import TritonServer
from tests.tinymodels import TINY_END_ID, for_tiny_model

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "codegen"
#: The users' request, its start/end ids inside the tiny vocabulary (the bounds refuse others).
SEED_REQUEST = for_tiny_model(load_request(ROOT / "bench" / "test.json"))
CLIENT_OUTPUTS = ("completion", "output_ids", "sequence_length", "cum_log_probs")

LOG_PROBS = {"cum_log_probs", "output_log_probs"}


def _publish(source: Path, root: Path) -> Path:
    import subprocess

    cmd = [
        sys.executable, "-m", "loader", "run", "--source", str(source), "--repository", str(root),
        "--model-name", MODEL, "--tp-size", "1", "--pp-size", "1", "--instance-count", "1",
        "--backend", "python", "--dynamic-batching", "--max-queue-delay-us", "2000",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def published(tiny_checkpoint_with_tokenizer: Path, tmp_path_factory) -> Path:
    return _publish(tiny_checkpoint_with_tokenizer, tmp_path_factory.mktemp("contract"))


@pytest.fixture(scope="module")
def server(published: Path):
    with TritonServer(published) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint_with_tokenizer: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint_with_tokenizer / "tokenizer.json"))


def _tensor(name: str, array: np.ndarray, dtype: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _infer(server: TritonServer, model: str, inputs: list, outputs: list[str] | None = None):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        requested = [httpclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        return client.infer(model, inputs, outputs=requested)
    finally:
        client.close()


def _output_names(result) -> dict[str, str]:
    return {o["name"]: o["datatype"] for o in result.get_response()["outputs"]}


def _ensemble_inputs(prompt: str, log_probs: bool | None) -> list:
    inputs = [
        _tensor("prompt", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
        _tensor("request_output_len", np.array([[6]], dtype=np.uint32), "UINT32"),
    ]
    if log_probs is not None:
        inputs.append(_tensor("is_return_log_probs", np.array([[log_probs]]), "BOOL"))
    return inputs


REQUESTED = [None, *([name] for name in CLIENT_OUTPUTS), ["completion", "sequence_length"]]


@pytest.mark.parametrize("log_probs", [None, False, True], ids=["unset", "false", "true"])
@pytest.mark.parametrize("outputs", REQUESTED, ids=lambda o: "all" if o is None else "+".join(o))
def test_the_model_clients_call_answers_every_combination_of_outputs(server, outputs, log_probs):
    result = _infer(server, MODEL, _ensemble_inputs("def add(a, b):", log_probs), outputs)
    names = _output_names(result)
    assert set(names) == set(outputs or CLIENT_OUTPUTS)
    if "sequence_length" in names:
        assert names["sequence_length"] == "INT32"
    if "completion" in names:
        assert result.as_numpy("completion").shape == (1, 1)


def _ft_inputs(
    ids: np.ndarray, lengths: list[int], output_lens: list[int] | None = None, **optional
) -> list:
    rows = len(lengths)
    output_lens = output_lens or [5] * rows
    inputs = [
        _tensor("input_ids", ids.astype(np.uint32), "UINT32"),
        _tensor("input_lengths", np.array(lengths, dtype=np.uint32).reshape(rows, 1), "UINT32"),
        _tensor(
            "request_output_len", np.array(output_lens, dtype=np.uint32).reshape(rows, 1), "UINT32"
        ),
        _tensor("runtime_top_k", np.ones((rows, 1), dtype=np.uint32), "UINT32"),
        _tensor("end_id", np.full((rows, 1), 100_000, dtype=np.uint32), "UINT32"),
    ]
    for name, value in optional.items():
        inputs.append(_tensor(name, value, "BOOL"))
    return inputs


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (None, False),
        ([[False]], False),
        ([[True]], True),
        # Two rows in one request: FT reads the batch's first row only.
        ([[False], [True]], False),
        ([[True], [False]], True),
    ],
)
def test_fastertransformer_sends_log_probs_only_when_the_first_row_asks(server, flags, expected):
    rows = 1 if flags is None else len(flags)
    ids = np.tile(np.array([[5, 6, 7, 8]]), (rows, 1))
    optional = {} if flags is None else {"is_return_log_probs": np.array(flags)}
    result = _infer(server, "fastertransformer", _ft_inputs(ids, [4] * rows, **optional))
    names = _output_names(result)
    assert names["sequence_length"] == "INT32"  # FT's own type, not the configs' UINT32
    assert names["output_ids"] == "UINT32"
    assert LOG_PROBS.issubset(names) is expected
    assert not (LOG_PROBS & set(names)) or expected
    if expected:
        assert result.as_numpy("output_log_probs").shape == (rows, 1, 5)
        assert result.as_numpy("cum_log_probs").shape == (rows, 1)


def test_a_padded_batch_has_fts_lengths_and_layout(server):
    """Rows padded to W: sequence_length = W + generated for every row, output_ids W + 5 wide,
    a short row's generated tokens follow its own prompt, then end_id."""
    ids = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
    result = _infer(server, "fastertransformer", _ft_inputs(ids, [6, 3]))
    lengths = result.as_numpy("sequence_length")[:, 0]
    output_ids = result.as_numpy("output_ids")[:, 0]
    assert output_ids.shape == (2, 6 + 5)
    assert lengths.tolist() == [6 + 5, 6 + 5]
    alone = _infer(server, "fastertransformer", _ft_inputs(ids[1:, :3], [3]))
    short = alone.as_numpy("output_ids")[0, 0]
    assert int(alone.as_numpy("sequence_length")[0, 0]) == 3 + 5
    assert output_ids[1, : 3 + 5].tolist() == short.tolist()
    assert (output_ids[1, 3 + 5 :] == 100_000).all()


def test_beam_search_is_refused_by_the_cpu_reference(server):
    """FT runs beam_width > 1 with OnlineBeamSearchLayer; the CPU reference does not implement it
    and says so (docs/fastertransformer.md, the differences table)."""
    ids = np.array([[5, 6, 7, 8]])
    inputs = _ft_inputs(ids, [4])
    inputs.append(_tensor("beam_width", np.array([[2]], dtype=np.uint32), "UINT32"))
    with pytest.raises(Exception, match=r"beam search \(beam_width > 1\) is not supported"):
        _infer(server, "fastertransformer", inputs)


def test_a_shorter_row_gets_one_token_more_from_fastertransformer(server):
    """FT GptJ::forward (setSeqLimitLen) and stop_criteria_kernels.cu (length_criterion): a row
    asking fewer tokens than the batch's largest samples one more."""
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    result = _infer(server, "fastertransformer", _ft_inputs(ids, [4, 4], [3, 6]))
    assert result.as_numpy("sequence_length")[:, 0].tolist() == [4 + 4, 4 + 6]
    assert result.as_numpy("output_ids").shape == (2, 1, 4 + 6)


def test_output_log_probs_follow_fts_layout_in_a_mixed_batch(server):
    """FT GptJ::setOutputTensors copies them with transposeAxis01 and the first row's
    request_output_len as the stride: row 0 holds both rows' first two steps, row 1 nothing
    (stale GPU memory; NaN from the CPU reference). The client-facing model leaves them out."""
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    optional = {"is_return_log_probs": np.array([[True], [True]])}
    mixed = _infer(server, "fastertransformer", _ft_inputs(ids, [4, 4], [2, 4], **optional))
    rows = mixed.as_numpy("output_log_probs")[:, 0]
    assert rows.shape == (2, 4)
    assert np.isfinite(rows[0]).all() and np.isnan(rows[1]).all()
    alone = [
        _infer(server, "fastertransformer", _ft_inputs(ids[i : i + 1], [4], [n], **{
            "is_return_log_probs": np.array([[True]])
        })).as_numpy("output_log_probs")[0, 0]
        for i, n in enumerate((2, 4))
    ]  # fmt: skip
    np.testing.assert_allclose(rows[0], [*alone[0], *alone[1][:2]], rtol=1e-5)


#: Optional fields a client may send, a different set per request.
OPTIONAL_FIELDS = [
    {},
    {"temperature": [0.7]},
    {"random_seed": [5], "runtime_top_p": [0.9], "runtime_top_k": [0]},
    {"repetition_penalty": [1.2]},
    {"end_id": [TINY_END_ID - 1]},  # inside the vocabulary: preprocessing refuses others
    {"start_id": [1], "is_return_log_probs": [False]},
    {"runtime_top_k": [3], "random_seed": [9]},
    {"temperature": [1.3], "runtime_top_p": [0.5], "runtime_top_k": [0], "random_seed": [1]},
]


def _stats(server: TritonServer, model: str) -> dict:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()


def batch_mixed_fields(url: str, send, stats) -> tuple[list, list, int, int]:
    """Each of OPTIONAL_FIELDS alone, then all at once while a long request keeps the model
    busy (so they queue together): ``(alone, together, inferences, executions)``."""
    base = {"prompt": ["def add(a, b):"], "request_output_len": [6]}
    requests = [{**base, **fields} for fields in OPTIONAL_FIELDS]
    alone = [send(r) for r in requests]
    every_field = {**base, **{k: v for f in OPTIONAL_FIELDS for k, v in f.items()}}
    before = stats()
    with concurrent.futures.ThreadPoolExecutor(len(requests) + 1) as pool:
        blocker = pool.submit(send, {**every_field, "request_output_len": [300]})
        time.sleep(0.3)
        together = list(pool.map(send, requests))
        blocker.result()
    deadline = time.monotonic() + 10
    while True:
        after = stats()
        inferences = int(after["inference_count"]) - int(before["inference_count"])
        if inferences >= len(requests) + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    executions = int(after["execution_count"]) - int(before["execution_count"])
    return alone, together, inferences, executions


def test_clients_sending_different_optional_fields_share_batches_and_are_all_answered(server):
    """Triton's dynamic batcher joins only requests with the same input set (core
    RequiredEqualInputs::HasEqualInputs) and the FT backend takes the first request's set for
    the batch (SetInputTensors): preprocessing sends fastertransformer every input, FT's default
    for each the client left out, so any two requests can share a batch and mean the same."""
    alone, together, inferences, executions = batch_mixed_fields(
        server.grpc_url,
        lambda r: complete(server.grpc_url, MODEL, r, protocol="grpc"),
        lambda: _stats(server, "fastertransformer"),
    )
    assert inferences == len(OPTIONAL_FIELDS) + 1
    assert executions < inferences  # requests of different field sets were batched
    for a, b in zip(alone, together, strict=True):
        assert a.text == b.text
        assert a.output_ids.tolist() == b.output_ids.tolist()


def test_temperature_reaches_the_model_through_the_ensemble(server):
    """Sampling (top_p 1) at temperature 0.01 gives the greedy text for every seed; at 1.0 it
    does not: the ensemble forwards the temperature and the model applies it."""
    base = {**SEED_REQUEST, "prompt": ["def add(a, b):"], "request_output_len": [6]}
    greedy = complete(server.http_url, MODEL, {**base, "runtime_top_k": [1]}).output_ids

    def sampled(temperature: float) -> list[list[int]]:
        return [
            complete(
                server.http_url,
                MODEL,
                {
                    **base,
                    "runtime_top_k": [0],
                    "runtime_top_p": [1.0],
                    "temperature": [temperature],
                    "random_seed": [seed],
                },
            ).output_ids.tolist()
            for seed in range(6)
        ]

    assert all(ids == greedy.tolist() for ids in sampled(0.01))
    warm = sampled(1.0)
    assert sum(ids == greedy.tolist() for ids in warm) <= 1
    assert len({tuple(ids) for ids in warm}) >= 4


def test_a_repository_moved_to_another_root_still_serves(published, tmp_path, tokenizer):
    """No absolute model_checkpoint_path: the backend finds 1/<T>-gpu wherever it is mounted."""
    moved = shutil.copytree(published, tmp_path / "elsewhere" / "models" / "codegen")
    config = (moved / "fastertransformer" / "config.pbtxt").read_text()
    assert "model_checkpoint_path" not in config and str(published) not in config
    with TritonServer(moved) as server:
        result = complete(server.http_url, MODEL, {**SEED_REQUEST, "runtime_top_k": [1]})
    prompt = tokenizer.encode(SEED_REQUEST["prompt"][0]).ids
    assert result.output_ids[: len(prompt)].tolist() == prompt
    assert result.text


def test_an_unsupported_head_size_fails_the_load(published, tmp_path):
    """Same hidden size, 16 heads of 16: the files still fit, but FasterTransformer has no
    generation kernel for head size 16, so the stand-in refuses to load."""
    broken = shutil.copytree(published, tmp_path / "broken")
    ini = broken / "fastertransformer" / "1" / "1-gpu" / "config.ini"
    text = ini.read_text()
    assert "head_num = 8" in text and "size_per_head = 32" in text
    ini.write_text(text.replace("head_num = 8", "head_num = 16").replace(
        "size_per_head = 32", "size_per_head = 16"
    ))  # fmt: skip
    with pytest.raises(ServerStartError) as failure, TritonServer(broken, startup_timeout=60):
        pass
    message = str(failure.value)
    assert "heads of size 16" in message
    assert "32, 48, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256" in message
