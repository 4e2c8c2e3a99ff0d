"""The run's strategies on their own, with the fetch replaced by a stand-in source."""

from __future__ import annotations

import shutil

import pytest

from loader.checkpoint import read_hf_config, read_inventory
from loader.convert import plan_conversion
from loader.errors import TransientSourceError
from loader.parallel import Parallelism
from loader.repository.key import ServingSettings
from loader.run import RunRequest, strategies
from loader.run.verify import Verified
from loader.sources import FetchResult
from loader.sources.fingerprint import Fingerprint


def test_a_source_that_changes_before_an_undeclared_checkpoint_is_fetched_whole_is_refused(
    tiny_sharded_bin_checkpoint, tmp_path, monkeypatch
):
    """Without a declared dtype the overlapped strategy fetches the rest before converting:
    what it fetched must still be what it verified."""
    fetched = iter(["generation 1", "generation 2"])

    def fetch(uri, dest, **options):
        hooks = options.get("hooks")
        dest.mkdir(parents=True, exist_ok=True)
        files = []
        for path in tiny_sharded_bin_checkpoint.iterdir():
            if hooks is None or hooks.include is None or hooks.include(path.name):
                shutil.copy(path, dest / path.name)
                files.append(path.name)
        commit = next(fetched)
        return FetchResult(dest, None, files, fingerprint=Fingerprint(uri, commit=commit))

    monkeypatch.setattr(strategies, "fetch", fetch)
    request = RunRequest(
        source="gs://bucket/ckpt",
        repository=tmp_path / "models",
        model_name="tiny",
        parallelism=Parallelism(tp=2),
        settings=ServingSettings(backend="python"),
    )
    overlapped = strategies.Overlapped(request, tmp_path / "work", tmp_path)
    first = overlapped.fetch()
    assert not list(first.path.glob("*.bin"))  # the small files only
    plan = plan_conversion(
        read_hf_config(first.path), read_inventory(first.path), parallelism=request.parallelism
    )
    assert plan.out_dtype is None  # its config.json declares no dtype
    with pytest.raises(TransientSourceError, match="changed while it was loading"):
        overlapped.convert(Verified(plan, []), tmp_path / "out")
    assert not (tmp_path / "out").exists()
