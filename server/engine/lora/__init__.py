"""The engine's device side of LoRA: adapter slots and their budget and sharing, DoRA scales, aLoRA
activation, and the kernel-strategy backends (backends/) the model calls through."""
