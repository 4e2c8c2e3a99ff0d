"""Every Python model a repository ships runs on the python_backend r23.05 API (Triton 23.05).

The models are loaded from a published repository by ``tests/r2305/driver.py`` in a ``python -S``
interpreter of ``.venv-triton``, the virtualenv with the Triton image's package pins
(``images/triton/requirements.txt``; ``make test`` creates it, and so does the fixture below when
it is missing), against ``tests/r2305/triton_python_backend_utils.py``: the r23.05 surface and
nothing newer. The stub models the memory types the real backend hands out: the
``fastertransformer`` model's outputs are GPU tensors to a BLS caller that did not ask for CPU
memory, and ``as_numpy()`` on them raises.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format

from loader.parallel import Parallelism
from loader.repository.config import read_config
from loader.repository.key import ServingSettings
from loader.run import RunRequest, run
from tests.tinymodels import TINY_END_ID

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "r2305" / "driver.py"
STUB = ROOT / "tests" / "r2305" / "triton_python_backend_utils.py"
TRITON_VENV = ROOT / ".venv-triton"
PINS = ROOT / "images" / "triton" / "requirements.txt"
PROMPT = "def add(a, b):"
#: An end_id outside the tiny vocabulary: every requested token is generated.
NEVER = 100_000


def _pins() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in PINS.read_text().splitlines()]
    return dict(line.split("==") for line in lines if line)


#: The tests that run the models in ``.venv-triton`` (built here if `make test` has not): slow,
#: so not in `make test-fast` (markers in pyproject.toml).
NEEDS_TRITON_VENV = pytest.mark.slow


@pytest.fixture(scope="session")
def triton_site() -> tuple[Path, str]:
    """``.venv-triton``'s interpreter and site-packages, the venv created if `make test` has not
    (one creator at a time: the lock serialises parallel test workers)."""
    python, stamp = TRITON_VENV / "bin" / "python", TRITON_VENV / ".installed"
    digest = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    lock = Path(tempfile.gettempdir()) / f"model-triton-venv-{digest}.lock"
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if not stamp.is_file() or stamp.stat().st_mtime < PINS.stat().st_mtime:
            script = ROOT / "scripts" / "install-triton-venv.sh"
            subprocess.run([str(script), str(TRITON_VENV)], check=True, timeout=900)
            stamp.touch()
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    return python, site


def _publish(source: Path, root: Path, *, streaming: bool) -> Path:
    request = RunRequest(
        source=str(source),
        repository=root,
        model_name="codegen",
        parallelism=Parallelism(tp=1, pp=1, instance_count=1),
        settings=ServingSettings(backend="python", dynamic_batching=True, streaming=streaming),
    )
    return run(request).path


def _drive(published: Path, tmp_path: Path, triton_site, scenario: str, requests: list) -> dict:
    python, site = triton_site
    models, ensemble, streaming = [], None, None
    for config_path in sorted(published.glob("*/config.pbtxt")):
        config = read_config(config_path)
        as_dict = json_format.MessageToDict(config, preserving_proto_field_name=True)
        if config.platform == "ensemble":
            ensemble = as_dict
            continue
        if config.name not in ("preprocessing", "postprocessing", "fastertransformer", "llm"):
            streaming = config.name
        models.append(
            {
                "name": config.name,
                "version_dir": str(config_path.parent / "1"),
                "model_config": as_dict,
            }
        )
    spec = {
        "site": site,
        "models": models,
        "gpu_output_models": ["fastertransformer"],  # the C++ backend answers in GPU memory
        "ensemble": ensemble,
        "streaming": streaming,
        "scenario": scenario,
        "requests": requests,
    }
    spec_path = tmp_path / f"spec-{scenario}.json"
    spec_path.write_text(json.dumps(spec))
    done = subprocess.run(
        [str(python), "-S", str(DRIVER), str(spec_path)],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _client_request(n_out: int = 6, **optional) -> dict:
    request = {
        "prompt": ["BYTES", [PROMPT]],
        "request_output_len": ["UINT32", [[n_out]]],
        "runtime_top_k": ["UINT32", [[1]]],
    }
    request.update(optional)
    return request


def _ft_request(prompt: list[int], n_out: int, **optional) -> dict:
    request = {
        "input_ids": ["UINT32", [prompt]],
        "input_lengths": ["UINT32", [[len(prompt)]]],
        "request_output_len": ["UINT32", [[n_out]]],
        "end_id": ["UINT32", [[NEVER]]],
    }
    request.update(optional)
    return request


@pytest.fixture(scope="module")
def source(tiny_checkpoint_with_tokenizer: Path) -> Path:
    return tiny_checkpoint_with_tokenizer


@pytest.fixture(scope="module")
def plain(source, tmp_path_factory) -> Path:
    return _publish(source, tmp_path_factory.mktemp("r2305") / "models", streaming=False)


@pytest.fixture(scope="module")
def streaming(source, tmp_path_factory) -> Path:
    return _publish(source, tmp_path_factory.mktemp("r2305s") / "models", streaming=True)


@NEEDS_TRITON_VENV
def test_the_models_run_with_the_triton_images_pins(plain, tmp_path, triton_site):
    report = _drive(plain, tmp_path, triton_site, "ensemble", [_client_request()])
    pins = _pins()
    assert report["numpy"] == pins["numpy"] == "1.24.4"
    assert report["tokenizers"] == pins["tokenizers"]
    # The image installs exactly this file.
    dockerfile = (ROOT / "images" / "triton" / "Dockerfile").read_text()
    assert "COPY images/triton/requirements.txt" in dockerfile
    assert "-r /tmp/model-triton-requirements.txt" in dockerfile


@NEEDS_TRITON_VENV
def test_ensemble_models_answer_on_the_r2305_api(plain, tmp_path, triton_site):
    seed_fields = {
        "temperature": ["FP32", [[0.2]]],
        "repetition_penalty": ["FP32", [[1.0]]],
        "runtime_top_p": ["FP32", [[0.98]]],
        "random_seed": ["UINT64", [[1594506369]]],
        "is_return_log_probs": ["BOOL", [[True]]],
        "start_id": ["UINT32", [[TINY_END_ID]]],
        "end_id": ["UINT32", [[TINY_END_ID]]],
    }
    report = _drive(
        plain,
        tmp_path,
        triton_site,
        "ensemble",
        [_client_request(), _client_request(**seed_fields)],
    )
    for result in report["results"]:
        assert "error" not in result, result
        assert result["dtypes"] == {
            "completion": "object",
            "output_ids": "uint32",
            "sequence_length": "int32",
            "cum_log_probs": "float32",
        }
        assert result["outputs"]["completion"][0][0]
        assert result["shapes"]["output_ids"][:2] == [1, 1]


@NEEDS_TRITON_VENV
def test_a_request_beyond_the_bounds_is_refused_on_the_r2305_api(plain, tmp_path, triton_site):
    # r23.05's TritonError carries a message only (INTERNAL on the wire); the message names the
    # field and the limit, and the other request of the batch is answered.
    report = _drive(
        plain,
        tmp_path,
        triton_site,
        "ensemble",
        [_client_request(end_id=["UINT32", [[NEVER]]]), _client_request()],
    )
    refused, answered = report["results"]
    assert "end_id: 100000 is outside the model's vocabulary of 320 ids" in refused["error"]
    assert "error" not in answered, answered


@NEEDS_TRITON_VENV
def test_preprocessing_sends_every_fastertransformer_input_whatever_the_client_sent(
    plain, tmp_path, triton_site
):
    """One input set for every request (Triton batches only requests with the same set, core
    RequiredEqualInputs::HasEqualInputs): preprocessing produces all sixteen inputs of the
    fastertransformer contract for any choice of the client's optional fields."""
    from loader.repository.tensors import FASTERTRANSFORMER_INPUTS, SAMPLING_INPUTS

    choices = [{}]
    values = {"UINT32": [[1]], "UINT64": [[5]], "FP32": [[0.5]], "BOOL": [[False]]}
    for tensor in SAMPLING_INPUTS:
        choices.append({tensor.name: [tensor.dtype, values[tensor.dtype]]})
    choices.append({t.name: [t.dtype, values[t.dtype]] for t in SAMPLING_INPUTS})
    report = _drive(
        plain, tmp_path, triton_site, "ensemble", [_client_request(**c) for c in choices]
    )
    expected = sorted(t.name for t in FASTERTRANSFORMER_INPUTS)
    for result in report["results"]:
        assert "error" not in result, result
        assert result["produced"]["preprocessing"] == expected


