"""What a careless command line gets: the real mistake named first, in an ``error:`` and a
``hint:`` line (exit code 2), never a usage dump or a hint that points elsewhere; and the log
options and side effects a user expects."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from loader.cli import build_parser, main
from loader.errors import SourceError
from loader.progress import byte_progress
from loader.sources import parse_uri


def _exit(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``model-loader ARGV`` (argument errors exit through argparse)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def _run_args(source: Path, root: Path, *extra: str) -> list[str]:
    return [
        "run", "--source", str(source), "--repository", str(root), "--model-name", "tiny",
        "--tp-size", "1", "--pp-size", "1", "--instance-count", "1", "--backend", "python",
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("--tp-sise", "--tp-size"), ("--instance-cuont", "--instance-count"), ("--sorce", "--source")],
)
def test_a_mistyped_option_is_named_with_the_one_meant_before_any_missing_one(
    capsys, tmp_path, typo, meant
):
    argv = _run_args(tmp_path / "ckpt", tmp_path / "models")
    index = argv.index(meant)
    argv[index] = typo
    code, err = _exit(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[0] == f"error: model-loader run: unknown option {typo} (did you mean {meant}?)"
    assert lines[1].startswith("hint: ") and len(lines) == 2  # no usage dump
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ("--retry-deadlne", "unknown option --retry-deadlne (did you mean --retry-deadline?)"),
        ("--hf-token-file", "unknown option --hf-token-file"),  # fetch's, not run's
    ],
)
def test_an_unknown_option_beside_every_required_one_is_named_not_a_good_one(
    capsys, tmp_path, extra, said
):
    """argparse reports it from the main parser, which knows none of run's options: the first
    of those (--source) was named as unknown."""
    code, err = _exit(capsys, *_run_args(tmp_path / "ckpt", tmp_path / "models"), extra, "3")
    lines = err.strip().splitlines()
    assert code == 2 and lines[0] == f"error: model-loader run: {said}", err
    assert lines[1] == "hint: `model-loader run --help` lists the options and arguments."


def test_plan_takes_a_model_name_in_any_case_and_refuses_an_unknown_one_in_two_lines(capsys):
    code, err = _exit(
        capsys, "plan", "--model", "CodeGen-16B", "--gpus-per-node", "16", "--gpu-memory-gib", "40"
    )
    assert code == 0, err
    code, err = _exit(
        capsys, "plan", "--model", "CodeGen-17B", "--gpus-per-node", "16", "--gpu-memory-gib", "40"
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2
    assert "invalid choice: 'codegen-17b'" in lines[0] and "codegen-16b" in lines[0]


@pytest.mark.parametrize(
    ("uri", "meant"),
    [("hf:/Salesforce/codegen-350M-mono", "hf://Salesforce/codegen-350M-mono"),
     ("gs:/bucket/ckpt", "gs://bucket/ckpt"), ("hf:org/name@main", "hf://org/name@main")],
)  # fmt: skip
def test_a_uri_with_its_slashes_wrong_is_not_taken_for_a_local_path(uri, meant):
    with pytest.raises(SourceError, match="two slashes") as info:
        parse_uri(uri)
    assert info.value.remediation == f"Did you mean {meant}?"


def test_a_local_path_that_only_looks_like_a_uri_is_still_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf:odd").mkdir()
    assert parse_uri("hf:odd").scheme == "file"


@pytest.mark.parametrize(
    "argv",
    [["-vv", "fetch", "x"], ["fetch", "x", "-vv"], ["fetch", "-v", "-v", "x"]],
)
def test_verbosity_counts_before_and_after_the_sub_command(argv):
    args = build_parser().parse_args(argv)
    assert args.verbose == 2 and args.quiet is False
    assert build_parser().parse_args(["fetch", "x", "-q"]).quiet is True


def test_an_unknown_log_level_in_the_environment_is_an_error_not_ignored(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.setenv("MODEL_LOADER_LOG_LEVEL", "LOUD")
    code, err = _exit(capsys, "fetch", str(tmp_path))
    assert code == 2
    assert "MODEL_LOADER_LOG_LEVEL='LOUD' is not a log level" in err and "DEBUG" in err


def test_run_never_creates_the_parents_of_the_repository_root(capsys, source, tmp_path):
    root = tmp_path / "no" / "such" / "models"
    code, err = _exit(capsys, *_run_args(source, root))
    assert code == 2
    assert f"{root.parent} does not exist" in err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--repository", ""],
        ["run", "--repository", "{root}", "--work-dir", ""],
        ["prune", "--repository", ""],
        ["fetch", "--copy", "{source}", ""],
        ["convert", "--tp-size", "1", "{source}", ""],
        ["convert", "--tp-size", "1", "", "{root}"],
    ],
)
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(
    capsys, source, tmp_path, monkeypatch, argv
):
    """``--repository "$ROOT"`` with ROOT unset is a mistake: it must not publish, prune, copy
    or convert into whatever directory the command was started in."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    argv = [a.format(source=source, root=tmp_path / "models") for a in argv]
    if argv[0] == "run":
        argv = _run_args(source, tmp_path / "models")[:3] + argv[1:] + _run_args(source, "x")[5:]
    code, err = _exit(capsys, *argv)
    assert code == 2
    assert "an empty path would mean the current directory" in err
    assert list(cwd.iterdir()) == []
    assert not (tmp_path / "models").exists()


