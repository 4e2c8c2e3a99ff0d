"""The architecture registry checks what it registers and refuses a silent overwrite."""

from __future__ import annotations

import pytest

from loader.convert.gptj import GptJArchitecture
from loader.convert.registry import ARCHITECTURES, register


def test_a_model_type_registered_twice_is_refused():
    before = dict(ARCHITECTURES)
    with pytest.raises(ValueError, match="'gptj' is already registered"):
        register("gptj")(GptJArchitecture)
    assert before == ARCHITECTURES


def test_a_class_whose_model_type_differs_is_refused():
    class Mislabelled(GptJArchitecture):
        model_type = "gptj"

    with pytest.raises(ValueError, match="model_type is not 'llama-like'"):
        register("llama-like")(Mislabelled)
    assert "llama-like" not in ARCHITECTURES


def test_a_class_lacking_part_of_the_interface_is_refused():
    class Partial:
        model_type = "partial"

        def expected_tensors(self, cfg):
            return {}

    with pytest.raises(ValueError, match="does not implement every method"):
        register("partial")(Partial)
    assert "partial" not in ARCHITECTURES
