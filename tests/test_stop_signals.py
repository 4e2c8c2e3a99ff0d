"""A signal that stops a command, whichever thread the kernel hands it to and whatever became of
standard error: the command unwinds (its lock released, its own files removed) and ends with
its code (143 SIGTERM, 129 SIGHUP), never a hang, exit 1 or a process left serving; and a
number is read only as ASCII digits.

The commands run as the installed command does, in processes of their own, started with the
signals a shell leaves them (:func:`tests.stalled.as_a_shell_starts`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from loader.cli import main
from tests import procs
from tests.stalled import (
    as_a_shell_starts,
    sent_once_asked,
    stopped_while_stalled,
)

ROOT = Path(__file__).resolve().parents[1]

#: tgkill(2)'s number: the one call that sends a signal to one thread of another process.
_TGKILL = {"x86_64": 234, "aarch64": 131}


def to_another_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to a thread of ``pid`` other than its main one, as the kernel may hand a
    process's signal to any thread that does not block it."""
    number = _TGKILL.get(os.uname().machine)
    if number is None:
        pytest.skip(f"tgkill's number on {os.uname().machine} is not known here")
    masks = procs.signal_masks(pid)
    others = [tid for tid, mask in masks.items() if tid != pid and not mask & (1 << (sig - 1))]
    assert others, "the command runs threads besides its main one that take the signal"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(number, pid, others[0], int(sig)) == 0


