"""Incremental detokenisation: text grows as tokens arrive, multi-byte characters come out whole.

Each step decodes only a short window: the tokens since `prefix_offset`
twice (with and without the newest tokens). Decoding a window rather than
single tokens keeps tokenizers that merge spaces across tokens right, and a
trailing U+FFFD means the newest token ends mid-character, so the text waits.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens

    def step(self, state: list[int], output_ids: list[int]) -> str:
        """New text made final by the tokens appended since the last call.

        `state` is the sequence's [prefix_offset, read_offset] into its output ids, updated in place.
        """
        prefix_offset, read_offset = state
        decode = self.tokenizer.decode
        prefix = decode(output_ids[prefix_offset:read_offset], skip_special_tokens=self.skip)
        full = decode(output_ids[prefix_offset:], skip_special_tokens=self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        state[0], state[1] = read_offset, len(output_ids)
        return full[len(prefix) :]

    def flush(self, state: list[int], output_ids: list[int]) -> str:
        """At the end of a sequence: whatever text is still held back, incomplete characters included."""
        prefix_offset, read_offset = state
        prefix = self.tokenizer.decode(output_ids[prefix_offset:read_offset], skip_special_tokens=self.skip)
        full = self.tokenizer.decode(output_ids[prefix_offset:], skip_special_tokens=self.skip)
        state[0] = state[1] = len(output_ids)
        return full[len(prefix) :]
