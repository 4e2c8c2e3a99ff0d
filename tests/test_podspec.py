"""loader.podspec: a rendered container's environment and command line, as the kubelet
resolves them (Kubernetes' `$(VAR)` expansion rules)."""

from __future__ import annotations

import base64

import pytest

from loader import podspec


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--key=$(TOKEN)", "--key=s3cr3t"),
        ("$(TOKEN)$(TOKEN)", "s3cr3ts3cr3t"),
        ("$(UNSET)", "$(UNSET)"),  # an undefined variable stays as written
        ("$$(TOKEN)", "$(TOKEN)"),  # $$ escapes
        ("$$$(TOKEN)", "$s3cr3t"),
        ("cost: $5 and $(", "cost: $5 and $("),
        ("$(EMPTY)x", "x"),
    ],
)
def test_expansion_follows_kubernetes(text, expected):
    assert podspec.expand(text, {"TOKEN": "s3cr3t", "EMPTY": ""}) == expected


def test_a_substituted_value_is_not_expanded_again():
    assert podspec.expand("$(A)", {"A": "$(B)", "B": "no"}) == "$(B)"


def _secret(name: str, **data: str) -> dict:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"kind": "Secret", "metadata": {"name": name}, "data": encoded}


def test_environment_reads_values_and_secrets_in_order():
    container = {
        "env": [
            {"name": "A", "value": "a"},
            {"name": "B", "value": "$(A)-$(C)"},  # C is defined later: stays
            {"name": "C", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {
                "name": "D",
                "valueFrom": {"secretKeyRef": {"name": "s", "key": "x", "optional": True}},
            },
        ],
        "command": ["run", "--c=$(C)", "--b=$(B)"],
        "args": ["$(D)"],
    }
    docs = [_secret("s", k="v=1:2")]
    assert podspec.environment(container, docs) == {"A": "a", "B": "a-$(C)", "C": "v=1:2"}
    assert podspec.command_line(container, docs) == ["run", "--c=v=1:2", "--b=a-$(C)", "$(D)"]


def test_a_missing_secret_is_an_error_unless_given():
    container = {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "ops", "key": "t"}}}]}
    with pytest.raises(podspec.PodSpecError, match="ops"):
        podspec.environment(container, [])
    assert podspec.environment(container, [], external={"ops": {"t": "x"}}) == {"T": "x"}