@NEEDS_TRITON_VENV
def test_the_streaming_model_streams_on_the_r2305_api(plain, streaming, tmp_path, triton_site):
    """Fails if any BLS call of the streaming model reads a ``fastertransformer`` tensor it did
    not ask for in CPU memory (the r23.05 backend hands it GPU memory)."""
    report = _drive(streaming, tmp_path, triton_site, "streaming", [_client_request()])
    [result] = report["results"]
    assert result["errors"] == []
    assert result["final"] and result["final_has_data"]
    assert result["responses"] == 6 + 1  # one per generated token, then the final one
    reference = _drive(plain, tmp_path, triton_site, "ensemble", [_client_request()])
    assert result["completion"] == reference["results"][0]["outputs"]["completion"][0][0]
    lengths = result["sequence_lengths"]
    assert lengths == sorted(lengths) and lengths[-1] - lengths[0] == 5


@NEEDS_TRITON_VENV
def test_a_batched_request_lacking_an_input_of_the_first_gets_tritons_error(
    plain, tmp_path, triton_site
):
    """BE SetInputTensors takes requests[0]'s inputs as the batch's; the input collector answers
    a request without one of them with Triton's error, and ignores what only later requests
    send."""
    seeded = {"random_seed": ["UINT64", [[7]]], "runtime_top_k": ["UINT32", [[20]]]}
    unseeded = {"runtime_top_k": ["UINT32", [[20]]]}
    first, second = _ft_request([5, 6, 7, 8], 5), _ft_request([9, 10, 11], 5)

    def batch(*optional: dict) -> list[dict]:
        """One execute of both requests, each with its optional inputs: their first responses."""
        requests = [{**r, **o} for r, o in zip((first, second), optional, strict=True)]
        report = _drive(plain, tmp_path, triton_site, "batch", requests)
        return [r["responses"][0] for r in report["results"]]

    ok, failed = batch(seeded, unseeded)
    assert "outputs" in ok
    assert failed["error"] == "input 'random_seed' does not exist in request"
    # The other way round both are answered, and the second request's seed is ignored: it
    # samples with FT's default seed 0, as it does when it sends none.
    ignored = batch(unseeded, seeded)[1]["outputs"]["output_ids"]
    assert ignored == batch(unseeded, unseeded)[1]["outputs"]["output_ids"]
    assert ignored != batch(seeded, seeded)[1]["outputs"]["output_ids"]


