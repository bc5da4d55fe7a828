"""Turning a request's prompt or chat messages into token ids, off the event loop.

The API keeps its own tokenizer (the engine's belongs to the engine thread) and
serialises calls to it: a fast tokenizer is not safe to share across threads.
"""
from __future__ import annotations

import threading

from starlette.concurrency import run_in_threadpool
from transformers import AutoTokenizer

from server.api.errors import APIError


class PromptTokenizer:
    def __init__(self, model_dir: str) -> None:
        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self._lock = threading.Lock()

    def _encode_text(self, text: str) -> list[int]:
        with self._lock:
            return list(self._tok(text).input_ids)

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        with self._lock:
            if not getattr(self._tok, "chat_template", None):
                raise APIError(400, "this model has no chat template; use /v1/completions",
                               "no_chat_template")
            try:
                text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001 - a template's raise_exception is the user's input error
                raise APIError(400, f"the chat template refused these messages: {e}",
                               "invalid_messages") from None
            # The template writes the special tokens (BOS...) itself.
            return list(self._tok(text, add_special_tokens=False).input_ids)

    async def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await run_in_threadpool(self._encode_text, prompt)
        return list(prompt)

    async def encode_chat(self, messages: list[dict]) -> list[int]:
        return await run_in_threadpool(self._encode_chat, messages)
