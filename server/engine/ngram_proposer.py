"""Prompt lookup (vLLM's `ngram` method): draft tokens copied from where the sequence's own tail
appeared before.

The last n tokens (prompt and output so far), for n from prompt_lookup_max down to prompt_lookup_min,
are looked for earlier in the sequence; at the latest earlier match, the tokens that followed it are
the drafts. Model-free, so every adapter gets it; the target model verifies every draft.
"""
from __future__ import annotations


def propose(tokens: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to k drafts continuing `tokens`; [] when no suffix of lookup_min.. tokens recurs."""
    size = len(tokens)
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        suffix = tokens[size - n :]
        last = suffix[-1]
        # Latest first: the most recent context is the likeliest to repeat. A match must end before
        # the suffix itself does, so at least one token follows it.
        for end in range(size - 2, n - 2, -1):
            if tokens[end] == last and tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []
