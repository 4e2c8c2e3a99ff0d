"""Command-line entry point: argument parsing, logging set-up and exit codes; nothing else.

Each sub-command lives in its own module of this package and is listed in :data:`COMMANDS`.
A module provides ``register(subparsers)`` (adds its parser and sets ``func``) and keeps the
work itself in the library modules.

Exit codes (the same for every command; a Kubernetes Job's ``podFailurePolicy`` acts on them):

====  ==========================================================================================
0     success
1     an unexpected failure (a bug: the log holds its traceback)
2     a user mistake (a :class:`~loader.errors.LoaderError`: an error line and a hint, no
      traceback); running it again unchanged cannot succeed
75    a transient failure (a source still failing at ``--retry-deadline``, a publish lock held
      too long or taken over, a source file cut short while it was read): running it again
      later may succeed
130   interrupted (Ctrl-C)
141   standard output's reader went away (``| head``) before the command finished writing
      it: an error line, the code of a command killed by SIGPIPE
128+n stopped by a signal n the loader gives no meaning (SIGUSR1: 138, SIGALRM: 142, SIGQUIT):
      the command unwinds like SIGTERM, then dies of the signal
143   stopped by SIGTERM (Kubernetes deleting the Job's pod or draining its node): the command
      unwinds like Ctrl-C (locks released, its own temporary files removed) and exits
129   stopped by SIGHUP (its terminal closed, or its session's leader ended): unwinds like
      SIGTERM (unless SIGHUP is ignored: ``nohup``)
128+n ``convert`` or ``run`` killed by signal n (SIGKILL: 137, SIGSEGV: 139): its supervisor
      (:mod:`loader.cli.supervise`) prints the error and removes what it left
====  ==========================================================================================
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import difflib
import errno
import importlib
import importlib.util
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from loader import __version__, stages
from loader.cli import supervise
from loader.cli.supervise import say
from loader.errors import (
    LoaderError,
    ResourceExhaustedError,
    naming_write_targets,
    redacted,
    resource_exhaustion,
    shown,
    typed_os_error,
)
from loader.limits import Limit, SettingError

log = logging.getLogger("loader")

EXIT_BUG = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
#: Standard output's reader went away: the code of a command killed by SIGPIPE.
EXIT_STDOUT_GONE = 128 + signal.SIGPIPE  # 141

#: Sub-command modules, in the order ``--help`` lists them; each is named after its command.
COMMANDS: tuple[str, ...] = (
    "loader.cli.convert",
    "loader.cli.fetch",
    "loader.cli.run",
    "loader.cli.prune",
    "loader.cli.plan",
    "loader.cli.serve",
    "loader.cli.tune",
    "loader.cli.complete",
)


def commands_for(argv: Sequence[str]) -> tuple[str, ...]:
    """The sub-command modules parsing ``argv`` needs: the one it names (its first argument
    that is not an option: the main parser's options take no value), none for ``--version``
    alone, else all of them (``--help``, or a name to correct)."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    if f"loader.cli.{first}" in COMMANDS:
        return (f"loader.cli.{first}",)
    return () if first is None and "--version" in argv else COMMANDS


class Parser(argparse.ArgumentParser):
    """argparse with our error format: ``error:`` and ``hint:`` lines, exit code 2, no usage
    dump, and an unknown option named first, with the option it most likely meant (argparse
    would report a required option as missing before it mentions the typo)."""

    def _get_value(self, action: argparse.Action, arg_string: str) -> object:
        """A number is written in ASCII digits: Python's ``int`` and ``float`` take any
        script's (``--workers ９``, ``--tp-size ٢``), which no shell script or manifest means
        and which prints as another number than the one read."""
        if (
            action.type in (int, float) or getattr(action.type, "number", False)
        ) and not arg_string.isascii():
            odd = next(c for c in arg_string if not c.isascii())
            raise argparse.ArgumentError(
                action,
                f"{arg_string!r} holds {odd!r} (U+{ord(odd):04X}), which is no ASCII "
                "character: write the number with the digits 0-9",
            )
        return super()._get_value(action, arg_string)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _command(self) -> argparse.ArgumentParser | None:
        """On the main parser, the parser of the command given (argparse reports a command's
        unknown option from the main parser); None elsewhere or without one."""
        given = [t for t in getattr(self, "_given", []) if not t.startswith("-")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return next((action.choices[t] for t in given if t in action.choices), None)
        return None

    def _known_options(self) -> list[str]:
        """This parser's options and those of the command given."""
        command = self._command()
        extra = list(command._option_string_actions) if command is not None else []
        return [*self._option_string_actions, *extra]

    def _unknown_options(self) -> list[str]:
        known = self._known_options()
        unknown = []
        for token in getattr(self, "_given", []):
            if token == "--":
                break
            name = token.split("=", 1)[0]
            if name.startswith("--") and not any(k.startswith(name) for k in known):
                unknown.append(name)
        return unknown

    def _commands(self) -> list[tuple[str, str]]:
        """``(name, help)`` of the sub-commands, if this parser has them."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help or "" for a in action._choices_actions}
                return [(name, helps.get(name, "")) for name in action.choices]
        return []

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        commands = self._commands()
        if commands and message.endswith("required: COMMAND"):
            print(f"error: {self.prog}: which command? One of:", file=sys.stderr)
            width = max(len(name) for name, _ in commands)
            for name, text in commands:
                print(f"  {name:<{width}}  {text}", file=sys.stderr)
            print(
                f"hint: `{self.prog} COMMAND --help` shows what a command takes.", file=sys.stderr
            )
            self.exit(2)
        unknown = self._unknown_options()
        if unknown:
            options = [o for o in self._known_options() if o.startswith("--")]
            close = difflib.get_close_matches(unknown[0], options, n=1, cutoff=0.6)
            message = f"unknown option {unknown[0]}" + (
                f" (did you mean {close[0]}?)" if close else ""
            )
        prog = getattr(self._command(), "prog", self.prog)
        print(f"error: {prog}: {message}", file=sys.stderr)
        print(f"hint: `{prog} --help` lists the options and arguments.", file=sys.stderr)
        self.exit(2)


def add_log_options(parser: argparse.ArgumentParser, *, default: object = 0) -> None:
    """-v/--verbose and -q/--quiet (on the main parser and, unset by default, on every
    sub-command, so they work before and after it)."""
    parser.add_argument(
        "-v", "--verbose", action="count", default=default, help="more log output (-vv for debug)"
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS if default is argparse.SUPPRESS else False,
        help="only warnings and errors",
    )


def build_parser(commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
    """The parser of ``commands`` (modules of :data:`COMMANDS`, by default all): ``main`` asks
    only for the command it runs, which then imports only what it uses, not what the others
    need to describe themselves."""
    parser = Parser(
        prog="model-loader",
        description="Fetch, convert and publish LLM checkpoints as Triton model repositories.",
        epilog="Environment: MODEL_LOADER_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR) sets the log "
        "level and wins over -v and -q; HF_TOKEN, HF_TOKEN_PATH (or HF_TOKEN_FILE) and HF_ENDPOINT for hf:// "
        "sources; GOOGLE_APPLICATION_CREDENTIALS and STORAGE_EMULATOR_HOST for gs:// sources. "
        "Exit codes: 0 done, 2 a mistake to fix (an error line and a hint), 1 a bug, "
        "130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_log_options(parser)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in commands:
        importlib.import_module(name).register(subparsers)
    for sub in subparsers.choices.values():
        add_log_options(sub, default=argparse.SUPPRESS)
    return parser


#: Optional extra -> what it is for, in the words of the error a missing one gives.
EXTRAS: dict[str, str] = {
    "torch": "reading PyTorch .bin checkpoints",
    "gcs": "gs:// sources",
    "hf": "hf:// sources",
    "serve": "the local CPU Triton (serve, tune, the serving bench)",
    "bench": "benchmarks (tables, plots, the demo model)",
    "dev": "the tests and linters",
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def require_extra(extra: str, *modules: str) -> None:
    """Raise a :class:`LoaderError` naming ``extra`` unless every module can be imported."""
    missing = [m for m in modules if not _importable(m)]
    if missing:
        raise LoaderError(
            f"this command needs {', '.join(missing)} ({EXTRAS.get(extra, extra)}), "
            "which is not installed",
            f"Install the [{extra}] extra: pip install 'model-triton-loader[{extra}]' "
            "(in a checkout: make install).",
        )


#: The values MODEL_LOADER_LOG_LEVEL takes.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def limit_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    limit: Limit,
    *,
    help: str,
    **kwargs: object,
) -> None:
    """Add ``flag`` for the setting ``limit``: its default (unless ``default`` is given) and the
    help's "(default: ...)" come from the limit, and an error about the setting names the flag."""
    default = kwargs.pop("default", limit.default)
    shown = "" if default is None else f" (default: {limit.format(default)})"  # type: ignore[arg-type]
    kwargs.setdefault("type", float)
    parser.add_argument(flag, default=default, help=help + shown, **kwargs)  # type: ignore[arg-type]
    flags = dict(parser.get_default("limit_flags") or {})
    parser.set_defaults(limit_flags={**flags, limit: flag})


#: Characters that would split the one line a command prints as its result.
LINE_BREAKS = "\n\r\0"


def nonempty(value: str) -> str:
    """An argparse ``type`` for a path argument: an empty one (an unset variable in a script)
    is refused, never taken as the current directory (``Path("")`` is ``.``)."""
    if not value:
        raise argparse.ArgumentTypeError(
            "an empty path would mean the current directory (is a variable in the command unset?)"
        )
    return value


def nonempty_path(value: str) -> Path:
    """:func:`nonempty` as a :class:`~pathlib.Path`."""
    return Path(nonempty(value))


def port(value: str) -> int:
    """An argparse ``type`` for a TCP port: 1 to 65535, or 0 for a free one (a socket's
    ``bind`` raises OverflowError past that range)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(
            f"{number} is no TCP port; pass 1 to 65535 (0: a free one)"
        )
    return number


port.number = True  # type: ignore[attr-defined]  # its text is a number (Parser._get_value)


def directory_path(value: str) -> Path:
    """An argparse ``type`` for a directory the command creates if needed (``--work-dir``,
    ``--output-dir``): refused at once when it, or the deepest level of it that exists, is no
    directory (a file, a FIFO, a dangling link), naming what stands there."""
    from loader import fs

    path = nonempty_path(value)
    for level in (path, *path.parents):
        what = fs.not_a_directory(level)
        if what == "is a directory":
            break
        if what != "does not exist":
            raise argparse.ArgumentTypeError(
                f"{level} {what}; pass a directory, or a path where one can be created"
            )
    return path


def one_line_path(what: str, value: object, hint: str | None = None) -> None:
    """Refuse ``value`` (the argument ``what``) if it holds a line break or a NUL: the last line
    ``run``, ``fetch`` and ``convert`` print is the path of their result, which must be one
    line for a script reading it. Checked before any work."""
    if value is not None and any(c in str(value) for c in LINE_BREAKS):
        raise LoaderError(
            f"{what} {str(value)!r} holds a line break or a NUL: the last line the command "
            "prints is the path of its result, which must be one line.",
            hint or f"Pass {what} as a path without line breaks.",
        )


def print_path(path: object) -> None:
    """Print the result's path as the command's last line; one that resolved to a name with a
    line break (through a link) is an error, never two lines a script would misread."""
    one_line_path(
        "The result's path",
        path,
        "It was written there; rename it (or the link that leads to it) to a name without "
        "line breaks, then run again.",
    )
    print(path, flush=True)


def _message(exc: LoaderError, args: argparse.Namespace) -> str:
    """The error's message; a setting's error names the flag that set it."""
    if isinstance(exc, SettingError):
        flag = (getattr(args, "limit_flags", None) or {}).get(exc.limit)
        if flag is not None:
            return exc.says(flag)
    return exc.message


def configure_logging(verbose: int, quiet: bool) -> None:
    """The log level from -v/-q, overridden by ``MODEL_LOADER_LOG_LEVEL`` (an unknown value
    is a :class:`LoaderError`). At DEBUG the libraries' own debug lines show too."""
    level = logging.WARNING if quiet else logging.DEBUG if verbose >= 2 else logging.INFO
    env_level = os.environ.get("MODEL_LOADER_LOG_LEVEL", "").strip()
    if env_level:
        if env_level.upper() not in LOG_LEVELS:
            raise LoaderError(
                f"MODEL_LOADER_LOG_LEVEL={env_level!r} is not a log level",
                f"Set it to one of {', '.join(LOG_LEVELS)}, or unset it.",
            )
        level = getattr(logging, env_level.upper())
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        if _redact not in handler.filters:
            handler.addFilter(_redact)
    if level > logging.DEBUG:
        for noisy in ("urllib3", "google", "filelock", "httpx", "httpx2", "huggingface_hub"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def _redact(record: logging.LogRecord) -> bool:
    """A log filter: the credentials of a URL in a line are never written (an HTTP library
    logs each request's URL, with those ``HF_ENDPOINT`` may carry, at -vv)."""
    try:
        message = record.getMessage()
    except Exception:  # a malformed call: the handler reports it as logging does
        return True
    if "@" in message:
        record.msg, record.args = redacted(message), None
    return True


#: The signals other than SIGINT that stop a command and unwind it like Ctrl-C, with the words
#: its last line gives them. SIGHUP is a stop too: the terminal the command ran in closed (or
#: its session ended), and dying of it left what only the command removes (a ``serve``'s
#: tritonserver, which leads a session of its own, went on serving its ports).
STOPPING: dict[int, str] = {
    signal.SIGTERM: "terminated (SIGTERM)",
    signal.SIGHUP: "hung up (SIGHUP: its terminal closed)",
}


#: The other signals whose default action ends the process, which the loader gives no meaning
#: (SIGQUIT, SIGUSR1, SIGALRM, the timers' and CPU limit's, the real-time ones, SIGSTKFLT,
#: which no fault raises on Linux), but not a fault's (SIGSEGV, SIGBUS, ...: a handler for
#: those would run the faulting instruction again for ever). Each killed a command at once,
#: without its clean-up: ``serve``'s tritonserver, which leads a session of its own, went on
#: serving its ports with its temporary directory left, ``prune`` left its lock, ``fetch``
#: its temporary files. Now they unwind the command like SIGTERM, then the process dies of
#: the signal (the status it had).
ENDING: tuple[int, ...] = (
    *(getattr(signal, name) for name in ("SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM",
                                         "SIGPROF", "SIGXCPU", "SIGIO", "SIGPWR",
                                         "SIGSTKFLT")
      if hasattr(signal, name)),
    *(range(signal.SIGRTMIN, signal.SIGRTMAX + 1) if hasattr(signal, "SIGRTMIN") else ()),
)  # fmt: skip


class Terminated(KeyboardInterrupt):
    """SIGTERM (or another signal of :data:`STOPPING`) arrived: unwinds every ``finally`` and
    ``except BaseException`` like Ctrl-C; the process then exits with 128 + ``signum``."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


#: The signal that began stopping the command (SIGTERM or SIGINT), once one arrived.
_stopping: list[int] = []


def _stop(signum: int, frame: object) -> None:
    """The first SIGTERM or SIGINT stops the command: :class:`Terminated` or
    ``KeyboardInterrupt`` raised in the main thread, which then unwinds. A later one (a second
    Ctrl-C, SIGTERM then Ctrl-C) is taken and not raised: raised inside the clean-up the first
    one runs, it cut that short at any point, Python's own included (a condition's lock being
    taken back: "RuntimeError: release unlocked lock", exit 1 with a traceback; or a lock left
    taken: the process hung with its publish lock held)."""
    if _stopping:
        return
    _stopping.append(signum)
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM, SIGHUP and the signals of :data:`ENDING` raise
    :class:`Terminated` and SIGINT ``KeyboardInterrupt`` in the main thread, the first of them only (:func:`_stop`); once one
    arrived the handlers stay, so that none raised while the command reports and ends either.
    SIGHUP and SIGINT stay ignored where they are (``nohup``; a shell's background job).
    Outside the main thread signals cannot be handled: no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stopping.clear()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _stop)}
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _stop)
    for signum in ENDING:  # those a caller (a test) handles, or ignores, stay so
        if signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, _stop)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _stop)
    try:
        yield
    finally:
        if not _stopping:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _exit_now(code: int) -> NoReturn:
    """Exit at once: every lock and temporary file of this command is already released, and
    worker threads of libraries (a download pool) must not hold the exit past the grace period
    Kubernetes gives after SIGTERM. A stream that cannot be flushed any more (its reader gone,
    its volume full) does not change the exit code."""
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # None for a closed stream: AttributeError
            stream.flush()
    os._exit(code)


#: The exit code of the command this process ran from its own command line, once it is known.
_process_exit: list[int] = []


def _end_process() -> None:
    """The process's last exit handler (registered first, so run last): once the command's own
    clean-up and every Python exit handler ran, end the process with its exit code without the
    exit handlers of native libraries, which the loader never needs and which can hang it:
    OpenBLAS's joins its worker threads, and one whose buffer could not be allocated (memory
    ran out, ``ulimit -v``) retries for ever, so the process hung after its error line."""
    if _process_exit:
        _exit_now(_process_exit[-1])


def report(exc: LoaderError, args: argparse.Namespace | None = None) -> int:
    """Print a user error as ``error:`` and ``hint:`` lines; its exit code (also when standard
    error itself cannot be written: the exit code still says what happened)."""
    message = exc.message if args is None else _message(exc, args)
    say(_writable(f"error: {message}"), _writable(f"hint: {exc.remediation}"))
    return exc.exit_code


def _writable(text: str) -> str:
    """``text`` as standard error can write it whatever its encoding: a character it cannot
    encode (a path's byte that is not UTF-8, a lone surrogate in Python) escaped."""
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


def run_command(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run a command and turn its outcome into the exit code (the one funnel for every CLI).
    A failed file-system call becomes its typed error here (:func:`loader.errors.typed_os_error`,
    the one mapping of errno classes)."""
    try:
        with sigterm_unwinds(), _marking_standard_output():
            _load_blas()
            result = func(args)
            if sys.stdout is not None:
                sys.stdout.flush()  # a failure to write what it printed is the command's
    except LoaderError as exc:
        return report(exc, args)
    except OSError as exc:
        if getattr(exc, _STANDARD_OUTPUT, False):
            return report(_stdout_gone(exc) or _stdout_failed(exc), args)
        typed = typed_os_error(exc) or _cwd_gone(exc)
        if typed is None:
            if _stopping:
                return _stopped(_stopping[0], exc)
            log.exception("unexpected failure (this is a bug; please report it with the log above)")
            return EXIT_BUG
        log.debug("file-system failure", exc_info=True)
        return report(typed, args)
    except KeyboardInterrupt as stopped:
        return _stopped(getattr(stopped, "signum", signal.SIGINT))
    except Exception as exc:
        if _stopping:
            return _stopped(_stopping[0], exc)
        typed = (
            resource_exhaustion(exc)
            or _stdout_unencodable(exc)
            or _not_text(exc, args)
            or _warning_raised(exc)
        )
        if typed is not None:
            log.debug("typed failure", exc_info=True)
            return report(typed, args)
        log.exception("unexpected failure (this is a bug; please report it with the log above)")
        return EXIT_BUG
    return int(result or 0)


def _stopped(signum: int, turned: Exception | None = None) -> int:
    """The end of a command stopped by ``signum``: its line, and the exit code (a signal of
    :data:`STOPPING` ends the process here, :func:`_exit_now`). ``turned``: the exception a
    library made of the stop's (numpy's C part, imported when SIGTERM came, fails its import
    with an ImportError of its own): the stop's, not a bug."""
    if turned is not None:
        log.debug("stopped; a library raised instead", exc_info=turned)
    if signum in STOPPING:
        say(f"{STOPPING[signum]}; stopped cleanly")
        _exit_now(128 + signum)
    if signum != signal.SIGINT:
        say(f"stopped by {signal.Signals(signum).name}; cleaned up")
        _die_of(signum)
    say("interrupted")
    return EXIT_INTERRUPTED


def _die_of(signum: int) -> NoReturn:
    """End the process by ``signum``'s default action, once the command unwound: the status
    a process killed by it has (``128 + signum`` to a shell; a core for SIGQUIT where cores
    are kept), as it had before the command cleaned up first."""
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signum,))
    os._exit(128 + signum)  # not reached where the signal can be taken


