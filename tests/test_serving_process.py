"""loader.serving: the tritonserver process itself (environment, ports, start failures).

Uses a one-model repository (a Python-backend model that doubles its input) so the real server
starts in a few seconds.
"""

from __future__ import annotations

import contextlib
import errno
import os
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
    os.mkfifo(tmp_path / "fifo")  # named for what it is (it was said not to exist)
    with pytest.raises(RepositoryError, match="is a FIFO, not a directory"):
        TritonServer(tmp_path / "fifo").start()


def test_a_port_given_explicitly_and_taken_is_refused_before_starting(repository, listening_socket):
    port = listening_socket.getsockname()[1]
    with pytest.raises(ServerStartError, match=rf"port {port} on 127.0.0.1 \(--http-port\)"):
        TritonServer(repository, http_port=port).start()


def test_a_free_port_taken_before_the_server_binds_it_is_replaced(
    repository, listening_socket, monkeypatch
):
    taken = listening_socket.getsockname()[1]
    real_free_ports = serving.free_ports
    rounds: list[list[int]] = []

    def first_taken(count: int, host: str = "127.0.0.1", *, avoid=()) -> list[int]:
        ports = real_free_ports(count, host, avoid=(*avoid, taken))
        if not rounds:
            ports[0] = taken
        rounds.append(ports)
        return ports

    monkeypatch.setattr(serving, "free_ports", first_taken)
    with TritonServer(repository) as server:
        assert server.ports.http != taken
        np.testing.assert_array_equal(_double(server), [[2, 4, 6]])
    assert [len(r) for r in rounds] == [3, 3] and rounds[0][0] == taken  # two rounds of three


def test_the_free_ports_of_one_server_are_different_and_avoid_the_given_ones():
    """Chosen one bound socket at a time, the OS may hand one port out twice, and Triton given
    one port for two endpoints stops at once with its usage."""
    for _ in range(50):
        first = serving.free_port()
        ports = serving.free_ports(3, avoid=[first])
        assert len(set(ports)) == 3 and first not in ports


