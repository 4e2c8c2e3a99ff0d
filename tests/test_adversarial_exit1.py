"""Generated hostile input for every command: what a user, a script or the environment hands
``model-loader`` ends in a typed error (exit 2 with ``error:`` and ``hint:`` lines, 75 for
what may pass), never exit 1 with a traceback ("unexpected failure (this is a bug)")."""

from __future__ import annotations

import errno
import json
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.cli import main
from loader.repository.key import resolve_revision
from tests.runs import cli, run_argv
from tests.stalled import stopped_while_stalled
from tests.tiers import examples

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: Bytes no UTF-8 text holds, as Python gives them from a command line (lone surrogates).
NOT_UTF8 = os.fsdecode(b"\xff\xfe")


def _typed(code: int, err: str, *needles: str) -> None:
    """Exit 2 with an error and a hint, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err and "this is a bug" not in err, err
    assert err.startswith("error: ") and "\nhint: " in err, err
    for needle in needles:
        assert needle in err, err


# --- a '..' below a level that does not exist ----------------------------------------------


def _creating(command: str, source: Path, target: Path) -> list[str]:
    """``command`` creating the directory ``target`` it writes to."""
    return {
        "convert OUTPUT_DIR": ["convert", str(source), str(target), "--tp-size", "1"],
        "fetch DEST": ["fetch", str(source), str(target), "--copy"],
    }[command]


@pytest.mark.parametrize("command", ["convert OUTPUT_DIR", "fetch DEST"])
@pytest.mark.parametrize("tail", [("a", "..", "b"), ("a", "b", "..", "..", "c"), ("a", "..")])
def test_a_dotdot_below_a_missing_level_is_refused_naming_it(
    source, tmp_path, capsys, command, tail
):
    """``OUT/a/../b`` with no ``OUT/a``: which directory it names is decided only once ``a``
    exists. Before, the loader made ``a`` and then tried to create a directory named ``..``
    (a ValueError: exit 1, a bug); now exit 2 naming the path, and nothing is created."""
    target = tmp_path.joinpath("out", *tail)
    code, out, err = cli(capsys, *_creating(command, source, target))
    _typed(code, err, "'..'", str(target))
    assert not (tmp_path / "out").exists()
    assert out == []


def test_a_dotdot_below_an_existing_level_is_followed(source, tmp_path, capsys):
    """A ``..`` the file system can resolve is the path it names, as before."""
    (tmp_path / "a").mkdir()
    target = tmp_path / "a" / ".." / "b"
    code, out, err = cli(capsys, "fetch", str(source), str(target), "--copy")
    assert code == 0, err
    assert out[-1] == str(target)
    assert (tmp_path / "b" / "config.json").is_file()


# --- a NUL in any argument ------------------------------------------------------------------


def _commands(source: Path, tmp: Path) -> dict[str, list[str]]:
    return {
        "convert": ["convert", str(source), str(tmp / "out"), "--tp-size", "1"],
        "fetch": ["fetch", str(source), str(tmp / "dest"), "--copy"],
        "run": run_argv(source, tmp / "root"),
        "prune": ["prune", "--repository", str(tmp / "root"), "--in-use", "k"],
        "plan": ["plan", "--source", str(source), "--gpus-per-node", "1"],
        "complete": ["complete", "hello", "--url", "127.0.0.1:9", "--model", "m"],
        "serve": ["serve", str(tmp / "repo"), "--set", "a=b"],
        "tune": ["tune", "--repository", str(tmp / "repo"), "--model", "m"],
    }


@settings(SETTINGS, max_examples=examples(40))
@given(data=st.data(), command=st.sampled_from(sorted(_commands(Path("s"), Path("t")))))
def test_a_nul_in_any_argument_of_any_command_is_a_user_error(
    source, tmp_path, capsys, data, command
):
    """No process's command line holds a NUL, but a caller of ``main`` (a script, scripts/bench)
    may pass one: it reached ``os.stat`` or ``os.open`` (ValueError: exit 1) wherever a path
    was checked last. Refused before parsing, naming the argument; nothing is written."""
    argv = _commands(source, tmp_path)[command]
    i = data.draw(st.integers(1, len(argv) - 1), label="argument")
    at = data.draw(st.integers(0, len(argv[i])), label="at")
    argv[i] = argv[i][:at] + "\0" + argv[i][at:]
    code, out, err = cli(capsys, *argv)
    _typed(code, err, "NUL", repr(argv[i]))
    assert out == []
    assert not {"out", "dest", "root"} & {p.name for p in tmp_path.iterdir()}


# --- bytes that are not UTF-8 --------------------------------------------------------------


@settings(SETTINGS, max_examples=examples(20))
@given(
    where=st.sampled_from(["prompt", "--model"]),
    text=st.text(st.characters(blacklist_characters="\0-"), max_size=8),
    raw=st.binary(min_size=1, max_size=4).filter(lambda b: not _utf8(b)),
)
def test_a_prompt_or_model_that_is_not_utf8_is_a_user_error(capsys, where, text, raw):
    """``complete $'\\xff'`` (a prompt in Latin-1 from a script): the prompt is sent as UTF-8
    text and the model name is part of a URL; both raised UnicodeEncodeError (exit 1). Now
    exit 2 naming the argument, before any connection is tried."""
    value = text + os.fsdecode(raw)
    argv = ["complete", "--url", "http://127.0.0.1:9", "--timeout", "1"]
    argv += [value, "--model", "m"] if where == "prompt" else ["hello", "--model", value]
    code, out, err = cli(capsys, *argv)
    _typed(code, err, "not UTF-8", repr(value))
    assert out == []


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_local_source_whose_path_is_not_utf8_has_a_key(tmp_path):
    """A local path is bytes: one that is not UTF-8 names a source all the same, and its key
    hashes those bytes (before: UnicodeEncodeError, exit 1, for every such source)."""
    one, other = os.fsdecode(b"/data/ckpt-\xff"), os.fsdecode(b"/data/ckpt-\xfe")
    assert resolve_revision(one).startswith("src-")
    assert resolve_revision(one) != resolve_revision(other)
    assert resolve_revision("/data/ckpt") == resolve_revision("file:///data/ckpt")


def test_run_of_a_local_source_whose_path_is_not_utf8_is_no_bug(source, tmp_path, capsys):
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/ckpt-\xff"))
    source.rename(odd)
    code, _, err = cli(capsys, *run_argv(odd, tmp_path / "root"))
    assert code in (0, 2), err
    assert "Traceback" not in err and "this is a bug" not in err, err
    if code == 2:
        assert "hint: " in err


@pytest.mark.parametrize(
    "uri", [f"hf://org/{NOT_UTF8}", f"gs://bucket/{NOT_UTF8}"], ids=["hf", "gs"]
)
def test_a_remote_uri_that_is_not_utf8_is_a_user_error(tmp_path, capsys, uri):
    code, out, err = cli(capsys, *run_argv(uri, tmp_path / "root", "--retry-deadline", "1"))
    _typed(code, err)
    assert out == []


# --- a host name no resolver takes ---------------------------------------------------------

_label = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
#: Host names with one label empty or longer than DNS allows (63): the resolver's IDNA
#: encoding raises UnicodeError before any lookup.
_bad_hosts = st.builds(
    lambda before, bad, after: ".".join([*before, bad, *after]),
    st.lists(_label, max_size=2),
    st.sampled_from(["", "a" * 64, "x" * 200]),
    st.lists(_label, min_size=1, max_size=2),
)


@settings(SETTINGS, max_examples=examples(20))
@given(host=_bad_hosts, form=st.sampled_from(["http://{}:8000", "{}:8001", "grpc://{}:8001"]))
def test_complete_to_a_host_no_resolver_takes_is_a_user_error(capsys, host, form):
    """``--url http://a..b:8000``: the HTTP client's resolver raised UnicodeError (exit 1)."""
    code, out, err = cli(capsys, "complete", "hi", "--url", form.format(host), "--timeout", "2")
    _typed(code, err, "empty or over 63 characters")
    assert out == []


