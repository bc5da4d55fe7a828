"""Reading a Hugging Face checkpoint's safetensors into tensors on the target device."""
from __future__ import annotations

from pathlib import Path

import torch

from server.engine.checkpoint_layout import layer_keys
from server.engine.checkpoint_tensors import CheckpointTensors, TensorEntry, read_index, read_tensor
from server.engine.config import EngineConfig, ModelConfig, ModelConfigError
from kernels.int4_weights import DEFAULT_GROUP_SIZE, Int4Weight, int4_to
from server.engine.gptq_checkpoint import check_checkpoint, dequantize_checkpoint, int4_checkpoint, is_gptq_part
from server.engine.model import CausalLM


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 quantization: str | None = None, int4_group_size: int | None = None,
                 require_gptq: bool = False) -> CheckpointTensors | dict[str, torch.Tensor | Int4Weight]:
    """Every tensor the model needs, by checkpoint key: on a CPU, a CheckpointTensors that reads each
    when the model takes it (no float copy of a quantized projection stays resident); elsewhere all
    read now (the device's free memory is measured after them, server.engine.lora.slot_budget). A GPTQ checkpoint's quantized layers come as
    Int4Weight under quantization "int4", else dequantized to `dtype` (server.engine.gptq_checkpoint).
    int4_group_size: the one asked for, refused for a GPTQ checkpoint (it keeps its own groups);
    require_gptq: a float checkpoint is refused (quantization "gptq", vLLM's name)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        bins = sorted(Path(model_dir).glob("*.bin"))
        hint = " (pickle .bin checkpoints are not loaded: convert to safetensors)" if bins else ""
        raise ModelConfigError(f"no *.safetensors files in {model_dir}{hint}")
    gptq = check_checkpoint(model_dir, require_gptq)
    entries: dict[str, TensorEntry] = {}
    for path in files:
        entries |= read_index(path)
    packed = {key: read_tensor(e) for key, e in entries.items() if gptq is not None and is_gptq_part(key)}
    wanted = {key: e for key, e in entries.items()
              if key not in packed and (key.startswith("model.") or key == "lm_head.weight")}

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    weights = (CheckpointTensors(wanted, convert) if device.type == "cpu"
               else {key: convert(read_tensor(e)) for key, e in wanted.items()})
    if gptq is not None and int4_group_size is not None:
        raise ModelConfigError(f"{model_dir} is a GPTQ checkpoint with groups of {gptq.group_size}, served as they "
                               f"are: drop --int4-group-size")
    if gptq is not None and quantization == "int4":
        weights.update({k: int4_to(w, device) for k, w in int4_checkpoint(packed, gptq).items()})
    elif gptq is not None:
        weights.update({k: convert(w) for k, w in dequantize_checkpoint(packed, gptq).items()})
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        required.append("lm_head.weight")
    for i in range(cfg.num_layers):
        required += layer_keys(cfg, i, weights)
    missing = [k for k in required if k not in weights]
    if missing:
        raise ModelConfigError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return weights



def served_weights(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype,
                   device: torch.device) -> CheckpointTensors | dict[str, torch.Tensor | Int4Weight]:
    """load_weights with `config`'s checkpoint and quantization (the engine's, and each tensor-parallel
    worker's: the same served model, which it then cuts to its shard)."""
    quant = config.quantization
    return load_weights(config.model, mcfg, dtype, device, quant.quantization, quant.int4_group_size,
                        quant.require_gptq_checkpoint)


def served_model(config: EngineConfig, mcfg: ModelConfig, weights, lora_layers: list, max_len: int) -> CausalLM:
    """The model `config` serves (quantization, lm_head) from served_weights' `weights`, over
    `lora_layers`' slots; it frees the unfused projections as it fuses them."""
    quant = config.quantization
    return CausalLM(mcfg, weights, lora_layers, max_len, config.scheduler.max_num_batched_tokens, quant.quantization,
                    quant.quantize_lm_head, quant.int4_group_size or DEFAULT_GROUP_SIZE)
