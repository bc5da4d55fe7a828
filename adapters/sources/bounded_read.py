"""Reading a stream of chunks under a byte cap and a deadline: a source that sends too much, or
drips slowly, fails as soon as it crosses either bound, with no more than the cap buffered."""
from __future__ import annotations

import time
from collections.abc import Iterable

from adapters.sources.errors import SourceError, too_large


def read_capped(chunks: Iterable[bytes], cap: int, deadline: float, what: str) -> bytes:
    """`deadline` is a time.monotonic() value."""
    out = bytearray()
    for chunk in chunks:
        out += chunk
        if len(out) > cap:
            raise too_large(what, len(out), cap)
        if time.monotonic() > deadline:
            raise timed_out(what)
    return bytes(out)


def timed_out(what: str) -> SourceError:
    return SourceError(504, f"fetching {what} timed out", "source_timeout")


def remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise timed_out(what)
    return left