@NEEDS_TRITON_VENV
def test_every_default_preprocessing_fills_in_means_what_its_absence_means(
    plain, tmp_path, triton_site
):
    """A differential test of preprocessing's DEFAULTS against the reference's handling of an
    absent input (FT's): a sampled request with every optional input absent and the same request
    with each set to its default give the same tokens and log probabilities."""
    pre = _model_module("preprocessing")
    triton_types = {np.uint32: "UINT32", np.uint64: "UINT64", np.float32: "FP32"}
    explicit = {
        name: [triton_types[dtype], [[value]]] for name, (dtype, value) in pre.DEFAULTS.items()
    }
    explicit.pop("runtime_top_k")  # both sample: top-k 20, so the seed's default matters
    for name in pre.WORD_LISTS:
        explicit[name] = ["INT32", [list(map(list, pre.EMPTY_WORDS))]]
    log_probs = {"is_return_log_probs": ["BOOL", [[True]]]}
    top_k = {"runtime_top_k": ["UINT32", [[20]]]}
    absent = _ft_request([5, 6, 7, 8], 8, **top_k, **log_probs)
    present = _ft_request([5, 6, 7, 8], 8, **top_k, **log_probs, **explicit)
    results = [
        _drive(plain, tmp_path, triton_site, "batch", [r])["results"][0]["responses"][0]["outputs"]
        for r in (absent, present)
    ]
    assert results[0] == results[1]
    seeded = _ft_request([5, 6, 7, 8], 8, **top_k, **log_probs, random_seed=["UINT64", [[1]]])
    other = _drive(plain, tmp_path, triton_site, "batch", [seeded])["results"][0]
    assert other["responses"][0]["outputs"]["output_ids"] != results[0]["output_ids"]


@NEEDS_TRITON_VENV
def test_streaming_fastertransformer_calls_back_every_request_each_step_but_the_last(
    streaming, tmp_path, triton_site
):
    """BE streaming_callback answers every request of the batch after each step; FT
    GptJ::forward skips the callback of the last step; ProcessRequests then sends each a final
    response with data. The shorter row samples one token more (step >= W + len)."""
    short, long_ = _ft_request([5, 6, 7], 3), _ft_request([9, 10, 11, 12], 6)
    report = _drive(streaming, tmp_path, triton_site, "batch", [short, long_])
    for result in report["results"]:
        responses = result["responses"]
        assert [r["final"] for r in responses] == [False] * 5 + [True]
        assert all("outputs" in r for r in responses)
    short_lengths = [
        r["outputs"]["sequence_length"][0][0] for r in report["results"][0]["responses"]
    ]
    long_lengths = [
        r["outputs"]["sequence_length"][0][0] for r in report["results"][1]["responses"]
    ]
    width = 4
    assert long_lengths == [width + n for n in range(1, 7)]
    assert short_lengths == [width + n for n in (1, 2, 3, 4, 4, 4)]  # 3 asked, 4 sampled


