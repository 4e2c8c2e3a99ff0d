"""Changes made at a chosen moment of a loader operation, through the fault-injection seam of
:mod:`loader.fs`: what another process could do between two of the loader's steps."""

from __future__ import annotations

from collections.abc import Callable

from loader.repository.key import key_filename


def when_locked(key: str, change: Callable[[], None]):
    """A hook of ``loader.fs`` that calls ``change()`` once, as prune opens ``key``'s lock:
    between prune's first look and its second under the lock. Returns the hook and a list
    that holds ``True`` once the change was made."""
    done: list[bool] = []

    def hook(op: str, path: str) -> None:
        if not done and op == "open" and path.endswith(f"/{key_filename(key)}.lock"):
            done.append(True)
            change()

    return hook, done
