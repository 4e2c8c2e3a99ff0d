"""End to end on the real tritonserver (CPU): repositories written by ``model-loader run
--backend python`` from a tiny local checkpoint, served on 127.0.0.1, called with tritonclient.

Two repositories cover T in {1, 2}, I in {1, 2} and dynamic batching off/on; each is served once
for the module's tests. The request is the users' ``test.json`` (``bench/test.json``).
"""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tinymodels import load_hf_model
from tokenizers import Tokenizer

from loader.completion import Completion, complete, load_request
from loader.errors import EndpointError, ServerStartError
from loader.repository.config import read_config, write_config
from loader.serving import TritonServer
from tests.tinymodels import for_tiny_model

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)


ROOT = Path(__file__).resolve().parent.parent
MODEL = "codegen"
#: The users' request, its start/end ids inside the tiny vocabulary (the bounds refuse others).
SEED_REQUEST = for_tiny_model(load_request(ROOT / "bench" / "test.json"))


@dataclass(frozen=True)
class Setup:
    tp: int
    instances: int
    batching: bool


SETUPS = {
    "tp1-i1-no-batching": Setup(tp=1, instances=1, batching=False),
    "tp2-i2-batching": Setup(tp=2, instances=2, batching=True),
}


def run_loader(source: Path, root: Path, setup: Setup) -> subprocess.CompletedProcess[str]:
    """``model-loader run --backend python`` for ``setup``."""
    batching = (
        ["--dynamic-batching", "--preferred-batch-size", "4", "--max-queue-delay-us", "500000"]
        if setup.batching
        else ["--no-dynamic-batching"]
    )
    cmd = [
        sys.executable, "-m", "loader", "run", "--source", str(source), "--repository", str(root),
        "--model-name", MODEL, "--tp-size", str(setup.tp), "--pp-size", "1",
        "--instance-count", str(setup.instances), "--backend", "python", *batching,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def publish(source: Path, root: Path, setup: Setup) -> Path:
    """Run ``model-loader run --backend python``; return the path it prints last."""
    done = run_loader(source, root, setup)
    assert done.returncode == 0, done.stderr
    published = Path(done.stdout.strip().splitlines()[-1])
    assert (published / ".ready").is_file()
    return published


@dataclass
class Served:
    setup: Setup
    repository: Path
    server: TritonServer

    def complete(self, request: dict, *, protocol: str = "http") -> Completion:
        url = self.server.http_url if protocol == "http" else self.server.grpc_url
        return complete(url, MODEL, request, protocol=protocol)

    def stats(self, model: str) -> dict:
        client = httpclient.InferenceServerClient(self.server.http_url)
        try:
            return client.get_inference_statistics(model)["model_stats"][0]
        finally:
            client.close()

    def stats_after(
        self, model: str, before: dict, inferences: int, *, timeout: float = 10.0
    ) -> dict:
        """Statistics once ``inferences`` more requests are counted (Triton updates them just
        after the responses go out, so a read right after the last response can miss one)."""
        deadline = time.monotonic() + timeout
        while True:
            after = self.stats(model)
            counted = int(after["inference_count"]) - int(before["inference_count"])
            if counted >= inferences or time.monotonic() > deadline:
                return after
            time.sleep(0.05)


@pytest.fixture(scope="module")
def source(tiny_checkpoint_with_tokenizer: Path) -> Path:
    return tiny_checkpoint_with_tokenizer


@pytest.fixture(scope="module")
def tokenizer(source: Path) -> Tokenizer:
    return Tokenizer.from_file(str(source / "tokenizer.json"))


@pytest.fixture(scope="module", params=list(SETUPS))
def served(request, source, tmp_path_factory):
    setup = SETUPS[request.param]
    repository = publish(source, tmp_path_factory.mktemp(request.param), setup)
    with TritonServer(repository) as server:
        yield Served(setup, repository, server)


def _prompt_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(SEED_REQUEST["prompt"][0]).ids


def test_seed_request_over_http_and_grpc_returns_the_same_completion(served, tokenizer):
    http = served.complete(SEED_REQUEST)
    grpc = served.complete(SEED_REQUEST, protocol="grpc")
    prompt = _prompt_ids(tokenizer)
    n_out = SEED_REQUEST["request_output_len"][0]
    # end_id 50256 lies outside the tiny vocabulary, so all 32 tokens are generated.
    assert http.sequence_length == len(prompt) + n_out
    assert http.output_ids.shape == (len(prompt) + n_out,)
    assert http.output_ids[: len(prompt)].tolist() == prompt
    assert http.text == tokenizer.decode(http.output_ids[len(prompt) :].tolist())
    np.testing.assert_array_equal(http.output_ids, grpc.output_ids)
    assert http.text == grpc.text
    # A request alone gets no token it did not ask for: its cum_log_probs is FT's sum.
    assert np.isfinite(http.cum_log_prob) and http.cum_log_prob < 0
    assert grpc.cum_log_prob == pytest.approx(http.cum_log_prob)


def test_greedy_completion_equals_hugging_face_generate(served, source, tokenizer):
    prompt = _prompt_ids(tokenizer)
    n_out = 12
    request = {**SEED_REQUEST, "runtime_top_k": [1], "request_output_len": [n_out]}
    got = served.complete(request, protocol="grpc")
    hf = load_hf_model(source)
    ids = torch.tensor([prompt])
    expected = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n_out,
        min_new_tokens=n_out,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0].numpy()
    np.testing.assert_array_equal(got.output_ids[: got.sequence_length], expected)