def test_the_stub_hands_out_gpu_tensors_as_the_r2305_backend_does():
    """The stub itself: a ``fastertransformer`` output is a GPU tensor to a BLS caller that did
    not prefer CPU memory (as_numpy raises as PbTensor::AsNumpy does), a CPU one otherwise."""
    spec = importlib.util.spec_from_file_location("r2305_stub", STUB)
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)

    class Echo:
        def execute(self, requests):
            return [stub.InferenceResponse([stub.Tensor("out", np.arange(3))]) for _ in requests]

    stub.MODELS["fastertransformer"] = (Echo(), False)
    stub.MODELS["postprocessing"] = (Echo(), False)
    stub.GPU_OUTPUT_MODELS.add("fastertransformer")

    def ask(model: str, **kwargs):
        request = stub.InferenceRequest(
            inputs=[], requested_output_names=[], model_name=model, **kwargs
        )
        return stub.get_output_tensor_by_name(request.exec(), "out")

    on_gpu = ask("fastertransformer")
    assert not on_gpu.is_cpu()
    with pytest.raises(stub.TritonModelException, match="stored in GPU"):
        on_gpu.as_numpy()
    cpu = stub.PreferredMemory(stub.TRITONSERVER_MEMORY_CPU, 0)
    assert ask("fastertransformer", preferred_memory=cpu).as_numpy().tolist() == [0, 1, 2]
    assert ask("postprocessing").as_numpy().tolist() == [0, 1, 2]  # a Python model: CPU


