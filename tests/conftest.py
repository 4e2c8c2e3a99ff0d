"""Shared pytest fixtures, and the tiers of the suite (see ``markers`` in pyproject.toml).

``make test`` runs every test with pytest-xdist, a test file per worker at a time
(``--dist loadfile``: a module's server fixtures start once, on its worker). ``make test-fast``
runs the fast tier, ``-m "not server and not slow"``, with ``MODEL_TRITON_TEST_TIER=fast``: a
test that starts a server there fails, naming the marker it lacks.

Session fixtures are read-only and built once per run (:func:`built_once`): under xdist the
workers share one copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The local Kubernetes control plane (tests/kube): `kube`, `kubelet`, `sandbox`.
from tests.kube import fixtures as kube_fixtures
from tests.kube.fixtures import kube, kubelet, sandbox  # noqa: F401
from tests.tiers import FAST_TIER

#: Fixtures of the fault-injection sweep (its templates, the GCS emulator it fetches from).
pytest_plugins = ["tests.fault_sweep"]


#: The test files that take longest under ``make test``, longest first (the sum of their tests'
#: durations, from ``--durations``). xdist hands files to workers in collection order
#: (``--no-loadscope-reorder`` in the Makefile; its default orders by the number of tests,
#: which sends the few long sweeps last), so no long file starts near the end and keeps one
#: worker busy alone while the others wait. A file not listed keeps its place after these.
LONGEST_FIRST = (
    "test_planted_names",
    "test_chart_cluster",
    "test_readme",
    "test_chart_scheduling",
    "test_kill_removal",
    "test_bench_serving",
    "test_kill_points",
    "test_fault_injection",
    "test_chart_policy",
    "test_streaming",
    "test_chart_values",
    "test_fault_injection_remote",
    "test_completions_service",
    "test_chart_key",
    "test_chart",
    "test_chart_operations",
    "test_supervise",
    "test_chart_openai",
    "test_chart_security",
    "test_serving",
    "test_serving_process",
    "test_sources_gcs",
    "test_chart_lifecycle",
    "test_prune",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


#: Seconds a stopping test server may take before the harness looks at what it waits for.
STOP_LOOK_S = 8.0


@pytest.fixture(scope="session", autouse=True)
def _triton_stops_without_waiting_out_its_exit_timeout() -> Iterator[None]:
    """A test that leaves a client's HTTP connection open makes Triton wait its whole
    ``--exit-timeout-secs`` (40 s with the chart's values) at every stop: the stop that found
    one fails, naming the server, so the test closes its clients instead.

    A model that does not unload is reported as a warning, and the test does not wait for the
    server's exit: the local Triton (24.10) now and then keeps a model referenced after a
    cancelled gRPC stream (a test that leaves a stream on purpose) and then waits its whole
    exit timeout for it. The harness sends SIGTERM as a pod's kubelet does and lets Triton
    exit by itself, as it would in a pod; only the test goes on meanwhile (a thread finishes
    the stop, and the session waits for every such thread before it ends)."""
    import signal
    import subprocess
    import threading
    import warnings

    from loader.serving import TritonServer, waiting_for

    stop, cleanup = TritonServer.stop, TritonServer.cleanup
    finishing: list[threading.Thread] = []
    detached: set[int] = set()

    def report(self: TritonServer, found: str) -> None:
        message = (
            f"tritonserver for {self.repository} waits out its exit timeout "
            f"({self.exit_timeout_secs} s; it found {found})"
        )
        if "HTTP service connection" in found:
            pytest.fail(f"{message}: close every HTTP client before the server stops", False)
        # The server's warnings and errors say what the model was still doing.
        said = [line for line in self.log_text().splitlines() if line[:1] in "WE"]
        warnings.warn(message + "".join(f"\n  {line}" for line in said[-12:]), stacklevel=3)

    def checked(self: TritonServer) -> None:
        if id(self) in detached:
            return  # a thread finishes this stop
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_LOOK_S)
            except subprocess.TimeoutExpired:
                found = waiting_for(self.log_text())
                if "never unloaded" in found and "HTTP service connection" not in found:
                    self.exit_waited_for = found

                    def finish() -> None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            process.wait(timeout=self.exit_timeout_secs + 10)
                        stop(self)
                        cleanup(self)
                        detached.discard(id(self))

                    detached.add(id(self))
                    thread = threading.Thread(target=finish, name="triton-stop", daemon=True)
                    finishing.append(thread)
                    thread.start()
                    report(self, found)
                    return
        stop(self)
        if not self.exit_timed_out:
            return
        self.exit_timed_out = False
        report(self, self.exit_waited_for)

    def deferred_cleanup(self: TritonServer) -> None:
        if id(self) not in detached:  # else the thread finishing the stop cleans up
            cleanup(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonServer, "stop", checked)
        mp.setattr(TritonServer, "cleanup", deferred_cleanup)
        yield
    for thread in finishing:
        thread.join()


#: Text the tiny test tokenizers are trained on.
TOKENIZER_CORPUS = [
    "def is_even(n: int) -> bool:\n    return n % 2 == 0\n",
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i)\n",
    "<python>def is_even(na: int) ->",
]


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """``build(directory)``'s result (``directory`` is new and empty), built once per test
    run: the first worker to ask builds it under a lock, the others wait and reuse it (tests
    must not modify it)."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, shared by its workers
    folder = base / "built-once"
    folder.mkdir(exist_ok=True)
    result = folder / f"{name}.path"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.is_file():
            target = folder / name
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            result.write_text(str(build(target)))
    return Path(result.read_text())


@pytest.fixture(scope="session")
def tiny_checkpoint_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-J checkpoint (fp32 safetensors, vocab 320, context
    :data:`tests.tinymodels.SERVING_CONTEXT`) with a trained tokenizer.

    Session-scoped and shared: tests must not modify it.
    """

    def build(path: Path) -> Path:
        from loader.demo.tokenizer import train_tokenizer
        from tests.tinymodels import SERVING_CONTEXT, make_tiny_checkpoint

        # A context long enough for the serving tests' long generations (GPT-J's rotary
        # positions have no table: the weights are those of any n_positions).
        make_tiny_checkpoint(path, arch="gptj", n_positions=SERVING_CONTEXT)
        train_tokenizer(TOKENIZER_CORPUS, 320, path)
        return path

    return built_once(tmp_path_factory, "tiny-gptj", build)


@pytest.fixture
def source(tiny_checkpoint_with_tokenizer: Path, tmp_path: Path) -> Path:
    """A copy of :func:`tiny_checkpoint_with_tokenizer` of the test's own, to change or break
    (a module that means another source defines its own ``source``)."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_with_tokenizer, path)
    return path


@pytest.fixture(scope="session")
def published_tiny_python_repository(
    tiny_checkpoint_with_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny checkpoint published by ``model-loader run --backend python`` (model ``codegen``,
    T=1, P=1, I=1, dynamic batching off); the path Triton serves.

    Session-scoped and shared: tests must not modify it (serve it, or make variants of it).
    """

    def build(path: Path) -> Path:
        from loader.parallel import Parallelism
        from loader.repository.key import ServingSettings
        from loader.run import RunRequest, run

        request = RunRequest(
            source=str(tiny_checkpoint_with_tokenizer),
            repository=path / "models",
            model_name="codegen",
            parallelism=Parallelism(tp=1, pp=1, instance_count=1),
            settings=ServingSettings(backend="python", dynamic_batching=False),
        )
        return run(request).path

    return built_once(tmp_path_factory, "published", build)


@pytest.fixture(scope="session")
def tiny_sharded_bin_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-J checkpoint as sharded ``pytorch_model-*.bin`` files plus the index.

    Session-scoped and shared: tests must not modify it.
    """
    from tests.tinymodels import make_tiny_checkpoint

    return built_once(
        tmp_path_factory,
        "tiny-bin",
        lambda path: make_tiny_checkpoint(path, fmt="bin", sharded=True),
    )


@pytest.fixture(scope="session")
def sharded_fp16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny fp16 CodeGen checkpoint in about 12 safetensors shards, with its tokenizer (the
    overlapped-conversion tests). Session-scoped and shared: tests must not modify it."""
    from tests.tinymodels import make_sharded_fp16_checkpoint

    return built_once(tmp_path_factory, "sharded-fp16", make_sharded_fp16_checkpoint)


@pytest.fixture(scope="session", autouse=True)
def _no_server_in_the_fast_tier() -> Iterator[None]:
    """In the fast tier, starting a server fails the test, naming the marker it lacks."""
    if not FAST_TIER:
        yield
        return
    from loader.serving import TritonServer
    from tests.servers import GcsServer, OlahServer

    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail(
            "this test starts a server, which the fast tier runs none of: mark its module "
            "`pytestmark = pytest.mark.server` (see markers in pyproject.toml)"
        )

    with pytest.MonkeyPatch.context() as patch:
        for owner, name in (
            (TritonServer, "start"),
            (GcsServer, "_launch"),
            (OlahServer, "_launch"),
            (kube_fixtures, "attach"),  # the local Kubernetes control plane
        ):
            patch.setattr(owner, name, refuse)
        yield