def _not_text(exc: Exception, args: argparse.Namespace) -> LoaderError | None:
    """An argument the user gave holds bytes that are not
    UTF-8 (a name in another encoding: Python carries them as lone surrogates), and a library
    had to write it as text (a prompt sent to a server, a URL, a JSON document): the error
    names that argument. None when no argument holds the characters (a bug). The environment
    variables a library reads are checked where they are read (:mod:`loader.sources.settings`)."""
    if not isinstance(exc, UnicodeEncodeError) or exc.start >= exc.end:
        return None
    bad = exc.object[exc.start : exc.end]
    given = [
        (f"The argument {shown(v)}", v)
        for value in vars(args).values()
        for v in (value if isinstance(value, list | tuple) else [value])
        if isinstance(v, str | os.PathLike)
    ]
    for what, value in given:
        if bad in str(value):
            return LoaderError(
                f"{what} holds bytes that are not UTF-8 text, and the command must write it "
                "as text.",
                "Pass it as UTF-8 text (a terminal or a file in another encoding gives other "
                "bytes; check the locale).",
            )
    return None


def _warning_raised(exc: Exception) -> LoaderError | None:
    """A library's warning raised as an error because Python was told to (``PYTHONWARNINGS=error``
    or ``-W error``: ``sys.warnoptions``), not a bug: google-api-core's ImportWarning at its
    import ended ``fetch gs://`` with exit 1 and a traceback. None for any other exception."""
    if not isinstance(exc, Warning) or not sys.warnoptions:
        return None
    return LoaderError(
        f"A library the command uses raised its warning as an error ({type(exc).__name__}: "
        f"{exc}), as Python was told to (PYTHONWARNINGS or -W: {','.join(sys.warnoptions)}).",
        "Unset PYTHONWARNINGS (and drop -W error): the loader's libraries warn of things that "
        "do not stop it.",
    )