@settings(SETTINGS, max_examples=examples(10))
@given(host=_bad_hosts, variable=st.sampled_from(["HF_ENDPOINT", "STORAGE_EMULATOR_HOST"]))
def test_an_endpoint_variable_naming_a_host_no_resolver_takes_is_a_user_error(
    tmp_path, capsys, host, variable
):
    """``HF_ENDPOINT=http://a..b``: the Hub client's resolver raised UnicodeError (exit 1);
    now refused before any request, naming the variable."""
    uri = "hf://org/name" if variable == "HF_ENDPOINT" else "gs://bucket/x"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(variable, f"http://{host}")
        code, out, err = cli(capsys, "fetch", uri, str(tmp_path / "d"), "--retry-deadline", "2")
    _typed(code, err, variable, "empty or over 63 characters")
    assert out == []


# --- a request file of any JSON shape --------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_entries = (
    _json
    | st.dictionaries(st.sampled_from(["prompt", "request_output_len", "x"]), _json, max_size=2)
    | st.fixed_dictionaries(
        {"prompt": st.fixed_dictionaries({"content": _json | st.just(["\ud800"]), "shape": _json})}
    )
)


@settings(SETTINGS, max_examples=examples(60))
@given(entry=_entries)
def test_a_request_file_of_any_json_shape_is_a_user_error_or_sent(tmp_path, capsys, entry):
    """``complete --request FILE``: a data entry that is no object, an input that holds no
    list, or text with a lone surrogate (``"\\ud800"``, valid JSON) raised AttributeError,
    TypeError or UnicodeEncodeError (exit 1). Every shape is now refused, naming what is
    wrong, or sent (here to a closed port: exit 2 too)."""
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"data": [entry]}))
    argv = ["complete", "--request", str(request), "--url", "http://127.0.0.1:9", "--timeout", "1"]
    code, out, err = cli(capsys, *argv)
    _typed(code, err)
    assert out == []