def test_a_second_server_on_busy_ports_fails_at_once_naming_the_port(repository, tmp_path):
    """`scripts/serve-local` twice with the same ports: the second one never says "serving"."""
    import os
    import subprocess

    with TritonServer(repository) as first:
        script = Path(__file__).parents[1] / "scripts" / "serve-local"
        proc = subprocess.run(
            [str(script), str(repository), "--http-port", str(first.ports.http)],
            capture_output=True, text=True, timeout=120, env={**os.environ},
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "serving" not in proc.stdout
        first_line = proc.stderr.strip().splitlines()[0]
        assert first_line.startswith(f"error: port {first.ports.http} on 127.0.0.1")
        assert "already in use" in first_line and "CUDA" not in proc.stderr
        np.testing.assert_array_equal(_double(first), [[2, 4, 6]])  # the first one still serves


def test_readiness_is_the_servers_own_not_another_process_on_its_port(repository, monkeypatch):
    """The race the port check cannot close: the port is taken between the check and the
    start, by a server that answers the health check. The new one is not taken for ready."""
    with TritonServer(repository) as first:
        assert serving.listens_on(first.process.pid, first.ports.http) is True
        assert serving.listens_on(os.getpid(), first.ports.http) is False
        monkeypatch.setattr(TritonServer, "_check_given_ports", lambda self: None)
        second = TritonServer(repository, http_port=first.ports.http)
        with pytest.raises(ServerStartError) as info:
            second.start()
        assert info.value.message.splitlines()[0] == (
            "tritonserver exited with code 1 before it was ready: failed to start HTTP service: "
            f"Unavailable - Socket '127.0.0.1:{first.ports.http}' already in use"
        )
        assert "Another server listens on that port" in info.value.remediation


def test_the_cause_in_a_triton_log_comes_before_the_cuda_noise():
    text = (
        'W1130 21:22:06.1 11 pinned_memory_manager.cc:273] "Unable to allocate pinned system '
        'memory, pinned memory pool will not be available: CUDA driver version is insufficient"\n'
        "E1130 21:22:06.2 11 model_lifecycle.cc:641] \"failed to load 'codegen' version 1: "
        "Invalid argument: unexpected inference input 'x'\"\n"
        'I1130 21:22:06.3 11 server.cc:307] "Waiting for in-flight requests to complete."\n'
    )
    assert serving.log_cause(text) == (
        "failed to load 'codegen' version 1: Invalid argument: unexpected inference input 'x'"
    )
    assert serving.log_cause("I1130 1 2 x.cc:1] all good\n") is None


def test_an_exit_timeout_names_what_it_waited_for_and_the_models_never_unloaded():
    """The lines Triton 23.05 logs on SIGTERM (``src/main.cc``, ``server.cc``,
    ``model_lifecycle.cc``), one model still answering a request when the timeout ran out."""
    lines = [
        "I1202 1 2 model_lifecycle.cc:693] \"successfully loaded 'postprocessing' version 1\"",
        "I1202 1 2 model_lifecycle.cc:693] \"successfully loaded 'codegen' version 1\"",
        'I1202 1 2 server.cc:345] "Timeout 40: Found 2 live models and 0 in-flight '
        'non-inference requests"',
        "I1202 1 2 model_lifecycle.cc:624] \"successfully unloaded 'postprocessing' version 1\"",
        'I1202 1 2 server.cc:345] "Timeout 1: Found 1 live models and 0 in-flight '
        'non-inference requests"',
        'E1202 1 2 main.cc:277] "Exit timeout expired. Exiting immediately."',
    ]
    assert serving.exit_wait("\n".join(lines)) == (
        "1 live models and 0 in-flight non-inference requests; "
        "2 live models and 0 in-flight non-inference requests; never unloaded: codegen"
    )
    assert serving.exit_wait("\n".join(lines[:-1])) is None  # it stopped in time


def test_the_loaders_root_and_a_gpu_only_repository_are_refused_with_what_to_serve(
    repository, tmp_path
):
    import shutil

    root = tmp_path / "models"
    key = root / "codegen@v1" / "tp1-pp1-i1-0123abcd"
    shutil.copytree(repository, key)
    (key / ".ready").write_text("")
    with pytest.raises(RepositoryError, match="repository ROOT") as info:
        TritonServer(root).start()
    assert str(key) in info.value.remediation
    config = key / "double" / "config.pbtxt"
    config.write_text(
        config.read_text().replace('backend: "python"', 'backend: "fastertransformer"')
    )
    with pytest.raises(RepositoryError, match="needs NVIDIA GPUs") as info:
        TritonServer(key).start()
    assert "--backend python" in info.value.remediation
    with pytest.raises(RepositoryError, match="holds no model"):
        TritonServer(tmp_path / "models" / "codegen@v1").start()


@pytest.mark.parametrize("keep", [False, True])
def test_serve_local_says_whether_its_log_outlives_it(repository, tmp_path, keep):
    """The log path serve-local prints is either kept (--log-file) or said to go with it."""
    import signal
    import subprocess

    script = Path(__file__).parents[1] / "scripts" / "serve-local"
    log_file = tmp_path / "logs" / "triton.log"
    if keep:
        log_file.parent.mkdir()
    proc = subprocess.Popen(
        [str(script), str(repository), *(["--log-file", str(log_file)] if keep else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # a hang dumps where it hangs (below)
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("serving"):
                break
        (shown,) = [line for line in lines if line.startswith("log ")]
    finally:
        proc.send_signal(signal.SIGTERM)
        # TritonServer.stop's own bound: the chart's --exit-timeout-secs (40) and 10 s, then
        # SIGKILL of the group and 10 s more; 60 s was that bound itself (a busy run hit it).
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            servers = _children(proc)
            proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack
            _, err = proc.communicate(timeout=30)
            _kill_with_its_server(proc, servers)
            pytest.fail(f"serve-local did not stop within 120 s of SIGTERM; its stacks:\n{err}")
    path = Path(shown.split()[1])
    if keep:
        assert path == log_file and shown == f"log     {log_file}"
        assert log_file.is_file() and log_file.read_text()  # kept, with Triton's lines
    else:
        assert shown.endswith("(removed when this stops; --log-file PATH keeps it)")
        assert not path.exists()


def _children(proc) -> list[int]:
    """The processes ``proc`` started (its tritonserver), while it lives."""
    try:
        return [
            int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        ]
    except OSError:
        return []


def _kill_with_its_server(proc, servers: list[int] | None = None) -> None:
    """SIGKILL a serve that did not stop, and the tritonserver it started (``servers``, else
    its children now), which runs in a session of its own: serve stops it, a killed serve only
    has it sent SIGTERM, which it may take its time over; no server outlives the test."""
    import signal

    if servers is None:
        servers = _children(proc) if proc.poll() is None else []
    for server in servers:
        with contextlib.suppress(OSError):
            os.killpg(server, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


#: tgkill(2)'s number: the one call that sends a signal to one thread of another process.
_TGKILL = {"x86_64": 234, "aarch64": 131}


def test_serve_stops_when_sigterm_reaches_a_thread_other_than_the_main_one(repository):
    """The kernel hands a process's SIGTERM to any thread that does not block it (gRPC's threads
    do not); a main thread blocked in one ``waitpid`` then never ran its handler and serve
    hung until SIGKILL. The signal here goes to a thread that is not the main one on purpose."""
    import ctypes
    import signal
    import subprocess

    from tests import procs

    number = _TGKILL.get(os.uname().machine)
    if number is None:
        pytest.skip(f"tgkill's number on {os.uname().machine} is not known here")
    proc = subprocess.Popen(
        [sys.executable, "-m", "loader", "serve", str(repository)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("serving"):
                break
        # One that takes it: those a library started while it loaded hold stop signals back.
        masks = procs.signal_masks(proc.pid)
        others = [
            tid
            for tid, mask in masks.items()
            if tid != proc.pid and not mask & (1 << (signal.SIGTERM - 1))
        ]
        threads = [tid for tid in masks if tid != proc.pid]
        assert threads, "serve runs threads besides its main one (gRPC's)"
        libc = ctypes.CDLL(None, use_errno=True)
        for tid in others:  # a thread may end between the listing and the signal (ESRCH)
            if libc.syscall(number, proc.pid, tid, int(signal.SIGTERM)) == 0:
                break
            assert ctypes.get_errno() == errno.ESRCH, os.strerror(ctypes.get_errno())
        else:
            # Every other thread was started while stop signals were held back (which of them
            # is a matter of timing): the kernel can hand the process's SIGTERM only to the main
            # thread, which is what the hold is for; the process-directed signal must stop it.
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)  # stop's own bound: --exit-timeout-secs and 10 s, then more
    finally:
        _kill_with_its_server(proc)
    assert code == 143, proc.stderr.read()


def test_a_hang_up_stops_serve_and_its_server(repository):
    """The terminal ``serve`` ran in closed (SIGHUP): serve died of it at once, and its
    tritonserver, which leads a session of its own (so a terminal's signals never reach it
    directly), went on serving its ports and holding its memory, with no one to stop it. Now
    serve stops like on SIGTERM, tritonserver with it, and exits 129."""
    import signal

    code, left, err, _ = _serve_signalled(repository, signal.SIGHUP)
    assert code == 129, err
    assert not left, f"tritonserver was left running\n{err[-2000:]}"
    assert err.rstrip().splitlines()[-1] == "hung up (SIGHUP: its terminal closed); stopped cleanly"


def _serve_signalled(repository: Path, sig: int) -> tuple[int, bool, str, Path | None]:
    """``serve repository`` started as a shell starts it, sent ``sig`` once it serves: its exit
    status, whether its tritonserver still runs, its standard error, and its log's path."""
    import subprocess

    from tests import procs
    from tests.stalled import as_a_shell_starts

    proc = subprocess.Popen(
        as_a_shell_starts([sys.executable, "-m", "loader", "serve", str(repository)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    server, log = None, None
    try:
        for line in proc.stdout:
            if line.startswith("log "):
                log = Path(line.split()[1])
            if line.startswith("serving"):
                break
        (server,) = procs.children(proc.pid)  # tritonserver
        proc.send_signal(sig)
        code = proc.wait(timeout=90)  # stop's own bound: --exit-timeout-secs and 10 s, then more
        left = procs.running(server)  # stopped (killed at worst), whether reaped or not
    finally:
        _kill_with_its_server(proc, [] if server is None else [server])
    return code, left, proc.stderr.read(), log


def test_a_serve_killed_outright_takes_its_server_with_it(repository):
    """``kill -9`` of ``serve`` (or the OOM killer): its tritonserver, which leads a session of
    its own, went on serving its ports and holding its memory with no one to stop it. Now the
    kernel sends it SIGTERM as serve ends (``PR_SET_PDEATHSIG``), and it stops."""
    import signal
    import subprocess
    import time

    from tests import procs
    from tests.stalled import as_a_shell_starts

    proc = subprocess.Popen(
        as_a_shell_starts([sys.executable, "-m", "loader", "serve", str(repository)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    server = None
    try:
        for line in proc.stdout:
            if line.startswith("serving"):
                break
        (server,) = procs.children(proc.pid)  # tritonserver
        # started through a Python that asked for the signal: with a pod's dispositions still
        # (Python ignores SIGXFSZ as it starts, and an ignored signal outlives exec; SIGPIPE
        # tritonserver ignores itself)
        with open(f"/proc/{server}/status") as fh:
            ignored = int(next(x for x in fh if x.startswith("SigIgn:")).split()[1], 16)
        assert not ignored & (1 << (signal.SIGXFSZ - 1)), "tritonserver starts ignoring SIGXFSZ"
        proc.kill()
        proc.wait()
        # its own stop's bound: the chart's --exit-timeout-secs (40), and more on a busy machine
        deadline = time.monotonic() + 90
        while procs.running(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not procs.running(server), "tritonserver was left running"
    finally:
        _kill_with_its_server(proc, [] if server is None else [server])


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGALRM", "SIGQUIT", "SIGSTKFLT"])
def test_a_signal_serve_gives_no_meaning_stops_its_server_first(repository, name):
    """``kill -USR1`` (or SIGALRM, or Ctrl-\\) of ``serve`` killed it at once, and its
    tritonserver, in a session of its own, went on serving its ports with its temporary
    directory left. Now serve stops it and removes that directory, then dies of the signal.
    So for SIGSTKFLT, which the supervisor of run and convert passes on as such a signal and
    which still killed serve at once."""
    import signal

    sig = getattr(signal, name)
    code, left, err, log = _serve_signalled(repository, sig)
    assert code == -sig, err
    assert not left, f"tritonserver was left running\n{err[-2000:]}"
    assert log is not None and not log.parent.exists(), "its temporary directory was left"
    assert err.rstrip().splitlines()[-1] == f"stopped by {name}; cleaned up"


def test_an_abort_under_load_names_its_cause_and_what_to_check(tmp_path):
    """The bench's local Triton can abort under load when the Python backend's shared-memory
    lock fails (libstdc++'s words for an uncaught exception): the error names it and the hint
    says what to check, instead of only "cannot reach Triton"."""
    log = tmp_path / "tritonserver.log"
    log.write_text(
        'I1201 19:22:06.1 11 grpc_server.cc:2495] "Started GRPCInferenceService at 127.0.0.1"\n'
        "terminate called after throwing an instance of 'boost::interprocess::lock_exception'\n"
        "  what():  boost::interprocess::lock_exception\n"
    )
    server = TritonServer(tmp_path, log_path=log)
    failure = server.failure("the local tritonserver exited during the measurement (code 134)")
    first = failure.message.splitlines()[0]
    assert first.endswith(
        "(code 134): terminate called after throwing an instance of "
        "'boost::interprocess::lock_exception'"
    )
    assert "/dev/shm" in failure.remediation and "memory" in failure.remediation