def test_config_endpoint_shows_the_written_instances_and_batching(served):
    client = httpclient.InferenceServerClient(served.server.http_url)
    try:
        config = client.get_model_config("fastertransformer")
        ensemble = client.get_model_config(MODEL)
    finally:
        client.close()
    assert config["backend"] == "python"
    assert [g["count"] for g in config["instance_group"]] == [served.setup.instances]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["parameters"]["tensor_para_size"]["string_value"] == str(served.setup.tp)
    assert ("dynamic_batching" in config) is served.setup.batching
    if served.setup.batching:
        assert config["dynamic_batching"]["preferred_batch_size"] == [4]
        assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 500000
    assert ensemble["platform"] == "ensemble"
    assert ensemble["max_batch_size"] == 8


#: Prompts of different token lengths (the tiny tokenizer gives each a length of its own).
RAGGED_PROMPTS = (
    "def",
    "def add(a",
    "def add(a, b):",
    "def add(a, b):\n    return",
    "class Point:\n    def __init__(self, x",
    "for i in range(10):\n    print(i)\n",
    "def is_even(n: int) -> bool:\n    return n % 2",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y",
)


def test_prompts_of_different_lengths_batch_together_and_answer_as_alone(served, tokenizer):
    """Ragged batching: greedy completions inside batches of 8 distinct prompt lengths equal the
    same requests sent alone; Triton's statistics show the batches (only with batching on)."""
    lengths = {len(tokenizer.encode(p).ids) for p in RAGGED_PROMPTS}
    assert len(lengths) == len(RAGGED_PROMPTS)
    requests = [
        {**SEED_REQUEST, "prompt": [p], "runtime_top_k": [1], "request_output_len": [4 + n % 3]}
        for n, p in enumerate(RAGGED_PROMPTS)
    ]
    alone = [served.complete(r) for r in requests]
    before = served.stats("fastertransformer")
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(served.complete, requests))
    after = served.stats_after("fastertransformer", before, len(requests))
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == len(requests)
    if served.setup.batching:
        assert executions < inferences
        assert max(int(b["batch_size"]) for b in after["batch_stats"]) > 1
    else:
        assert executions == inferences
    for request, a, b in zip(requests, alone, together, strict=True):
        prompt = tokenizer.encode(request["prompt"][0]).ids
        n_out = request["request_output_len"][0]
        # The answer never depends on the batch: the same tokens, layout and length (FT's own
        # layout counts the batch's widest prompt and gives shorter requests one token more).
        assert a.text == b.text
        assert a.output_ids.tolist() == b.output_ids.tolist()
        assert a.output_ids.shape == (len(prompt) + n_out,)
        assert a.sequence_length == b.sequence_length == len(prompt) + n_out
        # cum_log_probs: FT's sum, or NaN where it holds a token the request did not ask for.
        assert np.isfinite(a.cum_log_prob)
        assert np.isnan(b.cum_log_prob) or b.cum_log_prob == pytest.approx(a.cum_log_prob, abs=1e-4)


def test_the_fastertransformer_model_answers_ft_inputs_directly(served, tokenizer):
    """The way fauxpilot's proxy calls it: token ids in, FT outputs back; stop words honoured."""
    prompt = _prompt_ids(tokenizer)
    full = served.complete({**SEED_REQUEST, "runtime_top_k": [1], "request_output_len": [8]})
    generated = full.output_ids[len(prompt) : full.sequence_length].tolist()
    stop = generated[2]
    first = generated.index(stop)
    arrays = {
        "input_ids": (np.array([prompt], dtype=np.uint32), "UINT32"),
        "input_lengths": (np.array([[len(prompt)]], dtype=np.uint32), "UINT32"),
        "request_output_len": (np.array([[8]], dtype=np.uint32), "UINT32"),
        "runtime_top_k": (np.array([[1]], dtype=np.uint32), "UINT32"),
        "end_id": (np.array([[50256]], dtype=np.uint32), "UINT32"),
        "stop_words_list": (np.array([[[stop, 0], [1, -1]]], dtype=np.int32), "INT32"),
    }
    inputs = []
    for name, (array, dtype) in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = httpclient.InferenceServerClient(served.server.http_url)
    try:
        result = client.infer("fastertransformer", inputs)
    finally:
        client.close()
    sequence_length = int(result.as_numpy("sequence_length")[0, 0])
    output_ids = result.as_numpy("output_ids")[0, 0]
    assert output_ids.shape == (len(prompt) + 8,)
    assert sequence_length == len(prompt) + first + 1
    assert output_ids[:sequence_length].tolist() == prompt + generated[: first + 1]