#: The attribute :func:`_marking_standard_output` sets on an error of standard output.
_STANDARD_OUTPUT = "standard_output"


class _MarkedOutput:
    """Standard output as a command writes it: an ``OSError`` of a write or a flush is marked
    as standard output's (:data:`_STANDARD_OUTPUT`), so that the funnel never takes it for a
    failure of the files the command works on ("the volume holding a file ran out of space;
    nothing was published" for ``run > /dev/full``, once the key was published)."""

    def __init__(self, stream: object) -> None:
        self._stream = stream

    def _marked(self, call: Callable[..., object], *args: object) -> object:
        try:
            return call(*args)
        except (OSError, UnicodeEncodeError) as exc:
            setattr(exc, _STANDARD_OUTPUT, True)
            raise

    def write(self, text: str) -> object:
        return self._marked(self._stream.write, text)  # type: ignore[attr-defined]

    def writelines(self, lines: object) -> object:
        return self._marked(self._stream.writelines, lines)  # type: ignore[attr-defined]

    def flush(self) -> object:
        return self._marked(self._stream.flush)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _marking_standard_output() -> Iterator[None]:
    """While the block runs, ``sys.stdout`` is a :class:`_MarkedOutput` (none when it is
    closed: Python then drops what is printed)."""
    stream = sys.stdout
    if stream is None:
        yield
        return
    sys.stdout = _MarkedOutput(stream)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = stream


