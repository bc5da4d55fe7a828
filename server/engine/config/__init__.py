"""The engine's configuration: ModelConfig (the checkpoint's config.json) and EngineConfig, a tree of
sections (device, cache, lora, scheduler, quantization, parallel, speculative), one file each.

No torch at import: the front end and the `loraplex` CLI parse configs without loading it; only the
methods that resolve a device or dtype import it.
"""
from server.engine.config.cache import KV_CACHE_DTYPE_NAMES, CacheConfig, check_kv_cache_dtype_name
from server.engine.config.device import DTYPE_NAMES, DeviceConfig
from server.engine.config.engine import SECTIONS, EngineConfig, setting_names
from server.engine.config.lora import MAX_LORA_RANK, LoraConfig
from server.engine.config.model import QK_NORM_ARCHS, SUPPORTED_ARCHS, ModelConfig, ModelConfigError
from server.engine.config.parallel import ParallelConfig
from server.engine.config.quantization import (
    FP8_MIN_CAPABILITY,
    GPTQ_QUANTIZATIONS,
    QUANTIZATIONS,
    QuantizationConfig,
    check_quantization_name,
)
from server.engine.config.scheduler import (
    AUTO_PREFILL_CAP,
    CPU_PREFILL_CAP,
    CPU_PREFILL_STEP_RATIO,
    MAX_NUM_BATCHED_TOKENS,
    SchedulerConfig,
)
from server.engine.cpu_threads import AUTO
from server.engine.speculative_config import SpeculativeConfig

__all__ = [
    "AUTO", "AUTO_PREFILL_CAP", "CPU_PREFILL_CAP", "CPU_PREFILL_STEP_RATIO", "DTYPE_NAMES", "FP8_MIN_CAPABILITY",
    "GPTQ_QUANTIZATIONS", "KV_CACHE_DTYPE_NAMES", "MAX_LORA_RANK", "MAX_NUM_BATCHED_TOKENS", "QK_NORM_ARCHS",
    "QUANTIZATIONS", "SECTIONS", "SUPPORTED_ARCHS", "CacheConfig", "DeviceConfig", "EngineConfig", "LoraConfig",
    "ModelConfig", "ModelConfigError", "ParallelConfig", "QuantizationConfig", "SchedulerConfig",
    "SpeculativeConfig", "check_kv_cache_dtype_name", "check_quantization_name", "setting_names",
]
