"""Binding the engine's threads to its CUDA device.

PyTorch's current CUDA device is per thread and starts at 0. Triton launches
on the current device's current stream, and `torch.cuda.Stream()`,
`pin_memory()` and the caching allocator default to it too. So an engine on
cuda:1 must make cuda:1 current on every thread that touches CUDA: the thread
that builds it, the engine loop thread and the adapter loader threads
(pinning creates a context on the current device).
"""
from __future__ import annotations

from typing import Callable

import torch


def bind(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for other device types)."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index)


def thread_binder(device: torch.device) -> Callable[[], None]:
    """A no-argument callable for a thread's start (the engine loop, a loader pool's initializer)."""
    if device.type == "cuda" and device.index is None:
        raise ValueError("bind threads to an explicit device index (DeviceConfig.resolve_device gives one)")
    return lambda: bind(device)
