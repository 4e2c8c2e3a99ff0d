"""Run the real ``tritonserver`` bundled in the ``nvidia-pytriton`` wheel, on the CPU.

:class:`TritonServer` runs exactly the Triton arguments the chart renders (``helm template`` of
the checkout's chart with ``values/local.yaml`` unless others are given, :func:`rendered_pod_args`), and
adds only what a pod gets from Kubernetes and the image (:meth:`TritonServer.command`): the
model repository, the ports (a pod has its own network namespace; here free ports are mapped),
the addresses (the pod's every address, ``0.0.0.0``, is played by ``host``; its loopback stays
127.0.0.1) and the backend directory (the image's default path). An address the chart leaves
to Triton's default stays Triton's default: 23.05 binds metrics to the HTTP address when
``--metrics-address`` is absent (``src/command_line_parser.cc``, r23.05), and so does the
local server.

It is a context manager: it picks free ports (unless given),
builds a backend directory for the Python backend, starts the server in its own process
group with an environment that makes the Python-backend stub work with this interpreter,
waits with a deadline until its gRPC health service reports SERVING (what Kubernetes' probes
ask) and, unless HTTP is off, ``/v2/health/ready`` answers on the HTTP address, and on exit
stops the server (SIGTERM, a short ``--exit-timeout-secs``, then SIGKILL of the whole group),
so no process is left behind.

Before starting, the repository is checked (a loader's ROOT or a GPU-only FasterTransformer
repository is refused with what to serve instead) and so are explicitly given ports (one in
use is refused at once). The server is ready when its own process listens on the HTTP port
(the gRPC port when HTTP is off) and the checks above pass: a health check answered by
another server on the same port never counts. If the server does not become ready, the error starts with the cause found in
its log (a port in use, a model that failed to load), followed by the log's tail.

Environment facts this module encodes (``docs/local-triton.md``):

- the stub embeds libpython: the interpreter's ``LIBDIR`` goes first in ``LD_LIBRARY_PATH``,
  followed by the wheel's ``nvidia_pytriton.libs``;
- the stub runs the first ``python3`` on ``PATH``: this interpreter's ``bin`` goes first;
- after SIGTERM the server waits ``--exit-timeout-secs`` for models to unload.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from loader import fs
from loader.errors import RepositoryError, ServerStartError, SpecialFileError, ToolMissingError

log = logging.getLogger(__name__)

#: Lines of the server log quoted in a start failure: enough for the load failure of a model
#: above the model table and the unloading of the five models a repository holds.
LOG_TAIL_LINES = 80
#: Starts tried when a chosen free port is taken by someone else before the server binds it.
PORT_ATTEMPTS = 3
#: What Triton logs when it cannot bind a port.
PORT_IN_USE = "already in use"
#: How long :meth:`TritonServer.wait_exit` blocks at a time (a stop signal's longest delay).
EXIT_POLL_S = 0.2
#: What Triton logs when SIGTERM's wait for open connections and requests ran out
#: (``src/main.cc``); it then exits 1.
EXIT_TIMEOUT_EXPIRED = "Exit timeout expired"
#: What it counts down for, one line a second (``Timeout 12: Found 1 HTTP service connections``).
_WAITED_FOR = re.compile(r"Timeout \d+: Found (\d+ [^\n\"]+)")
#: A model's load and unload as Triton logs them (``model_lifecycle.cc``).
_LOADED = re.compile(r"successfully loaded '([^']+)'")
_UNLOADED = re.compile(r"successfully unloaded '([^']+)'")
#: Triton's log lines that name why it stopped, most telling first.
_CAUSES = (
    re.compile(r"failed to start .*already in use.*|Socket .* already in use.*"),
    re.compile(r"failed to load '.*"),  # the model's own reason, before "failed to load all"
    re.compile(r"failed to load .*|Invalid argument.*|Internal: .*"),
    re.compile(r"^error: .*|.*\bfailed\b.*", re.IGNORECASE),
    # An abort: the C++ runtime's last words (e.g. the Python backend's shared-memory lock).
    re.compile(r"^terminate called after throwing .*"),
)
#: A Triton log line's prefix (severity, date, time, thread, file:line]).
_LOG_PREFIX = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ")


def log_cause(text: str) -> str | None:
    """The line of a Triton log that says why the server stopped (without its prefix), else
    ``None``. Triton logs harmless CUDA errors first on a machine without GPUs: skipped."""
    bodies = [
        _LOG_PREFIX.sub("", line.strip()).strip('"').strip()
        for line in text.splitlines()
        if line.strip() and "CUDA" not in line
    ]
    for pattern in _CAUSES:
        found = next((b for b in reversed(bodies) if pattern.search(b)), None)
        if found:
            return found
    return None


def _open_log(path: Path) -> BinaryIO:
    """``path`` opened to write Triton's log: a FIFO without a reader is refused at once
    (``ENXIO``, its typed error), never waited on forever; a device such as /dev/null is
    written as asked."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    os.set_blocking(fd, True)  # Triton's writes wait for a slow reader, as on any pipe
    return os.fdopen(fd, "wb")


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` (a bind with SO_REUSEADDR fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` itself holds the socket listening on TCP ``port`` (Linux's
    ``/proc``); ``None`` where ``/proc`` cannot tell."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the inode.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None if not Path("/proc/net/tcp").exists() else False
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(fd) in inodes:
                return True
    return False


def link_tree(source: Path, dest: Path) -> Path:
    """``dest``: the directories of ``source`` made anew, each file a symbolic link to its
    original; ``__pycache__`` directories left out. What the server writes beside a model (the
    Python backend's stub compiles ``model.py`` and the modules it imports into ``__pycache__``,
    whatever ``PYTHONDONTWRITEBYTECODE`` says) lands in ``dest``, never in ``source``: a
    published key must hold exactly what its manifest lists, or the next ``model-loader run``
    publishes it again. Links are made to the path as found (not resolved), so a model that
    finds its files beside its ``__file__`` finds the view's."""
    dest.mkdir()
    todo = [(Path(source), dest, 0)]  # one directory at a time: no recursion however deep
    while todo:
        top, here, depth = todo.pop()
        with os.scandir(top) as scan:
            entries = sorted(scan, key=lambda e: e.name)
        for entry in entries:
            found = Path(top) / entry.name
            if not entry.is_dir(follow_symlinks=False):  # a file, or a link: linked whole
                (here / entry.name).symlink_to(found)
                continue
            if entry.name == "__pycache__":
                continue
            if depth + 1 >= fs.MAX_TREE_DEPTH:
                raise RepositoryError(
                    f"{found} is a directory nested {depth + 1} levels deep in the model "
                    f"repository; no model repository nests directories over "
                    f"{fs.MAX_TREE_DEPTH} levels deep.",
                    "Serve the repository the loader published (the path its last line "
                    "printed), or remove the deeply nested directories from it.",
                )
            (here / entry.name).mkdir()
            todo.append((found, here / entry.name, depth + 1))
    return dest


def check_repository(repository: Path) -> None:
    """Refuse what the local CPU Triton cannot serve, saying what to serve instead: a missing
    directory, a loader's ROOT (the published keys live below it), a repository without
    models, and one whose models need FasterTransformer's GPU backend."""
    if not repository.is_dir():
        raise RepositoryError(
            f"model repository {repository} {fs.not_a_directory(Path(repository))}",
            "Pass the directory `model-loader run` printed as its last line.",
        )
    configs = sorted(repository.glob("*/config.pbtxt"))
    if not configs:
        keys = sorted(p.parent for p in repository.glob("*@*/*/.ready"))
        if keys:
            shown = "\n".join(f"  {k}" for k in keys[:5])
            raise RepositoryError(
                f"{repository} is the loader's repository ROOT, not one model repository; "
                f"the published ones below it are:\n{shown}",
                f"Serve one of them: scripts/serve-local {keys[-1]}",
            )
        raise RepositoryError(
            f"{repository} holds no model (no <model>/config.pbtxt below it)",
            "Pass the directory `model-loader run` printed as its last line.",
        )
    gpu_only = [
        c.parent.name
        for c in configs
        if re.search(r'^\s*backend:\s*"fastertransformer"', c.read_text(errors="replace"), re.M)
    ]
    if gpu_only:
        raise RepositoryError(
            f"{repository}: the model {gpu_only[0]!r} runs on FasterTransformer's backend, which "
            "needs NVIDIA GPUs; the local CPU Triton has only the Python backend",
            "Publish a CPU copy of the same checkpoint with `model-loader run ... --backend "
            "python` (it prints the directory to serve), or serve this one on a GPU cluster "
            "(helm upgrade --install ...).",
        )


