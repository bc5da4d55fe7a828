"""DeviceConfig: where and how the engine computes (device, activation dtype, kernels, CPU threads)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.engine.config.checks import check_bools
from server.engine.cpu_threads import AUTO, parse_cpu_threads, resolve_cpu_threads

if TYPE_CHECKING:
    import torch

    from server.engine.config.model import ModelConfig

# The activation dtypes served, by torch's attribute name (torch is imported only to resolve one).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
KERNELS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    dtype: str = "auto"
    kernels: str = "auto"
    seed: int = 0
    # Intra-op threads for the CPU device: "auto" (the affinity mask, less a core for the HTTP side
    # on larger machines; server.engine.cpu_threads says why), an int, or None to leave torch's alone.
    cpu_threads: int | str | None = AUTO
    # The cores the step loop runs on (its thread, and the torch threads it starts), or the whole engine-core
    # process; None: not pinned. `loraplex serve` sets it from --engine-cpus (server.cpu_placement); with it,
    # cpu_threads auto is one thread per such core (the front end has cores of its own).
    cpu_affinity: tuple[int, ...] | None = None
    # vLLM's flag: no CUDA graphs, every step eager and unpadded. Off: on CUDA with the Triton kernels,
    # decode-only steps are padded to a bucket and replay a graph captured at start-up
    # (server.engine.decode_graphs); CPU devices have no graphs and always run eager.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be auto, triton or torch, got {self.kernels!r}")
        check_bools(self, "enforce_eager")
        object.__setattr__(self, "cpu_threads", parse_cpu_threads(self.cpu_threads))  # "4" -> 4; raises
        if self.cpu_affinity is not None:
            object.__setattr__(self, "cpu_affinity", tuple(sorted(set(self.cpu_affinity))))
            if not self.cpu_affinity or min(self.cpu_affinity) < 0:
                raise ValueError(f"cpu_affinity must name one or more cores, got {self.cpu_affinity!r}")

    def resolve_cpu_threads(self) -> int | None:
        """torch's intra-op thread count for a CPU device; None leaves it as it is."""
        if self.cpu_affinity is not None and self.cpu_threads == AUTO:
            return len(self.cpu_affinity)
        return resolve_cpu_threads(self.cpu_threads)

    def resolve_device(self) -> torch.device:
        """cpu, or cuda with an explicit index: "cuda" means this thread's current device, named so
        that the engine's other threads bind the same one (server.engine.cuda_device)."""
        import torch

        if self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} needs CUDA, which this machine does not have")
        device = torch.device(self.device if self.device != "auto" else "cuda")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device cuda:{index} does not exist: {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)

    def resolve_dtype(self, model: ModelConfig, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device.type == "cpu":
            return torch.float32  # CPU matmuls in half precision are slow and not what users expect
        name = model.checkpoint_dtype
        return getattr(torch, name) if name in DTYPE_NAMES else torch.bfloat16
