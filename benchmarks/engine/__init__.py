"""Engine benchmarks in-process (no HTTP): step host time, async scheduling, aLoRA, DoRA, int8/int4,
sampling, structured output."""