# --- the prompt on standard input ----------------------------------------------------------


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize(
    ("stdin", "needle"),
    [("closed", "standard input, which is closed"), ("/dev/zero", "longer than")],
)
def test_a_prompt_from_a_closed_or_endless_standard_input_is_a_user_error(stdin, needle):
    """``complete - <&-``: ``sys.stdin`` is None (AttributeError, exit 1); ``complete - <
    /dev/zero`` read until the memory ran out. Both are refused, naming standard input."""
    command = [sys.executable, "-m", "loader", "complete", "-", "--url", "http://127.0.0.1:9"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if stdin == "closed":
        done = subprocess.run(
            command, stdin=None, capture_output=True, text=True, env=env, timeout=120,
            preexec_fn=lambda: os.close(0),
        )  # fmt: skip
    else:
        with open(stdin, "rb") as source:
            done = subprocess.run(
                command, stdin=source, capture_output=True, text=True, env=env, timeout=120
            )
    _typed(done.returncode, done.stderr[done.stderr.find("error: ") :], needle)
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


# --- relative paths after the working directory was deleted --------------------------------

GONE_CWD = {
    "convert OUTPUT_DIR": ["convert", "{source}", "out", "--tp-size", "1"],
    "fetch SOURCE": ["fetch", "ckpt"],
    "fetch DEST": ["fetch", "{source}", "dest", "--copy"],
    "run --repository": ["run", "--source", "{source}", "--repository", "root",
                         "--model-name", "m", "--tp-size", "1", "--pp-size", "1",
                         "--instance-count", "1", "--backend", "python"],
    "run --work-dir": ["run", "--source", "{source}", "--repository", "{tmp}/root",
                       "--work-dir", "work", "--model-name", "m", "--tp-size", "1",
                       "--pp-size", "1", "--instance-count", "1", "--backend", "python"],
    "prune --repository": ["prune", "--repository", "root"],
    "plan --source": ["plan", "--source", "ckpt", "--gpus-per-node", "1"],
    "serve REPOSITORY": ["serve", "repo"],
    "tune --work-dir": ["tune", "--repository", "{source}", "--work-dir", "work"],
    "tune --output-dir": ["tune", "--repository", "{source}", "--output-dir", "results"],
}  # fmt: skip


@pytest.mark.parametrize("where", sorted(GONE_CWD))
def test_a_relative_path_after_the_working_directory_was_deleted_is_a_user_error(
    source, tmp_path, capsys, monkeypatch, where
):
    """A Job's or a shell's working directory removed under it: ``tune --work-dir w`` checked
    the path in its argument's type, outside the command's funnel (FileNotFoundError from
    ``getcwd``: exit 1). Every command now says the directory is gone."""
    argv = [a.format(source=source, tmp=tmp_path) for a in GONE_CWD[where]]
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    code, out, err = cli(capsys, *argv)
    _typed(code, err, "working directory was deleted")
    assert out == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# --- serve: ports and the log file ---------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "65536", "99999999999999999999", "1.5", "x"])
@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port", "--metrics-port"])
def test_serve_refuses_a_port_out_of_range_when_parsing(tmp_path, capsys, flag, value):
    """``serve --http-port 65536``: the free-port check's ``bind`` raised OverflowError
    (exit 1). Now refused with the arguments, before anything starts."""
    with pytest.raises(SystemExit) as exited:  # argparse's error exits
        cli(capsys, "serve", str(tmp_path), flag, value)
    _typed(exited.value.code, capsys.readouterr().err, flag)


@pytest.mark.server  # reaches TritonServer.start (helm template), though no server runs
def test_serve_refuses_a_log_file_that_is_a_fifo_without_a_reader(
    published_tiny_python_repository, tmp_path, capsys
):
    """``serve --log-file FIFO`` waited forever in ``open`` for a reader; now the FIFO's own
    error (exit 2), at once."""
    fifo = tmp_path / "log"
    os.mkfifo(fifo)
    repository = str(published_tiny_python_repository)
    code, _, err = cli(capsys, "serve", repository, "--log-file", str(fifo))
    _typed(code, err, "FIFO without a reader", str(fifo))
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


# --- a file:// URI the URL parser refuses --------------------------------------------------


@pytest.mark.parametrize("uri", ["file://[x/ckpt", "file://;]_:?_]]a..", "file://a]b[/c"])
@pytest.mark.parametrize("command", ["run", "fetch", "plan"])
def test_a_file_uri_with_a_bracket_in_its_host_is_a_user_error(tmp_path, capsys, command, uri):
    """``urlsplit`` raises ValueError ("Invalid IPv6 URL") for a '[' or ']' in the part
    after ``file://``: exit 1 before; now the URI's typed error."""
    argv = {
        "run": run_argv(uri, tmp_path / "root"),
        "fetch": ["fetch", uri, str(tmp_path / "dest"), "--copy"],
        "plan": ["plan", "--source", uri, "--gpus-per-node", "1"],
    }[command]
    code, out, err = cli(capsys, *argv)
    _typed(code, err, "file://")
    assert out == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.server
def test_serve_with_a_device_as_its_log_file_reports_a_failed_start(
    published_tiny_python_repository,
):
    """``serve --log-file /dev/zero``: a start that failed read the log for its cause, and
    read /dev/zero until the memory ran out (SIGKILL by the OOM killer). Only a regular file
    is read: the start's own error, exit 2. In a subprocess under a memory limit."""
    command = [sys.executable, "-m", "loader", "serve", str(published_tiny_python_repository),
               "--log-file", "/dev/zero", "--startup-timeout", "0.01"]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30)),
    )  # fmt: skip
    _typed(done.returncode, done.stderr[done.stderr.find("error: ") :], "not ready")


