"""Tensor parallelism (--tensor-parallel-size): one base model split across processes joined by
torch.distributed (gloo on CPUs), with its LoRA slots read by each rank as its shard (docs/scaling.md)."""
