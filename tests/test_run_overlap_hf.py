"""`model-loader run` from hf:// converting while it downloads (loader.run.strategies.Overlapped).

Against the real olah Hub mirror: the overlapped run publishes the same weights as the
sequential one, holds a few shards at a time, and a shard whose bytes do not match the Hub's
hash aborts without publishing (the rerun resumes with the outputs already written).
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import pytest

from loader.cli import main
from loader.convert import overlapped
from loader.convert.schedule import DEFAULT_WINDOW
from loader.errors import ChecksumMismatchError
from loader.repository import manifest
from loader.repository.publish import STAGING_DIR
from tests import runs
from tests.servers import OlahServer, git

pytestmark = pytest.mark.server  # starts a real server (see markers in pyproject.toml)


#: Shards of the test checkpoint: enough that a window of two is a small part of it.
SHARDS_AT_LEAST = 8


@pytest.fixture(scope="module")
def checkpoint(sharded_fp16_checkpoint) -> Path:
    assert len(list(sharded_fp16_checkpoint.glob("model-*.safetensors"))) >= SHARDS_AT_LEAST
    return sharded_fp16_checkpoint


def _files(checkpoint: Path) -> dict[str, Path]:
    return {p.name: p for p in checkpoint.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, checkpoint):
    srv = OlahServer(tmp_path_factory.mktemp("olah"))
    srv.make_repo("org/sharded", _files(checkpoint))
    srv.late_corrupt = srv.make_repo("org/late-corrupt", _files(checkpoint))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def endpoint(monkeypatch, hub, tmp_path):
    runs.use_hub(monkeypatch, hub.url, tmp_path / "hf-home")


def _argv(source: str, root: Path, *extra: str) -> list[str]:
    return runs.run_argv(source, root, *extra, tp=2, backend=None)


@pytest.fixture(scope="module")
def sequential(hub, tmp_path_factory) -> Path:
    """The repository the download-then-convert strategy publishes (the reference)."""
    root = tmp_path_factory.mktemp("sequential")
    with pytest.MonkeyPatch.context() as patch:
        runs.use_hub(patch, hub.url, root.parent / "hf-home-seq")
        runs.never_overlap(patch)
        assert main(_argv("hf://org/sharded", root, "--no-overlap")) == 0
    return runs.published(root)


def test_the_overlapped_hf_run_publishes_what_the_sequential_one_does_holding_few_shards(
    sequential, checkpoint, tmp_path, monkeypatch
):
    root = tmp_path / "models"
    shards = sorted(checkpoint.glob("model-*.safetensors"))
    largest = max(p.stat().st_size for p in shards)
    arrivals = runs.record_arrivals(monkeypatch, root)
    real_write = overlapped.write_file

    def slow_write(*args, **kwargs):
        # Writers slower than the download: only the window keeps the shards from piling up.
        time.sleep(0.4)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(overlapped, "write_file", slow_write)
    assert main(_argv("hf://org/sharded", root)) == 0
    repository = runs.published(root)
    assert manifest.verify(repository) == []
    assert runs.weights(repository) == runs.weights(sequential)
    ours = {e["path"]: e["blake3"] for e in manifest.read_manifest(repository)["files"]}
    theirs = {e["path"]: e["blake3"] for e in manifest.read_manifest(sequential)["files"]}
    assert ours == theirs

    # The small files came in the first fetch; the second reports them (already present)
    # before the shards, which arrive one by one in name order.
    assert arrivals.shards == [p.name for p in shards]
    order = arrivals.order
    assert order.index(arrivals.shards[0]) > order.index("config.json")
    assert order.index(arrivals.shards[0]) > order.index("model.safetensors.index.json")

    # The disk accounting: at most window + 1 shards on disk at once, never the checkpoint.
    assert max(arrivals.shards_on_disk) <= (DEFAULT_WINDOW + 1) * largest
    assert max(arrivals.shards_on_disk) < sum(p.stat().st_size for p in shards) / 2
    outputs = runs.tree_bytes(repository / "fastertransformer")
    assert max(arrivals.root_bytes) <= outputs + (DEFAULT_WINDOW + 1) * largest + 2**20
    assert not (root / ".work").exists() or not any((root / ".work").iterdir())


def _rewrite_blob(repo: Path, name: str, data: bytes) -> None:
    """Replace the bytes git stores for ``name`` at HEAD, keeping its object id (so the Hub's
    listing still names the original hash)."""
    blob = git(repo, "rev-parse", f"HEAD:{name}")
    obj = repo / ".git" / "objects" / blob[:2] / blob[2:]
    obj.chmod(0o644)
    obj.write_bytes(zlib.compress(b"blob %d\0" % len(data) + data))


def _hold_until_the_rest_is_journaled(monkeypatch: pytest.MonkeyPatch, shard: str) -> None:
    """Hold ``shard``'s download until every output that does not read it is written and
    journaled. Without the hold, how many outputs the failing run leaves depends on how far the
    writers got before the download failed (a race on a busy machine); the loader itself
    neither waits nor orders its fetch like this."""
    real = overlapped.OverlappedConversion.admit

    def admit(self: overlapped.OverlappedConversion, rel: str) -> bool:
        if rel == shard:
            rest = {name for name, reads in self.plan.needs.items() if shard not in reads}
            with self._cond:
                assert self._cond.wait_for(
                    lambda: (
                        self._error is not None
                        or (rest <= self.written.keys() and not self._syncing)
                    ),
                    timeout=120,
                ), "the outputs of the other shards were not written within 120 s"
        return real(self, rel)

    monkeypatch.setattr(overlapped.OverlappedConversion, "admit", admit)


def test_a_shard_not_matching_the_hubs_hash_aborts_without_publishing_and_the_rerun_resumes(
    hub, sequential, checkpoint, tmp_path, capsys, monkeypatch
):
    last = sorted(checkpoint.glob("model-*.safetensors"))[-1]
    good = last.read_bytes()
    bad = bytearray(good)
    bad[-100:-96] = b"\xff\xfe\xfd\xfc"
    _rewrite_blob(hub.late_corrupt, last.name, bytes(bad))
    root = tmp_path / "models"
    source = "hf://org/late-corrupt"
    _hold_until_the_rest_is_journaled(monkeypatch, last.name)
    try:
        assert main(_argv(source, root)) == ChecksumMismatchError.exit_code
        err = capsys.readouterr().err
        assert f"{last.name}: downloaded bytes do not match the Hub's hash" in err
        assert not list(root.glob("tiny@*/*"))  # nothing published
        assert not (root / STAGING_DIR).exists() or not any((root / STAGING_DIR).iterdir())
        kept = runs.journaled(root)
        assert len(kept) > 10  # outputs of the earlier shards were written before the failure
        (source_dir,) = root.glob(".work/*/source")
        assert not (source_dir / last.name).exists()  # the mismatching download was discarded
    finally:
        _rewrite_blob(hub.late_corrupt, last.name, good)

    arrivals = runs.record_arrivals(monkeypatch, root)
    assert main(_argv(source, root)) == 0
    repository = runs.published(root)
    assert runs.inodes(repository, kept) == kept  # published as written then, not written again
    assert 1 <= len(arrivals.shards) < len(list(checkpoint.glob("model-*.safetensors")))
    assert manifest.verify(repository) == []
    assert runs.weights(repository) == runs.weights(sequential)


def test_a_branch_that_moves_during_the_run_is_never_published_under_either_commit(
    sequential, checkpoint, tmp_path, capsys, monkeypatch
):
    """The Hub's ``main`` moves to a commit with another last shard after the run resolved it
    once (a forged Hub, tests.servers.ForgedHub, moving it on the model info call the run makes
    first): the overlapped run fetches the shards of the new commit into a conversion begun
    from the old one's config and index, and must publish nothing (exit 75); the rerun
    publishes the new commit's weights recorded as the new commit, never as the old."""
    from tests.servers import ForgedHub

    files = {name: path.read_bytes() for name, path in _files(checkpoint).items()}
    last = sorted(n for n in files if n.startswith("model-"))[-1]
    moved = bytearray(files[last])
    moved[-100:-96] = b"\x01\x02\x03\x04"  # tensor bytes: the shard still reads
    canary = tmp_path / "canary"  # beside ROOT: the same after every command
    (canary / "sub").mkdir(parents=True)
    (canary / "sub" / last).write_bytes(b"not the loader's")
    (canary / "link").symlink_to(canary / "sub")
    before = runs.tree_digest(canary)
    hub = ForgedHub().start()
    try:
        old = hub.add("org/moving", files)
        calls = []

        def info() -> dict:  # the branch moves once the run has asked where it is
            calls.append(hub.repos["org/moving"]["sha"])
            if len(calls) == 1:
                hub.move("org/moving", {**files, last: bytes(moved)})
            return {"id": "org/moving", "sha": calls[-1]}

        hub.repos["org/moving"]["info"] = info
        runs.use_hub(monkeypatch, hub.url, tmp_path / "hf-home")
        root = tmp_path / "models"
        code = main(_argv("hf://org/moving", root))
        err = capsys.readouterr().err
        assert code == 75, err
        assert "changed while it was loading" in err and old in err
        assert not list(root.glob("tiny@*/*"))  # nothing published
        assert runs.tree_digest(canary) == before

        new = hub.repos["org/moving"]["sha"]
        assert main(_argv("hf://org/moving", root)) == 0
        repository = runs.published(root)
        recorded = manifest.read_manifest(repository)[manifest.SOURCE_FINGERPRINT]
        assert recorded["commit"] == new != old
        assert manifest.verify(repository) == []
        assert runs.weights(repository) != runs.weights(sequential)  # the moved shard's
        assert runs.tree_digest(canary) == before
    finally:
        hub.stop()