def test_preferred_batch_sizes_without_dynamic_batching_are_refused(capsys, source, tmp_path):
    argv = _run_args(source, tmp_path / "models", "--no-dynamic-batching")
    code, err = _exit(capsys, *argv, "--preferred-batch-size", "4")
    assert code == 2 and "no effect with --no-dynamic-batching" in err
    assert not (tmp_path / "models").exists()


def test_progress_lines_are_not_repeated_and_nothing_to_do_is_not_a_zero_rate(caplog):
    with caplog.at_level(logging.DEBUG, logger="loader.progress"):
        with byte_progress("copy", 2_000_000, stream=io.StringIO(), interval=0.0) as progress:
            progress.update(1_000_000)
            progress.update(1_000_000)
        with byte_progress("verifying repository", 0, stream=io.StringIO()):
            pass
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == len(set(info)) == 2  # 50 % and 100 %, the last one not twice
    assert not any("0.00B/s" in line for line in info)
    assert "verifying repository: nothing to do" in caplog.text


@pytest.mark.parametrize("argv", [[], ["-v"], ["-q"]])
def test_no_command_lists_every_command_with_what_it_does(capsys, argv):
    from loader.cli import COMMANDS

    code, err = _exit(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[0] == "error: model-loader: which command? One of:"
    listed = [line.split()[0] for line in lines[1:-1]]
    assert listed == [name.rsplit(".", 1)[1] for name in COMMANDS]
    assert all(len(line.split()) > 1 for line in lines[1:-1])  # each with its help
    assert lines[-1].startswith("hint: `model-loader COMMAND --help`")


def test_make_help_lists_every_documented_target():
    """`make help` lists each target the Makefile documents with `##` (digits in a name too)."""
    import re
    import subprocess

    root = Path(__file__).resolve().parents[1]
    documented = re.findall(r"^([A-Za-z0-9_-]+):[^\n]*## ", (root / "Makefile").read_text(), re.M)
    shown = subprocess.run(
        ["make", "--no-print-directory", "help"], cwd=root, capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "test-e2e" in documented
    assert [line.split()[0] for line in shown.splitlines()] == documented


def _plant(where: Path, target: Path) -> None:
    where.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir(exist_ok=True)
    where.symlink_to(target)


@pytest.mark.parametrize("command", ["run", "fetch", "convert"])
def test_a_hint_names_where_this_command_writes_never_another_commands_option(
    capsys, source, tmp_path, command
):
    """A link planted where the command writes is refused, and the hint says to point the
    command's own argument elsewhere: ``fetch`` and ``convert`` have no --repository."""
    elsewhere = tmp_path / "elsewhere"
    if command == "run":
        _plant(tmp_path / "root" / ".staging", elsewhere)
        argv, own, foreign = _run_args(source, tmp_path / "root"), "--repository", "DEST"
    elif command == "fetch":
        elsewhere.mkdir()
        (tmp_path / "dest").mkdir()
        (tmp_path / "dest" / "config.json").symlink_to(elsewhere / "config.json")
        argv = ["fetch", "--copy", str(source), str(tmp_path / "dest")]
        own, foreign = "DEST", "--repository"
    else:
        _plant(tmp_path / "out" / "1-gpu", elsewhere)
        argv = ["convert", str(source), str(tmp_path / "out"), "--tp-size", "1", "--force"]
        own, foreign = "OUTPUT_DIR", "--repository"
    code, err = _exit(capsys, *argv)
    assert code == 2, err
    hint = [line for line in err.splitlines() if line.startswith("hint:")]
    assert hint and own in hint[-1] and foreign not in hint[-1], err
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e9"])
def test_serve_refuses_a_startup_timeout_that_never_ends_or_cannot_start(capsys, tmp_path, value):
    """``serve --startup-timeout inf`` waited for ever for a server that would not be ready;
    ``nan`` and ``-1`` failed at once with a readiness error that blamed the server. Each is
    refused as the flag's error, before anything starts."""
    code, err = _exit(capsys, "serve", str(tmp_path), "--startup-timeout", value)
    assert code == 2, err
    assert "--startup-timeout must be" in err and "hint: Set the startup timeout" in err, err


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e9"])
def test_complete_refuses_a_timeout_that_never_ends_or_cannot_start(capsys, value):
    """gRPC took ``complete --timeout inf`` (and nan, 0, -1) for a deadline already past: the
    readiness check, the model list or the completion failed at once with "Deadline
    Exceeded" and a hint to check that the server is up. Each is the flag's error, before any
    call."""
    code, err = _exit(capsys, "complete", "hi", "--url", "127.0.0.1:1", "--timeout", value)
    assert code == 2, err
    assert "--timeout must be" in err and "hint: Set the completion timeout" in err, err


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGABRT", "SIGUSR1"])
def test_a_child_ended_by_another_signal_while_it_stopped_keeps_that_signals_hint(sig):
    """Only SIGKILL while the supervised child stopped is a stop that did not wait for it;
    another signal that ended it then (a crash, a signal it gives no meaning) keeps its own
    hint, never the grace period's."""
    import signal

    from loader.errors import KilledError

    signum = getattr(signal, sig)
    while_stopping = KilledError(signum, stopping=signal.SIGTERM)
    assert while_stopping.remediation == KilledError(signum).remediation
    assert "stopping on" not in while_stopping.remediation
    killed = KilledError(signal.SIGKILL, stopping=signal.SIGTERM).remediation
    assert killed.startswith("It was stopping on SIGTERM")


def test_standard_output_that_cannot_write_a_character_is_named_a_lone_surrogate_not():
    """Standard output in an encoding without a character the command prints (``ascii``,
    ``modèles``): the error is marked as standard output's and names its encoding and
    PYTHONIOENCODING. A lone surrogate (bytes of an argument that are not UTF-8) is not the
    encoding's fault: left to the check of the arguments (the slow test runs a whole command
    under PYTHONIOENCODING=ascii)."""
    import io

    from loader import cli

    out = cli._MarkedOutput(io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    for text, named in (("/data/modèles", True), ("/data/mod\udce8les", False)):
        with pytest.raises(UnicodeEncodeError) as raised:
            out.write(text)
        assert getattr(raised.value, cli._STANDARD_OUTPUT, False)
        typed = cli._stdout_unencodable(raised.value)
        if named:
            assert typed is not None and "ascii" in typed.message, typed
            assert "PYTHONIOENCODING" in typed.remediation
        else:
            assert typed is None


def test_a_warning_raised_as_an_error_is_named_only_when_python_was_told_to(monkeypatch):
    """A Warning raised as an exception is Python told to (``-W error``, PYTHONWARNINGS:
    ``sys.warnoptions``) only when it was; without such an option it is no setting of the
    user's to name (a library raising a Warning class itself)."""
    import sys

    from loader import cli

    monkeypatch.setattr(sys, "warnoptions", [])
    assert cli._warning_raised(ImportWarning("from a library")) is None
    monkeypatch.setattr(sys, "warnoptions", ["error"])
    typed = cli._warning_raised(ImportWarning("from a library"))
    assert typed is not None and "PYTHONWARNINGS" in typed.message
    assert cli._warning_raised(ValueError("no warning")) is None
