"""One rule for what a remote listing names (``gs://`` objects, Hub files): checked against the
real file system, and the same for both sources (:mod:`loader.sources.names`)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader import fs
from loader.errors import SourceError
from loader.sources import parse_uri
from loader.sources.gcs import _PARTIAL_SUFFIX, _relpath
from loader.sources.hf import INCOMPLETE, _names
from loader.sources.names import NAME_MAX, listed_parts
from tests.tiers import examples

_LEVEL = st.one_of(
    st.sampled_from(["", ".", "..", ".partial", fs.MADE, "a", "model.safetensors", "x\ny", "x\0y"]),
    st.text(min_size=1, max_size=12),
    st.integers(200, 300).map(lambda n: "é" * (n // 2)),  # two bytes each: bytes, not chars
)
_NAME = st.lists(_LEVEL, min_size=1, max_size=fs.MAX_NAME_LEVELS + 2).map("/".join)


def _refused(call) -> bool:
    try:
        call()
    except SourceError:
        return True
    return False


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rel=_NAME, suffix=st.sampled_from([len(INCOMPLETE), _PARTIAL_SUFFIX]))
def test_a_name_taken_can_be_created_with_its_download_suffix_and_maps_back(
    rel, suffix, tmp_path_factory
):
    """What is taken lands below DEST as exactly its own levels, each creatable on the real file
    system with the suffix its download carries; what is refused is refused before anything is
    written, in a message that prints on one line."""
    try:
        parts = listed_parts(rel, what="Object", remedy="Rename it.", suffix=suffix)
    except SourceError as exc:
        assert "\n" not in exc.message and "\0" not in exc.message
        return
    assert "/".join(parts) == rel and len(parts) <= fs.MAX_NAME_LEVELS
    assert parts[0] != ".partial" and not parts[0].startswith(fs.MARKER_PREFIX)
    base = tmp_path_factory.mktemp("dest")
    for part in parts:
        with open(base / (part + "x" * suffix), "xb"):  # ENAMETOOLONG would fail here
            pass
        assert os.listdir(base) == [part + "x" * suffix]
        os.unlink(base / (part + "x" * suffix))


@settings(max_examples=examples(300), deadline=None)
@given(rel=_NAME)
def test_gcs_and_the_hub_refuse_the_same_names(rel):
    """Both sources apply one rule; they differ only in what a download adds to a name, so
    only a name whose longest level fits one suffix and not the other may be judged apart."""
    gcs = _refused(lambda: _relpath(parse_uri("gs://bucket/p"), f"p/{rel}"))
    hub = _refused(lambda: _names(parse_uri("hf://org/name"), rel))
    longest = max(len(os.fsencode(p)) for p in rel.split("/"))
    if not NAME_MAX - _PARTIAL_SUFFIX < longest <= NAME_MAX - len(INCOMPLETE):
        assert gcs == hub, rel
    else:
        assert gcs, rel


def test_an_object_name_too_long_with_its_generation_and_owner_is_refused_before_download():
    """Before: a level of 224 to 232 bytes passed the check (which allowed 32 bytes of suffix)
    and failed at download with ENAMETOOLONG, whose hint asked for a shorter --repository."""
    fits = "m" * (NAME_MAX - _PARTIAL_SUFFIX)
    assert _relpath(parse_uri("gs://bucket/p"), f"p/{fits}") == fits
    with pytest.raises(SourceError, match=f"path component of {len(fits) + 1} bytes"):
        _relpath(parse_uri("gs://bucket/p"), f"p/{fits}m")
    assert len(f".{2**63 - 1}.{4194304}-{'f' * 8}.slices") <= _PARTIAL_SUFFIX


@pytest.mark.parametrize("name", [fs.MADE, ".model-loader-fetch", ".model-loader-made/x"])
def test_an_object_named_like_the_loaders_record_is_refused_never_placed_over_it(name):
    """Before: a ``gs://`` object named ``.model-loader-made`` at the prefix's top was a
    listed name like any other, downloaded to the very name of DEST's record of what the
    loader wrote. A name below the top is no record's and is taken."""
    with pytest.raises(SourceError, match="record of what it wrote"):
        _relpath(parse_uri("gs://bucket/p"), f"p/{name}")
    assert _relpath(parse_uri("gs://bucket/p"), "p/sub/.model-loader-made") == (
        "sub/.model-loader-made"
    )


@pytest.mark.parametrize(
    ("one", "other"),
    [("Config.json", "config.json"),
     ("Maß.bin", "MASS.bin"),  # full case folding: ß is ss
     ("\u03c3.bin", "\u03c2.bin"),  # σ and final ς fold alike
     ("model-\uff11.bin", "model-1.bin"),  # NFKC: a full-width digit is the digit
     ("e\u0301", "\u00e9")],
    ids=["case", "sharp s", "final sigma", "full width", "composed"],
)  # fmt: skip
def test_names_one_file_system_may_keep_as_one_fold_alike(one, other):
    from loader.sources.names import colliding, folded

    assert folded(one) == folded(other)
    assert colliding([one, other]) == (min(one, other), max(one, other), False)
    assert colliding([f"d/{one}", "d/x", f"d/{other}"]) is not None


def test_colliding_names_the_first_pair_in_name_order_and_what_it_would_be():
    from loader.sources.names import colliding

    assert colliding(["b", "a", "B"]) == ("B", "b", False)  # the same file
    assert colliding(["a", "c/x", "A/b"]) == ("a", "A/b", True)  # a file where a folder goes
    # Of two nested pairs, the one first once folded (not first as listed, not first by code
    # point: "B/y" sorts before "a"), whatever order the listing gives.
    for listing in (["B/y", "b", "a/x", "a"], ["a", "a/x", "b", "B/y"]):
        assert colliding(listing) == ("a", "a/x", True)
    assert colliding(["a", "ab", "a.b", "b/a"]) is None
