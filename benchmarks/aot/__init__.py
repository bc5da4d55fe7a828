"""Ahead-of-time compilation of every Triton kernel variant the engine can launch, with no GPU."""
