"""Stop strings: where the text must end, and how much of its tail to hold back while streaming."""
from __future__ import annotations


class StopChecker:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.searched = 0  # text before this offset holds no stop string

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts, or None."""
        if not self.stops:
            return None  # the common case: one attribute check per token
        start = max(0, self.searched - self.longest + 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        self.searched = len(text)
        return min(hits) if hits else None

    def skip(self, text: str) -> None:
        """`text` is not to be searched (min_tokens not reached): later searches start at its end,
        less a stop string's length, so only a stop string that ends after it counts."""
        self.searched = len(text)

    def partial_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