# --- standard output's reader goes away ----------------------------------------------------


@pytest.mark.slow  # commands in subprocesses of their own
@pytest.mark.parametrize(
    "argv",
    [["plan", "--model", "gpt-j-6b", "--gpus-per-node", "8"], ["fetch", "{source}"]],
    ids=["plan", "fetch"],
)
def test_a_reader_closing_standard_output_early_is_no_bug(source, argv):
    """``model-loader plan | head -c1``: print raised BrokenPipeError (EPIPE, a bug's errno:
    exit 1 with a traceback). Now an error line and 141, the code of a command killed by
    SIGPIPE, as a shell pipeline expects."""
    argv = [a.format(source=source) for a in argv]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    with os.fdopen(write, "wb") as stdout:
        done = subprocess.run(
            [sys.executable, "-m", "loader", *argv, "-q"], stdout=stdout, stderr=subprocess.PIPE,
            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr
    assert done.stderr.startswith("error: Standard output was closed"), done.stderr
    assert "\nhint: " in done.stderr


@pytest.mark.slow  # commands in subprocesses of their own
@pytest.mark.parametrize("command", ["run", "fetch", "plan", "prune"])
def test_standard_output_on_a_full_volume_is_named_and_what_was_done_stands(
    source, tmp_path, command
):
    """``model-loader run ... > /dev/full``: the key was published, then printing its path
    failed with ENOSPC, reported as "The volume holding a file ran out of space; nothing was
    published" with a hint to free space on it. Now standard output is named, and what the
    command did stands."""
    root, dest = tmp_path / "root", tmp_path / "dest"
    argv = {"run": run_argv(source, root), "fetch": ["fetch", str(source), str(dest), "--copy"],
            "plan": ["plan", "--source", str(source), "--gpus-per-node", "1"],
            "prune": ["prune", "--repository", str(root), "--keep", "1"]}[command]  # fmt: skip
    if command == "prune":
        root.mkdir()
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "loader", *argv, "-q"], stdout=full, stderr=subprocess.PIPE,
            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    _typed(done.returncode, done.stderr, "Standard output could not be written")
    assert "nothing was published" not in done.stderr, done.stderr
    if command == "run":
        assert len(list(root.glob("tiny@*/*"))) == 1
    if command == "fetch":
        assert {p.name for p in source.iterdir()} <= {p.name for p in dest.iterdir()}


@pytest.mark.slow  # a command in a subprocess of its own
def test_standard_output_in_an_encoding_without_a_printed_character_names_it(source, tmp_path):
    """``PYTHONIOENCODING=ascii model-loader run --repository /data/modèles``: the key was
    published, then printing its path failed, reported as "The argument ... holds bytes that
    are not UTF-8 text" with a hint to pass it as UTF-8, which it was. Now standard output's
    encoding is named, and what the command did stands."""
    root = tmp_path / "mod\u00e8les"
    done = subprocess.run(
        [sys.executable, "-m", "loader", *run_argv(source, root), "-q"], capture_output=True,
        text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "ascii",
             "LC_ALL": "C.UTF-8"},
    )  # fmt: skip
    _typed(done.returncode, done.stderr, "Standard output writes ascii", "PYTHONIOENCODING")
    assert "not UTF-8" not in done.stderr, done.stderr
    assert len(list(root.glob("tiny@*/*"))) == 1


def _closing(*fds: int):
    """A ``preexec_fn`` that starts the command with the descriptors ``fds`` closed (``>&-``)."""

    def close() -> None:
        for fd in fds:
            os.close(fd)

    return close


