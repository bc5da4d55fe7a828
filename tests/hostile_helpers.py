"""Shared bits of the hostile-tenant tests: a victim's stream that must stay correct while an
attacker acts, and adapter files tampered with after PEFT wrote them."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import safetensors.torch
import torch

VICTIM_PROMPT = [11, 42, 97, 5, 64, 23]
VICTIM_TOKENS = 120


def victim_body(model: str) -> dict:
    return {"model": model, "prompt": VICTIM_PROMPT, "max_tokens": VICTIM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def stream_text(url: str, key: str, body: dict) -> tuple[str, dict | None]:
    """Run one streaming completion to the end: (concatenated text, final usage)."""
    text, usage = [], None
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event["choices"]:
                    text.append(choice["text"])
    return "".join(text), usage


class Victim:
    """Another tenant's long greedy stream, run in a thread while the attack happens."""

    def __init__(self, url: str, key: str, model: str) -> None:
        self.result: tuple[str, dict | None] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, key, victim_body(model)), daemon=True)

    def _run(self, url, key, body) -> None:
        try:
            self.result = stream_text(url, key, body)
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e

    def __enter__(self) -> "Victim":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join(120)

    def assert_completed(self, expected_text: str) -> None:
        assert not self._thread.is_alive(), "the victim's stream never finished"
        assert self.error is None, repr(self.error)
        text, usage = self.result
        assert text == expected_text
        assert usage["completion_tokens"] == VICTIM_TOKENS


def tampered_adapter(src: Path, dst: Path, *, config: dict | None = None, lora_b=None) -> Path:
    """A copy of the PEFT adapter in `src` with config fields overridden and/or every lora_B replaced
    by `lora_b(tensor) -> tensor`."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = safetensors.torch.load_file(str(src / "adapter_model.safetensors"))
    if lora_b is not None:
        tensors = {k: (lora_b(v) if ".lora_B." in k else v) for k, v in tensors.items()}
    safetensors.torch.save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))
