"""Stop sequences on the text, as the client sees it.

The model is sent the stop sequences too (``stop_words``: it stops generating early), but
FasterTransformer matches them as token sequences, which a string can straddle differently.
So the service also cuts the text itself: the answer ends right before the first occurrence of
a stop sequence (the sequence excluded, as OpenAI does), and the Triton stream is closed then.
While streaming, text that could be the start of a stop sequence is held back until the next
increment shows whether it is; it is sent at the end if the stream ends without it.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._pending = ""  # received, not yet released
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (with what was held back) that is safe to send now."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        pending = self._pending + text
        cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        keep = max((self._overlap(pending, s) for s in self.stops), default=0)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """What was held back, at the end of the stream."""
        rest, self._pending = self._pending, ""
        return "" if self.stopped else rest

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        """The length of the longest end of ``text`` that starts ``stop`` (shorter than it)."""
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if stop.startswith(text[-size:]):
                return size
        return 0
