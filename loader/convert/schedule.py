"""What the overlapped conversion may do next: a state machine without threads or files.

:class:`~loader.convert.overlapped.OverlappedConversion` keeps a :class:`Schedule` under its
lock and asks it, at each event, what follows:

* :meth:`Schedule.admit`: may this shard start downloading? One shard downloads at a time (all
  the fetch's streams on it, so it arrives as early as it can while the one before converts),
  and at most ``window`` shards are held, downloading or arrived and not yet deleted; one more
  when those held cannot progress without another (nothing is being written and nothing
  downloads), so the disk holds the outputs plus a few shards;
* :meth:`Schedule.arrived`, :meth:`Schedule.written`: a :class:`Step`, the outputs whose shards
  are all here now (to write) and the shards nothing left to write reads (to delete);
* :attr:`Schedule.skip`: the shards no output left to write reads (a resumed run does not
  download them);
* :meth:`Schedule.missing`: once the download ended with outputs still waiting, the shards
  they lack.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Shards held (downloading or arrived) at a time by default.
DEFAULT_WINDOW = 2


@dataclass(frozen=True)
class Step:
    """What to do after an event: outputs to hand to the writers, shards to delete."""

    write: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()


class Schedule:
    """The state of an overlapped conversion: which shards are held and arrived, which outputs
    wait, are being written or are done, and who still reads each shard."""

    def __init__(
        self,
        needs: Mapping[str, frozenset[str]],
        *,
        done: Iterable[str] = (),
        window: int = DEFAULT_WINDOW,
    ) -> None:
        """``needs``: output name -> the shards it reads, in the order outputs are written;
        ``done``: outputs already written (a resumed run)."""
        self.window = max(1, window)
        self.needs = needs
        finished = set(done)
        #: Outputs waiting for shards, in plan order.
        self.waiting: dict[str, None] = dict.fromkeys(n for n in needs if n not in finished)
        #: Outputs handed to the writers, not written yet.
        self.writing: set[str] = set()
        #: shard -> the outputs not written yet that read it
        self.readers: dict[str, set[str]] = {s: set() for n in needs for s in needs[n]}
        for name in self.waiting:
            for shard in needs[name]:
                self.readers[shard].add(name)
        #: Shards admitted or arrived and not deleted yet.
        self.held: set[str] = set()
        #: Shards arrived and not deleted yet.
        self.here: set[str] = set()

    def reads(self, shard: str) -> bool:
        """Whether ``shard`` is one the outputs read (anything else is not scheduled)."""
        return shard in self.readers

    @property
    def skip(self) -> frozenset[str]:
        """Shards nothing left to write reads: not to be downloaded."""
        return frozenset(shard for shard, readers in self.readers.items() if not readers)

    @property
    def downloading(self) -> set[str]:
        return self.held - self.here

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.writing

    def may_admit(self, shard: str) -> bool:
        """Whether ``shard`` may start downloading now (see the module docstring)."""
        if not self.reads(shard) or shard in self.held:
            return True
        if self.downloading:
            return False
        return len(self.held) < self.window or not self.writing

    def admit(self, shard: str) -> bool:
        """Let ``shard`` start downloading if it may (then it is held); False: not yet."""
        if not self.may_admit(shard):
            return False
        if self.reads(shard):
            self.held.add(shard)
        return True

    def arrived(self, shard: str) -> Step:
        """``shard`` arrived, verified (whether it was admitted or was already there)."""
        if not self.reads(shard):
            return Step()
        self.held.add(shard)
        self.here.add(shard)
        return self._next(released=[shard] if not self.readers[shard] else [])

    def written(self, output: str) -> Step:
        """``output`` is written: the shards only it still read can go."""
        self.writing.discard(output)
        released = []
        for shard in sorted(self.needs[output]):
            self.readers[shard].discard(output)
            if not self.readers[shard] and shard in self.here:
                released.append(shard)
        return self._next(released=released)

    def _next(self, *, released: list[str]) -> Step:
        for shard in released:
            self.held.discard(shard)
            self.here.discard(shard)
        ready = tuple(n for n in self.waiting if self.needs[n] <= self.here)
        for name in ready:
            del self.waiting[name]
            self.writing.add(name)
        return Step(write=ready, delete=tuple(released))

    def missing(self) -> list[str]:
        """The shards outputs still waiting need and that are not here, once nothing is being
        written (empty while anything can still progress)."""
        if self.writing:
            return []
        needed = set().union(*(self.needs[n] for n in self.waiting))
        return sorted(needed - self.here)
