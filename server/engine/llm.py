"""The offline Python API (DESIGN.md "Python API")."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Sequence as Seq

from adapters.draft_lora import load_adapter_with_draft
from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.engine.output_text import OutputTexts
from server.engine.sequence import RequestOutput, SamplingParams


class LLM:
    """Generate for many prompts at once, each with its own adapter or none.

    Adapters are added by name; each addition gets a fresh version id, so
    re-adding a name never lets old weights (or KV computed with them) serve
    the new version.
    """

    def __init__(self, model: str | Path, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig.of(str(model), **kwargs))  # each flat setting to its section
        self.tokenizer = self.engine.tokenizer
        self._versions: dict[str, str] = {}  # adapter name -> version id
        self._version_counter = itertools.count(1)
        self._request_counter = itertools.count()

    def add_adapter(self, name: str, path: str | Path) -> str:
        """Load a PEFT LoRA directory under `name`; returns its version id."""
        adapter = load_adapter_with_draft(path, self.engine.adapter_shape, self.engine.draft_adapter_shape,
                                          self.engine.config.lora.max_lora_rank)
        version = f"{name}@{next(self._version_counter)}"
        self.engine.add_adapter(version, adapter)
        old = self._versions.get(name)
        self._versions[name] = version
        if old is not None:
            self.engine.remove_adapter(old)
        return version

    def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(self._versions.pop(name))

    def generate(
        self,
        prompts: Seq[str | list[int]] | str,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        adapters: Seq[str | None] | str | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order.

        With n > 1 it is choice 0, and `.choices` (also `.outputs`, as in vLLM) lists all n
        choices in index order, each a RequestOutput of its own (`index`, `token_ids`, `text`,
        `finish_reason`, `logprobs`). For n == 1, `.choices` is None and `.outputs` is `[out]`.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * n if isinstance(params, SamplingParams) else list(params)
        names = [adapters] * n if adapters is None or isinstance(adapters, str) else list(adapters)
        if len(params_list) != n or len(names) != n:
            raise ValueError("sampling_params and adapters must be one value or one per prompt")
        for name in names:
            if name is not None and name not in self._versions:
                raise ValueError(f"unknown adapter {name!r}: add it with add_adapter first")
        ids = [f"req-{next(self._request_counter)}" for _ in range(n)]
        texts = OutputTexts(self.engine.detokenizer, self.engine.abort_choice)
        for rid, prompt, p, name in zip(ids, prompts, params_list, names):
            self.engine.add_request(rid, prompt, p, self._versions.get(name) if name else None)
            texts.add(rid, p)
        final: dict[str, dict[int, RequestOutput]] = {rid: {} for rid in ids}
        unfinished = sum(p.n for p in params_list)
        while unfinished:
            for out in texts.apply(self.engine.step()):
                if out.finished:
                    final[out.request_id][out.index] = out
                    unfinished -= 1
        return [_with_choices(final[rid]) for rid in ids]


def _with_choices(choices: dict[int, RequestOutput]) -> RequestOutput:
    first = choices[0]
    if len(choices) > 1:
        first.choices = [choices[i] for i in range(len(choices))]
    return first