def _nothing_left(tmp_path: Path, command: str) -> None:
    if command == "run":
        for what in (".locks", ".staging"):
            where = tmp_path / "root" / what
            assert not where.exists() or not any(where.iterdir()), what


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize("command", ["fetch", "run"])
def test_a_hang_up_stops_the_command_cleanly(tmp_path, command):
    """SIGHUP (the terminal the command ran in closed, its ssh session ended): the command died
    of it at once, with no error line, exit status "killed by SIGHUP"; ``serve`` left its
    tritonserver serving. Now it unwinds like SIGTERM: its lock released, its staging removed,
    a last line that says so, exit 129."""
    code, _, err, took = stopped_while_stalled(tmp_path, command, lambda p: p.send_signal(1))
    assert code == 129, err
    assert err.rstrip().splitlines()[-1] == "hung up (SIGHUP: its terminal closed); stopped cleanly"
    assert "Traceback" not in err and "this is a bug" not in err, err
    assert took < 15, f"{took:.0f} s after SIGHUP"
    _nothing_left(tmp_path, command)


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize("command", ["fetch", "run"])
def test_a_stop_signal_the_parent_left_blocked_still_stops_the_command(tmp_path, command):
    """A signal mask is inherited across ``exec``: started by a parent's thread that blocks
    SIGTERM (a process manager, a Python program's worker thread), the command never took it,
    and waited on a stalled download until SIGKILL (``run``'s child never took the SIGTERM its
    supervisor passed on). Now it unwinds at once, as it does with the mask a shell gives."""
    code, _, err, took = stopped_while_stalled(
        tmp_path, command, lambda p: p.send_signal(signal.SIGTERM), blocked=(signal.SIGTERM,)
    )
    assert code == 143, err
    assert err.rstrip().splitlines()[-1] == "terminated (SIGTERM); stopped cleanly", err
    assert took < 15, f"{took:.0f} s after SIGTERM"
    _nothing_left(tmp_path, command)


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize("command", ["fetch", "run"])
def test_sigterm_a_download_thread_got_stops_the_command_at_once(tmp_path, command):
    """The kernel hands a process's SIGTERM to any of its threads that does not block it; one
    of the download pool's got it while the main thread waited for the downloads in one
    blocking wait, which such a signal does not wake (and Python runs its handler only in the
    main thread): on a stalled server the stop waited for the read timeout (minutes), past
    Kubernetes' grace period. Now the wait wakes every half second and the command stops."""

    def to_a_worker(proc: subprocess.Popen) -> None:
        pid = (procs.children(proc.pid) or [proc.pid])[0] if command == "run" else proc.pid
        to_another_thread(pid, signal.SIGTERM)

    code, _, err, took = stopped_while_stalled(tmp_path, command, to_a_worker)
    assert code == 143, err
    assert "terminated (SIGTERM); stopped cleanly" in err
    assert took < 15, f"{took:.0f} s after SIGTERM"
    _nothing_left(tmp_path, command)


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize("command", ["fetch", "run"])
def test_a_stop_with_standard_errors_reader_gone_keeps_its_code(tmp_path, command):
    """``model-loader fetch ... 2>&1 | head -1`` and then SIGTERM: the line "terminated
    (SIGTERM); stopped cleanly" could not be written (EPIPE), and that error, raised in the
    command line's own funnel, ended the process with exit 1 (a bug's code), not 143."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone
    try:
        code, *_ = stopped_while_stalled(
            tmp_path, command, lambda p: p.send_signal(signal.SIGTERM), stderr=write
        )
    finally:
        os.close(write)
    assert code == 143
    _nothing_left(tmp_path, command)


@pytest.mark.slow  # a command in a subprocess of its own
def test_a_killed_child_with_standard_errors_reader_gone_keeps_its_code(tmp_path):
    """``model-loader run ... 2>&1 | head -1``, and the supervised child is killed (the OOM
    killer): the supervisor's lines about what it removed could not be written, and that
    error ended it with exit 1; its clean-up stands, its code is the child's signal's."""
    read, write = os.pipe()
    os.close(read)

    def kill_child(proc: subprocess.Popen) -> None:
        (child,) = procs.children(proc.pid)
        os.kill(child, signal.SIGKILL)

    try:
        code, *_ = stopped_while_stalled(tmp_path, "run", kill_child, stderr=write)
    finally:
        os.close(write)
    assert code == 137
    _nothing_left(tmp_path, "run")


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize(
    "sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGPROF, signal.SIGRTMIN]
)
def test_a_signal_the_loader_gives_no_meaning_leaves_nothing_through_its_supervisor(tmp_path, sig):
    """``kill -USR1`` of ``run`` (its supervisor): the supervisor died of it at once, and its
    child, killed with it, left its publish lock for the next run to take over. Now the child
    dies of it, and the supervisor removes what it left before it dies of it too (the status an
    unsupervised loader has). So for every signal whose default action ends a process: SIGALRM,
    SIGPROF and the real-time signals left the lock and staging after USR1 and USR2 no longer
    did."""
    code, _, err, _ = stopped_while_stalled(tmp_path, "run", lambda p: p.send_signal(sig))
    assert code == -sig, err
    assert "Traceback" not in err, err
    _nothing_left(tmp_path, "run")
    assert (tmp_path / "root" / ".locks").is_dir()  # it held a lock, now removed


# --- a streamed completion from a server that went silent ----------------------------------


def _silent_triton():
    """A gRPC server of Triton's inference service whose streams and readiness, model list
    calls take a request and never answer; the event is set once a request came, ``release``
    ends the stalled calls."""
    from concurrent import futures

    import grpc
    from tritonclient.grpc import service_pb2_grpc

    asked, release = threading.Event(), threading.Event()

    def stall(request, context):
        asked.set()
        release.wait(300)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    class Silent(service_pb2_grpc.GRPCInferenceServiceServicer):
        ServerReady = ModelReady = RepositoryIndex = staticmethod(stall)

        def ModelStreamInfer(self, request_iterator, context):
            for _ in request_iterator:
                asked.set()
                release.wait(300)
                return
            yield  # a generator: the stream's answers (none)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Silent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, asked, release


@pytest.mark.slow  # a command in a subprocess of its own
def test_sigterm_a_grpc_thread_got_stops_a_streamed_completion_at_once():
    """``complete --stream`` waiting for a server that went silent: a SIGTERM that one of
    gRPC's threads got waited for the next response, up to the whole ``--timeout``."""
    server, port, asked, release = _silent_triton()
    try:
        proc = subprocess.Popen(
            as_a_shell_starts([sys.executable, "-m", "loader", "complete", "hi", "--stream",
                                "--url", f"127.0.0.1:{port}", "--model", "m", "--timeout", "300"]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        code, _, err, took = sent_once_asked(
            proc, asked, lambda p: to_another_thread(p.pid, signal.SIGTERM), "no request came"
        )
    finally:
        release.set()
        server.stop(0)
    assert code == 143, err
    assert took < 15, f"{took:.0f} s after SIGTERM"


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize(
    "argv", [["--model", "m", "--check-ready"], []], ids=["check-ready", "model-list"]
)
def test_a_server_that_never_answers_the_readiness_or_model_list_ends_at_the_timeout(argv):
    """``complete --check-ready`` (the chart's ``helm test``), or without ``--model``, against a
    server that took the call and never answered: the readiness checks and the model list had
    no deadline over gRPC, and the command waited for good whatever ``--timeout`` said. Now
    each ends at ``--timeout``: 2, saying so."""
    server, port, asked, release = _silent_triton()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "loader", "complete", "hi", "--url", f"127.0.0.1:{port}",
             "--timeout", "2", *argv],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    finally:
        release.set()
        server.stop(0)
    assert asked.is_set()
    assert done.returncode == 2, done.stderr
    assert "Deadline Exceeded" in done.stderr and "hint:" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


# --- numbers in other scripts' digits ------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--model", "gpt-j-6b", "--gpus-per-node", "\uff18"],  # fullwidth 8
        ["plan", "--model", "gpt-j-6b", "--gpus-per-node", "8", "--tp-size", "\u0662"],  # Arabic 2
        ["fetch", "{source}", "{tmp}/dest", "--workers", "\uff12"],
        ["fetch", "{source}", "{tmp}/dest", "--retry-deadline", "\uff13\uff10"],  # a float flag
        ["serve", "{tmp}/repo", "--http-port", "\uff18\uff10\uff10\uff10"],  # a port
        ["complete", "hi", "--max-tokens", "\uff14"],
        ["complete", "hi", "--temperature", "\uff10.5"],
    ],
    ids=["gpus", "arabic-tp", "workers", "retry-deadline", "port", "max-tokens", "temperature"],
)
def test_a_number_in_digits_other_than_ascii_is_refused(source, tmp_path, capsys, argv):
    """Python's ``int`` and ``float`` read the digits of every script: ``--workers ２`` (a
    full-width 2, from a document or an input method) was taken as 2, a value printed and
    compared as another text than the one given. Refused (2), naming the flag and the
    character, before anything is done."""
    argv = [a.format(source=source, tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "which is no ASCII character" in err and "0-9" in err, err
    assert err.startswith("error: ") and "\nhint: " in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("url", ["127.0.0.1:\uff18\uff10\uff10\uff11", "http://h:\u0668\u0660"])
def test_a_port_in_a_url_in_digits_other_than_ascii_is_refused(capsys, url):
    """``--url 127.0.0.1:８００１``: the port was read as 8001."""
    code = main(["complete", "hi", "--url", url, "--model", "m"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: not a Triton endpoint") and "\nhint: " in err, err


# --- a stop that a library turns into an error of its own ------------------------------------

#: ``model-loader plan`` in a process whose numpy import gets the signal ``sys.argv[1]`` and
#: fails as numpy's C part does then: the signal's exception raised inside it becomes an
#: ImportError of its own ("PyCapsule_Import could not import module").
_SIGNALLED_IMPORT = (
    "import os, signal, sys, time\n"
    "import loader.cli as cli\n"
    "def load_blas():\n"
    "    try:\n"
    "        os.kill(os.getpid(), int(sys.argv[1]))\n"
    "        time.sleep(5)\n"
    "    except BaseException:\n"
    "        raise ImportError('PyCapsule_Import could not import module \"datetime\"')\n"
    "cli._load_blas = load_blas\n"
    "sys.exit(cli.main(['plan', '--model', 'gpt-j-6b', '--gpus-per-node', '8']))\n"
)


@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [(signal.SIGTERM, 143, "terminated (SIGTERM); stopped cleanly"),
     (signal.SIGHUP, 129, "hung up (SIGHUP: its terminal closed); stopped cleanly"),
     (signal.SIGINT, 130, "interrupted")],
)  # fmt: skip
def test_a_stop_a_library_turns_into_its_own_error_is_still_the_stop(sig, code, said):
    """SIGTERM while numpy's C part was imported (a command loads it right after parsing):
    the exception the handler raised inside it came back as numpy's ImportError, and the
    command ended with exit 1 and a traceback ("this is a bug"). Seen sweeping SIGHUP over the
    first 0.2 s of ``fetch``. An error raised once a stop arrived is now that stop."""
    done = subprocess.run(
        as_a_shell_starts([sys.executable, "-c", _SIGNALLED_IMPORT, str(int(sig))]),
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    assert done.stderr.rstrip().splitlines()[-1] == said, done.stderr
    assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr, done.stderr
    assert done.stdout == ""


@pytest.mark.slow  # a command in a subprocess of its own
def test_the_threads_a_library_starts_while_it_loads_never_take_a_stop_signal(tmp_path):
    """OpenBLAS starts its threads while numpy is imported, with SIGINT held back (so they never
    take it) but SIGTERM and SIGHUP open: the kernel could hand the process's SIGTERM to one
    of them, which runs no Python handler and wakes no main thread blocked in a library's
    wait (``complete --url http://...`` waiting on a stalled server: until ``--timeout``). They
    now start with every stop signal held back, and take none."""
    stops = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGHUP - 1))
    masks: list[int] = []

    def look_then_kill(proc: subprocess.Popen) -> None:
        masks.extend(procs.signal_masks(proc.pid).values())
        proc.kill()

    stopped_while_stalled(tmp_path, "fetch", look_then_kill, env={"OPENBLAS_NUM_THREADS": "3"})
    library = [mask for mask in masks if mask & (1 << (signal.SIGINT - 1))]
    if not library:
        pytest.skip("OpenBLAS started no thread of its own here (one CPU)")
    assert all(mask & stops == stops for mask in library), [hex(m) for m in masks]


#: A process that ignores SIGHUP (started under ``nohup``), in a command's stop handling, and
#: sent a SIGHUP: it goes on; SIGTERM still stops it.
_IGNORED_HANG_UP = (
    "import os, signal\n"
    "from loader import cli\n"
    "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
    "with cli.sigterm_unwinds():\n"
    "    os.kill(os.getpid(), signal.SIGHUP)\n"
    "    print('went on', flush=True)\n"
    "    try:\n"
    "        os.kill(os.getpid(), signal.SIGTERM)\n"
    "    except cli.Terminated:\n"
    "        print('stopped')\n"
)


def test_a_hang_up_stays_ignored_under_nohup():
    """``nohup model-loader run ...``: the terminal closing (SIGHUP) was meant not to stop it."""
    done = subprocess.run(
        [sys.executable, "-c", _IGNORED_HANG_UP], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["went", "on", "stopped"], done.stdout


#: Every signal whose default action ends a process (``signal(7)``: Term and Core), by name.
_ENDS_A_PROCESS = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS",
                   "SIGFPE", "SIGKILL", "SIGUSR1", "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM",
                   "SIGTERM", "SIGSTKFLT", "SIGXCPU", "SIGXFSZ", "SIGVTALRM", "SIGPROF",
                   "SIGIO", "SIGPWR", "SIGSYS")  # fmt: skip
#: Those a fault raises (a handler would run the faulting instruction again for ever).
_FAULTS = ("SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGSEGV", "SIGSYS")


def _ending() -> set[int]:
    named = {getattr(signal, n) for n in _ENDS_A_PROCESS if hasattr(signal, n)}
    return named | set(range(signal.SIGRTMIN, signal.SIGRTMAX + 1))


def test_every_signal_that_would_end_the_supervisor_is_passed_on_to_its_child():
    """Python ignores SIGPIPE and SIGXFSZ; no handler takes SIGKILL. Any other such signal
    left out killed the supervisor at once, its child then, with the lock and staging left."""
    from loader.cli.supervise import FORWARDED

    left_out = _ending() - {signal.SIGKILL, signal.SIGPIPE, signal.SIGXFSZ} - set(FORWARDED)
    assert not left_out, sorted(signal.Signals(s).name for s in left_out)


def test_every_signal_that_would_end_a_command_unwinds_it():
    """Each signal whose default action ends the process, except a fault's (and SIGKILL, and
    SIGPIPE and SIGXFSZ, which Python ignores), raises the stop in the command's main thread
    while it runs: one left out killed the command at once, its lock and files left (``kill
    -STKFLT`` of ``fetch``, ``prune`` or ``serve``)."""
    from loader import cli

    faults = {getattr(signal, n) for n in _FAULTS if hasattr(signal, n)}
    taken = _ending() - faults - {signal.SIGKILL, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT}
    before = {s: signal.getsignal(s) for s in _ending() - {signal.SIGKILL}}
    try:
        # Each at its default, as a shell starts a command: this process may ignore some (a
        # suite started under nohup ignores SIGHUP, which a command rightly keeps ignoring:
        # the next test).
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)
        with cli.sigterm_unwinds():
            for sig in faults:
                assert signal.getsignal(sig) is signal.SIG_DFL, signal.Signals(sig).name
            for sig in taken:  # (one not taken would end this process: looked at first)
                assert signal.getsignal(sig) is cli._stop, signal.Signals(sig).name
        for sig in sorted(taken):
            with pytest.raises(KeyboardInterrupt) as info, cli.sigterm_unwinds():
                signal.pthread_kill(threading.get_ident(), sig)
                signal.sigtimedwait((), 0)  # (a signal is handled between bytecodes)
            assert isinstance(info.value, cli.Terminated), signal.Signals(sig).name
            assert info.value.signum == sig
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        cli._stopping.clear()


def test_an_ending_signal_the_command_was_started_ignoring_stays_ignored():
    """As SIGHUP under ``nohup``: a signal the loader gives no meaning, ignored by whoever
    started it (an ignored signal stays ignored across ``exec``), neither stops nor ends it."""
    from loader import cli

    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with cli.sigterm_unwinds():
            assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
            signal.sigtimedwait((), 0)
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, before)
        cli._stopping.clear()


