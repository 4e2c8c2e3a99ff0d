"""What the ``model-loader run`` tests share: the command line, running it in-process, and
where a published repository and its weights are."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from loader.cli import main
from tests import procs


def run_argv(
    source: Path | str,
    root: Path,
    *extra: str,
    tp: int = 1,
    count: int = 1,
    backend: str | None = "python",
    model: str = "tiny",
) -> list[str]:
    """``run`` of ``source`` into ``root`` as model ``model``, T=``tp``, P=1, I=``count``
    (the CPU reference backend unless ``backend`` says otherwise; None: the default)."""
    argv = ["run", "--source", str(source), "--repository", str(root), "--model-name", model,
            "--tp-size", str(tp), "--pp-size", "1", "--instance-count", str(count)]  # fmt: skip
    if backend is not None:
        argv += ["--backend", backend]
    return [*argv, *extra]


def checkpoint_copy(checkpoint: Path, dest: Path, *, undeclared: bool = False) -> tuple[Path, Path]:
    """The files of ``checkpoint`` copied into the new directory ``dest``, and the copy's
    safetensors weights file; with ``undeclared``, ``config.json`` declares no dtype (no
    ``torch_dtype``, no ``dtype``): the loader then follows the weights' bytes."""
    dest.mkdir()
    for path in checkpoint.iterdir():
        if path.is_file():
            (dest / path.name).write_bytes(path.read_bytes())
    if undeclared:
        config = json.loads((dest / "config.json").read_text())
        config.pop("torch_dtype", None)
        config.pop("dtype", None)
        (dest / "config.json").write_text(json.dumps(config))
    (weights,) = dest.glob("*.safetensors")
    return dest, weights


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, list[str], str]:
    """``model-loader ARGV`` in-process: the exit code, stdout's lines and stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def loader_processes(proc: subprocess.Popen) -> list[int]:
    """The pids of ``model-loader`` started as ``proc``: its supervised child (``convert``,
    ``run``: loader.cli.supervise) first, if it has one, then ``proc`` itself. Stopping the
    loader (SIGSTOP) stops both: a signal that cannot be caught is not passed on."""
    return [*procs.children(proc.pid), proc.pid]


def published(root: Path, model: str = "tiny") -> Path:
    """The one repository published under ``root`` for ``model``."""
    (path,) = root.glob(f"{model}@*/*")
    return path


def forged_key(root: Path, key: str, created_at: str, mtime: float | None = None) -> Path:
    """A published key as prune recognises it (no files): a manifest naming ``key`` and
    ``created_at``; with ``mtime``, the directory's own time."""
    path = root / key
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(
        json.dumps({"key": key, "created_at": created_at, "files": []})
    )
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def weights(repository: Path) -> dict[str, bytes]:
    """The converted weight files of a published repository, by name."""
    (folder,) = (repository / "fastertransformer" / "1").glob("*-gpu")
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def use_hub(monkeypatch: pytest.MonkeyPatch, url: str, home: Path) -> None:
    """Point hf:// sources at the test Hub ``url``, with a Hub cache of its own and no token."""
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)


class Arrivals:
    """Every file a fetch hands to the overlapped conversion, in order; at each shard's
    arrival, the bytes of shards then on disk beside it and the bytes under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.order: list[str] = []
        self.shards_on_disk: list[int] = []
        self.root_bytes: list[int] = []

    @property
    def shards(self) -> list[str]:
        return [rel for rel in self.order if rel.endswith(".safetensors")]


def _size_if_present(path: Path, blocks: bool = False) -> int:
    """A file's size (or bytes on disk), 0 once the conversion deleted it meanwhile (the
    overlapped conversion deletes shards on its own thread while this helper walks them)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return 0
    return st.st_blocks * 512 if blocks else st.st_size


def tree_bytes(path: Path) -> int:
    """Bytes ``path`` takes on disk."""
    return sum(_size_if_present(p, blocks=True) for p in path.rglob("*") if p.is_file())


def record_arrivals(monkeypatch: pytest.MonkeyPatch, root: Path) -> Arrivals:
    from loader.convert.overlapped import OverlappedConversion

    arrivals = Arrivals(root)
    real = OverlappedConversion.arrived

    def arrived(self, rel: str, path: Path, checked: object = None) -> None:
        arrivals.order.append(rel)
        if rel.endswith(".safetensors"):
            shards = path.parent.glob("model-*.safetensors")
            arrivals.shards_on_disk.append(sum(_size_if_present(p) for p in shards))
            arrivals.root_bytes.append(tree_bytes(root))
        return real(self, rel, path, checked)

    monkeypatch.setattr(OverlappedConversion, "arrived", arrived)
    return arrivals


def journaled(root: Path) -> dict[str, int]:
    """The outputs an interrupted overlapped conversion under ``root`` recorded as written,
    with their inodes (a complete line each)."""
    from loader.convert.overlapped import Journal

    (journal,) = root.glob(f".work/*/converted/*-gpu{Journal.SUFFIX}")
    outputs = journal.with_name(journal.name[: -len(Journal.SUFFIX)])
    lines = journal.read_text().split("\n")[1:-1]  # the header; a last line cut short
    names = [line.split()[0] for line in lines if len(line.split()) == 5]
    return {name: (outputs / name).stat().st_ino for name in names}


def inodes(repository: Path, names: list[str] | dict[str, int]) -> dict[str, int]:
    """The inodes of these weight files of a published repository."""
    (folder,) = (repository / "fastertransformer" / "1").glob("*-gpu")
    return {name: (folder / name).stat().st_ino for name in names}


def never_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any overlapped conversion (a reference made by the sequential strategy)."""
    from loader.convert.overlapped import OverlappedConversion

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sequential strategy converted while downloading")

    monkeypatch.setattr(OverlappedConversion, "__init__", refuse)


def tree_digest(top: Path) -> str:
    """A digest of everything below ``top``: names, kinds, modes, link targets, contents."""
    digest = hashlib.sha256()
    for path in sorted(top.rglob("*")):
        info = path.lstat()
        digest.update(f"{path.relative_to(top)}\0{info.st_mode}\0".encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()
