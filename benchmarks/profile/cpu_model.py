"""The CPU's model name as `lscpu` prints it, for the machine section of a bench's report."""
from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")),
                platform.processor())
