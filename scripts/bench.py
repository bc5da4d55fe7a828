#!/usr/bin/env python3
"""loraplex vs transformers + peft on a seeded multi-tenant workload (same as `loraplex bench`).

    .venv/bin/python scripts/bench.py --adapters 8 --requests 64 --compare-peft --json bench-out/bench.json
    .venv/bin/python scripts/bench.py --adapters 1,8,64,256 --requests 96 --compare-peft --json bench-out/sweep.json
    .venv/bin/python scripts/bench.py --gpu --adapters 1,8,64 --requests 256 --compare-peft   # on a CUDA machine
"""
from __future__ import annotations

import sys
from pathlib import Path

# Runnable as a plain script from a checkout, without installing the project.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