def test_an_end_id_sent_to_the_ensemble_stops_the_completion(served, tokenizer):
    prompt = _prompt_ids(tokenizer)
    greedy = {**SEED_REQUEST, "runtime_top_k": [1], "request_output_len": [8]}
    full = served.complete(greedy)
    generated = full.output_ids[len(prompt) : full.sequence_length].tolist()
    end_id = generated[3]
    stopped = served.complete({**greedy, "end_id": [end_id]})
    assert stopped.sequence_length == len(prompt) + generated.index(end_id) + 1
    assert (stopped.output_ids[stopped.sequence_length :] == end_id).all()
    # The end token ends the completion; it is not part of its text.
    assert stopped.text == tokenizer.decode(generated[: generated.index(end_id)])


def test_an_empty_prompt_is_refused_with_a_clear_error(served):
    with pytest.raises(EndpointError, match="prompt is empty"):
        served.complete({**SEED_REQUEST, "prompt": [""]})


@pytest.fixture(scope="module")
def published(source, tmp_path_factory) -> Path:
    """A T=1 repository, published but not served (tests may copy it, not modify it)."""
    return publish(source, tmp_path_factory.mktemp("published"), SETUPS["tp1-i1-no-batching"])


@pytest.mark.parametrize("model", ["preprocessing", "fastertransformer", "postprocessing"])
def test_published_python_models_import_without_the_project_installed(published, model):
    """``python -S`` skips site-packages' .pth files, so the editable ``loader`` is invisible:
    the model must run from the copies the repository writer put next to it."""
    import pytriton
    import tokenizers

    site = Path(tokenizers.__file__).resolve().parents[1]
    backend = Path(pytriton.__file__).resolve().parent / "tritonserver" / "backends" / "python"
    version_dir = published / model / "1"
    code = (
        "import sys; sys.path[:0] = sys.argv[1:]; import model; "
        "print(model.__file__); print(sys.modules['loader'].__file__ if 'loader' in sys.modules "
        "else '-')"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(version_dir), str(site), str(backend)],
        capture_output=True, text=True, timeout=120, check=False, cwd=version_dir,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    model_file, loader_file = done.stdout.split()
    assert Path(model_file).parent == version_dir
    if model == "fastertransformer":
        assert Path(loader_file).is_relative_to(version_dir / "loader")


def test_the_server_leaves_no_process_behind(published):
    with TritonServer(published) as server:
        pid = server.process.pid
        children = _children(pid)
        assert len(children) >= 3  # one Python-backend stub per model instance
    for process in (pid, *children):
        assert not Path(f"/proc/{process}").exists() or _is_zombie(process), process


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line
            )
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            found.append(int(status.parent.name))
    return found


def _is_zombie(pid: int) -> bool:
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


def test_a_repository_whose_tp_does_not_match_its_files_fails_to_load(published, tmp_path):
    broken = shutil.copytree(published, tmp_path / "broken")
    config_path = broken / "fastertransformer" / "config.pbtxt"
    config = read_config(config_path)
    config.parameters["tensor_para_size"].string_value = "2"
    write_config(config, config_path.parent)
    # FT's default checkpoint directory follows tensor_para_size: give it T=1 files.
    weights = broken / "fastertransformer" / "1"
    (weights / "1-gpu").rename(weights / "2-gpu")
    with pytest.raises(ServerStartError) as failure, TritonServer(broken, startup_timeout=60):
        pass
    message = str(failure.value)
    assert "failed to load 'fastertransformer'" in message
    assert "says tensor_para_size 2 but config.ini says 1" in message


def test_serving_writes_nothing_into_the_repository_and_the_key_stays_published(served, source):
    """The Python backend's stub compiles model.py and its imports into __pycache__ whatever
    PYTHONDONTWRITEBYTECODE says: the server is given a view of links (TritonServer.served),
    so the published key holds exactly its manifest and the next run finds nothing to do."""
    assert served.server.served != served.repository
    assert (served.server.served / "preprocessing" / "1" / "model.py").is_symlink()
    assert served.complete({"prompt": ["def f():"], "request_output_len": [4]}).text is not None
    assert list(served.repository.rglob("__pycache__")) == []
    assert list(served.server.served.rglob("__pycache__"))  # the stubs did write, elsewhere
    again = run_loader(source, served.repository.parents[1], served.setup)
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip().splitlines()[-1]) == served.repository
    assert "nothing to do" in again.stderr, again.stderr
