"""Typed errors of the loader.

Every error a user can cause is a :class:`LoaderError`: it carries *what* is wrong and a
*remediation* sentence saying what to do. The CLI prints ``error: <what>`` and ``hint: <fix>``,
never a traceback, and exits with the error's :attr:`~LoaderError.exit_code`: 2 for a mistake
to fix, :data:`EXIT_TRANSIENT` for a failure that may pass by itself (a source still failing at
the retry deadline), worth retrying as it is. Anything else is a bug and exits with code 1.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import resource
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import ClassVar

#: Names a message shows before it says how many more there are.
SHOWN_NAMES = 6

#: Exit code of a user mistake (bad input, bad arguments): retrying as it is cannot help.
EXIT_USER_ERROR = 2
#: Exit code of a transient failure that outlasted the retry deadline (sysexits' EX_TEMPFAIL):
#: running the same command again later may succeed (a Kubernetes Job retries it).
EXIT_TRANSIENT = 75


class LoaderError(Exception):
    """A problem the user can fix. ``remediation`` says how."""

    #: The process exit code the CLI returns for this error.
    exit_code = EXIT_USER_ERROR
    #: One-sentence default fix for the class; instances may pass a more specific one.
    default_remediation = "Check the command's arguments (model-loader --help)."

    def __init__(self, message: str, remediation: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.remediation = remediation or self.default_remediation

    def __str__(self) -> str:
        return f"{self.message} {self.remediation}"


def shown(name: object) -> str:
    """A name (a path, a file or tensor name read from a checkpoint or a listing) as a message
    shows it: as it is when every character prints, else quoted with escapes (``'a\\nb'``), so
    that a name can never start a line of its own in the log (a forged ``error:`` line)."""
    text = str(name)
    return text if text.isprintable() else repr(text)


def one_line(text: str) -> str:
    """Text a library or a server wrote (an exception's message, a response's body) as one
    line of a message: every run of white space, line breaks included, one space, and any
    other character that does not print escaped, so that a server's answer can never print a
    line of the loader's own (a forged ``error:`` or ``hint:``)."""
    text = " ".join(text.split())
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


#: The user name and password a URL may carry (``http://USER:PASSWORD@HOST``): an endpoint
#: such as ``HF_ENDPOINT`` may hold them, and HTTP libraries quote the URL in their errors and
#: their log lines.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@'\"]+@")


#: The query parameters of a signed URL that grant access on their own: a Hub download is
#: redirected to a storage URL signed for a gated or private file (``X-Amz-Signature``,
#: ``X-Amz-Credential``, ``X-Amz-Security-Token``, CloudFront's ``Signature``, ``Policy`` and
#: ``Key-Pair-Id``, GCS's ``X-Goog-Signature``/``X-Goog-Credential``, Azure's ``sig``), valid
#: for minutes to hours to whoever reads the log. Their values are replaced; the rest of the URL
#: still shows where the request went.
_SIGNED = re.compile(
    r"(?i)([?&;](?:[a-z0-9_-]*(?:signature|credential|security-token|token|policy|key-pair-id)"
    r"|sig|access_token|api[_-]?key)=)[^&;\s'\"<>#]+"
)