@pytest.mark.slow  # commands in subprocesses of their own
@pytest.mark.parametrize("command", ["run", "fetch", "convert", "plan"])
def test_a_command_started_with_standard_output_closed_is_refused_before_any_work(
    source, tmp_path, command
):
    """``model-loader run ... >&-``: Python drops what is printed to a closed standard output
    without a word, so the key was published and the command exited 0 without the line that
    names it (``run`` and ``convert``, supervised, failed in their supervisor instead: exit 1,
    a traceback). Now refused at once (2, naming standard output), before anything is written,
    and the same command with standard output open then succeeds."""
    argv = [a.format(source=source) for a in _commands(source, tmp_path)[command]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "loader", *argv, "-q"], stderr=subprocess.PIPE, text=True,
        timeout=120, env=env, preexec_fn=_closing(1),
    )  # fmt: skip
    _typed(done.returncode, done.stderr, "Standard output is closed", ">/dev/null")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    again = subprocess.run(
        [sys.executable, "-m", "loader", *argv, "-q"], capture_output=True, text=True,
        timeout=120, env=env,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip(), again.stderr


@pytest.mark.slow  # commands in subprocesses of their own
@pytest.mark.parametrize("command", ["run", "fetch"])
def test_a_command_started_with_standard_error_closed_keeps_its_output_to_the_result(
    source, tmp_path, command
):
    """``model-loader run ... 2>&-``: Python's ``print`` to a closed standard error writes to
    standard output, so a failed command's ``error:`` and ``hint:`` lines went where a script
    reads the result's path. Now standard output holds nothing of them (the exit code still
    says what happened), and a command that succeeds prints its path alone."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = _commands(source, tmp_path)[command]
    bad = [tmp_path / "no-such-checkpoint" if a == str(source) else a for a in argv]
    failed = subprocess.run(
        [sys.executable, "-m", "loader", *map(str, bad)], stdout=subprocess.PIPE, text=True,
        timeout=120, env=env, preexec_fn=_closing(2),
    )  # fmt: skip
    assert failed.returncode == 2
    assert failed.stdout == ""
    done = subprocess.run(
        [sys.executable, "-m", "loader", *argv], stdout=subprocess.PIPE, text=True,
        timeout=120, env=env, preexec_fn=_closing(2),
    )  # fmt: skip
    assert done.returncode == 0
    (line,) = done.stdout.splitlines()
    assert Path(line).is_dir()


def test_standard_output_failing_for_a_moment_is_transient(source, capsys, monkeypatch):
    """An I/O error writing standard output (a terminal hung up, a network volume): 75, naming
    standard output, never a file-system failure of the command's own files."""

    class Failing:
        def write(self, text: str) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Failing())
    code = main(["plan", "--source", str(source), "--gpus-per-node", "1"])
    err = capsys.readouterr().err
    assert code == 75, err
    assert err.startswith("error: Standard output could not be written"), err
    assert "this is a bug" not in err and "\nhint: " in err


# --- resource limits -------------------------------------------------------------------------


@pytest.mark.slow  # commands in subprocesses of their own
@pytest.mark.parametrize("command", ["fetch", "convert"])
def test_a_file_size_limit_is_named_as_the_limit(source, tmp_path, command):
    """Under ``ulimit -f`` a write past the limit fails with EFBIG (Python ignores SIGXFSZ):
    the hint said the file was "far larger than a file of its kind can be". It names the
    process's limit and how to raise it (exit 2), and leaves nothing behind."""
    out = tmp_path / "out"
    argv = {"fetch": ["fetch", str(source), str(out), "--copy"],
            "convert": ["convert", str(source), str(out), "--tp-size", "1"]}[command]  # fmt: skip
    limit = 64 * 1024
    done = subprocess.run(
        [sys.executable, "-m", "loader", *argv, "-q"], capture_output=True, text=True,
        timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )  # fmt: skip
    _typed(done.returncode, done.stderr, "ulimit -f", f"({limit} bytes")
    assert done.stdout == ""


#: ``python -c`` as the console script runs the loader, once a native exit handler that never
#: returns is registered (``pause``, through ``__cxa_atexit``), as OpenBLAS's is when one of its
#: threads spins retrying a buffer that memory no longer holds.
_STUCK_AT_EXIT = (
    "import ctypes, sys; libc = ctypes.CDLL(None); "
    "libc.__cxa_atexit(ctypes.cast(libc.pause, ctypes.c_void_p), None, None); "
    "from loader.cli import main; sys.exit(main())"
)


