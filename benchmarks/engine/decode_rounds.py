"""The command line shared by the paired-round decode benchmarks (bench_architectures, bench_moe)."""
from __future__ import annotations

import argparse


def decode_rounds_parser(doc: str, default_json: str) -> argparse.ArgumentParser:
    """--seqs, --steps, --rounds and --json, with `doc` as the description."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=8, help="decoding sequences per batch (default 8)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per round (default 16)")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (default 5)")
    ap.add_argument("--json", default=default_json)
    return ap
