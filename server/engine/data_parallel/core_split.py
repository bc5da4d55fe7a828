"""Each data-parallel engine core's EngineConfig: its share of the engine's cores and torch threads.

The engine side's cores (server.cpu_placement) are cut into N contiguous groups, as equal as they go (the
first groups one larger); each core pins itself to its group and runs one torch thread per core of it
(an explicit --cpu-threads is honoured as given). With nothing pinned (one core, or a config built in
code) the cores are not pinned and --cpu-threads auto becomes the allowed cores over N, so that N cores
do not each start a thread per core of the machine.
"""
from __future__ import annotations

from server.cpu_list import Cpus, allowed_cpus, format_cpu_list
from server.engine.config import AUTO, EngineConfig


class DataParallelSplitError(ValueError):
    """Fewer engine cores (or devices) than --data-parallel-size asks for; one line."""


def split_cores(cores: Cpus, n: int) -> list[Cpus]:
    if len(cores) < n:
        raise DataParallelSplitError(f"--data-parallel-size {n} needs at least {n} engine cores, one per engine "
                                     f"core process; the engine side has {format_cpu_list(cores)}")
    size, extra = divmod(len(cores), n)
    groups, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        groups.append(tuple(cores[start:end]))
        start = end
    return groups


def core_configs(engine: EngineConfig, n: int) -> list[EngineConfig]:
    """The N cores' configs from the one the flags built; on a CUDA device, core i on cuda:i."""
    import torch

    if engine.device.device.startswith("cuda") or (engine.device.device == "auto" and torch.cuda.is_available()):
        if torch.cuda.device_count() < n:
            raise DataParallelSplitError(f"--data-parallel-size {n} needs {n} CUDA devices, one per engine core; "
                                         f"{torch.cuda.device_count()} are visible")
        return [engine.with_settings(device=f"cuda:{i}") for i in range(n)]
    if engine.device.cpu_affinity is None:
        threads = engine.device.cpu_threads
        threads = threads if threads != AUTO else max(1, len(allowed_cpus()) // n)
        return [engine.with_settings(cpu_threads=threads) for _ in range(n)]
    return [engine.with_settings(cpu_affinity=group) for group in split_cores(engine.device.cpu_affinity, n)]