def test_every_signal_a_command_takes_is_held_back_while_libraries_start_their_threads():
    """The threads a library starts while it loads (OpenBLAS, as numpy is imported) keep the
    mask they start with: a signal not held back then may be handed to one of them, which runs
    no Python handler, for good (the slow test above looks at OpenBLAS's real threads)."""
    from loader import cli

    with cli._interrupts_told_apart():
        held = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    left = {signal.SIGINT, *cli.STOPPING, *cli.ENDING} - held
    assert not left, sorted(signal.Signals(s).name for s in left)


def test_every_signal_a_command_takes_is_unblocked_when_its_parent_left_it_blocked():
    """A signal mask is inherited across ``exec``: a command started from a thread blocking
    signals never took them. Each signal that stops the command, or that would end it (the
    slow tests send SIGTERM alone), is taken again as the command starts; a fault's (and
    SIGPIPE and SIGXFSZ, which Python ignores) stays as it was."""
    from loader import cli

    faults = {getattr(signal, n) for n in _FAULTS if hasattr(signal, n)}
    taken = _ending() - faults - {signal.SIGKILL, signal.SIGPIPE, signal.SIGXFSZ}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, taken | {signal.SIGBUS})
    try:
        cli._open_stop_signals()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    still = held & taken
    assert not still, sorted(signal.Signals(s).name for s in still)
    assert signal.SIGBUS in held
