"""How many values a JSON body holds, counted before any of them is built, and while its bytes
still arrive: a body with more values than its endpoint can use (a completions body's token ids are
at most `--max-batch-prompts` x `max_model_len`) is refused as soon as its running count passes the
bound, so a 15 MB body of token ids is refused after its first megabyte, not received whole and
then refused.

Values are counted by their separating commas outside strings, string literals by their quotes.
UTF-8 puts no '"' or '\\' byte inside a multi-byte character, so on the raw bytes a string's end is
the next quote byte unless a backslash precedes it; where one does (an escaped quote) the byte count
stops being exact and the decoded text is scanned instead, once the body is whole.
"""
from __future__ import annotations

import json
from json.decoder import scanstring

from server.api.errors import APIError

# String literals (object keys included) in one body: 4,096 chat messages of a few fields each,
# 1,024 logit_bias keys and 64 prompts stay far below it.
MAX_STRINGS = 1 << 16
# A C call holds the GIL throughout: a whole body is scanned in windows of this many bytes.
SCAN_WINDOW_CHARS = 1 << 20
_BACKSLASH = ord("\\")


def too_many_values(cap: int, what: str) -> APIError:
    return APIError(400, f"the body has more than {cap} {what}; no request to this endpoint needs that many "
                         f"(token ids are bounded by max_model_len per prompt and --max-batch-prompts)",
                    "too_many_values")


class ValueCounter:
    """The running count over a body's bytes as they arrive (`feed` after each chunk): raises the 400
    as soon as the values pass `max_values` or the strings MAX_STRINGS."""

    def __init__(self, max_values: int) -> None:
        self.max_values = max_values
        self.values = 0
        self.strings = 0
        self._pos = 0
        self._in_string = False
        self._exact = True

    @property
    def complete(self) -> bool:
        """Every byte fed was counted exactly and no string is left open: the whole body's count."""
        return self._exact and not self._in_string

    def feed(self, raw: bytes | bytearray, end: int) -> None:
        """Count raw[counted so far:end]; `raw` holds the body's bytes up to `end` at least."""
        pos = self._pos
        while self._exact and pos < end:
            if self._in_string:
                close = raw.find(b'"', pos, end)
                if close < 0:
                    break
                if raw[close - 1] == _BACKSLASH:
                    self._exact = False  # an escaped quote, or a backslash ending the string: not decidable here
                    break
                self._in_string = False
                pos = close + 1
                continue
            hi = min(end, pos + SCAN_WINDOW_CHARS)
            quote = raw.find(b'"', pos, hi)
            self.values += raw.count(b",", pos, hi if quote < 0 else quote)
            if self.values > self.max_values:
                raise too_many_values(self.max_values, "values (array elements and object members)")
            if quote < 0:
                pos = hi
                continue
            self.strings += 1
            if self.strings > MAX_STRINGS:
                raise too_many_values(MAX_STRINGS, "strings")
            self._in_string = True
            pos = quote + 1
        self._pos = end


def check_value_count(text: str, max_values: int) -> None:
    """The count on the decoded text, where the bytes' was not exact. Strings are skipped with the
    JSON decoder's own C scanner, so a comma inside one never counts."""
    pos, values, strings = 0, 0, 0
    while True:
        quote = text.find('"', pos)
        end = len(text) if quote < 0 else quote
        for lo in range(pos, end, SCAN_WINDOW_CHARS):
            values += text.count(",", lo, min(end, lo + SCAN_WINDOW_CHARS))
            if values > max_values:
                raise too_many_values(max_values, "values (array elements and object members)")
        if quote < 0:
            return
        strings += 1
        if strings > MAX_STRINGS:
            raise too_many_values(MAX_STRINGS, "strings")
        try:
            _, pos = scanstring(text, quote + 1, True)
        except json.JSONDecodeError as e:
            raise APIError(400, f"the body is not valid JSON: {e}", "invalid_json") from None
