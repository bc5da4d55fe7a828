"""The baseline a user without loraplex would write: transformers + peft.

All adapters are loaded into one PeftModel up front (not timed). Requests
arrive on the workload's schedule; whenever the model is free it takes the
adapter of the oldest queued request, `set_adapter`s it, and runs every queued
request of that adapter (up to max_batch) as one left-padded greedy
`model.generate` (base-model requests run under `disable_adapter()`). One
adapter at a time: that is the limit loraplex removes. A group generates until
its longest request is done; each request is credited with its own max_tokens,
at the time its last token was produced.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from server.bench.metrics import RequestRecord
from server.bench.workload import BenchRequest


@dataclass(frozen=True)
class BaselineConfig:
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 32
    # torch's intra-op threads on a CPU device, the count loraplex gets; None leaves torch's default,
    # whose spin-waiting pool on a busy machine made one run 30x slower than the next.
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"baseline threads must be >= 1, got {self.threads}")
        if self.max_batch < 1:
            raise ValueError(f"baseline max_batch must be >= 1, got {self.max_batch}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"baseline dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


class _StepClock:
    """A StoppingCriteria that never stops: it timestamps every decoding step."""

    def __init__(self, t0: float, sync) -> None:
        self.t0, self.sync, self.times = t0, sync, []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.sync()
        self.times.append(time.perf_counter() - self.t0)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class PeftBaseline:
    def __init__(self, model_dir: str | Path, adapter_dirs: dict[str, Path], cfg: BaselineConfig,
                 base_model: torch.nn.Module | None = None) -> None:
        """base_model: an already built transformers model (the GPU mode's in-memory one)."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu" and cfg.threads is not None:
            torch.set_num_threads(cfg.threads)  # process-wide, as loraplex's engine does in its own
        model = base_model if base_model is not None else AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, cfg.dtype)).to(self.device)
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.bos_id = model.config.bos_token_id
        names = list(adapter_dirs)
        if names:
            model = PeftModel.from_pretrained(model, str(adapter_dirs[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
        # generate() fills an unset eos from the model's own generation config and would stop (and
        # pad) at EOS, while the servers ignore_eos: unset it there too, so all sides do the same work.
        model.generation_config.eos_token_id = None
        self.model = model.eval()
        self.has_adapters = bool(names)
        self.outputs: dict[int, list[int]] = {}  # request index -> its generated token ids, once run
        self.tokenizer = _tokenizer(model_dir)  # texts, to compare with a server's; None without one

    def _generation_config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        # eos None: nothing stops early, so both sides produce exactly max_tokens.
        return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                eos_token_id=None, bos_token_id=self.bos_id, pad_token_id=self.pad_id,
                                temperature=None, top_p=None, top_k=None, use_cache=True)

    @torch.inference_mode()
    def _generate(self, group: list[BenchRequest], t0: float) -> tuple[list[float], torch.Tensor]:
        """Each step's time, and the generated ids [B, N]."""
        from transformers import StoppingCriteriaList

        width = max(len(r.prompt_ids) for r in group)
        ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)  # ids: [B, P]
        mask = torch.zeros((len(group), width), dtype=torch.long)               # mask: [B, P]
        for i, r in enumerate(group):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        clock = _StepClock(t0, sync)
        kwargs = dict(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                      generation_config=self._generation_config(max(r.max_tokens for r in group)),
                      stopping_criteria=StoppingCriteriaList([clock]))
        adapter = group[0].adapter_name
        if adapter is None and self.has_adapters:
            with self.model.disable_adapter():
                out = self.model.generate(**kwargs)
        else:
            if adapter is not None:
                self.model.set_adapter(adapter)
            out = self.model.generate(**kwargs)
        return clock.times, out[:, width:].cpu()

    def warmup(self, requests: list[BenchRequest]) -> None:
        """One tiny generate per distinct adapter so first-call costs stay out of the numbers."""
        seen = {}
        for r in requests:
            seen.setdefault(r.adapter_name, r)
        for r in seen.values():
            short = BenchRequest(r.index, 0.0, r.adapter, r.tenant, r.prompt_ids[:4], 2)
            self._generate([short], time.perf_counter())

    def run(self, requests: list[BenchRequest]) -> list[RequestRecord]:
        records = {r.index: RequestRecord(r.index, r.tenant, r.adapter_name, r.arrival_s, len(r.prompt_ids),
                                          r.max_tokens) for r in requests}
        pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        queue: list[BenchRequest] = []
        t0 = time.perf_counter()
        while pending or queue:
            now = time.perf_counter() - t0
            while pending and pending[0].arrival_s <= now:
                queue.append(pending.popleft())
            if not queue:
                time.sleep(max(0.0, pending[0].arrival_s - now))
                continue
            key = queue[0].adapter
            group = [r for r in queue if r.adapter == key][: self.cfg.max_batch]
            chosen = {r.index for r in group}
            queue = [r for r in queue if r.index not in chosen]
            times, generated = self._generate(group, t0)
            for r, ids in zip(group, generated):
                rec = records[r.index]
                n = min(r.max_tokens, len(times))
                rec.token_times_s = times[:n]
                rec.first_token_s, rec.end_s, rec.output_tokens = times[0], times[n - 1], n
                self.outputs[r.index] = ids[:n].tolist()
                if self.tokenizer is not None:
                    rec.text = self.tokenizer.decode(ids[:n].tolist(), skip_special_tokens=True)  # as the servers
        return [records[r.index] for r in requests]


def _tokenizer(model_dir: str | Path | None):
    from transformers import AutoTokenizer

    if model_dir is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError):
        return None
