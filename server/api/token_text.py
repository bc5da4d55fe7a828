"""What one token id reads as, for logprobs: its text and its exact UTF-8 bytes.

A byte-level BPE token can be part of a multi-byte character, so its text
alone may not round-trip (OpenAI's chat logprobs carry `bytes` for this). For
byte-level vocabularies the bytes are exact (the vocabulary entry mapped back
through GPT-2's byte-to-unicode table); otherwise they are the decoded text's.
Memoised per id: only ids that were actually returned are ever decoded.
"""
from __future__ import annotations

from server.engine.tokenizer_loader import bytes_to_unicode


class TokenText:
    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._table = {c: b for b, c in bytes_to_unicode().items()} if self._byte_level else {}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw = None
        if self._byte_level:
            piece = self._tok.convert_ids_to_tokens(token_id)
            if piece is not None and all(c in self._table for c in piece):
                raw = bytes(self._table[c] for c in piece)
        text = self._tok.decode([token_id])
        entry = (raw.decode("utf-8", errors="replace") if raw is not None else text,
                 raw if raw is not None else text.encode("utf-8", errors="replace"))
        self._cache[token_id] = entry
        return entry

    def text(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return list(self._entry(token_id)[1])
