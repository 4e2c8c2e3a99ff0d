"""CRC32C combined from pieces (loader.sources.transfer.crc32c_combine) equals the CRC32C of
the whole, for any split: what lets a download verify an object from its slices' values as
they arrive, in any order, without reading the file back."""

from __future__ import annotations

import base64
import hashlib

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.sources.transfer import crc32c_combine, crc32c_of, crc32c_text, md5_of
from tests.tiers import examples


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.binary(max_size=2000), min_size=1, max_size=8))
def test_the_values_of_consecutive_pieces_combine_into_the_whole_s(pieces):
    combined = 0
    for piece in pieces:
        combined = crc32c_combine(combined, google_crc32c.value(piece), len(piece))
    assert combined == google_crc32c.value(b"".join(pieces))


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=3, max_size=3),
    st.integers(min_value=0, max_value=2**50),
    st.integers(min_value=0, max_value=2**50),
)
def test_combining_is_associative_for_lengths_of_any_size(crcs, n, m):
    """(A + B) + C == A + (B + C) for pieces B, C of n and m bytes, up to petabytes: the
    powers of x the lengths stand for multiply as they must."""
    a, b, c = crcs
    left = crc32c_combine(crc32c_combine(a, b, n), c, m)
    assert left == crc32c_combine(a, crc32c_combine(b, c, m), n + m)


def test_lengths_out_of_range_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        crc32c_combine(1, 2, -1)


def test_a_file_s_value_in_cloud_storage_s_spelling(tmp_path):
    data = bytes(range(256)) * 1000
    path = tmp_path / "f"
    path.write_bytes(data)
    with open(path, "rb") as fh:
        assert crc32c_text(crc32c_of(fh)) == crc32c_text(google_crc32c.value(data))
        assert crc32c_of(fh, 1000, 5000) == google_crc32c.value(data[1000:6000])
        assert crc32c_of(fh, len(data) - 10, 100) == google_crc32c.value(data[-10:])
        fh.seek(0)
        assert md5_of(fh) == base64.b64encode(hashlib.md5(data).digest()).decode("ascii")
    assert crc32c_text(0xE3069283) == "4waSgw=="  # CRC32C("123456789"), the check value
