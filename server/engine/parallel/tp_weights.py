"""A served base weight (float, int8, int4) cut for one tensor-parallel rank, from the full weight as
TP = 1 quantized it: the rank's rows or input columns of the integers and of their scales, so each
shard's x W^T is TP = 1's, summed in another order, and TP = 2 serves TP = 1's quantized model.

Quantizing each shard on its own would not: int8's per-output-row scale is max|w| over the whole row,
and a row-parallel shard sees half of it. int4's scales are per (row, group of input channels): a
row-parallel shard must start on a group boundary (int4_split_refusal). fp8 is refused under tensor
parallelism: its per-token activation scale is max|x| over the whole input, which a row-parallel
shard does not see (and fp8 needs a GPU, which gloo's tensor parallelism does not use yet).
"""
from __future__ import annotations

import torch

from kernels.fp8_weights import Fp8Weight
from kernels.int4_weights import Int4Weight
from kernels.int8_weights import Int8Weight

Weight = torch.Tensor | Int8Weight | Int4Weight | Fp8Weight


def weight_rows(weight: Weight, rows: torch.Tensor) -> Weight:
    """The output rows `rows` ([n] int64) of weight, with their scales (column-parallel)."""
    if isinstance(weight, Int8Weight):
        return Int8Weight(weight.qweight.index_select(0, rows), weight.scale.index_select(0, rows))
    if isinstance(weight, Int4Weight):
        return Int4Weight(weight.qweight.index_select(0, rows), weight.scale.index_select(0, rows),
                          weight.offset.index_select(0, rows), weight.group_size)
    if isinstance(weight, Fp8Weight):
        raise ValueError(fp8_refusal())
    return weight.index_select(0, rows)


def weight_columns(weight: Weight, lo: int, hi: int) -> Weight:
    """Input columns [lo, hi) of weight (row-parallel): int8's per-row scales whole, int4's groups that
    cover them (lo on a group boundary, hi on one or at the end: int4_split_refusal)."""
    if isinstance(weight, Int8Weight):
        return Int8Weight(weight.qweight[:, lo:hi].contiguous(), weight.scale)
    if isinstance(weight, Int4Weight):
        g, n_in = weight.group_size, weight.shape[1]
        if lo % g or (hi % g and hi != n_in) or lo % 2:
            raise ValueError(f"int4 groups of {g} input channels do not split at column {lo if lo % g else hi}")
        return Int4Weight(weight.qweight[:, lo // 2:hi // 2].contiguous(), weight.scale[:, lo // g:-(-hi // g)].contiguous(),
                          weight.offset[:, lo // g:-(-hi // g)].contiguous(), g)
    if isinstance(weight, Fp8Weight):
        raise ValueError(fp8_refusal())
    return weight[:, lo:hi].contiguous()


def vocab_shard(weight: torch.Tensor | Int8Weight, rank: int, world_size: int) -> torch.Tensor | Int8Weight:
    """A vocabulary-parallel lm_head's rows for `rank`: the vocabulary padded with zero rows to a multiple
    of world_size (their logits are trimmed after the gather), float or int8 (--quantize-lm-head)."""
    vocab = weight.shape[0]
    per_rank = -(-vocab // world_size)
    lo, hi = rank * per_rank, min((rank + 1) * per_rank, vocab)
    pad = per_rank - (hi - lo)
    if isinstance(weight, Int8Weight):
        q = weight.qweight[lo:hi]
        return Int8Weight(torch.cat([q, q.new_zeros(pad, q.shape[1])]),
                          torch.cat([weight.scale[lo:hi], weight.scale.new_ones(pad)]))
    return torch.cat([weight[lo:hi], weight.new_zeros(pad, weight.shape[1])])


def int4_split_refusal(group_size: int, splits: dict[str, int], world_size: int) -> str | None:
    """The one line int4 under tensor parallelism is refused with where a row-parallel projection's
    per-rank input width (splits: what -> width) is not whole groups of group_size (-1, GPTQ's one
    group per row: never whole), else None."""
    for what, width in splits.items():
        if group_size == -1:
            return (f"--tensor-parallel-size {world_size}: a GPTQ checkpoint's int4 groups of a whole row "
                    f"(group_size -1) do not split {what}'s inputs")
        if width % group_size:
            return (f"--tensor-parallel-size {world_size}: int4 groups of {group_size} input channels do not split "
                    f"{what}'s {width * world_size} inputs into {world_size} shards of {width} (use a group size "
                    f"that divides {width})")
    return None


def fp8_refusal(world_size: int | None = None) -> str:
    size = "" if world_size is None else f" {world_size}"
    return (f"--tensor-parallel-size{size}: a quantized base (fp8) is not sharded (its per-token activation "
            f"scales span the whole input, which a row-parallel shard does not hold)")