@pytest.mark.slow  # commands in subprocesses of their own
@pytest.mark.parametrize("command", ["convert", "fetch", "plan", "bad"])
def test_a_native_exit_handler_never_holds_the_process(source, tmp_path, command):
    """The process of a command ends with its exit code once its own clean-up and Python's
    exit handlers ran, whatever a native library's exit handler would do: under ``ulimit -v``
    a run that ran out of memory printed its error line, then hung for ever in OpenBLAS's exit
    handler, which joins a thread that retries its buffer for ever."""
    argv = {"convert": ["convert", str(source), str(tmp_path / "out"), "--tp-size", "1"],
            "fetch": ["fetch", str(source), str(tmp_path / "dest"), "--copy"],
            "plan": ["plan", "--source", str(source), "--gpus-per-node", "1"],
            "bad": ["convert", str(tmp_path / "none"), str(tmp_path / "out"), "--tp-size", "1"],
            }[command]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _STUCK_AT_EXIT, *argv, "-q"], capture_output=True, text=True,
        timeout=30, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if command == "bad":
        _typed(done.returncode, done.stderr)
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), done.stderr


@pytest.mark.slow  # commands in subprocesses of their own
@pytest.mark.parametrize("command", ["convert", "run"])
def test_running_out_of_address_space_ends_the_process(source, tmp_path, command):
    """``ulimit -v`` at each of a range of sizes around what the loader needs: each command
    ends, with 0 or a typed error (75: memory or a thread ran out), within seconds. A library
    imported once memory ran out failed with an ``ImportError`` (numpy's own, or the dynamic
    loader's "failed to map segment"): exit 1, a bug. The commands run with one BLAS thread
    (``OPENBLAS_NUM_THREADS=1``), which users' processes do not set: with OpenBLAS's default,
    a process that cannot start its threads gets SIGINT from OpenBLAS itself, which
    test_a_blas_that_cannot_start_its_threads_is_no_interruption covers."""
    for mib in range(80, 200, 10):
        out = tmp_path / str(mib)
        argv = {"convert": ["convert", str(source), str(out), "--tp-size", "1"],
                "run": run_argv(source, out)}[command]  # fmt: skip
        limit = mib << 20
        done = subprocess.run(
            [sys.executable, "-m", "loader", *argv, "-q"], capture_output=True, text=True,
            timeout=30, env={**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"},
            preexec_fn=lambda limit=limit: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
        )  # fmt: skip
        assert done.returncode in (0, 2, 75), (mib, done.stderr)
        assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr, done.stderr


@pytest.mark.slow  # commands in subprocesses of their own
@pytest.mark.parametrize("command", ["run", "convert", "plan"])
def test_a_blas_that_cannot_start_its_threads_is_no_interruption(source, tmp_path, command):
    """Threads that cannot be started (here: each thread's stack, the size of ``ulimit -s``,
    larger than the address space ``ulimit -v`` leaves): OpenBLAS, loaded with numpy, sends
    SIGINT to its own process when it cannot start its threads. ``run`` took that for Ctrl-C
    ("interrupted", 130), which no one pressed; ``convert`` and ``plan``, importing numpy
    later, failed in its import (exit 1, a bug). Now it is memory or threads running out (75),
    naming OpenBLAS; the same command with room then succeeds."""
    argv = {"run": run_argv(source, tmp_path / "root"),
            "convert": ["convert", str(source), str(tmp_path / "out"), "--tp-size", "1"],
            "plan": ["plan", "--source", str(source), "--gpus-per-node", "1"]}[command]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "4"}
    env.pop("OMP_NUM_THREADS", None)

    def cramped() -> None:
        resource.setrlimit(resource.RLIMIT_STACK, (1 << 30, 1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = subprocess.run(
        [sys.executable, "-m", "loader", *argv, "-q"], capture_output=True, text=True,
        timeout=60, env=env, preexec_fn=cramped,
    )  # fmt: skip
    assert done.returncode == 75, done.stderr
    assert "interrupted" not in done.stderr, done.stderr
    assert "error: A library the command loads (OpenBLAS" in done.stderr, done.stderr
    assert "\nhint: " in done.stderr and "Traceback" not in done.stderr, done.stderr
    again = subprocess.run(
        [sys.executable, "-m", "loader", *argv, "-q"], capture_output=True, text=True,
        timeout=120, env=env,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr


#: A process of one thread (a signal to it is pending in that thread while blocked) that
#: ignores SIGINT, holds it back as the loader does while libraries load, and is sent one.
_IGNORED_INTERRUPT = (
    "import os, signal, subprocess\n"
    "from loader import cli\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "with cli._interrupts_told_apart():\n"
    "    subprocess.run(['kill', '-INT', str(os.getpid())], check=True)\n"
    "    print('pending' if signal.SIGINT in signal.sigpending() else 'gone')\n"
    "print('went on')\n"
)


def test_an_ignored_interrupt_held_back_while_libraries_load_stays_ignored():
    """SIGINT ignored (a background job of a shell) and sent meanwhile: a blocked signal is
    kept pending even when ignored, so holding SIGINT back while libraries load must not turn
    it into an interruption when it is taken."""
    done = subprocess.run(
        [sys.executable, "-c", _IGNORED_INTERRUPT], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["pending", "went", "on"], done.stdout


# --- any hostile value for any option ------------------------------------------------------

#: Values libraries refuse: numbers out of every range, text that is no number, control
#: characters, bytes that are not UTF-8, a very long string.
HOSTILE = ["", " ", "0", "-1", "99999999999999999999999", "nan", "inf", "-inf", "1e308",
           "1e-320", "1.5", "0x10", "1_000", "\uff19", "a\nb", "\x1b[2J", "A" * 5000, NOT_UTF8,
           "..", "gs://", "hf://", "s3://x/y", "file:", "gs://b/../x", "hf://a/../b",
           "hf://org/name@", "file://host/x", "gs://bucket:99999/x"]  # fmt: skip


def _options(source: Path, tmp: Path) -> dict[str, list[str]]:
    """Each command with every option it takes given (a value of each may be replaced)."""
    return {
        "convert": ["convert", str(source), str(tmp / "out"), "--tp-size", "1", "--pp-size", "1",
                    "--dtype", "fp16", "--workers", "1"],
        "fetch": ["fetch", str(source), str(tmp / "dest"), "--copy", "--workers", "1",
                  "--retry-deadline", "2", "--slice-mib", "1"],
        "prune": ["prune", "--repository", str(tmp / "root"), "--keep", "1", "--in-use", "k",
                  "--lock-expiry-s", "5"],
        "plan": ["plan", "--n-embd", "256", "--n-layer", "2", "--n-head", "4", "--vocab-size",
                 "320", "--n-inner", "1024", "--n-positions", "64", "--tp-size", "1",
                 "--pp-size", "1", "--instance-count", "1", "--gpus-per-node", "1",
                 "--replicas-per-node", "1", "--gpus-per-replica", "1", "--gpu-memory-gib", "16",
                 "--max-batch-size", "8", "--max-sequence-length", "64"],
        "complete": ["complete", "hi", "--url", "http://127.0.0.1:9", "--model", "m",
                     "--max-tokens", "4", "--temperature", "1", "--top-k", "1", "--top-p", "0.5",
                     "--seed", "1", "--timeout", "1"],
    }  # fmt: skip


@settings(SETTINGS, max_examples=examples(80))
@given(data=st.data(), command=st.sampled_from(sorted(_options(Path("s"), Path("t")))))
def test_any_hostile_value_of_any_option_is_never_a_bug(
    source, tmp_path, capsys, monkeypatch, data, command
):
    """The generated form of this module's cases: whatever value one argument of a command
    takes, the command ends in 0, a typed error (2, 75) or argparse's refusal (2), never
    exit 1 with a traceback. A relative value is a path below this test's own directory."""
    cwd = tmp_path / "cwd" / "here"
    cwd.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(cwd)
    argv = _options(source, tmp_path)[command]
    values = [i for i, a in enumerate(argv) if i > 0 and not a.startswith("--")]
    i = data.draw(st.sampled_from(values), label="argument")
    argv[i] = data.draw(st.sampled_from(HOSTILE), label="value")
    try:
        code, _, err = cli(capsys, *argv)
    except SystemExit as exited:  # argparse refused it
        code, err = exited.code, capsys.readouterr().err
    assert code in (0, 2, 75), err
    assert "Traceback" not in err and "this is a bug" not in err, err
    if code:
        assert "hint: " in err, err


@pytest.mark.parametrize("command", ["run", "fetch", "plan"])
def test_a_source_under_the_home_of_no_such_user_is_a_user_error(tmp_path, capsys, command):
    """``--source ~nosuchuser/ckpt``: expanding the user's home raised RuntimeError ("Could
    not determine home directory": exit 1); now the source's typed error naming it."""
    uri = "~no-such-user-here/ckpt"
    argv = {
        "run": run_argv(uri, tmp_path / "root"),
        "fetch": ["fetch", uri],
        "plan": ["plan", "--source", uri, "--gpus-per-node", "1"],
    }[command]
    code, out, err = cli(capsys, *argv)
    _typed(code, err, "'~no-such-user-here'", "does not have")
    assert out == []
    assert list(tmp_path.iterdir()) == []


# --- a Hub that accepts the connection and never answers --------------------------------


@pytest.mark.slow  # commands in subprocesses of their own
@pytest.mark.parametrize("command", ["fetch", "run"])
def test_a_hub_that_never_answers_is_transient_at_the_retry_deadline(tmp_path, command):
    """``HF_ENDPOINT`` naming a server that accepts connections and never answers: the Hub
    library's session has no timeout and asks for none for the model info or the file list,
    so ``fetch``, ``run`` and ``plan`` waited for ever whatever ``--retry-deadline`` said.
    Now each wait is bounded by it: 75 once it passed."""
    import socket
    import time

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)  # connections complete in the backlog; nothing is ever read
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        argv = {"fetch": ["fetch", "hf://org/name", str(tmp_path / "dest")],
                "run": run_argv("hf://org/name", tmp_path / "root")}[command]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": url,
               "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
        for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_TOKEN_FILE"):
            env.pop(name, None)
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "loader", *argv, "--retry-deadline", "2", "-q"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
    assert done.returncode == 75, done.stderr
    assert "Traceback" not in done.stderr and "\nhint: " in done.stderr, done.stderr
    assert time.monotonic() - start < 30


# --- a storage listing whose pages never end ------------------------------------------------


def _endless_listing(repeat: bool):
    """A Cloud Storage JSON API stand-in whose object listing always has a next page: of a
    new object each time, or of the same one again."""
    import itertools
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    counter = itertools.count()

    class Pages(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            n = next(counter)
            name = "p/config.json" if repeat else f"p/f{n}.json"
            body = json.dumps({"kind": "storage#objects", "nextPageToken": f"t{n}",
                               "items": [{"name": name, "bucket": "b", "size": "1"}]}).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize("repeat", [False, True], ids=["new-objects", "same-object"])
def test_a_storage_listing_whose_pages_never_end_is_refused(tmp_path, repeat):
    """``STORAGE_EMULATOR_HOST`` (or a proxy) answering every page of a listing with a next
    page: fetch read pages for ever (no failure for the retry deadline to end). Now a listing
    that names an object twice or goes past its bound of pages is refused (2), at once."""
    server = _endless_listing(repeat)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT),
               "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{server.server_address[1]}"}  # fmt: skip
        env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        done = subprocess.run(
            [sys.executable, "-m", "loader", "fetch", "gs://b/p", str(tmp_path / "dest"), "-q"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
    finally:
        server.shutdown()
    _typed(done.returncode, done.stderr, "The listing of gs://b/p")
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize("command", ["fetch", "run"])
def test_ctrl_c_during_a_stalled_download_ends_the_process_at_once(tmp_path, command):
    """Ctrl-C while a gs:// download waits on a server that stopped answering: the command
    said "interrupted", released its lock, and then the process stayed, Python waiting at its
    exit for the download pool's worker, still in a read that ends only at the read timeout
    (minutes; ``--retry-deadline``). Now it ends at once, 130, leaving no lock."""
    import signal

    code, out, err, took = stopped_while_stalled(
        tmp_path, command, lambda p: p.send_signal(signal.SIGINT)
    )
    assert code == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    assert took < 15, f"{took:.0f} s after Ctrl-C"
    assert out == ""
    if command == "run":
        assert not any((tmp_path / "root" / ".locks").iterdir())


@pytest.mark.slow  # a command in a subprocess of its own
@pytest.mark.parametrize("command", ["fetch", "run"])
def test_a_second_signal_while_the_command_stops_never_cuts_its_clean_up_short(tmp_path, command):
    """SIGTERM (the pod deleted) and Ctrl-C together, or a second Ctrl-C while the command
    stops: the second signal raised its exception inside the clean-up the first one ran,
    anywhere, Python's own locks included: exit 1 with "RuntimeError: release unlocked lock"
    (this is a bug), or the process hung with its publish lock held. Now the first signal
    stops the command and a later one is not raised: it ends at once with the first one's
    code, no lock left. (Both are sent before the command takes either: Python then runs
    their handlers one after the other, the second inside the first one's unwinding.)"""
    import signal

    def ctrl_c_and_sigterm(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGTERM)

    code, _, err, took = stopped_while_stalled(tmp_path, command, ctrl_c_and_sigterm)
    assert code in (130, 143), err
    assert "Traceback" not in err and "this is a bug" not in err, err
    assert took < 15, f"{took:.0f} s after the signals"
    if command == "run":
        assert not any((tmp_path / "root" / ".locks").iterdir())


def test_ctrl_c_while_the_commands_module_is_imported_is_an_interruption(monkeypatch, capsys):
    """Ctrl-C (or OpenBLAS, which raises SIGINT when it cannot start its threads) while
    ``run``'s module and numpy are imported for parsing: a KeyboardInterrupt traceback. Now
    "interrupted" and 130, as anywhere else; nothing was done yet."""
    import loader.cli

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(loader.cli, "build_parser", interrupted)
    assert main(["run", "--help"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("name", [NOT_UTF8, f"values-{NOT_UTF8}.yaml"])
def test_a_values_file_name_that_is_not_utf8_is_helms_error_not_a_bug(tmp_path, name):
    """``serve -f $'\\xff'``: helm quotes the name in its error, and reading helm's output as
    UTF-8 raised UnicodeDecodeError (exit 1). Helm's words now come back with that byte
    escaped: the chart's error, which ``serve`` reports as a user error."""
    from loader.chart import Chart, ChartError

    with pytest.raises(ChartError) as caught:
        Chart.in_checkout(ROOT).render(values_files=[tmp_path / name])
    assert "\\xff" in caught.value.output, caught.value.output