def _stdout_failed(exc: OSError) -> LoaderError:
    """Standard output could not be written (its volume full, an I/O error, a file-size limit,
    a descriptor opened only for reading): what the command printed is cut short, while what
    it did stands; 75 when the failure may pass, else 2."""
    typed = typed_os_error(exc)
    reason = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
    failed = LoaderError(
        f"Standard output could not be written ({reason}): what the command printed is cut "
        "short; what it did before stands (a published key stays published).",
        "Point standard output at a terminal, a pipe or a file on a volume with room, then run "
        "again to see the output (an already published key is verified, not rebuilt).",
    )
    if typed is not None:
        failed.exit_code = typed.exit_code
    return failed


def _stdout_unencodable(exc: Exception) -> LoaderError | None:
    """Standard output's encoding (``PYTHONIOENCODING``, else the locale's: ``ascii``) cannot
    write a character the command printed (``run --repository /data/modèles``): the error said
    the argument "holds bytes that are not UTF-8 text" with a hint to pass it as UTF-8, which it
    was, once the key was published. None unless standard output raised it for characters
    (a lone surrogate, from bytes that are not UTF-8, is :func:`_not_text`'s)."""
    if not isinstance(exc, UnicodeEncodeError) or not getattr(exc, _STANDARD_OUTPUT, False):
        return None
    bad = exc.object[exc.start : exc.end]
    if any("\ud800" <= c <= "\udfff" for c in bad):
        return None
    return LoaderError(
        f"Standard output writes {exc.encoding} (PYTHONIOENCODING, else the locale), which "
        f"cannot write {bad!r}: what the command printed is cut short; what it did before "
        "stands (a published key stays published).",
        "Set PYTHONIOENCODING=utf-8 or a UTF-8 locale (LC_ALL=C.UTF-8), then run again to see "
        "the output (an already published key is verified, not rebuilt).",
    )


