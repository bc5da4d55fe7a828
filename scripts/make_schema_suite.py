#!/usr/bin/env python3
"""Rewrite the generated part of the structured-output schema suite (server/bench/schemas/generated/)
from its seed; the hand-written core (server/bench/schemas/core/) is left alone.

    .venv/bin/python scripts/make_schema_suite.py [--count 220] [--seed 24]
"""
from __future__ import annotations

import argparse

from server.bench.schema_suite import DEFAULT_COUNT, DEFAULT_SEED, SUITE_DIR, write_generated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=DEFAULT_COUNT, help=f"schemas to generate (default {DEFAULT_COUNT})")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"generator seed (default {DEFAULT_SEED})")
    args = ap.parse_args()
    n = write_generated(SUITE_DIR, args.count, args.seed)
    print(f"wrote {n} schemas to {SUITE_DIR / 'generated'}")


if __name__ == "__main__":
    main()
