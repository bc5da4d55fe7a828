"""int4's groups of input channels: the sizes the kernels serve. No torch here: configs check it."""
from __future__ import annotations

# Round-to-nearest's group: GGUF's block. Without GPTQ's or AWQ's calibration, 128 rounds too coarsely:
# on the default model 72% teacher-forced top-1 agreement against 100% at 32 (eval-quantized.md).
DEFAULT_GROUP_SIZE = 32
# A group is whole 8-value words in the kernels (kernels.int4_avx2 unpacks 8 nibbles at a time), and the
# Triton kernel's K tile (a power of two >= 8) must lie within one group: group sizes are multiples of 32.
GROUP_MULTIPLE = 32


def check_group_size(group_size: int, n_in: int) -> None:
    """Raises ValueError naming the rule when `group_size` cannot serve a projection of n_in inputs."""
    if n_in % 16:  # two per byte, and the CPU kernel widens 16 at a time (every real model's widths are)
        raise ValueError(f"int4 needs input widths that are multiples of 16, got {n_in}")
    if group_size <= 0 or group_size % GROUP_MULTIPLE:
        raise ValueError(f"int4 group size must be a positive multiple of {GROUP_MULTIPLE}, got {group_size}")
