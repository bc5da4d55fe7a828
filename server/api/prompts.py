"""Turning a request's prompt or chat messages into token ids, off the event loop.

Bounded before tokenizing: a token covers at most `max_token_chars`
characters (the longest entry in the vocabulary), so text longer than
`max_model_len * max_token_chars` characters cannot fit in the context and is
refused without being tokenized. A 20 MB prompt is a 400 in microseconds, not
36 s and 4 GB of tokenizer memory.

No lock is shared between requests: a fast tokenizer is not safe to share
across threads (the wrapper mutates its truncation state per call), so each
worker thread gets its own copy, and one tenant's long prompt never makes
another tenant's request wait for it.
"""
from __future__ import annotations

import copy
import json
import threading

from starlette.concurrency import run_in_threadpool

from server.api.errors import APIError
from server.api.token_text import TokenText
from server.engine.tokenizer_loader import load_tokenizer


def longest_token_chars(tokenizer) -> int:
    """Characters the longest vocabulary entry can stand for (at least 1).

    Byte-level BPE entries are one character per byte, so their length bounds
    the characters they decode to; SentencePiece byte-fallback entries such as
    "<0x0A>" are longer than the one byte they encode, which only loosens the bound.
    """
    vocab = tokenizer.get_vocab()
    return max([1, *(len(token) for token in vocab)])


class PromptTokenizer:
    def __init__(self, model_dir: str, max_model_len: int, chat_template: str | None = None) -> None:
        self._template = load_tokenizer(model_dir)
        if chat_template is not None:  # --chat-template (server.chat_templates)
            self._template.chat_template = chat_template
        self._local = threading.local()
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len * longest_token_chars(self._template)
        # The template itself is used on the event loop only (decoding never mutates it).
        self.token_texts = TokenText(self._template)

    def decode(self, ids: list[int]) -> str:
        """Token ids as text (event-loop thread only; at most a context's worth)."""
        return self._template.decode(ids)

    async def detokenize(self, ids: list[int]) -> str:
        """Any number of ids as text, on a worker thread with its own tokenizer."""
        return await run_in_threadpool(lambda: self._tok().decode(ids))

    def _tok(self):
        tok = getattr(self._local, "tok", None)
        if tok is None:
            tok = self._local.tok = copy.deepcopy(self._template)
        return tok

    def check_text_length(self, chars: int, what: str, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(400, f"{what} has {chars} characters; at most {self.max_prompt_chars} can fit in "
                                f"the maximum context length of {self.max_model_len} tokens",
                           "context_length_exceeded", param=param)

    def check_token_count(self, count: int, param: str) -> None:
        if count > self.max_model_len:
            raise APIError(400, f"the prompt has {count} tokens, more than the maximum context length of "
                                f"{self.max_model_len} tokens", "context_length_exceeded", param=param)

    def _encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok()(text, add_special_tokens=add_special_tokens).input_ids)

    @property
    def chat_template(self) -> str | dict | None:
        return getattr(self._template, "chat_template", None)

    def _encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        tok = self._tok()
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", "no_chat_template",
                           param="messages")
        try:
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception is the user's input error
            raise APIError(400, f"the chat template refused these messages: {e}", "invalid_messages",
                           param="messages") from None
        # The template writes the special tokens (BOS...) itself.
        return list(tok(text, add_special_tokens=False).input_ids)

    async def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            self.check_text_length(len(prompt), "the prompt", "prompt")
            ids = await run_in_threadpool(self._encode_text, prompt, add_special_tokens)
        else:
            ids = list(prompt)
        self.check_token_count(len(ids), "prompt")
        return ids

    async def encode_batch(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """`encode` for each prompt of a batch, with one worker-thread hop for all its texts, not one
        per prompt (64 hops cost the event loop and the engine's core more than 64 short encodes)."""
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            self.check_text_length(len(text), "the prompt", "prompt")
        encoded = iter(await run_in_threadpool(lambda: [self._encode_text(t) for t in texts]) if texts else ())
        batch = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        for ids in batch:
            self.check_token_count(len(ids), "prompt")
        return batch

    async def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        chars = sum(_message_chars(m) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        self.check_text_length(chars, "the conversation", "messages")
        ids = await run_in_threadpool(self._encode_chat, messages, tools)
        self.check_token_count(len(ids), "messages")
        return ids


def _message_chars(message: dict) -> int:
    content = message.get("content")
    calls = len(json.dumps(message["tool_calls"])) if message.get("tool_calls") else 0
    if isinstance(content, str):
        return len(content) + calls
    return sum(len(part.get("text", "")) for part in content or ()) + calls
