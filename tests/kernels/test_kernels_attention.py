"""Triton write_kv + paged attention against dense causal attention and kernels.attention_ref.

On CPU these run under TRITON_INTERPRET=1 (set by conftest): shapes are small.
With a GPU they launch for real on it (`kernel_device`).
"""
from __future__ import annotations

import dataclasses
import inspect
import random
from dataclasses import dataclass

import pytest
import torch

from kernels import attention_decode, attention_ref, attention_triton, metadata
from kernels.metadata import AttentionBatch
from server.engine.kernel_choice import select_kernels
from server.engine.unified_buffer import UnifiedBuffer
from server.engine.unified_memory import UnifiedPool
from tests.kernel_helpers import bit_equal

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """The oracle for one sequence: q [n, Hq, D] are the last n positions of k, v [L, Hkv, D]; with a
    window, query position p sees keys (p - window, p]; with a softcap, scores are softcap * tanh(x / softcap)."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    out = torch.empty(n, hq, q.shape[2])
    for j in range(n):
        pos = length - n + j
        first = 0 if window is None else max(0, pos + 1 - window)
        for h in range(hq):
            kv = h // (hq // hkv)
            x = (k[first: pos + 1, kv].double() @ q[j, h].double()) * scale
            if softcap is not None:
                x = torch.tanh(x / softcap) * softcap
            w = torch.softmax(x, dim=0)  # [pos + 1 - first]
            out[j, h] = (w @ v[first: pos + 1, kv].double()).float()
    return out


@dataclass
class Case:
    batch: AttentionBatch
    q: torch.Tensor  # [T, Hq, D]
    k_new: torch.Tensor  # [T, Hkv, D], this step's keys
    v_new: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], prefixes already written, rest NaN
    v_cache: torch.Tensor
    k_full: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]: every key, cached and new
    v_full: list[torch.Tensor]
    query_lens: list[int]
    tables: list[list[int]]

    def to(self, device: torch.device) -> "Case":
        lens = [len(k) - n for k, n in zip(self.k_full, self.query_lens)]
        batch = AttentionBatch.build(self.tables, lens, self.query_lens, self.k_cache.shape[1], device)
        return dataclasses.replace(self, batch=batch, q=self.q.to(device), k_new=self.k_new.to(device),
                                   v_new=self.v_new.to(device), k_cache=self.k_cache.to(device, copy=True),
                                   v_cache=self.v_cache.to(device, copy=True))


def make_case(context_lens: list[int], query_lens: list[int], block_size: int, hq: int, hkv: int,
              head_dim: int, dtype: torch.dtype, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(c + n) // block_size) for c, n in zip(context_lens, query_lens)]
    num_blocks = sum(need) + 5
    pool = list(range(num_blocks))
    rng.shuffle(pool)  # tables are non-contiguous and out of order, as after churn in the pool
    tables = [[pool.pop() for _ in range(n)] for n in need]
    nan = float("nan")
    k_cache = torch.full((num_blocks, block_size, hkv, head_dim), nan, dtype=dtype)
    v_cache = torch.full_like(k_cache, nan)
    k_full, v_full = [], []
    for table, c, n in zip(tables, context_lens, query_lens):
        k_full.append(torch.randn(c + n, hkv, head_dim, generator=g).to(dtype))
        v_full.append(torch.randn(c + n, hkv, head_dim, generator=g).to(dtype))
        for pos in range(c):  # the cached prefix, written by earlier steps
            k_cache[table[pos // block_size], pos % block_size] = k_full[-1][pos]
            v_cache[table[pos // block_size], pos % block_size] = v_full[-1][pos]
    return Case(
        batch=AttentionBatch.build(tables, context_lens, query_lens, block_size),
        q=torch.randn(sum(query_lens), hq, head_dim, generator=g).to(dtype),
        k_new=torch.cat([k[c:] for k, c in zip(k_full, context_lens)]),
        v_new=torch.cat([v[c:] for v, c in zip(v_full, context_lens)]),
        k_cache=k_cache, v_cache=v_cache, k_full=k_full, v_full=v_full, query_lens=query_lens,
        tables=tables,
    )


def _cloned(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k_cache.clone(), v_cache.clone()


def check_attention(case: Case, device: torch.device | str = "cpu", place=_cloned, **options) -> torch.Tensor:
    """Triton on `device` against the reference and the dense oracle (on the CPU); returns the output.
    place: the caches the kernels write and read, holding the case's (copies; or views of another
    layout); options: paged_attention's softcap and window."""
    dtype = case.q.dtype
    scale = case.q.shape[2] ** -0.5
    dev = case.to(torch.device(device))
    k_cache, v_cache = place(dev.k_cache, dev.v_cache)
    attention_triton.write_kv(dev.k_new, dev.v_new, k_cache, v_cache, dev.batch.slot_mapping)
    k_ref, v_ref = place(case.k_cache, case.v_cache)
    attention_ref.write_kv(case.k_new, case.v_new, k_ref, v_ref, case.batch.slot_mapping)
    assert bit_equal(k_cache.cpu(), k_ref) and bit_equal(v_cache.cpu(), v_ref)

    out = torch.full_like(dev.q, float("nan"))  # poisoned: every query row must be written
    attention_triton.paged_attention(dev.q, k_cache, v_cache, dev.batch, scale, out, **options)
    out = out.cpu()
    assert not out.isnan().any()
    out_ref = torch.full_like(case.q, float("nan"))
    attention_ref.paged_attention(case.q, k_ref, v_ref, case.batch, scale, out_ref, **options)
    torch.testing.assert_close(out, out_ref, **TOL[dtype])
    start = 0
    for n, k, v in zip(case.query_lens, case.k_full, case.v_full):
        dense = dense_causal_attention(case.q[start: start + n], k, v, scale, **options)
        torch.testing.assert_close(out[start: start + n].float(), dense, **TOL[dtype])
        start += n
    return out


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_mixed_batch(block_size: int, hq: int, hkv: int, kernel_device) -> None:
    """Decode, fresh prefill and continued-prefix prefill in one launch, spanning many blocks."""
    context_lens = [37, 0, 70, 5, 0]
    query_lens = [1, 23, 9, 1, 1]
    check_attention(make_case(context_lens, query_lens, block_size, hq, hkv, 32, torch.float32), kernel_device)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_decode_only(block_size: int, hq: int, hkv: int, kernel_device) -> None:
    check_attention(make_case([0, 15, 16, 95], [1, 1, 1, 1], block_size, hq, hkv, 32, torch.float32), kernel_device)


def test_long_continued_prefix_fp16(kernel_device) -> None:
    """A chunked prefill whose query tile spans several q blocks, over a prefix many blocks long."""
    check_attention(make_case([100, 3], [40, 2], 16, 8, 2, 64, torch.float16, seed=1), kernel_device)


def test_odd_group_and_head_dim(kernel_device) -> None:
    """GQA group 3 (not a power of two) and head_dim 24 (padded lanes must stay out of the math)."""
    check_attention(make_case([20, 0], [1, 18], 16, 6, 2, 24, torch.float32, seed=2), kernel_device)


def test_write_kv_touches_only_its_slots(kernel_device) -> None:
    case = make_case([3, 0], [5, 4], 16, 4, 2, 16, torch.float32)
    dev = case.to(kernel_device)
    k_cache = torch.full_like(dev.k_cache, float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    attention_triton.write_kv(dev.k_new, dev.v_new, k_cache, v_cache, dev.batch.slot_mapping)
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    flat_k = k_cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[case.batch.slot_mapping] = True
    assert torch.equal(flat_k[case.batch.slot_mapping], case.k_new)
    assert torch.equal(v_cache.flatten(0, 1)[case.batch.slot_mapping], case.v_new)
    assert flat_k[~written].isnan().all() and v_cache.flatten(0, 1)[~written].isnan().all()


def test_entry_points_through_select_kernels(kernel_device) -> None:
    ops = select_kernels("triton", kernel_device)
    assert ops.name == "triton"
    for name in ("write_kv", "paged_attention"):
        ref, tri = getattr(attention_ref, name), getattr(ops, name)
        assert list(inspect.signature(ref).parameters) == list(inspect.signature(tri).parameters)
    case = make_case([10, 0], [1, 12], 16, 4, 2, 16, torch.float32)
    dev = case.to(kernel_device)
    ops.write_kv(dev.k_new, dev.v_new, dev.k_cache, dev.v_cache, dev.batch.slot_mapping)
    out = torch.full_like(dev.q, float("nan"))
    ops.paged_attention(dev.q, dev.k_cache, dev.v_cache, dev.batch, 0.25, out)
    dense = dense_causal_attention(case.q[1:], case.k_full[1], case.v_full[1], 0.25)
    torch.testing.assert_close(out[1:].cpu(), dense, **TOL[torch.float32])


@pytest.mark.parametrize("contexts,dtype", [([600], torch.float32), ([700, 300, 10], torch.float32),
                                            ([1100, 40], torch.float16)], ids=["one", "uneven", "fp16"])
def test_split_context_decode_equals_the_reference(contexts, dtype, kernel_device) -> None:
    """Few decodes over long contexts: each context is split across programs and combined; sequences
    shorter than the longest leave their last splits empty."""
    case = make_case(contexts, [1] * len(contexts), 16, 8, 2, 32, dtype, seed=3)
    plan = attention_triton.step_plan(case.batch, 1, 2, "cpu")
    assert plan.num_splits >= 2 and plan.split_len % attention_triton.BLOCK_N == 0
    assert plan.split_len * (plan.num_splits - 1) < max(contexts) + 1 <= plan.split_len * plan.num_splits
    check_attention(case, kernel_device)


def test_split_context_decode_next_to_a_prefill(kernel_device) -> None:
    """A mixed step: the decode is split while the prefill's query tiles go to the other launch."""
    case = make_case([900, 0, 37], [1, 20, 9], 16, 8, 2, 32, torch.float32, seed=4)
    plan = attention_triton.step_plan(case.batch, 8, 2, "cpu")
    assert plan.num_decode == 1 and plan.num_splits >= 2
    assert plan.prefill.tolist() == [[1, 0], [1, 1], [1, 2], [2, 0], [2, 1]]  # 20 and 9 queries, 8 a tile
    check_attention(case, kernel_device)


@pytest.mark.parametrize("softcap,window", [(1.5, None), (None, 7), (2.0, 20)], ids=["softcap", "window", "both"])
def test_softcap_and_window(softcap, window, kernel_device) -> None:
    """Gemma's attention: soft-capped scores (a cap small enough to bend unit-scale scores) and a sliding
    window, over decodes, fresh and continued prefills; windows shorter and longer than a query tile."""
    case = make_case([37, 0, 70, 5, 0], [1, 23, 9, 1, 1], 16, 8, 2, 32, torch.float32, seed=5)
    check_attention(case, kernel_device, softcap=softcap, window=window)


def test_split_decode_with_a_window(kernel_device) -> None:
    """Long contexts split across programs, most splits wholly before the window: they give no weight."""
    case = make_case([700, 300, 10], [1, 1, 1], 16, 8, 2, 32, torch.float32, seed=6)
    assert attention_triton.step_plan(case.batch, 1, 2, "cpu").num_splits >= 2
    check_attention(case, kernel_device, softcap=3.0, window=40)


def test_many_decodes_are_not_split() -> None:
    assert metadata.split_context(64, 8, 4096, 32) == (4096, 1)  # 512 programs already
    assert metadata.split_context(1, 8, 4096, 32) == (256, 16)  # batch 1: 8 programs -> 128
    assert metadata.split_context(1, 8, 300, 32)[1] == 1  # too short to pay for a combine pass
    assert attention_decode.num_warps(torch.float32) == 8 and attention_decode.num_warps(torch.bfloat16) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton kernels need a GPU")
def test_bf16_on_gpu() -> None:
    context_lens = [300, 0, 17, 64, 2000]
    case = make_case(context_lens, [1, 200, 1, 33, 1], 16, 32, 8, 128, torch.bfloat16)
    check_attention(case, torch.device("cuda"))


def _in_unified_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as --unified-memory's views (server.engine.unified_buffer): layer 1 of 3 of a pool whose
    units are token-major, strided, the other layers' bytes NaN, after a zero page of 2 units."""
    blocks, block_size, hkv, d = k_cache.shape
    unit = 2 * 3 * block_size * hkv * d * k_cache.element_size()
    memory = UnifiedBuffer.allocate(UnifiedPool(blocks, unit, 2, blocks, 0), k_cache.device)
    memory.data.view(k_cache.dtype).fill_(float("nan"))
    k, v = memory.kv_caches(3, block_size, hkv, d, k_cache.dtype)[1]
    assert not k.is_contiguous() and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    k.copy_(k_cache)
    v.copy_(v_cache)
    return k, v


@pytest.mark.parametrize("contexts,queries,dtype", [([37, 0, 5], [1, 20, 9], torch.float32),
                                                    ([600], [1], torch.float32), ([700, 30], [1, 1], torch.float16)],
                         ids=["mixed", "split-decode", "fp16"])
def test_unified_pool_views(contexts, queries, dtype, kernel_device) -> None:
    """write_kv and attention (prefill and split decode), Triton and the reference, on the unified pool's
    strided per-layer views: the same bits and outputs as on contiguous caches."""
    case = make_case(contexts, queries, 16, 8, 2, 32, dtype, seed=8)
    want = check_attention(case, kernel_device)
    torch.testing.assert_close(check_attention(case, kernel_device, _in_unified_pool), want, rtol=0, atol=0)