@dataclass(frozen=True)
class TritonInstall:
    """Where the wheel keeps the server binary, the Python backend and its stubs."""

    binary: Path
    python_backend: Path
    stub: Path
    libs: Path


def find_triton(*, python_version: str | None = None) -> TritonInstall:
    """Locate the ``tritonserver`` of the installed ``nvidia-pytriton`` wheel."""
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    try:
        import pytriton
    except ImportError as exc:
        raise ToolMissingError(
            "the nvidia-pytriton package (tritonserver) is not installed"
        ) from exc
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    install = TritonInstall(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=root.parent.parent / "nvidia_pytriton.libs",
    )
    for path in (install.binary, install.python_backend, install.stub):
        if not path.exists():
            raise ToolMissingError(f"tritonserver file not found: {path}")
    return install


def build_backend_dir(install: TritonInstall, dest: Path) -> Path:
    """Create ``dest/python/`` holding the Python backend and the stub for this interpreter."""
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for source in (*sorted(install.python_backend.glob("*.*")), install.stub):
        if source.is_file():
            target = python_dir / source.name
            if not target.exists():
                shutil.copy2(source, target)
    return dest


def server_environment(
    install: TritonInstall, *, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment the server and its Python-backend stubs need. The stubs write no
    bytecode beside a repository's ``model.py`` (``PYTHONDONTWRITEBYTECODE``): a published
    repository holds exactly what its manifest lists, and a ``__pycache__`` in it would count
    as damage (:mod:`loader.repository.manifest`)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    lib_paths = [p for p in (libdir, str(install.libs), env.get("LD_LIBRARY_PATH", "")) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_paths)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
    env.pop("PYTHONHOME", None)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` right now."""
    (port,) = free_ports(1, host)
    return port


def free_ports(count: int, host: str = "127.0.0.1", *, avoid: Collection[int] = ()) -> list[int]:
    """``count`` different TCP ports the OS reports free on ``host`` right now, none of
    ``avoid``: each socket stays bound until all are chosen (one bound and closed at a time,
    the OS may hand the same port out twice, and Triton given one port for two endpoints
    stops at once, printing its usage)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
            if port not in avoid:
                ports.append(port)
        return ports


#: ``grpc.health.v1.HealthCheckResponse.ServingStatus`` values.
HEALTH_UNKNOWN, HEALTH_SERVING, HEALTH_NOT_SERVING = 0, 1, 2
#: The standard gRPC health service's one method, which Kubernetes' gRPC probes call.
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"


def grpc_health(grpc_url: str, *, timeout: float = 2.0) -> int | None:
    """The serving status Triton's ``grpc.health.v1`` service reports, ``None`` if unreachable.

    What a Kubernetes gRPC probe sees: Triton answers SERVING once the server and every model
    are ready (``CommonHandler::RegisterHealthCheck``, ``src/grpc/grpc_server.cc``). The request
    (an empty ``service``) and the response (field 1, ``status``, a varint) are encoded here,
    so no generated stubs are needed. A fresh channel per call: a channel that failed to
    connect would wait out its reconnect backoff.
    """
    import grpc

    with grpc.insecure_channel(grpc_url) as channel:
        check = channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=lambda message: message,
            response_deserializer=lambda data: data,
        )
        try:
            response = check(b"", timeout=timeout)
        except grpc.RpcError:
            return None
    if not response:
        return HEALTH_UNKNOWN
    if response[0] != 0x08 or len(response) < 2:
        raise ValueError(f"not a grpc.health.v1 HealthCheckResponse: {response!r}")
    return response[1]


#: Triton's prefix of the header a restricted gRPC protocol expects
#: (``kRestrictedProtocolHeaderTemplate``, ``src/grpc/grpc_server.h``).
RESTRICTED_HEADER_PREFIX = "triton-grpc-protocol-"
RESTRICTED_FLAG = "--grpc-restricted-protocol"


def restricted_protocols(args: Sequence[str]) -> dict[str, tuple[str, str]]:
    """``protocol -> (header, value)`` from the ``--grpc-restricted-protocol`` arguments in ``args``.

    Parsed as Triton 23.05 parses them (``TritonParser::ParseGrpcRestrictedProtocolOption``,
    ``src/command_line_parser.cc``): the protocols are the comma-separated text before the
    first ``:``, the key runs to the next ``=``, the value is the rest; each part non-empty.
    A protocol in two groups is refused (``grpc::Server`` constructor, ``src/grpc/grpc_server.cc``).
    """
    found: dict[str, tuple[str, str]] = {}
    values = []
    for index, arg in enumerate(args):
        if arg.startswith(RESTRICTED_FLAG + "="):
            values.append(arg[len(RESTRICTED_FLAG) + 1 :])
        elif arg == RESTRICTED_FLAG and index + 1 < len(args):
            values.append(args[index + 1])
    for value in values:
        protocols, colon, rest = value.partition(":")
        key, equals, secret = rest.partition("=")
        if not (colon and equals and protocols and key and secret):
            raise ValueError(f"{RESTRICTED_FLAG}={value}: the format is <protocols>:<key>=<value>")
        for protocol in protocols.split(","):
            if protocol in found:
                raise ValueError(f"{RESTRICTED_FLAG}: protocol {protocol!r} is in two groups")
            found[protocol] = (RESTRICTED_HEADER_PREFIX + key, secret)
    return found


def _last_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag=value`` in ``args``, None if absent."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    return values[-1] if values else None


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int


#: The flag that sets each endpoint's port and address (``src/command_line_parser.cc``).
PORT_FLAGS = {"http": "--http-port", "grpc": "--grpc-port", "metrics": "--metrics-port"}
ADDRESS_FLAGS = {"http": "--http-address", "grpc": "--grpc-address", "metrics": "--metrics-address"}
#: Addresses that mean every address of the pod (Triton's default for HTTP and gRPC).
WILDCARDS = frozenset({"0.0.0.0", "::", "[::]"})
#: The pod's loopback: what `kubectl port-forward` reaches, never the network.
POD_LOOPBACK = "127.0.0.1"


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def rendered_pod_args(
    *, values_files: Sequence[str | os.PathLike[str]] = (), set_values: Sequence[str] = ()
) -> list[str]:
    """The Triton arguments ``helm template`` renders for these values (``values/local.yaml``
    when none are given) with the chart of the checkout this package runs from."""
    from loader import chart

    root = Path(__file__).resolve().parents[1]
    checkout = chart.Chart.in_checkout(root)
    if not (checkout.path / "Chart.yaml").is_file():
        raise ToolMissingError(
            f"the chart is not beside the loader package ({checkout.path}): the local server "
            "runs the Triton arguments the chart renders; run it from a checkout"
        )
    files = list(values_files) or [root / chart.LOCAL_VALUES]
    try:
        return chart.rendered_triton_args(checkout, values_files=files, set_values=set_values)
    except FileNotFoundError as exc:  # helm not installed
        raise ToolMissingError(str(exc)) from exc
    except chart.ChartError as exc:
        raise ServerStartError(
            f"the chart does not render for these values: {exc}",
            "Fix the values helm names (scripts/render_chart.py -f FILE shows the rendering).",
        ) from exc


def exit_wait(log_text: str) -> str | None:
    """What a server whose log is ``log_text`` waited for until its exit timeout ran out (the
    counts it logged each second, and the models it never finished unloading), or None when it
    did not wait that long."""
    if EXIT_TIMEOUT_EXPIRED not in log_text:
        return None
    return waiting_for(log_text)


def waiting_for(log_text: str) -> str:
    """What a stopping server whose log is ``log_text`` waits for so far: the counts it logged
    each second, and the models not unloaded yet."""
    waited = sorted({m[1] for m in _WAITED_FOR.finditer(log_text) if not m[1].startswith("0 ")})
    said = "; ".join(waited) or "what it waited for is in its log"
    live = sorted(set(_LOADED.findall(log_text)) - set(_UNLOADED.findall(log_text)))
    return said + (f"; never unloaded: {', '.join(live)}" if live else "")


#: What tritonserver's process runs before tritonserver itself (the same process, then
#: ``exec``): it asks the kernel for SIGTERM when the thread that started it ends
#: (``PR_SET_PDEATHSIG``; the main thread, so the process), then runs ``sys.argv[2:]``. It
#: leads a session of its own, where a terminal's signals never reach it: a ``serve`` killed
#: by SIGKILL (``kill -9``, the OOM killer) left it serving its ports and holding its memory
#: with no one to stop it. Its starter already gone (``sys.argv[1]``, its pid): it never starts.
#: Python ignores SIGPIPE and SIGXFSZ as it starts, and an ignored signal stays ignored across
#: ``exec``: both are set back to their default first, so tritonserver starts as in a pod.
_STOPPED_WITH_ITS_STARTER = (
    "import ctypes, os, signal, sys\n"
    "for s in (signal.SIGPIPE, signal.SIGXFSZ):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class TritonServer:
    """A ``tritonserver`` process serving ``repository`` with the arguments a pod of the chart
    runs (``pod_args``: :func:`rendered_pod_args` by default), the pod's address played by ``host``;
    use as a context manager."""

    def __init__(
        self,
        repository: str | os.PathLike[str],
        *,
        pod_args: Sequence[str] | None = None,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        host: str = "127.0.0.1",
        startup_timeout: float = 120.0,
        log_verbose: int = 0,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.repository = Path(repository).resolve()
        #: What tritonserver is given: a tree of links to ``repository``'s files in the
        #: server's own work directory (:func:`link_tree`), once started.
        self.served = self.repository
        self.host = host
        self.pod_args: tuple[str, ...] = tuple(
            rendered_pod_args() if pod_args is None else pod_args
        )
        self._requested = Ports(http=http_port or 0, grpc=grpc_port or 0, metrics=metrics_port or 0)
        self.ports = self._pick_ports()
        self.startup_timeout = startup_timeout
        exit_timeout = _last_value(self.pod_args, "--exit-timeout-secs")
        #: Triton's default is 30 s (``src/command_line_parser.cc``).
        self.exit_timeout_secs = int(exit_timeout) if exit_timeout else 30
        #: True once a stop found Triton exiting only because its exit timeout expired.
        self.exit_timed_out = False
        self.exit_waited_for = ""
        self.log_verbose = log_verbose
        self._work_dir: Path | None = None
        self._log_path = Path(log_path) if log_path else None
        self._log_file = None
        self.process: subprocess.Popen[bytes] | None = None

    # -- addresses ------------------------------------------------------------------------

    def _pod_address(self, endpoint: str) -> str | None:
        """The address the pod's Triton binds for ``endpoint`` as the arguments say, None
        when they leave it to Triton's default."""
        return _last_value(self.pod_args, ADDRESS_FLAGS[endpoint])

    def _local_address(self, address: str) -> str:
        """Where a pod address is played on this machine: the pod's every address by ``host``,
        its loopback by 127.0.0.1."""
        if address in WILDCARDS:
            return self.host
        if address == POD_LOOPBACK:
            return POD_LOOPBACK
        raise ServerStartError(
            f"the Triton arguments bind an endpoint to {address}, which the local server cannot "
            "play (only 0.0.0.0, the pod's every address, and 127.0.0.1, its loopback)",
            "Render the chart with values that leave the addresses to the chart.",
        )

    def address(self, endpoint: str) -> str:
        """The local address ``endpoint`` (http, grpc, metrics) listens on. Triton 23.05's
        defaults: 0.0.0.0 for HTTP and gRPC, and for metrics the HTTP address
        (``src/command_line_parser.cc``: "Set metrics_address to default if never specified")."""
        given = self._pod_address(endpoint)
        if given is None:
            return self.address("http") if endpoint == "metrics" else self.host
        return self._local_address(given)

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint (the form tritonclient expects)."""
        return f"{self.address('http')}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.address('grpc')}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.address('metrics')}:{self.ports.metrics}/metrics"

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise RuntimeError("the server has not been started")
        return self._log_path

    # -- lifecycle ------------------------------------------------------------------------

    def command(self, backend_dir: Path) -> list[str]:
        """The pod's arguments, with what a pod gets from Kubernetes and its image mapped onto
        this machine, and nothing else changed:

        - ``--model-repository``: the local repository (the pod's is on its volume);
        - ``--http-port``, ``--grpc-port``, ``--metrics-port``: the local ports, set whether the
          arguments give one or leave Triton's default (a pod has its own network namespace;
          here several servers share the machine);
        - ``--http-address``, ``--grpc-address``, ``--metrics-address``: ``0.0.0.0`` (given, or
          Triton's default for HTTP and gRPC) becomes ``host``, 127.0.0.1 stays; an absent
          ``--metrics-address`` stays absent, so metrics follow the HTTP address as in a pod;
        - ``--backend-directory``: the Python backend built for this interpreter (the image
          keeps its backends at Triton's default path);
        - ``--log-verbose`` only when asked for.
        """
        install = find_triton()
        args = [str(install.binary), f"--backend-directory={backend_dir}"]
        local_ports = {PORT_FLAGS[e]: getattr(self.ports, e) for e in PORT_FLAGS}
        addresses = set(ADDRESS_FLAGS.values())
        for arg in self.pod_args:
            name = _flag_name(arg)
            if name == "--model-repository":
                args.append(f"--model-repository={self.served}")
            elif name in local_ports:
                args.append(f"{name}={local_ports.pop(name)}")
            elif name in addresses and "=" in arg:
                args.append(f"{name}={self._local_address(arg.split('=', 1)[1])}")
            else:
                args.append(arg)
        if "--model-repository" not in map(_flag_name, self.pod_args):
            args.append(f"--model-repository={self.served}")
        args += [f"{flag}={port}" for flag, port in local_ports.items()]
        for endpoint in ("http", "grpc"):
            if self._pod_address(endpoint) is None:
                args.append(f"{ADDRESS_FLAGS[endpoint]}={self.host}")
        if self.log_verbose:
            args.append(f"--log-verbose={self.log_verbose}")
        return args

    def start(self) -> TritonServer:
        if self.process is not None:
            raise RuntimeError("the server is already running")
        check_repository(self.repository)
        self._check_given_ports()
        install = find_triton()
        self._work_dir = Path(tempfile.mkdtemp(prefix="tritonserver-"))
        backend_dir = build_backend_dir(install, self._work_dir / "backends")
        self.served = link_tree(self.repository, self._work_dir / "repository")
        if self._log_path is None:
            self._log_path = self._work_dir / "tritonserver.log"
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._launch(install, backend_dir)
                return self
            except ServerStartError:
                port_taken = PORT_IN_USE in self.log_text()
                self.stop()
                if not port_taken or attempt == PORT_ATTEMPTS or not self._free_choice():
                    self.cleanup()
                    raise
                log.info("a port was taken meanwhile; starting again on other free ports")
                self.ports = self._pick_ports()
            except BaseException:
                self.stop()
                self.cleanup()
                raise
        raise AssertionError("unreachable")

    def _pick_ports(self) -> Ports:
        """The requested ports, and different free ones for the endpoints given none."""
        requested = [self._requested.http, self._requested.grpc, self._requested.metrics]
        free = iter(free_ports(requested.count(0), self.host, avoid=requested))
        http, grpc, metrics = (port or next(free) for port in requested)
        return Ports(http=http, grpc=grpc, metrics=metrics)

    def _check_given_ports(self) -> None:
        """Refuse at once a port given explicitly that something already listens on."""
        given = {"--http-port": self._requested.http, "--grpc-port": self._requested.grpc}
        given["--metrics-port"] = self._requested.metrics
        taken = [
            (flag, port) for flag, port in given.items() if port and port_in_use(self.host, port)
        ]
        if taken:
            flag, port = taken[0]
            raise ServerStartError(
                f"port {port} on {self.host} ({flag}) is already in use: another server (a "
                "second scripts/serve-local?) listens there",
                f"Stop the other server, or pass another {flag} (or none: a free port is "
                f"chosen); `ss -ltnp 'sport = :{port}'` shows who holds it.",
            )

    def _free_choice(self) -> bool:
        """Whether at least one port was chosen here (and may be chosen again)."""
        return 0 in (self._requested.http, self._requested.grpc, self._requested.metrics)

    def _launch(self, install: TritonInstall, backend_dir: Path) -> None:
        self._log_file = _open_log(self._log_path)
        cmd = self.command(backend_dir)
        if threading.current_thread() is threading.main_thread():
            cmd = [sys.executable, "-c", _STOPPED_WITH_ITS_STARTER, str(os.getpid()), *cmd]
        log.info(
            "starting tritonserver on %s (HTTP %s, gRPC %s, metrics %s) for %s",
            self.host,
            self.ports.http,
            self.ports.grpc,
            self.ports.metrics,
            self.repository,
        )
        log.debug("command: %s", " ".join(cmd))
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=server_environment(install),
            start_new_session=True,
        )
        self._wait_ready()

    def _ready(self) -> bool:
        """gRPC health SERVING and, unless HTTP is off, ``/v2/health/ready`` answering 200 on
        the HTTP address: Triton starts its gRPC endpoint before the HTTP one, and a port that
        merely accepts connections may be someone else's."""
        if grpc_health(self.grpc_url) != HEALTH_SERVING:
            return False
        address = self.http_address
        if address is None:
            return True
        url = f"http://{address}:{self.ports.http}/v2/health/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    @property
    def http_address(self) -> str | None:
        """The local address the HTTP endpoint listens on, None when ``--allow-http=false``."""
        allow_http = _last_value(self.pod_args, "--allow-http")
        if allow_http is not None and allow_http.lower() in ("false", "0", "off", "no"):
            return None
        return self.address("http")

    def _holds_its_ports(self) -> bool:
        """Whether the server's own process listens on its gRPC port and (unless HTTP is off)
        its HTTP port; where ``/proc`` cannot tell, the server's ports were checked free
        before it started (:meth:`_check_given_ports`, :func:`free_port`)."""
        assert self.process is not None
        ports = [self.ports.grpc] + ([self.ports.http] if self.http_address is not None else [])
        return all(listens_on(self.process.pid, port) is not False for port in ports)

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise self.failure(f"tritonserver exited with code {code} before it was ready")
            # Ready only when this process holds every port its readiness is read from (gRPC,
            # and HTTP unless it is off): a health check answered by another server on the
            # same port must not count.
            if self._holds_its_ports() and self._ready():
                log.info("tritonserver is ready (pid %s)", self.process.pid)
                return
            time.sleep(0.25)
        raise self.failure(f"tritonserver was not ready within {self.startup_timeout:.0f} s")

    def wait_exit(self) -> int:
        """Wait until tritonserver exits by itself; its exit code. Waits in short steps, never
        in one blocking ``waitpid``: SIGTERM or Ctrl-C may be delivered to any thread of this
        process (gRPC's, a library's), which leaves a blocked main thread blocked and its Python
        handler never run, so a stopped ``serve`` hung until SIGKILL. Between steps the main
        thread runs the handler within :data:`EXIT_POLL_S`."""
        assert self.process is not None
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self.process.wait(timeout=EXIT_POLL_S)

    def failure(self, what: str) -> ServerStartError:
        """A start (or run) failure: the cause from the log first, then the log's tail."""
        text = self.log_text()
        cause = log_cause(text)
        head = f"{what}: {cause}" if cause else what
        if cause and PORT_IN_USE in cause:
            hint = (
                "Another server listens on that port: stop it, or pass other --http-port / "
                "--grpc-port / --metrics-port values (or none: free ones are chosen)."
            )
        elif cause and "failed to load" in cause:
            hint = (
                "The model named in the message did not load; the log says which file or "
                "setting. Republish the repository with `model-loader run --force` if it was "
                "changed by hand."
            )
        elif "boost::interprocess" in text:
            hint = (
                "Triton's Python backend lost the shared-memory link to a model's stub "
                "(boost::interprocess), which happens when /dev/shm fills up or the machine runs "
                "out of memory under load: check `df -h /dev/shm` and free memory, lower the "
                "load (--concurrency-range, instance counts) or stop other work, and run again."
            )
        elif self.process is not None and (self.process.returncode or 0) < 0:
            hint = (
                f"tritonserver was killed by signal {-self.process.returncode}: by you, or by "
                "the kernel's out-of-memory killer (`dmesg | tail`); free memory and run again."
            )
        else:
            hint = None
        return ServerStartError(f"{head}\ntritonserver's log ends with:\n{self.log_tail()}", hint)

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) the server's processes (its Python-backend stubs too) used
        so far, from Linux's ``/proc``; ``None`` where that cannot be read."""
        if self.process is None:
            return None
        group = self.process.pid  # the server leads its own session and process group
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        try:
            entries = list(Path("/proc").iterdir())
        except OSError:
            return None
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            # after "pid (comm)": state ppid pgrp ... utime stime cutime cstime (fields 14-17)
            if int(fields[2]) == group:
                total += sum(int(v) for v in fields[11:15])
        return total / tick

    def log_text(self) -> str:
        """The server's log, the paths of the served view written as the repository's."""
        if self._log_path is None:
            return ""
        try:  # only a regular file: --log-file /dev/zero never ends, a FIFO blocks
            with fs.open_read(self._log_path) as log_file:
                raw = log_file.read()
        except (OSError, SpecialFileError):  # gone, or a device the user chose: it tells nothing
            return ""
        text = raw.decode("utf-8", errors="replace")
        if self.served != self.repository:
            text = text.replace(str(self.served), str(self.repository))
        return text

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the server and every process of its group; safe to call twice."""
        process, self.process = self.process, None
        if process is not None:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=self.exit_timeout_secs + 10)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "tritonserver (pid %s) did not stop in time; killing it", process.pid
                    )
            # Python-backend stubs live in the server's process group; leave none behind.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            log.info("tritonserver stopped (exit code %s)", process.returncode)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        text = self.log_text() if process is not None else ""
        waited_for = exit_wait(text)
        if waited_for is not None:
            self.exit_timed_out = True
            self.exit_waited_for = waited_for
            log.warning(
                "tritonserver waited its whole --exit-timeout-secs=%s before exiting (it found %s): "
                "a client kept an HTTP connection or a request open (on SIGTERM Triton waits for "
                "both); close clients before stopping the server",
                self.exit_timeout_secs,
                self.exit_waited_for,
            )

    def cleanup(self) -> None:
        """Remove the temporary backend directory (the log too, unless a path was given)."""
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self.cleanup()
