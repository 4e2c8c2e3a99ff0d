"""Something done to a tree at one chosen call of the file-system seam: a clean run counts the
calls a filter picks, and then one run per step does the deed at that step's call (a
directory removed, or a user's one renamed to a loader name, right there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from loader import fs

T = TypeVar("T")

#: Picks a seam call (``op``, ``path``): what the deed is done to, or None to pass it by.
Match = Callable[[str, str], "T | None"]


def picked_calls(match: Match, run: Callable[[], object]) -> tuple[list[str], object]:
    """The calls (``"op path"``) ``match`` picks while ``run()`` runs, and what it returned."""
    calls: list[str] = []

    def count(op: str, path: str) -> None:
        if match(op, path) is not None:
            calls.append(f"{op} {path}")

    with fs.inject(count):
        returned = run()
    return calls, returned


class AtStep(Generic[T]):
    """A seam hook that calls ``deed(picked)`` at the ``step``-th call ``match`` picks (counting
    from 1), once; ``done`` holds what it was done to."""

    def __init__(self, step: int, match: Match, deed: Callable[[T], None]) -> None:
        self.step, self.match, self.deed = step, match, deed
        self.seen = 0
        self.done: list[T] = []

    def __call__(self, op: str, path: str) -> None:
        if self.done:
            return
        picked = self.match(op, path)
        if picked is None:
            return
        self.seen += 1
        if self.seen == self.step:
            self.deed(picked)
            self.done.append(picked)
