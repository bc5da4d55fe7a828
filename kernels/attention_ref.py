"""Plain-torch paged attention: the semantics the Triton kernels implement, and the fp8 KV cache's
stored form that both paths share.

fp8 KV cache: vLLM's `--kv-cache-dtype fp8_e4m3|fp8_e5m2` without calibrated scales stores each
element cast to fp8 with a scale of 1.0, saturating at the format's largest finite value; the
attention reads the cache back in float32. The same here, on both the torch and the Triton paths, so
both hold the same bytes: the cast is torch's (round to nearest even) on either, since Triton's
interpreter rounds fp8 toward zero. torch's CPU index_copy_ and where have no fp8 kernels, so writes
go through a uint8 view of the same memory (reads, index_select and .float(), work on fp8 directly).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionBatch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it.

    Semantics: fp8: clamp(x, -max, max) rounded to the nearest fp8 value (max = the format's largest
    finite value: e4m3fn has no infinity and would store NaN, e5m2 would store inf); else x.to(cache_dtype).
    Shape: any; the result has x's shape.
    """
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return x.clamp(-limit, limit).to(cache_dtype)


def reads_exactly(cache_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether every cache value converts exactly to compute_dtype, so a kernel may read it in that
    dtype (e4m3 and e5m2 are subsets of bfloat16 and float16: fewer mantissa bits, smaller range)."""
    return cache_dtype == compute_dtype or (is_fp8(cache_dtype) and compute_dtype in (torch.bfloat16, torch.float16))


def storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a dtype torch's CPU scatter ops support: uint8 for fp8, else itself.

    Shape: t's (both fp8 formats are one byte)."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x converted for `cache` and viewed as storage(cache) views it: what a scatter into it writes."""
    return storage(to_cache_dtype(x, cache.dtype))


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's new keys and values in the block pool.

    Semantics: k_cache.flat[slot_mapping[t]] = k[t] in the cache's dtype (an fp8 cache saturates:
        to_cache_dtype); v_cache likewise.
    Shape: k, v [T, Hkv, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D],
        modified in place; slot_mapping [T] int64.
    """
    num_blocks, block_size, hkv, d = k_cache.shape
    storage(k_cache).view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, stored(k, k_cache))
    storage(v_cache).view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, stored(v, v_cache))


def write_kv_padded(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """write_kv where a negative slot (a padded decode batch's padding row) writes nothing, with no
    host value read from the data.

    Semantics: k_cache.flat[slot_mapping[t]] = k[t] for slot_mapping[t] >= 0; v_cache likewise.
    Shape: as write_kv. A padding row rewrites row 0's destination with row 0's value (or, when row 0
    is padding too, the value already there): duplicate indices then carry equal values, so the
    scatter is deterministic and leaves every other slot alone.
    """
    keep = slot_mapping >= 0  # [T]
    first = slot_mapping[:1].clamp(min=0)  # [1]
    dst = torch.where(keep, slot_mapping, first)  # [T]
    for new, cache in ((k, k_cache), (v, v_cache)):
        num_blocks, block_size, hkv, d = cache.shape
        flat = storage(cache).view(num_blocks * block_size, hkv, d)
        new = stored(new, cache)  # [T, Hkv, D]
        row0 = torch.where(keep[:1, None, None], new[:1], flat.index_select(0, first))  # [1, Hkv, D]
        flat.index_copy_(0, dst, torch.where(keep[:, None, None], new, row0))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    out: torch.Tensor,
    softcap: float | None = None,
    window: int | None = None,
) -> None:
    """Causal attention of each sequence's new tokens over its cached + new K/V.

    Semantics: for sequence b, query j (absolute position p = context_len[b] + j),
        out[t] = softmax(cap(scale * q[t] @ K_b[w:p+1].T)) @ V_b[w:p+1]
    where K_b/V_b are read through block_tables[b]; query head h uses kv head
    h // (Hq / Hkv) (GQA); cap(x) = softcap * tanh(x / softcap) with a softcap, x
    without (Gemma's attention soft-capping); w = max(0, p + 1 - window) with a
    window (the window keys up to and including p), 0 without. Call write_kv for the
    step first. Keys before a query's window are never read: a block table may hold a negative
    entry there (a block released to the pool, server.engine.block_manager.FREED).
    Shape: q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
        out [T, Hq, D], written in place.
    """
    if batch.padded:
        plan = _padded_decode_plan(batch, k_cache.shape[1], window)
        _decode_attention(q, k_cache, v_cache, plan, scale, out, softcap)
        return
    decode = _decode_plan(batch, k_cache.shape[1], q.device, window)
    if decode is not None:
        _decode_attention(q, k_cache, v_cache, decode, scale, out, softcap)
    block_size = k_cache.shape[1]
    start = 0
    for b, (qlen, slen) in enumerate(zip(batch.query_lens_host, batch.seq_lens_host)):
        if qlen == 1 and decode is not None:
            start += 1
            continue  # done above, batched
        first, blocks = _sequence_blocks(batch, block_size, q.device, window, decode is not None)[b]
        lo = first * block_size  # position of the first key read
        k = k_cache.index_select(0, blocks).flatten(0, 1)[: slen - lo].float().transpose(0, 1)  # [Hkv, slen-lo, D]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[: slen - lo].float().transpose(0, 1)
        qs = q[start : start + qlen].float().transpose(0, 1)  # [Hq, qlen, D]
        if qlen == slen and softcap is None and window is None:  # a whole prompt: plain causal, no mask tensor
            o = _sdpa(qs, k, v, None, scale)  # [Hq, qlen, D]
        else:
            pos = torch.arange(slen - qlen, slen, device=q.device).unsqueeze(1)  # [qlen, 1]
            kpos = torch.arange(lo, slen, device=q.device).unsqueeze(0)  # [1, slen - lo]
            keep = kpos <= pos  # [qlen, slen], causal from the prefix on
            if window is not None:
                keep &= kpos > pos - window
            o = _attention(qs, k, v, keep, scale, softcap)
        out[start : start + qlen] = o.transpose(0, 1).to(out.dtype)
        start += qlen


def _attention(q, k, v, keep: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """softmax(cap(scale * q k^T)) v over the keys `keep` allows; q [..., Hq, L, D], k and v
    [..., Hkv, S, D], keep broadcastable to [..., Hq, L, S]. Without a softcap, SDPA; with one, the
    scores one op at a time, as transformers' eager attention (SDPA has no soft-capping)."""
    if softcap is None:
        return _sdpa(q, k, v, keep, scale)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


def _sdpa(q, k, v, keep: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA over `keep` (None: causal, query i seeing keys 0..i), with a leading batch dimension whatever q's
    rank: on a CPU a 3-D call takes the math path (GQA's K/V repeated per query head, the scores and a float
    mask materialized), a 4-D one the flash kernel, which reads the mask blockwise: ~7-25x less time for a
    chunk late in a 2,000-token context, results within float32 rounding."""
    unbatched = q.dim() == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=keep is None, scale=scale, enable_gqa=True)
    return o[0] if unbatched else o


def _valid(pos: torch.Tensor, lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, L]: which of positions `pos` ([L], or [B, L] per row) a decode query (at lens - 1) sees:
    before it, and within `window` keys of it when given."""
    pos = pos if pos.dim() == 2 else pos[None, :]
    valid = pos < lens[:, None]
    return valid if window is None else valid & (pos >= (lens - window)[:, None])


def _sequence_blocks(batch: AttentionBatch, block_size: int, device, window: int | None,
                     batched_decode: bool) -> list[tuple[int, torch.Tensor] | None]:
    """Each sequence's (first block read, the blocks it reads [n] int64 on the device), from the block of
    its first query's first key (those before it may be released); None for a decode row the batched
    decode plan covers (batched_decode).

    Built once per step and cached on the batch (all layers of one window share it): one read of the tables
    back to the host and one small copy per sequence, not one per layer; so later calls copy nothing between
    host and device (the kernel bench captures them in a CUDA graph).
    """
    key = ("sequence_blocks", block_size, window, batched_decode)
    if key not in batch.scratch:
        out: list[tuple[int, torch.Tensor] | None] = []
        for row, qlen, slen in zip(batch.block_tables.tolist(), batch.query_lens_host, batch.seq_lens_host):
            if qlen == 1 and batched_decode:
                out.append(None)
                continue
            first = 0 if window is None else max(0, slen - qlen + 1 - window) // block_size
            nblocks = -(-slen // block_size)
            out.append((first, torch.tensor(row[first:nblocks], dtype=torch.long, device=device)))
        batch.scratch[key] = out
    return batch.scratch[key]


def _decode_plan(batch: AttentionBatch, block_size: int, device, window: int | None = None) -> tuple | None:
    """Rows, pool slots and validity of every decode sequence's context (within `window` keys of
    its newest when given), built once per step.

    Cached on the batch (all layers of one window share it). None when fewer than two sequences decode.
    """
    key = ("decode", block_size, window)
    if key in batch.scratch:
        return batch.scratch[key]
    qlens = torch.tensor(batch.query_lens_host)
    which = (qlens == 1).nonzero().squeeze(1)  # [Bd] decode sequences
    plan = None
    if which.numel() >= 2:
        rows = batch.query_start_loc[:-1].long().cpu().index_select(0, which)  # [Bd] their token rows
        lens = torch.tensor(batch.seq_lens_host).index_select(0, which)  # [Bd]
        width = int(lens.max())
        # With a window, each row reads its last `window` positions only: the work stays the window's.
        span = width if window is None else min(width, window)
        first = (lens - span).clamp(min=0)  # [Bd]
        pos = first[:, None] + torch.arange(span)[None, :]  # [Bd, L]
        tables = batch.block_tables.cpu().long().index_select(0, which)  # [Bd, W]
        blocks = tables.gather(1, (pos // block_size).clamp(max=tables.shape[1] - 1))
        slots = blocks * block_size + pos % block_size  # [Bd, L]
        valid = _valid(pos, lens, window)  # [Bd, L]
        # Padding and keys before the window read the sequence's own newest slot, written this step:
        # never another sequence's leftovers (which may be NaN, and a masked NaN still poisons:
        # 0 * NaN = NaN), nor a released block's (a negative table entry).
        own = slots.gather(1, (lens - 1 - first)[:, None])  # [Bd, 1]
        plan = rows.to(device), torch.where(valid, slots, own).to(device), valid.to(device)
    batch.scratch[key] = plan
    return plan


def _padded_decode_plan(batch: AttentionBatch, block_size: int, window: int | None) -> tuple:
    """_decode_plan's tuple for a padded decode batch, from its device tensors alone (no host value
    read from the data). Every row reads the pool's full width, masked past its own length; rebuilt
    by each layer, since the persistent batch's buffers change from step to step."""
    lens = batch.seq_lens.long()  # [B]
    rows = batch.query_start_loc[:-1].long()  # [B]
    tables = batch.block_tables.long()  # [B, W]
    pos = torch.arange(tables.shape[1] * block_size, device=tables.device)  # [L]
    slots = tables.gather(1, (pos // block_size).expand(tables.shape[0], -1)) * block_size + pos % block_size
    valid = _valid(pos, lens, window)  # [B, L]
    own = slots.gather(1, (lens - 1).clamp(min=0)[:, None])  # [B, 1], as in _decode_plan
    return rows, torch.where(valid, slots, own), valid


def _decode_attention(q, k_cache, v_cache, plan, scale: float, out: torch.Tensor, softcap: float | None = None) -> None:
    """All single-token queries at once over their padded, gathered contexts."""
    rows, slots, valid = plan
    num_blocks, block_size, hkv, d = k_cache.shape
    bd, hq = rows.shape[0], q.shape[1]
    # Padding positions read the sequence's own newest K/V (see _decode_plan), so they are finite
    # whenever the sequence's own are, and the mask gives them weight 0.
    k = k_cache.view(-1, hkv, d).index_select(0, slots.flatten()).view(bd, -1, hkv, d).float()  # [Bd, L, Hkv, D]
    v = v_cache.view(-1, hkv, d).index_select(0, slots.flatten()).view(bd, -1, hkv, d).float()
    qd = q.index_select(0, rows).float().unsqueeze(2)  # [Bd, Hq, 1, D]
    o = _attention(qd, k.transpose(1, 2), v.transpose(1, 2), valid[:, None, None, :], scale, softcap)  # [Bd, Hq, 1, D]
    out.index_copy_(0, rows, o.reshape(bd, hq, d).to(out.dtype))