def redacted(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``: a user name and
    password, and the values of a signed URL's signature, credential, token and policy."""
    return _SIGNED.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


def some_names(names: Iterable[str]) -> str:
    """The first few of ``names`` for a message: ``a, b, c, d, e, f and 4 more``, each as
    :func:`shown` shows it (a name read from a checkpoint or a listing may hold a line break)."""
    names = list(names)
    first = ", ".join(shown(name) for name in names[:SHOWN_NAMES])
    more = len(names) - SHOWN_NAMES
    return first + (f" and {more} more" if more > 0 else "")


# --- checkpoints and conversion ------------------------------------------------------------


class CheckpointError(LoaderError):
    """The source checkpoint is missing, incomplete, corrupt or inconsistent."""

    default_remediation = (
        "Point the loader at a complete Hugging Face checkpoint directory "
        "(config.json plus model.safetensors / pytorch_model.bin, or their sharded form with an index)."
    )


class CorruptFileError(CheckpointError):
    """A checkpoint file whose bytes are not a valid file of its format (``path``: the file,
    ``what``: what is wrong with it). Its hint assumes a copy damaged on its way here; a file
    that matched the checksum its remote source lists is corrupt at that source, which
    :meth:`at_source` says."""

    default_remediation = (
        "Download or copy that file again (compare its size and checksum with the source)."
    )

    def __init__(self, path: Path, what: str, *, origin: str | None = None) -> None:
        self.path = path
        self.what = what
        self.origin = origin
        if origin is None:
            super().__init__(f"{shown(path)} is truncated or corrupt: {what}.")
        else:
            super().__init__(
                f"{shown(origin)} is corrupt at its source: {what}. Its download ({shown(path)}) "
                "matched the "
                "checksum the source lists for it, so fetching it again gives the same bytes.",
                f"Replace {shown(origin)} at its source with a good copy (upload or push the file "
                "again), or point the loader at another source or revision, then run again.",
            )

    def at_source(self, origin: str) -> CorruptFileError:
        """The same failure of a file verified against ``origin``'s checksum."""
        return CorruptFileError(self.path, self.what, origin=origin)


class FileContentError(CheckpointError):
    """What one file of a checkpoint holds is wrong, though it is a file of its format
    (``path``: the file, ``what``: what is wrong with it, said after the file's name). A file
    downloaded from a remote source that matched the checksum the source lists holds what the
    source holds: :meth:`at_source` names the object, the download's path in parentheses."""

    def __init__(
        self, path: Path, what: str, remediation: str | None = None, *, origin: str | None = None
    ) -> None:
        self.path = path
        self.what = what
        self.origin = origin
        self._remediation = remediation
        where = shown(path) if origin is None else f"{shown(origin)} (downloaded to {shown(path)})"
        super().__init__(f"{where} {what}.", remediation)

    def at_source(self, origin: str) -> FileContentError:
        """The same failure of a file verified against ``origin``'s checksum."""
        return type(self)(self.path, self.what, self._remediation, origin=origin)


class UnsupportedArchitectureError(CheckpointError):
    """config.json names a model_type no converter handles."""


class OutputExistsError(LoaderError):
    """The output directory already holds a converted checkpoint for this tensor-parallel size."""

    def __init__(self, message: str, remediation: str | None = None) -> None:
        super().__init__(
            message,
            remediation
            or f"Pass --force to replace it, or choose another directory for {write_targets()}.",
        )


class DtypeError(LoaderError):
    """An unknown or unsupported data type was asked for or found."""

    default_remediation = "Use --dtype fp16 or --dtype fp32."


class TensorDtypeError(FileContentError, DtypeError):
    """A tensor of a checkpoint file is stored in a dtype the loader does not read."""

    default_remediation = "Convert the checkpoint to fp16, bf16 or fp32 first."


class ParallelismError(LoaderError):
    """Tensor/pipeline-parallel sizes do not fit the model or the GPUs."""

    default_remediation = (
        "Choose a tensor/pipeline-parallel size that divides the model's dimensions."
    )


class PlacementError(ParallelismError):
    """A configuration breaks the FasterTransformer placement rules or does not fit GPU memory."""

    default_remediation = "Run `model-loader plan` to see which numbers fit this node type."


# --- sources -----------------------------------------------------------------------------


class SourceError(LoaderError):
    """A checkpoint source cannot be read."""

    default_remediation = (
        "Check the source URI (file://, gs://bucket/prefix, hf://org/name@revision)."
    )


class ResourceExhaustedError(LoaderError):
    """The machine ran out of something for a moment (memory, threads): worth running again,
    with more room."""

    exit_code = EXIT_TRANSIENT
    default_remediation = (
        "Run again; if it keeps failing, give the loader more memory (the Job's resources) "
        "or fewer workers (--workers)."
    )


#: What the dynamic loader says when the memory to map a shared object ran out (ENOMEM).
_NO_MEMORY_TO_LOAD = ("failed to map segment from shared object", "cannot allocate memory")
#: The memory :func:`_memory_short` asks for (address space only, never touched).
_MEMORY_PROBE = 64 << 20


def resource_exhaustion(exc: BaseException) -> ResourceExhaustedError | None:
    """The transient error of a machine that ran out of memory or threads (None: another
    failure), wherever it was raised: in the loader or in a library it called, or as the cause
    of another error, as a library's import wraps it: a library imported once memory ran out
    (``ulimit -v``) fails with an ``ImportError`` (or, from a C extension that lost the cause,
    a ``SystemError``) whose message may no longer say why."""
    chain = _chain(exc)
    for link in chain:
        if isinstance(link, MemoryError):
            return ResourceExhaustedError("The loader ran out of memory.")
        if isinstance(link, RuntimeError) and "can't start new thread" in str(link):
            return ResourceExhaustedError(f"The loader could not start a thread ({link}).")
        if isinstance(link, ImportError) and any(
            words in str(link).lower() for words in _NO_MEMORY_TO_LOAD
        ):
            return ResourceExhaustedError(
                f"The loader ran out of memory while loading a library ({_quoted(link)})."
            )
    if any(isinstance(link, ImportError | SystemError) for link in chain) and _memory_short():
        return ResourceExhaustedError(
            "The loader ran out of memory while loading a library (its import failed: "
            f"{_quoted(chain[-1])}; {_MEMORY_PROBE >> 20} MiB more cannot be had now)."
        )
    return None


def _quoted(exc: BaseException, limit: int = 200) -> str:
    """A library's exception as a message quotes it: its type, one line, at most ``limit``
    characters (numpy's failed import explains itself in twenty lines)."""
    text = one_line(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, each once."""
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and all(link is not seen for seen in chain):
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def _memory_short() -> bool:
    """Whether this process cannot have :data:`_MEMORY_PROBE` more bytes of memory now (its
    ``ulimit -v`` reached, or the machine's commit limit): asked of the kernel as an anonymous
    mapping, never touched, given back at once."""
    try:
        mmap.mmap(-1, _MEMORY_PROBE).close()
    except (OSError, MemoryError, ValueError):
        return True
    return False


class SpecialFileError(SourceError):
    """A FIFO, device or socket where the loader reads a file: never read (it may block
    forever or never end)."""

    def __init__(self, path: object, found: str) -> None:
        path = shown(path)
        super().__init__(
            f"{path} is {found}, not a regular file; the loader reads only regular files "
            "(a FIFO, device or socket may block forever or never end).",
            f"Replace {path} with the regular file it stands for, or remove it.",
        )


class MappedReadError(LoaderError):
    """A memory-mapped file (a checkpoint's weights) could not be read: the kernel answered
    the read with a bus error (``SIGBUS``), which kills the process at once. The supervising
    process of ``convert`` and ``run`` reports it (:mod:`loader.cli.supervise`). Transient:
    running again reads the file again."""

    exit_code = EXIT_TRANSIENT
    default_remediation = (
        "Check the storage holding those files (the kernel log, the volume's events), then run "
        "the loader again."
    )


class SourceShrankError(MappedReadError):
    """A file the loader was reading (memory-mapped) got shorter meanwhile: something truncated
    or rewrote it in place. Transient: a rerun reads the file again, and a file left cut short
    is then refused by its header check (exit 2, naming it)."""

    default_remediation = (
        "Let nothing write the source while the loader reads it (a copy or download still "
        "running, a sync), then run the loader again; a file left cut short is then refused, "
        "named."
    )

    def __init__(self, shrank: Iterable[tuple[object, int, int]], *, killed: bool = False):
        described = [
            f"{shown(path)} ({was} bytes when the loader opened it, {now} now)"
            for path, was, now in shrank
        ]
        how = (
            "reading past its new end killed the reader with SIGBUS"
            if killed
            else "the loader stopped reading it"
        )
        super().__init__(
            f"A source file shrank while the loader read it: {'; '.join(described)}; {how}."
        )


class KilledError(LoaderError):
    """The process doing a command was killed by a signal other than SIGBUS (the supervisor
    of ``convert`` and ``run`` reports it); the exit code stays the conventional 128 + the
    signal's number."""

    #: Signal -> what most often sends it, and what to do.
    HINTS: ClassVar[dict[int, str]] = {
        signal.SIGKILL: "Most often the kernel's OOM killer (see the kernel log, or the pod's "
        "OOMKilled status): give the loader more memory (the Job's resources.limits.memory) "
        "or fewer workers (--workers), then run it again.",
        signal.SIGSEGV: "A crash in native code (a bug): run again with PYTHONFAULTHANDLER=1 "
        "and report it with the stack that prints.",
        signal.SIGABRT: "A native library aborted (a bug, or memory running out): run again "
        "with PYTHONFAULTHANDLER=1 and report it with the log.",
    }

    def __init__(self, signum: int, *, stopping: int | None = None) -> None:
        name = _signal_name(signum)
        hint = self.HINTS.get(signum, f"Find what sends {name} to the loader, then run it again.")
        if stopping is not None and signum == signal.SIGKILL:
            # Asked to stop, then killed while it unwound: whoever asked did not wait for it.
            hint = (
                f"It was stopping on {_signal_name(stopping)} (passed on to it) when SIGKILL "
                "ended it: what stops it waited too little for it to remove what it had made "
                "(a pod's terminationGracePeriodSeconds); give it longer, then run it again."
            )
        super().__init__(
            f"The loader was killed by {name} before it finished; what it had written "
            "is not published.",
            hint,
        )
        self.exit_code = 128 + signum


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class SourceNotFoundError(SourceError):
    """The bucket, object, repository, revision or path does not exist."""


class SourcePermissionError(SourceError):
    """The credentials in use may not read the source."""

    default_remediation = (
        "Check the credentials: GOOGLE_APPLICATION_CREDENTIALS / Workload Identity for gs://, "
        "HF_TOKEN, HF_TOKEN_PATH or --hf-token-file for hf://."
    )


class ChecksumMismatchError(SourceError):
    """A downloaded file does not match the checksum its source published: bytes damaged or
    replaced on the way (a proxy answering with a page of its own), or an object corrupt at
    its source. The download was discarded; running again fetches it again (exit 75)."""

    exit_code = EXIT_TRANSIENT

    default_remediation = (
        "Run the loader again (it downloads the file again); if the same file keeps failing, "
        "it is corrupt at its source: re-upload it."
    )


class TransientSourceError(SourceError):
    """A failure worth retrying (connection reset, 429, 5xx); raised after retries ran out."""

    exit_code = EXIT_TRANSIENT

    default_remediation = (
        "The source kept failing; check its availability and run the loader again (it resumes)."
    )


class ReplacedDownloadError(TransientSourceError):
    """A downloaded file was replaced (renamed over, or written in place) in the download
    directory after it was verified against its checksum: another process wrote there. What is
    there now was not converted; nothing was published."""

    def __init__(self, path: object) -> None:
        super().__init__(
            f"{shown(path)} is not the file the loader downloaded and verified: another "
            "process replaced it (or wrote to it) since; it was not converted and nothing was "
            "published.",
            "Let nothing but the loader write into its download directory (--work-dir, or "
            "ROOT/.work), then run the loader again.",
        )


class SourceChangedError(SourceError):
    """The source no longer holds what an already published key was built from."""

    default_remediation = (
        "Pin the new content under a new key (--revision NEW, or hf://ORG/NAME@<commit>) and run "
        "again; or pass --follow-source to replace the published copy (the chart: "
        "model.followSource: true)."
    )


class InsufficientDiskSpaceError(LoaderError):
    """Not enough free disk space for a download, a conversion or a repository."""

    default_remediation = (
        "Free disk space or point the loader at a larger volume, then run it again."
    )


class OutputPathError(LoaderError):
    """An output directory cannot be created or written (a file in the way, no permission)."""

    def __init__(self, message: str, remediation: str | None = None) -> None:
        super().__init__(
            message,
            remediation
            or f"Point {write_targets()} at a directory that is, or can be created as, a "
            "writable directory.",
        )


# --- repository and publishing -----------------------------------------------------------


class RepositoryError(LoaderError):
    """A Triton model repository cannot be written or is invalid."""

    default_remediation = "Check the repository root path and the loader's arguments."


class PublishError(RepositoryError):
    """Publishing a model repository failed; nothing half-written was left where Triton loads."""


class LockLostError(PublishError):
    """This loader's publish lock was taken over by another loader; it stopped unpublished."""

    exit_code = EXIT_TRANSIENT

    default_remediation = (
        "Another loader took over this model key (this one had stalled past --lock-expiry-s); "
        "run the loader again to verify or complete its result, and raise --lock-expiry-s if "
        "loaders stall that long."
    )


class LockTimeoutError(PublishError):
    """Another loader holds the publish lock for the same model key for too long."""

    exit_code = EXIT_TRANSIENT

    default_remediation = (
        "Another loader is publishing the same model key; wait for it, or remove its lock file "
        "if that loader is gone (locks also expire by themselves)."
    )


#: How the running command's user names the directories it writes below (``--repository or
#: --work-dir`` for ``run``, ``DEST`` for ``fetch``): hints that say where to point the
#: loader instead name them (:func:`naming_write_targets`, around :func:`loader.cli.main`'s command).
_WRITE_TARGETS_DEFAULT = "the loader's directories"
_write_targets = _WRITE_TARGETS_DEFAULT


@contextlib.contextmanager
def naming_write_targets(text: str | None) -> Iterator[None]:
    """While the block runs, hints name ``text`` as where the command writes (None: a command
    that writes nowhere, or a library caller: a name that needs no command line)."""
    global _write_targets
    before, _write_targets = _write_targets, text or _WRITE_TARGETS_DEFAULT
    try:
        yield
    finally:
        _write_targets = before


def write_targets() -> str:
    """What :func:`naming_write_targets` set: ``--repository (and --work-dir)``."""
    return _write_targets


class NotOursError(RepositoryError):
    """A path under the repository root holds something the loader did not create (a symbolic
    link, a file where its directory belongs): it is left alone, never followed or removed."""

    def __init__(self, path: Path | str, found: str, expected: str) -> None:
        self.path = Path(path)
        path = shown(path)
        super().__init__(
            f"{path} is {found}, where the loader expected {expected}; the loader did not "
            "create it and leaves it alone (it never follows, writes through or removes what "
            "it did not make).",
            f"Move {path} away (or choose another directory for {write_targets()}), then run "
            "again.",
        )


class InTheWayError(NotOursError):
    """Names a command is about to put its files at hold what it did not write there (a
    user's file whose bytes differ from the source's, a link, a directory): found before
    anything is written, named all at once, and never replaced."""

    def __init__(self, found: list[str], where: Path | str) -> None:
        self.path = Path(where)
        self.found = list(found)
        listed = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        many = len(found) > 1
        RepositoryError.__init__(
            self,
            f"{listed} under {shown(where)}: the loader would put its file{'s' if many else ''} "
            f"there, but it did not write what stands there now, and it never replaces what it "
            "did not write (nothing was written).",
            f"Move {'them' if many else 'it'} away (or choose another directory for "
            f"{write_targets()}), then run again.",
        )


# --- the file system ----------------------------------------------------------------------


class FileSystemError(LoaderError):
    """A file-system operation failed for a reason of the environment: permissions, a
    read-only volume, a name too long, a link or a file where a directory belongs."""


class TransientFileSystemError(FileSystemError):
    """A file-system operation failed in a way that may pass (an I/O error, a stale NFS
    handle, too many open files): worth running again."""

    exit_code = EXIT_TRANSIENT


class ReplacedOutputError(TransientFileSystemError):
    """A file of a repository being built (converted weights, a config, a tokenizer copy) was
    written over (or another file renamed over it) after the loader wrote it, before the
    repository was sealed: another process wrote into the loader's directory. Nothing was
    published."""

    def __init__(self, path: object) -> None:
        super().__init__(
            f"{shown(path)} is not the file the loader wrote: another process wrote to it (or "
            "replaced it) since; nothing was published.",
            "Let nothing but the loader write into its directories (ROOT/.staging, and "
            "--work-dir or ROOT/.work), then run the loader again.",
        )


class DirectoryRemovedError(FileNotFoundError):
    """A call relative to a directory the loader had open failed with ``ENOENT`` because the
    directory itself was removed (or replaced) meanwhile, by another process: not a name the
    loader lost track of (a bug), but a change of the environment under a running loader.
    Raised by :mod:`loader.fs`; still a ``FileNotFoundError`` for every caller that treats a
    missing name as absent; :func:`typed_os_error` makes it a
    :class:`TransientFileSystemError`."""

    def __init__(self, directory: Path | str, path: Path | str) -> None:
        super().__init__(
            errno.ENOENT, "its directory was removed while the loader worked in it", str(path)
        )
        self.directory = Path(directory)


class NameTakenError(FileExistsError):
    """A file the loader creates new (``O_CREAT | O_EXCL``: an output, a partial download, a
    marker) found its name taken by something it did not make there (a link, a FIFO, a user's
    file or directory, planted meanwhile). Raised by :mod:`loader.fs`; still a
    ``FileExistsError`` for every caller that competes for a name (the publish lock);
    :func:`typed_os_error` makes it a :class:`NotOursError` (``EEXIST`` alone is a bug's
    errno)."""

    def __init__(self, path: Path | str, found: str) -> None:
        super().__init__(errno.EEXIST, "the name is taken", str(path))
        self.found = found


class NameContendedError(FileExistsError):
    """A name of the loader's own tree held another file of the loader's at every look of a
    rename over it (other loaders placing the same file there): contention, not a user's entry
    in the way. Raised by :mod:`loader.fs`; :func:`typed_os_error` makes it a
    :class:`TransientFileSystemError`."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(errno.EEXIST, "another loader keeps replacing it", str(path))


#: errno -> (what happened, what to do with ``{path}``) for failures of the environment
#: (exit 2). ENOSPC and EDQUOT are :class:`InsufficientDiskSpaceError`.
_ENVIRONMENT: dict[int, tuple[str, str]] = {
    errno.EROFS: (
        "is on a read-only file system",
        "Mount the volume holding {path} read-write for the loader (Triton's pods may mount it "
        "read-only), or point the loader at a writable directory.",
    ),
    errno.EACCES: (
        "is not accessible to this user",
        "Give the loader's user write access to {path} and its directory (or run it as the "
        "volume's owner, e.g. the chart's fsGroup).",
    ),
    errno.EPERM: (
        "cannot be changed by this user",
        "Give the loader's user ownership of or write access to {path}.",
    ),
    errno.ENAMETOOLONG: (
        "is too long a name for the file system",
        "Use a shorter path for {targets} (or shorter names: a model name, a revision, a file in "
        "the source) so that {path} fits.",
    ),
    errno.EXDEV: (
        "is on another file system than where it must move",
        "Keep everything below {targets} on one file system ({path} is not), then run again.",
    ),
    errno.ELOOP: (
        "is a symbolic link (or a loop of them) where the loader follows none",
        "Replace the link at {path} with a real directory or file, or remove it.",
    ),
    errno.EISDIR: (
        "is a directory where the loader expected a file",
        "Move the directory {path} away, then run again.",
    ),
    errno.ENOTDIR: (
        "(or a level above it) is not a directory where the loader expected one",
        "Move what stands at {path} (or at the level above it that is no directory) away, or "
        "point the loader at another directory, then run again.",
    ),
    errno.EFBIG: (
        "is too large",
        "Check {path}: it is far larger than a file of its kind can be.",
    ),
    errno.EMLINK: (
        "has too many links or entries",
        "Remove unused entries under the directory of {path} (model-loader prune).",
    ),
    errno.EOPNOTSUPP: (
        "is on a file system that does not support an operation the loader needs",
        "Keep {targets} on a POSIX file system (ext4, xfs, NFS); the one holding {path} is not.",
    ),
    errno.EUCLEAN: (
        "is on a file system whose structure is damaged",
        "Check the volume holding {path} (its kernel log; fsck it or replace it).",
    ),
    errno.EBADMSG: (
        "is on a file system that found damaged data or metadata",
        "Check the volume holding {path} (its kernel log; fsck it or replace it).",
    ),
    errno.EOVERFLOW: (
        "is larger than this system can address",
        "Check {path}: it is far larger than a file of its kind can be.",
    ),
    errno.ENXIO: (
        "is a FIFO without a reader, or a device that is gone",
        "Replace {path} with the regular file or directory it stands for, or remove it.",
    ),
    errno.ENODEV: (
        "is a device, or on a file system, that does not support the operation",
        "Replace {path} with a regular file or directory on a POSIX file system.",
    ),
    errno.ENOMEDIUM: (
        "is on a device with no medium",
        "Mount the volume holding {path}, then run again.",
    ),
    errno.EMEDIUMTYPE: (
        "is on a medium of the wrong type",
        "Mount the right volume at {path}, then run again.",
    ),
}
#: errno values of a failure that may pass by itself (exit 75).
_TRANSIENT: frozenset[int] = frozenset(
    {
        errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ESTALE, errno.ETIMEDOUT, errno.EINTR,
        errno.ENOLCK, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EREMOTEIO, errno.ECOMM,
        errno.ENETDOWN, errno.ENETUNREACH, errno.EHOSTDOWN, errno.EHOSTUNREACH,
        errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ETXTBSY,
        # A network file system's or FUSE mount's connection (gcsfuse: "Transport endpoint is
        # not connected"), a lock or a buffer that may come back.
        errno.ENOTCONN, errno.ENOLINK, errno.ETIME, errno.ENONET, errno.ENETRESET,
        errno.ECANCELED, errno.ENOBUFS, errno.EDEADLK, errno.ESHUTDOWN, errno.EPROTO,
        errno.ENODATA,
    }
)  # fmt: skip
#: errno values that no failure of the environment explains: the loader called wrongly (a bad
#: descriptor or argument), met a state it should have handled itself (a name that exists or
#: vanished, a directory not empty), or a code no file-system call returns. Exit 1 with the
#: traceback: a bug to fix. ``tests/test_failure_classes.py`` checks that every errno is in
#: exactly one class.
BUG_ERRNOS: frozenset[int] = frozenset(
    {
        errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EBADF, errno.EINVAL, errno.EFAULT,
        errno.ENOSYS, errno.ESPIPE, errno.ENOTTY, errno.EPIPE, errno.E2BIG, errno.ENOEXEC,
        errno.ESRCH, errno.ECHILD, errno.EDOM, errno.ERANGE, errno.EILSEQ, errno.EBADFD,
        errno.ENOTBLK, errno.ENOMSG, errno.EIDRM, errno.ECHRNG, errno.EL2NSYNC, errno.EL3HLT,
        errno.EL3RST, errno.ELNRNG, errno.EUNATCH, errno.ENOCSI, errno.EL2HLT, errno.EBADE,
        errno.EBADR, errno.EXFULL, errno.ENOANO, errno.EBADRQC, errno.EBADSLT, errno.EBFONT,
        errno.ENOSTR, errno.ENOSR, errno.ENOPKG, errno.EREMOTE, errno.EADV, errno.ESRMNT,
        errno.EMULTIHOP, errno.EDOTDOT, errno.ENOTUNIQ, errno.EREMCHG, errno.ELIBACC,
        errno.ELIBBAD, errno.ELIBSCN, errno.ELIBMAX, errno.ELIBEXEC, errno.ERESTART,
        errno.ESTRPIPE, errno.EUSERS, errno.ENOTSOCK, errno.EDESTADDRREQ, errno.EMSGSIZE,
        errno.EPROTOTYPE, errno.ENOPROTOOPT, errno.EPROTONOSUPPORT, errno.ESOCKTNOSUPPORT,
        errno.EPFNOSUPPORT, errno.EAFNOSUPPORT, errno.EADDRINUSE, errno.EADDRNOTAVAIL,
        errno.EISCONN, errno.ETOOMANYREFS, errno.EALREADY, errno.EINPROGRESS, errno.ENOTNAM,
        errno.ENAVAIL, errno.EISNAM, errno.ENOKEY, errno.EKEYEXPIRED, errno.EKEYREVOKED,
        errno.EKEYREJECTED, errno.EOWNERDEAD, errno.ENOTRECOVERABLE, errno.ERFKILL,
    }
)  # fmt: skip
#: The errno values every file-system call site is tested with (tests/test_fault_injection.py).
ERRNO_CLASSES: tuple[int, ...] = (
    errno.ENAMETOOLONG, errno.EXDEV, errno.EROFS, errno.EACCES, errno.ENOSPC, errno.ELOOP,
    errno.EISDIR, errno.ENOTDIR, errno.EIO,
)  # fmt: skip


def typed_os_error(exc: OSError) -> LoaderError | None:
    """The typed error for a failed file-system call (None: an errno that means a bug, such
    as EBADF or EINVAL): the one mapping of errno classes. The message and the hint name the
    path."""
    code = exc.errno
    if code is None:
        return None
    if isinstance(exc, NameTakenError):
        return NotOursError(exc.filename, exc.found, "a new file the loader creates there")
    if isinstance(exc, NameContendedError):
        return TransientFileSystemError(
            f"{shown(exc.filename)} was replaced by another loader at every look while this "
            "loader renamed its file there; nothing was replaced.",
            "Another loader keeps replacing it: run again (or once that loader is done).",
        )
    if isinstance(exc, DirectoryRemovedError):
        directory = shown(exc.directory)
        return TransientFileSystemError(
            f"The directory {directory} was removed (or replaced) by another process while the "
            "loader worked in it; nothing was published.",
            f"Let nothing else remove or replace {directory} while a loader runs (a user, a "
            "script cleaning the volume); running again starts it anew.",
        )
    path = shown(exc.filename) if exc.filename is not None else "a file"
    where = f"{path} (to {shown(exc.filename2)})" if exc.filename2 is not None else f"{path}"
    reason = exc.strerror or errno.errorcode.get(code, str(code))
    if code in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientDiskSpaceError(
            f"The volume holding {where} ran out of space ({reason}); nothing was published.",
            f"Free space on the volume holding {path} (model-loader prune removes old keys and "
            "leftovers) or give it more, then run again.",
        )
    exhausted = _exhausted(code, where, reason)
    if exhausted is not None:
        return exhausted
    if code == errno.EFBIG and reason == os.strerror(errno.EFBIG):  # the kernel's, on a write
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return FileSystemError(
                f"{where} reached this process's limit on the size of a file it writes "
                f"({limit} bytes: ulimit -f) ({reason}); nothing was published.",
                "Raise the loader's file-size limit (ulimit -f unlimited; the container "
                "runtime's fsize limit), then run again.",
            )
    if code in _ENVIRONMENT:
        what, hint = _ENVIRONMENT[code]
        return FileSystemError(
            f"{where} {what} ({reason}); nothing was published.",
            hint.format(path=path, targets=write_targets()),
        )
    if code in _TRANSIENT:
        return TransientFileSystemError(
            f"A file-system operation on {where} failed ({reason}); nothing was published.",
            f"Check the volume holding {path} (kernel log, NFS server); running again may succeed.",
        )
    return None


def _exhausted(code: int, where: str, reason: str) -> ResourceExhaustedError | None:
    """The process or the machine ran out of file descriptors or kernel memory: not the
    volume's failure, so the hint names what ran out and what to raise."""
    if code == errno.EMFILE:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        shown_limit = "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
        return ResourceExhaustedError(
            f"The loader ran out of file descriptors ({shown_limit}) at {where} ({reason}); "
            "nothing was published.",
            "Raise the loader's limit on open files (ulimit -n, the container runtime's nofile "
            "limit) or use fewer --workers, then run again.",
        )
    if code == errno.ENFILE:
        return ResourceExhaustedError(
            f"The machine ran out of open files (its file table is full) at {where} "
            f"({reason}); nothing was published.",
            "Run again when fewer files are open on the machine, or raise fs.file-max.",
        )
    if code == errno.ENOMEM:
        return ResourceExhaustedError(
            f"The kernel ran out of memory at {where} ({reason}); nothing was published."
        )
    return None


# --- serving, benchmarking and tools -----------------------------------------------------


class ToolMissingError(LoaderError):
    """An external program (tritonserver, perf_analyzer, helm) is not installed."""

    default_remediation = "Run `make install` to install the project's pinned tools."


class EndpointError(LoaderError):
    """A Triton endpoint is unreachable or does not serve the expected model."""

    default_remediation = "Check the --url and that the server is up (curl <url>/v2/health/ready)."


class EndpointSyntaxError(LoaderError):
    """A ``--url`` no client can use as written (:mod:`loader.endpoint`)."""

    default_remediation = "Pass --url as host:port (gRPC), grpc://host:port or http://host:port."


class ServerStartError(LoaderError):
    """tritonserver exited or did not become ready (e.g. a model failed to load)."""

    default_remediation = (
        "Read Triton's message in the error (a model that fails to load names the file or "
        "setting) and its log."
    )


class InvalidRequestError(LoaderError):
    """An inference request carries values the model cannot serve (empty prompt, bad length)."""

    default_remediation = "Send a non-empty prompt, temperature and repetition_penalty > 0."


class ModelNotFoundError(EndpointError):
    """The endpoint answers but does not serve (or has not loaded) the named model."""

    default_remediation = (
        "Check --model against the server's models (curl <url>/v2/repository/index -X POST) "
        "and that the model loaded (its readiness: curl <url>/v2/models/<model>/ready)."
    )


class MeasurementError(LoaderError):
    """perf_analyzer could not measure (bad input data, no request completed, a crash)."""

    default_remediation = (
        "Read perf_analyzer's words quoted in the error; run it again with -v to see the whole "
        "log, and check that the server still answers."
    )