def test_the_code_the_triton_image_runs_passes_vermin_for_python_3_10():
    """vermin over the paths ``make lint`` checks (the Makefile's TRITON_IMAGE_PYTHON)."""
    line = next(
        line
        for line in (ROOT / "Makefile").read_text().splitlines()
        if line.startswith("TRITON_IMAGE_PYTHON :=")
    )
    paths = line.split(":=", 1)[1].split()
    assert "loader/repository/models" in paths and "loader/reference" in paths
    done = subprocess.run(
        [str(Path(sys.executable).parent / "vermin"), "-q", "-t=3.10-", "--no-tips", "--violations",
         "--eval-annotations", *paths],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def _model_module(name: str):
    """``<name>/model.py`` imported against the stub (for its functions and tables)."""
    models = ROOT / "loader" / "repository" / "models"
    saved = list(sys.path)
    sys.path[:0] = [str(STUB.parent), str(models)]
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_model", models / name / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
        for name in ("triton_python_backend_utils", "tokenization", "bls"):
            sys.modules.pop(name, None)
    return module


def test_postprocessing_cuts_fts_batch_layout_to_what_the_request_asked_for():
    """FT's rows are W + M wide with sequence_length W + n (GptJ::setOutputTensors, gatherTree),
    and a row asking fewer than M tokens holds one more (length_criterion): the answer keeps the
    prompt and min(n, request_output_len) tokens, its own length, and NaN for a cum_log_probs
    that holds the extra token."""
    answer = _model_module("postprocessing").answer
    end, width, most = 99, 5, 6  # end_id, W (the batch's widest prompt), M
    rows = np.full((3, 1, width + most), end, dtype=np.uint32)
    rows[0, 0, :3], rows[0, 0, 3:8] = [1, 2, 3], [11, 12, 13, 14, 15]  # asked 4, got 5
    rows[1, 0, :5], rows[1, 0, 5:7] = [4, 5, 6, 7, 8], [21, end]  # end_id after 1 token
    rows[2, 0, :2], rows[2, 0, 2:4] = [9, 10], [31, 32]  # a snapshot: 2 of 6 so far
    lengths = np.array([[width + 5], [width + 2], [width + 2]], dtype=np.int32)
    cums = np.array([[-1.0], [-2.0], [-3.0]], dtype=np.float32)
    ids, seq, cum, texts = answer(
        rows, lengths, cums, most, np.array([3, 5, 2]), np.array([4, 6, 6]), np.full(3, end)
    )
    assert ids.shape == (3, 1, 5 + 6)  # the request's own widest prompt + largest length
    assert ids[0, 0].tolist() == [1, 2, 3, 11, 12, 13, 14] + [end] * 4
    assert ids[1, 0].tolist() == [4, 5, 6, 7, 8, 21, end] + [end] * 4
    assert ids[2, 0].tolist() == [9, 10, 31, 32] + [end] * 7
    assert seq[:, 0].tolist() == [3 + 4, 5 + 2, 2 + 2]  # a stopping end_id counts, as in FT
    assert np.isnan(cum[0, 0]) and cum[1:, 0].tolist() == [-2.0, -3.0]
    assert texts == [[11, 12, 13, 14], [21], [31, 32]]


def test_the_readme_builds_the_base_image_the_dockerfile_starts_from():
    """images/triton/Dockerfile starts FROM an image built locally from upstream's
    docker/Dockerfile: the README says how, with the exact tag the Dockerfile expects."""
    dockerfile = (ROOT / "images" / "triton" / "Dockerfile").read_text()
    [base] = [
        line.split("=", 1)[1] for line in dockerfile.splitlines() if line.startswith("ARG BASE=")
    ]
    readme = (ROOT / "README.md").read_text()
    commit = "c6936c39be6fc57c161db34cfe5c45d1bef81ee2"
    assert f"git -C fastertransformer_backend checkout {commit}" in readme
    assert (
        f"docker build --rm -t {base} \\\n  -f fastertransformer_backend/docker/Dockerfile"
        in readme
    )
    assert base.endswith(commit[:7])
    ignore = (ROOT / "images" / "triton" / "Dockerfile.dockerignore").read_text().split()
    assert "!images/triton/requirements.txt" in ignore
    assert "!images/triton/requirements.txt" in (ROOT / ".dockerignore").read_text().split()


def test_the_streaming_models_tensor_names_are_the_contracts():
    """The streaming model cannot import loader.repository.tensors (it runs in Triton); its own
    name lists must be the contract's."""
    from loader.repository import tensors

    streaming_model = _model_module("streaming")
    assert tuple(t.name for t in tensors.ENSEMBLE_INPUTS) == streaming_model.CLIENT_INPUTS
    assert tuple(t.name for t in tensors.FASTERTRANSFORMER_INPUTS) == streaming_model.FT_INPUTS
    assert tuple(t.name for t in tensors.FT_RESULTS) == streaming_model.FT_RESULTS
    assert tuple(t.name for t in tensors.POSTPROCESSING_OUTPUTS) == streaming_model.ANSWER
    names = {t.name for t in tensors.POSTPROCESSING_INPUTS}
    assert set(streaming_model.REQUEST_FIELDS) | set(streaming_model.FT_RESULTS) == names


def _bls_module():
    """``bls.py`` imported against the stub, as the models import it."""
    models = ROOT / "loader" / "repository" / "models"
    saved = list(sys.path)
    sys.path[:0] = [str(STUB.parent)]
    try:
        spec = importlib.util.spec_from_file_location("bls_steps", models / "bls.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
        sys.modules.pop("triton_python_backend_utils", None)
    return module


class _Request:
    def __init__(self, sender, kind: str) -> None:
        self.sender, self.kind = sender, kind

    def get_response_sender(self):
        return self.sender


def test_a_failed_request_ends_its_stream_and_unloading_waits_once_for_all(capsys):
    """Every failure ends the client's stream with the error (a client's own mistake is not
    logged as the model's); ``finalize`` waits for the requests still served for one deadline
    in all, not one per request, and says how many it left."""
    bls = _bls_module()
    pb = bls.pb_utils
    release = threading.Event()

    class ClientMistake(ValueError):
        pass

    def serve(request, sender):
        if request.kind == "block":
            release.wait(60)
        raise (ClientMistake if request.kind == "client" else RuntimeError)("no good")

    threads = bls.RequestThreads(serve, name="llm", quiet=(ClientMistake,))
    kinds = ("client", "ours", "block", "block", "block")
    senders = [pb.InferenceResponseSender() for _ in kinds]
    requests = [_Request(sender, kind) for sender, kind in zip(senders, kinds, strict=True)]
    try:
        threads.start(requests[:2])
        for sender in senders[:2]:
            assert pb.wait_final(sender, 30)
            [(response, flags)] = pb.sent(sender)
            assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            assert response.error().message() == "no good"
        threads.join(timeout_s=5)  # both finished: no warning
        logged = capsys.readouterr().out
        assert logged.count("llm request failed: no good") == 1  # the model's failure only
        assert "still being served" not in logged

        threads.start(requests[2:])
        threads.join(timeout_s=0.2)
        assert "llm: unloading with 3 request(s) still being served" in capsys.readouterr().out
    finally:
        release.set()
