"""loader.serving: the tritonserver process itself (environment, ports, start failures).

Uses a one-model repository (a Python-backend model that doubles its input) so the real server
starts in a few seconds.
"""

from __future__ import annotations

import socket
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2 as mc

import loader.serving as serving
from loader.errors import RepositoryError, ServerStartError
from loader.repository.config import write_config
from loader.serving import TritonServer, find_triton, server_environment

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)

DOUBLE_MODEL = """
import triton_python_backend_utils as pb_utils



class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy() * 2)]
            )
            for r in requests
        ]
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("double-repo")
    config = mc.ModelConfig(name="double", backend="python", max_batch_size=4)
    for message, name in ((config.input.add(), "x"), (config.output.add(), "y")):
        message.name = name
        message.data_type = mc.TYPE_FP32
        message.dims.append(-1)
    write_config(config, root / "double")
    (root / "double" / "1").mkdir()
    (root / "double" / "1" / "model.py").write_text(DOUBLE_MODEL)
    return root


@pytest.fixture
def listening_socket():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def _double(server: TritonServer) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        x = httpclient.InferInput("x", [1, 3], "FP32")
        x.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.float32))
        return client.infer("double", [x]).as_numpy("y")
    finally:
        client.close()


def test_the_environment_puts_this_interpreter_first():
    env = server_environment(find_triton(), base={"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/x"})
    libs = env["LD_LIBRARY_PATH"].split(":")
    assert libs[0] == sysconfig.get_config_var("LIBDIR")
    assert libs[1].endswith("nvidia_pytriton.libs") and libs[-1] == "/x"
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)


def test_a_missing_repository_is_a_typed_error(tmp_path):
    with pytest.raises(RepositoryError, match="does not exist"):
        TritonServer(tmp_path / "nope").start()


def test_a_port_given_explicitly_and_taken_fails_with_tritons_message(repository, listening_socket):
    port = listening_socket.getsockname()[1]
    with pytest.raises(ServerStartError, match=f"127.0.0.1:{port}' already in use"):
        TritonServer(repository, http_port=port).start()


def test_a_free_port_taken_before_the_server_binds_it_is_replaced(
    repository, listening_socket, monkeypatch
):
    taken = listening_socket.getsockname()[1]
    real_free_port = serving.free_port
    handed_out = []

    def first_taken(host: str = "127.0.0.1") -> int:
        port = taken if not handed_out else real_free_port(host)
        handed_out.append(port)
        return port

    monkeypatch.setattr(serving, "free_port", first_taken)
    with TritonServer(repository) as server:
        assert server.ports.http != taken
        np.testing.assert_array_equal(_double(server), [[2, 4, 6]])
    assert handed_out[0] == taken and len(handed_out) == 6  # two rounds of three ports
