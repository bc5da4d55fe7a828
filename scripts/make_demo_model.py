"""Make the built-in demo model and adapters: make_demo_model.py OUT_DIR.

Idempotent: an existing complete demo under OUT_DIR is left as it is.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from server.demo import ensure_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make the loraplex demo model and its LoRA adapters.")
    parser.add_argument("out_dir", type=Path, help="directory to hold model/ and adapters/<name>/")
    args = parser.parse_args(argv)
    paths = ensure_demo(args.out_dir)
    print(f"model\t{paths.model_dir}")
    for name, path in paths.adapters.items():
        print(f"adapter\t{name}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