def _stdout_gone(exc: OSError) -> LoaderError | None:
    """Standard output's reader went away (``model-loader plan | head -1``): the write's
    ``EPIPE`` is no bug, and no user mistake either; the exit code is the one a command
    killed by SIGPIPE has. Only when standard output itself is the broken pipe (``POLLERR``
    on it), not a socket to a server."""
    if not isinstance(exc, BrokenPipeError):
        return None
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, 0)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            return None
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)  # the last flush at exit goes nowhere
    except (AttributeError, OSError, ValueError):  # no standard output with a descriptor
        return None
    gone = LoaderError(
        "Standard output was closed by its reader (a pipe into head?) before the command "
        "finished writing it; the rest of its output was dropped.",
        "Read the whole output; if only its start was wanted, ignore this error.",
    )
    gone.exit_code = EXIT_STDOUT_GONE
    return gone


def _cwd_gone(exc: OSError) -> LoaderError | None:
    """A relative path met a working directory that was deleted (``getcwd`` fails)."""
    if exc.errno != errno.ENOENT or exc.filename is not None:
        return None
    try:
        os.getcwd()
    except FileNotFoundError:
        return LoaderError(
            "The current working directory was deleted, so a relative path cannot be resolved.",
            "Run from an existing directory, or pass absolute paths.",
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` and return its exit code. Without ``argv`` (the console script,
    ``python -m loader``) the command line is the process's own, a command that maps source
    files runs in a supervised child (:mod:`loader.cli.supervise`), and the process ends with
    the exit code once Python's exit handlers ran (:func:`_end_process`); with ``argv`` it runs
    here."""
    if argv is not None:
        return _main(argv)
    atexit.register(_end_process)
    _hold_standard_descriptors()
    _open_stop_signals()
    code = _main(None)
    _process_exit.append(code)
    if _left_running():
        # Python would wait for them before its exit handlers run (a download pool's worker
        # that Ctrl-C left in a read of a stalled server: up to the read timeout, minutes,
        # after "interrupted"); the exit handlers run now instead, the last one ending the
        # process (_end_process), as a command killed then would have left them.
        atexit._run_exitfuncs()
        _exit_now(code)
    return code


def _left_running() -> list[threading.Thread]:
    """The threads other than this one that would hold the process's exit (not daemons):
    those of a library's pool the command stopped waiting for."""
    return [
        thread
        for thread in threading.enumerate()
        if thread is not threading.current_thread() and not thread.daemon and thread.is_alive()
    ]


@contextlib.contextmanager
def _interrupts_told_apart() -> Iterator[None]:
    """While the block runs (the command's modules are imported, numpy and its OpenBLAS with
    them), SIGINT is held back, then taken with who sent it. OpenBLAS sends SIGINT to itself
    when it cannot start its threads (threads or memory ran out: ``ulimit -u`` or ``-v``, a
    pod's pid limit), then goes on with threads that do not exist; Python took that for Ctrl-C:
    ``run`` said "interrupted" (130), which no user did, and a command importing numpy later
    failed in its import (exit 1, a bug). Now that is :class:`ResourceExhaustedError` (75); a
    SIGINT from anyone else is an interruption, as before, once the block ends, unless SIGINT
    is ignored (a background job: a blocked signal is kept even then). SIGTERM, SIGHUP and
    the signals of :data:`ENDING` are held back too, taken once the block ends: raised inside numpy's C part, the stop came
    back as its ImportError; and the threads a library starts meanwhile keep the mask, so
    that none of them, running no Python handler and waking no main thread, ever takes a stop
    signal the kernel hands the process. Outside the main thread, or where signals cannot be
    taken with their sender: no-op."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "sigtimedwait"
    ):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, *STOPPING, *ENDING))
    try:
        yield
    finally:
        sent = None
        if signal.SIGINT in signal.sigpending():
            sent = signal.sigtimedwait((signal.SIGINT,), 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if sent is not None:
            if sent.si_pid == os.getpid() and sent.si_code <= 0:  # sent (kill, raise) by us
                raise ResourceExhaustedError(
                    "A library the command loads (OpenBLAS, with numpy) could not start its "
                    "threads: threads or memory ran out (its own lines above say which), and "
                    "it sent the loader an interrupt.",
                    "Run again with more room: a higher process and thread limit (`ulimit -u`, "
                    "the pod's pid limit) or memory limit, or fewer threads for OpenBLAS "
                    "(OPENBLAS_NUM_THREADS=1 is enough for the loader).",
                )
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a background job's
                raise KeyboardInterrupt


def _load_blas() -> None:
    """Import numpy, which loads OpenBLAS and starts its threads, with SIGINT told apart
    (:func:`_interrupts_told_apart`), before the command imports it wherever it first needs it
    (``plan`` reading a checkpoint's config: numpy then failed to import, a bug's exit)."""
    if "numpy" in sys.modules:
        return
    with _interrupts_told_apart():
        import numpy  # noqa: F401


def _open_stop_signals() -> None:
    """Take the stop signals (SIGINT, :data:`STOPPING`, :data:`ENDING`) again where the process
    started with them blocked: a signal mask is inherited across ``exec``, and a parent that
    started the loader from a thread blocking them (a process manager, a Python program's
    worker thread) left each of them pending for good: ``kill`` (or Kubernetes' SIGTERM) never
    stopped the command, which waited on a stalled download until SIGKILL; through the
    supervisor, its child never took the SIGTERM passed on. An ignored signal stays ignored
    (``nohup``); one already pending is taken now."""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, *STOPPING, *ENDING))


def _hold_standard_descriptors() -> None:
    """Open ``/dev/null`` on each standard descriptor (0, 1, 2) the process started without
    (``>&-``, ``2>&-``): else the next file the loader opens takes that number, and what a
    library writes to its standard error (a native library's warning) or a child process
    inherits as its output goes into that file. Python has made the stream ``None``; a closed
    standard error becomes one that writes nowhere (``print`` to ``None`` writes to standard
    output, which then holds error lines); standard output stays ``None``, which a command
    refuses (:func:`_stdout_closed`)."""
    held = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            held.append(fd)
    if sys.stderr is None and 2 in held:  # never a file that took the number before
        with contextlib.suppress(OSError):
            sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115


def _stdout_closed() -> LoaderError:
    """The error of a command started with standard output closed: what it prints (for
    ``run``, ``fetch`` and ``convert`` the result's path, as the last line) could not be
    written, and Python drops it without a word: the command did its work and exited 0, with
    a script reading an empty result. Refused before any work."""
    return LoaderError(
        "Standard output is closed (`>&-`?): what the command prints (the path of its result, "
        "as the last line, for run, fetch and convert) could not be written, so nothing was "
        "done.",
        "Redirect standard output to /dev/null to drop what it prints (`>/dev/null`), or to a "
        "file or a pipe to read it.",
    )


def _main(argv: Sequence[str] | None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if commands_for(argv) in [(name,) for name in supervise.SUPERVISED]:
            outcome = supervise.supervise()
            if isinstance(outcome, LoaderError):
                return report(outcome)
            if outcome is not None:
                return outcome
    argv = list(argv)
    held = next((arg for arg in argv if "\0" in arg), None)
    if held is not None:  # no command line of a process holds one: a caller's mistake
        return report(
            LoaderError(
                f"The argument {shown(held)} holds a NUL character, which no path, name or "
                "number can hold.",
                "Pass the argument without the NUL character.",
            )
        )
    try:
        with _interrupts_told_apart():
            parser = build_parser(commands_for(argv))  # imports the command's module
        args = parser.parse_args(argv)
    except LoaderError as exc:  # a library could not start its threads (_interrupts_told_apart)
        return report(exc)
    except OSError as exc:  # an argument's type looks at the file system (directory_path)
        typed = typed_os_error(exc) or _cwd_gone(exc)
        if typed is None:
            raise
        return report(typed)
    except Exception as exc:  # memory ran out while importing
        exhausted = resource_exhaustion(exc) or _warning_raised(exc)
        if exhausted is None:
            raise
        return report(exhausted)
    except KeyboardInterrupt:  # Ctrl-C while the command's module is imported: nothing done yet
        say("interrupted")
        return EXIT_INTERRUPTED
    try:
        configure_logging(args.verbose, args.quiet)
    except LoaderError as exc:
        return report(exc)
    if sys.stdout is None:
        return report(_stdout_closed())
    profile = os.environ.get("MODEL_LOADER_PROFILE", "").strip()
    if (
        profile
    ):  # stage-by-stage wall and CPU seconds, as JSON, at exit (docs/conversion-profile.md)
        try:
            stages.enable(profile)
        except LoaderError as exc:
            return report(exc)
    with naming_write_targets(getattr(args, "writes_below", None)):  # what its hints name
        return run_command(args.func, args)
