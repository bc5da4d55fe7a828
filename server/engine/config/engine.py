"""EngineConfig: the engine's settings as one tree of sections (vLLM's split), each validating its own
fields once; the rules that span sections live here. EngineConfig.of routes flat names (the Python
API's `LLM(model, max_loras=8)`) to the section that declares each, from the sections' own fields."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from server.engine.config.cache import CacheConfig
from server.engine.config.device import DeviceConfig
from server.engine.config.lora import LoraConfig
from server.engine.config.parallel import ParallelConfig
from server.engine.config.quantization import QuantizationConfig
from server.engine.config.scheduler import SchedulerConfig
from server.engine.speculative_config import SpeculativeConfig, parse_speculative_config

# Each section field of EngineConfig and its class: flat names are routed by these classes' fields.
SECTIONS: Mapping[str, type] = {"device": DeviceConfig, "cache": CacheConfig, "lora": LoraConfig,
                                "scheduler": SchedulerConfig, "quantization": QuantizationConfig,
                                "parallel": ParallelConfig}


@dataclass(frozen=True)
class EngineConfig:
    # The checkpoint's directory. None until resolved: `loraplex serve` turns --model (the default model,
    # `demo`, a GGUF file or a directory) into one at start (server.model_source) and sets it then.
    model: str | None = None
    device: DeviceConfig = field(default_factory=DeviceConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # vLLM's --speculative-config (a dict, its JSON text, or parsed; server.engine.speculative_config): drafts
    # verified by the target each step, the output exactly the plain engine's; None: one token per step.
    # Annotated as what it holds after __post_init__ (the engine-core process decodes it by this type).
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"EngineConfig.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        try:
            object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        except ValueError as e:
            raise ValueError(f"speculative_config: {e}") from None
        if self.speculative_config is not None and self.scheduler.async_scheduling:
            # A step prepared ahead assumes one token per sequence; drafts change how far each gets.
            raise ValueError("speculative_config does not combine with async_scheduling yet")

    @classmethod
    def of(cls, model: str | None = None, **flat: Any) -> EngineConfig:
        """From flat setting names (max_loras=8, device="cpu", ...), each put in the section declaring it."""
        return cls(model=model, **_sectioned(cls(), flat))

    def with_settings(self, **flat: Any) -> EngineConfig:
        """This config with some flat settings changed (model and speculative_config too)."""
        return dataclasses.replace(self, **_sectioned(self, flat))

    def resolved_for(self, device_type: str) -> EngineConfig:
        """The scheduler's device-dependent defaults (the prefill cap's auto) resolved for this device type."""
        scheduler = self.scheduler
        return dataclasses.replace(self, scheduler=dataclasses.replace(
            scheduler, max_prefill_tokens_while_decoding=scheduler.prefill_cap_for(device_type),
            max_prefill_step_ratio=scheduler.prefill_step_ratio_for(device_type)))


def setting_names() -> dict[str, str]:
    """Every flat setting name -> the section that declares it (the top-level ones map to themselves)."""
    names = {f.name: f.name for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS}
    for section, cls in SECTIONS.items():
        names |= {f.name: section for f in dataclasses.fields(cls)}
    return names


def _sectioned(base: EngineConfig, flat: Mapping[str, Any]) -> dict[str, Any]:
    """EngineConfig fields to replace in `base`: the flat settings grouped into their sections."""
    names = setting_names()
    unknown = sorted(set(flat) - set(names))
    if unknown:
        raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}")
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        grouped.setdefault(names[name], {})[name] = value
    top = {name: values[name] for name, values in grouped.items() if name not in SECTIONS}
    return top | {section: dataclasses.replace(getattr(base, section), **values)
                  for section, values in grouped.items() if section in SECTIONS}
