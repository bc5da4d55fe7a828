"""What a bench result depends on besides the code: versions, the device, and the machine's state
(load average, GPU clocks) when a run starts, recorded in the JSON beside the numbers."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time

import torch

# One-minute load average from which a run is flagged: on the 16-core GPU machine the first H100
# 64-adapter point started at 4.6, right after an AOT compile in the same call, and ran slow.
BUSY_LOAD = 2.0
NVIDIA_SMI_FIELDS = ("name", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "temperature.gpu",
                     "power.draw", "pstate", "utilization.gpu")


def environment(cfg) -> dict:
    """cfg: a BenchConfig (device, threads(), kv_cache_bytes, enforce_eager)."""
    import peft
    import transformers

    gpu = torch.cuda.get_device_name(0) if cfg.device.startswith("cuda") and torch.cuda.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_threads": cfg.threads(), "affinity_cores": len(os.sched_getaffinity(0)),
            "kv_cache_bytes": cfg.kv_cache_bytes,
            "enforce_eager": cfg.enforce_eager,  # CUDA graphs turned off (server.engine.config.DeviceConfig)
            "device_name": gpu or f"CPU ({os.cpu_count()} cores)",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def gpu_clocks() -> list[dict] | None:
    """nvidia-smi's clocks, temperature and power per GPU; None where there is no nvidia-smi (a CPU
    machine) or it fails. A throttled or down-clocked card explains a slow run."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [dict(zip(NVIDIA_SMI_FIELDS, (v.strip() for v in line.split(",")))) for line in out.splitlines()
            if line.strip()]


def machine_state(log=None) -> dict:
    """The load average and GPU clocks now; logs a warning when the machine is busy."""
    load = os.getloadavg()
    state = {"load_avg": load, "busy": load[0] >= BUSY_LOAD, "gpu_clocks": gpu_clocks()}
    if state["busy"] and log is not None:
        log(f"  warning: load average {load[0]:.1f} >= {BUSY_LOAD} at the start of a run: something else is "
            f"running, and the numbers will show it")
    return state
