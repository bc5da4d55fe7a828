"""QuantizationConfig: the base weights' format (float, int8, int4 / GPTQ, fp8) and what goes with it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernels.int4_groups import check_group_size
from server.engine.config.checks import check_bools

if TYPE_CHECKING:
    import torch

# Base-weight quantizations served (kernels.int8_weights, kernels.int4_weights, kernels.fp8_weights);
# None serves the checkpoint's floats. Which device serves which: QuantizationConfig.check_device.
QUANTIZATIONS = ("int8", "int4", "fp8")
# vLLM's names for serving a GPTQ checkpoint in its 4 bits: int4 here, on a checkpoint that must be GPTQ.
GPTQ_QUANTIZATIONS = ("gptq", "gptq_marlin")
# fp8 products on tensor cores: Ada (8.9) and Hopper (9.0) on.
FP8_MIN_CAPABILITY = (8, 9)


def check_quantization_name(name: str | None) -> None:
    """Raises ValueError, naming the supported values, for a quantization loraplex does not serve."""
    if name is not None and name not in QUANTIZATIONS + GPTQ_QUANTIZATIONS:
        raise ValueError(f"quantization {name!r} is not supported; supported: {', '.join(QUANTIZATIONS)} or none "
                         f"({' and '.join(GPTQ_QUANTIZATIONS)}: int4 on a GPTQ checkpoint)")


@dataclass(frozen=True)
class QuantizationConfig:
    # The decoder projections' weights: None (float, the activation dtype), "int8" (weight-only,
    # per-output-channel symmetric scales; LoRA stays in the activation dtype), "int4" (weight-only,
    # a scale and an offset per group of inputs: a GPTQ checkpoint's own 4-bit weights, else
    # round-to-nearest in groups of int4_group_size) or "fp8" (Ada, Hopper).
    quantization: str | None = None
    # The lm_head in int8 as well (needs quantization "int8"): per-vocabulary-row scales, the same
    # kernel as the projections. Off by default: the logits are where rounding shows most, and a
    # tied lm_head gets an int8 copy beside the float embedding (the gather needs float rows).
    quantize_lm_head: bool = False
    # int4's input channels per group when quantizing a float checkpoint (a multiple of 32; None: 32,
    # kernels.int4_groups.DEFAULT_GROUP_SIZE says why). Smaller groups cost 8 bytes per group and row
    # and round less (eval-quantized.md).
    # A GPTQ checkpoint keeps its own groups, so giving one there is refused (server.engine.weights).
    int4_group_size: int | None = None
    # Set from quantization "gptq"/"gptq_marlin" (vLLM's names, served as "int4"): the checkpoint must be
    # GPTQ, or loading refuses it (server.engine.weights) rather than quantize a float one.
    require_gptq_checkpoint: bool = False

    def __post_init__(self) -> None:
        check_quantization_name(self.quantization)
        if self.quantization in GPTQ_QUANTIZATIONS:
            object.__setattr__(self, "quantization", "int4")
            object.__setattr__(self, "require_gptq_checkpoint", True)
        check_bools(self, "quantize_lm_head", "require_gptq_checkpoint")
        if self.require_gptq_checkpoint and self.quantization != "int4":
            raise ValueError(f"require_gptq_checkpoint needs quantization 'int4', not {self.quantization!r}")
        if self.quantize_lm_head and self.quantization != "int8":
            raise ValueError(f"quantize_lm_head needs quantization 'int8', not {self.quantization!r}")
        if self.int4_group_size is not None:
            if self.quantization != "int4":
                raise ValueError(f"int4_group_size needs quantization 'int4', not {self.quantization!r}")
            check_group_size(self.int4_group_size, 16)

    def check_device(self, device: torch.device, dtype: torch.dtype | None = None,
                     capability: tuple[int, int] | None = None) -> None:
        """Refuses a quantization the resolved device and activation dtype (None: float32) cannot serve.
        capability: the CUDA device's (major, minor), read from the device when None."""
        if self.quantization != "fp8":  # int8 and int4 run everywhere: kernels.int8_triton/int4_triton on a GPU
            return
        import torch

        dtype = torch.float32 if dtype is None else dtype
        if device.type != "cuda":
            raise ValueError(f"quantization 'fp8' needs an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper), "
                             f"not {device}: on a CPU use --quantization int8")
        capability = capability or torch.cuda.get_device_capability(device)
        if tuple(capability) < FP8_MIN_CAPABILITY:
            raise ValueError(f"quantization 'fp8' needs compute capability >= 8.9 (Ada, Hopper); {device} has "
                             f"{capability[0]}.{capability[1]}: serve float weights there (no --quantization)")
        if dtype != torch.bfloat16:
            raise ValueError(f"quantization 'fp8' computes in bfloat16 (torch._scaled_mm's row-wise scaling), "
                             f"not {str(dtype).removeprefix('torch.')}: pass --dtype bfloat16")
