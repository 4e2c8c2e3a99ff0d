"""Fill-in-the-middle (``suffix``): only for a model that declares how it infills.

A model infills when it was trained on a template that puts the text before and after the gap
around special tokens (StarCoder's ``<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>``,
CodeGen2's ``{prefix}<mask_1><|endoftext|><sep><mask_1>`` ...). CodeGen1 and GPT-J were trained
on no such template: a ``suffix`` is refused (HTTP 400 saying so), never ignored.

The hook: the ``llm`` model's ``config.pbtxt`` may carry the parameter ``infill_template``, a
string with ``{prefix}`` and ``{suffix}`` in it; when it does, a request's ``prompt`` and
``suffix`` become the model's prompt through it (:func:`infill_prompt`).
"""

from __future__ import annotations

from completions_service.errors import InvalidRequest

#: The ``llm`` model's config parameter that declares the template.
TEMPLATE_PARAMETER = "infill_template"


def check_template(template: str) -> str:
    """``template`` if it holds ``{prefix}`` and ``{suffix}`` once each, else ValueError."""
    if template.count("{prefix}") != 1 or template.count("{suffix}") != 1:
        raise ValueError(
            f"the model's {TEMPLATE_PARAMETER} parameter must hold {{prefix}} and {{suffix}} "
            f"once each (got {template!r})"
        )
    return template


def infill_prompt(prompt: str, suffix: str | None, template: str | None, model: str) -> str:
    """The prompt the model is sent: ``prompt`` itself without a suffix; with one, the
    model's template filled in, or a 400 when the model declares none."""
    if suffix is None:
        return prompt
    if template is None:
        raise InvalidRequest(
            f"suffix: the model {model!r} cannot fill in the middle (it was trained on no "
            "infill format, as CodeGen1 and GPT-J); leave suffix out, or serve a model that "
            f"declares an {TEMPLATE_PARAMETER}",
            param="suffix",
        )
    # Replaced one at a time, so braces in the user's text are never read as a format.
    head, tail = template.split("{prefix}", 1)
    if "{suffix}" in head:
        before, after = head.split("{suffix}", 1)
        return before + suffix + after + prompt + tail
    middle, end = tail.split("{suffix}", 1)
    return head + prompt + middle + suffix + end