def test_outputs_of_a_commit_the_branch_left_are_never_kept_once_it_returns(
    sequential, checkpoint, tmp_path, capsys, monkeypatch
):
    """The Hub's ``main`` moves to a commit with another first shard once the run resolved it,
    then back before the rerun. Before: the run's second fetch resolved ``main`` again and
    converted the other commit's shards into outputs journaled under the commit the
    conversion was planned from; it stopped (75), and the rerun, finding ``main`` at that
    commit again, kept those outputs and published the other commit's weights recorded as
    this one (every later run then called the key up to date). The second fetch now stops
    before it downloads a shard of another commit than the one the plan was made from."""
    from tests.servers import ForgedHub

    files = {name: path.read_bytes() for name, path in _files(checkpoint).items()}
    first = sorted(n for n in files if n.startswith("model-"))[0]
    moved = bytearray(files[first])
    moved[-100:-96] = b"\x01\x02\x03\x04"  # tensor bytes: the shard still reads
    hub = ForgedHub().start()
    try:
        old = hub.add("org/returning", files)
        calls = []

        def info() -> dict:  # the branch moves once the run has asked where it is
            calls.append(hub.repos["org/returning"]["sha"])
            if len(calls) == 1:
                hub.move("org/returning", {**files, first: bytes(moved)})
            return {"id": "org/returning", "sha": calls[-1]}

        hub.repos["org/returning"]["info"] = info
        runs.use_hub(monkeypatch, hub.url, tmp_path / "hf-home")
        root = tmp_path / "models"
        code = main(_argv("hf://org/returning", root))
        err = capsys.readouterr().err
        assert code == 75, err
        assert "changed while it was loading" in err and old in err
        assert not list(root.glob("tiny@*/*"))

        del hub.repos["org/returning"]["info"]
        assert hub.move("org/returning", files) == old  # main is back where it was
        code = main(_argv("hf://org/returning", root))
        assert code == 0, capsys.readouterr().err
        repository = runs.published(root)
        assert manifest.read_manifest(repository)[manifest.SOURCE_FINGERPRINT]["commit"] == old
        assert manifest.verify(repository) == []
        assert runs.weights(repository) == runs.weights(sequential)
    finally:
        hub.stop()
