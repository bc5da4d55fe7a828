"""Kernel benchmarks (Triton against torch) and the GPU warm-up check."""
