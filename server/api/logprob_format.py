"""The engine's per-token logprobs in OpenAI's two response shapes (and vLLM's prompt_logprobs).

Completions (legacy): parallel lists `tokens`, `token_logprobs`, `top_logprobs`
(a {token text: logprob} dict per position) and `text_offset` (where each token
starts in the returned text); an echoed prompt's first token has no logprob
(null). Chat: `content`, one {token, logprob, bytes, top_logprobs} per token.
"""
from __future__ import annotations

from collections.abc import Sequence

from server.api.token_text import TokenText
from server.engine.protocol import TokenLogprobs


class CompletionLogprobs:
    """Accumulates one choice's completions-style logprobs; `offset` is the returned text's length so far."""

    def __init__(self, texts: TokenText, offset: int = 0) -> None:
        self._texts = texts
        self.offset = offset

    def block(self, entries: Sequence[TokenLogprobs | None], token_ids: Sequence[int]) -> dict:
        """The lists for these tokens (an entry None: a token with no logprob, the prompt's first)."""
        t = self._texts
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry, token_id in zip(entries, token_ids):
            text = t.text(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                tops.append(None)
            else:
                token_logprobs.append(entry.logprob)
                tops.append(_top_dict(t, entry.top))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _top_dict(texts: TokenText, top) -> dict[str, float]:
    """{token text: logprob}; where two ids read the same, the likelier one (listed first) stays."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(texts.text(token_id), logprob)
    return out


def merge_blocks(a: dict | None, b: dict) -> dict:
    """`a` with `b`'s lists appended (in place: a choice's lists grow by one block per delta)."""
    if a is None:
        return b
    for k in a:
        a[k].extend(b[k])
    return a


def chat_content(texts: TokenText, entries: Sequence[TokenLogprobs]) -> list[dict]:
    out = []
    for entry in entries:
        top = [{"token": texts.text(i), "logprob": lp, "bytes": texts.bytes(i)} for i, lp in entry.top]
        out.append({"token": texts.text(entry.token_id), "logprob": entry.logprob,
                    "bytes": texts.bytes(entry.token_id), "top_logprobs": top})
    return out


def prompt_logprobs(texts: TokenText, entries: Sequence[TokenLogprobs | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt position, {token id: {logprob, decoded_token}} for the
    prompt's own token and the top alternatives; the first position has none."""
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {entry.token_id: entry.logprob, **dict(entry.top)}
        out.append({str(i): {"logprob": lp, "decoded_token": texts.text(i)} for i, lp in ranked.items()})
    return out
