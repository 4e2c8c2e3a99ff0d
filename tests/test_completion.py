"""loader.completion: reading the users' request and turning it into typed Triton inputs."""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from loader.completion import build_inputs, check_inputs, complete, load_request
from loader.errors import EndpointError, InvalidRequestError

SEED = Path(__file__).resolve().parent.parent / "bench" / "test.json"


def test_the_tiny_models_request_is_the_seed_request_with_ids_in_its_vocabulary():
    from tests.tinymodels import TINY_REQUEST_FILE, for_tiny_model

    assert load_request(TINY_REQUEST_FILE) == for_tiny_model(load_request(SEED))


@pytest.mark.parametrize("name", ["test.json", "mixed.json"])
def test_the_demo_models_requests_are_the_production_ones_with_ids_in_its_vocabulary(name):
    import json

    bench = SEED.parent
    production = json.loads((bench / name).read_text())["data"]
    demo = json.loads((bench / "demo" / name).read_text())["data"]
    assert [{**e, "start_id": [511], "end_id": [511]} for e in production] == demo
    # 511 is the last id of the demo model's vocabulary (loader.demo.checkpoint.DemoRecipe).
    from loader.demo.checkpoint import DemoRecipe

    assert DemoRecipe().vocab_size == 512


def test_the_seed_request_is_read_with_every_field():
    request = load_request(SEED)
    assert request["prompt"] == ["<python>def is_even(na: int) ->"]
    assert request["request_output_len"] == [32]
    assert request["random_seed"] == [1594506369]
    assert set(request) == {
        "prompt", "request_output_len", "temperature", "repetition_penalty", "runtime_top_k",
        "runtime_top_p", "start_id", "end_id", "random_seed", "is_return_log_probs",
    }  # fmt: skip


@pytest.mark.parametrize("module", [httpclient, grpcclient])
def test_inputs_carry_the_ensembles_types_and_a_batch_dimension(module):
    inputs = {i.name(): i for i in build_inputs(module, load_request(SEED))}
    assert inputs["prompt"].datatype() == "BYTES"
    assert inputs["random_seed"].datatype() == "UINT64"
    assert inputs["runtime_top_p"].datatype() == "FP32"
    assert inputs["is_return_log_probs"].datatype() == "BOOL"
    assert all(list(i.shape()) == [1, 1] for i in inputs.values())


def test_a_file_without_data_is_a_typed_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"prompt": "x"}')
    with pytest.raises(InvalidRequestError, match="data entry"):
        load_request(bad)


def test_an_unknown_input_is_a_typed_error():
    with pytest.raises(InvalidRequestError, match="no input named 'top_k'"):
        build_inputs(httpclient, {"top_k": [1]})


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("request_output_len", 2**32, "from 0 to 4294967295"),  # was wrapped to 0
        ("request_output_len", 99999999999, "from 0 to 4294967295"),
        ("runtime_top_k", -1, "from 0 to 4294967295"),  # was wrapped to 4294967295
        ("runtime_top_k", 1.5, "whole number"),  # was rounded down
        ("runtime_top_k", "abc", "must be a number"),  # was a ValueError
        ("random_seed", -1, "from 0 to 18446744073709551615"),
        ("temperature", 1e40, "at most 3.40282e+38"),  # was inf
        ("temperature", "0.5", "must be a number"),
        ("is_return_log_probs", 2, "true or false"),
        ("runtime_top_k", True, "must be a number"),
    ],
)
def test_a_value_its_input_type_cannot_hold_is_refused_never_wrapped(field, value, needle):
    """A request file's value (or an option's) that the input's type cannot hold is refused
    before sending: numpy would wrap it (``-1`` as UINT32 is 4294967295), round it, or make it
    infinite, and the server would answer another request than the one asked."""
    with pytest.raises(InvalidRequestError, match=f"the input {field} .*{re.escape(needle)}"):
        check_inputs({"prompt": ["x"], field: [value]})
    check_inputs({"prompt": ["x"], "request_output_len": [2**32 - 1], "random_seed": [2**64 - 1],
                  "temperature": [float("nan")], "is_return_log_probs": [True]})  # fmt: skip


@pytest.mark.parametrize("argv", [["--max-tokens", "99999999999"], ["--top-k", "-1"]])
def test_the_complete_command_refuses_an_option_past_its_input_type(argv, capsys):
    from loader.cli import main

    code = main(["complete", "--url", "127.0.0.1:1", "--model", "codegen", *argv, "x"])
    err = capsys.readouterr().err
    assert code == 2 and "from 0 to 4294967295" in err and "Traceback" not in err, err


def test_an_unknown_protocol_is_a_typed_error():
    with pytest.raises(EndpointError, match="unknown protocol"):
        complete("127.0.0.1:1", "codegen", {"prompt": ["x"]}, protocol="ftp")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_unreachable_server_is_an_endpoint_error(protocol):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        request = {"prompt": ["x"], "request_output_len": [1]}
        with pytest.raises(EndpointError, match=f"127.0.0.1:{port}"):
            complete(f"127.0.0.1:{port}", "codegen", request, protocol=protocol, timeout_s=5)


GREEDY_CASES = [
    ({"temperature": [0.2]}, True),  # neither top-k nor top-p: greedy
    ({"temperature": [0.2], "runtime_top_p": [0.95]}, False),
    ({"temperature": [0.2], "runtime_top_k": [40]}, False),
    ({"temperature": [0.2], "runtime_top_k": [1], "runtime_top_p": [0.9]}, True),  # k = 1
    ({"temperature": [0.2], "runtime_top_k": [0], "runtime_top_p": [0.0]}, True),
    ({"temperature": [1.0]}, False),  # no temperature to lose
    ({}, False),
]


@pytest.mark.parametrize(("request_", "greedy"), GREEDY_CASES)
def test_a_temperature_without_top_k_or_top_p_is_known_greedy_by_both_clients(request_, greedy):
    """loader.completion and scripts/complete (which users copy alone) decide alike, as
    FasterTransformer does (TopKSamplingLayer::setup: top-k 0 and top-p 0 is top-k 1)."""
    from loader.completion import greedy_despite_temperature
    from tests.test_bench_errors import _scripts_complete

    assert greedy_despite_temperature(request_) is greedy
    flat = {name: values[0] for name, values in request_.items()}
    assert _scripts_complete().greedy_despite_temperature(flat) is greedy


@pytest.mark.parametrize("client", ["model-loader", "scripts/complete"])
def test_the_clients_warn_about_a_greedy_temperature_before_sending(client):
    import subprocess
    import sys

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"127.0.0.1:{closed.getsockname()[1]}"  # nothing listens: the send fails
    command = (
        [sys.executable, "-m", "loader", "complete"]
        if client == "model-loader"
        else [sys.executable, str(Path(__file__).parents[1] / "scripts" / "complete")]
    )

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "--url", url, "--model", "codegen", *flags, "def f():"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    alone = run("--temperature", "0.2")
    assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr
    assert "temperature 0.2 without top-k or top-p is greedy decoding" in alone.stderr
    assert "--top-p" in alone.stderr
    sampled = run("--temperature", "0.2", "--top-p", "0.95")
    assert sampled.returncode == 2 and "greedy" not in sampled.stderr, sampled.stderr


@pytest.mark.parametrize("kind", ["fifo", "device", "too-large"])
def test_a_request_file_is_read_only_when_it_is_a_small_regular_file(tmp_path, kind):
    """A FIFO blocked `complete --request` forever and /dev/zero filled its memory."""
    import os

    from loader.errors import LoaderError

    path = tmp_path / "request.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        prompt = "x" * (17 * 1024 * 1024)  # a valid request, larger than any real one
        path.write_text('{"data": [{"prompt": {"content": ["' + prompt + '"], "shape": [1]}}]}')
    with pytest.raises(LoaderError) as info:
        load_request(path)
    assert info.value.exit_code == 2 and str(path) in info.value.message


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_wait_of_the_complete_command_for_the_server_ends_at_its_timeout(
    protocol, monkeypatch, capsys
):
    """``complete --check-ready`` without ``--model``: the model list and the readiness checks
    wait for the server at most ``--timeout`` each, over HTTP (the client's connection and
    network timeouts) and gRPC (each call's deadline: a call has none of its own, and one a
    server took and never answered waited for good)."""
    import types

    from tritonclient.utils import InferenceServerException

    from loader.cli import main

    made, calls = [], []

    class Client:
        def __init__(self, url, **kwargs):
            made.append(kwargs)

        def get_model_repository_index(self, **kwargs):
            calls.append(("index", kwargs))
            return [{"name": "codegen", "state": "READY"}]

        def is_server_ready(self, **kwargs):
            calls.append(("server", kwargs))
            return True

        def is_model_ready(self, model, **kwargs):
            calls.append(("model", kwargs))
            return True

        def infer(self, *args, **kwargs):
            raise InferenceServerException("refused")

        def close(self):
            pass

    real = httpclient if protocol == "http" else grpcclient
    fake = types.ModuleType(real.__name__)
    fake.__dict__.update(vars(real), InferenceServerClient=Client)
    monkeypatch.setitem(sys.modules, real.__name__, fake)
    code = main(["complete", "--url", f"{protocol}://127.0.0.1:1", "--timeout", "7",
                 "--check-ready", "x"])  # fmt: skip
    assert code == 2, capsys.readouterr().err
    assert [what for what, _ in calls] == ["index", "server", "model"]
    if protocol == "http":
        waits = {"connection_timeout": 7.0, "network_timeout": 7.0}
        assert made[:2] == [waits, waits] and all(kwargs == {} for _, kwargs in calls)
    else:
        assert all(kwargs == {"client_timeout": 7.0} for _, kwargs in calls), calls
