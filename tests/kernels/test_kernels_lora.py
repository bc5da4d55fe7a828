"""Triton multi-LoRA shrink/expand against the fp32 reference and a dense per-adapter oracle.

On CPU these run under TRITON_INTERPRET=1 (set by conftest), which is ~1000x
slower than a GPU: shapes are small and the matrix is chosen, not crossed.
With a GPU they launch for real on it (`kernel_device`). Compiling every
variant for sm_90/sm_80 is tests/kernels/test_kernels_aot.py's job.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels import lora_ref, lora_triton
from kernels.metadata import LoraBatch
from server.engine.kernel_choice import select_kernels
from tests.kernel_helpers import bit_equal
from tests.repo import ROOT_DIR

FORMS = {
    "segmented": (lora_triton.shrink_segmented, lora_triton.expand_segmented),
    "gathered": (lora_triton.shrink_gathered, lora_triton.expand_gathered),
}
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}


def request_slots(mode: str, num_requests: int, rng: random.Random) -> list[int]:
    """One adapter slot per request, by the field's popularity modes (-1 = base model)."""
    if mode == "none":
        return [-1] * num_requests
    if mode == "identical":
        return [3] * num_requests
    if mode == "distinct":
        slots = list(range(num_requests))
    elif mode == "uniform":  # ~sqrt(B) adapters of ~sqrt(B) requests each
        slots = [rng.randrange(max(1, round(num_requests ** 0.5))) for _ in range(num_requests)]
    elif mode == "zipf":
        weights = [1 / (k + 1) ** 1.5 for k in range(num_requests)]
        slots = rng.choices(range(num_requests), weights=weights, k=num_requests)
    else:
        raise AssertionError(mode)
    # Every third request runs on the base model, so -1 rows sit between adapter rows.
    return [-1 if i % 3 == 1 else s for i, s in enumerate(slots)]


def token_slots(req_slots: list[int], req_lens: list[int]) -> list[int]:
    return [s for s, n in zip(req_slots, req_lens) for _ in range(n)]


@dataclass
class Problem:
    batch: LoraBatch
    x: torch.Tensor  # [T, in]
    lora_a: torch.Tensor  # [S, L, R, in]
    scaling: torch.Tensor  # [S, L]
    lora_b: tuple[torch.Tensor, ...]  # S x [L, n_i, R]
    offsets: tuple[int, ...]
    y_width: int
    ranks: list[int]  # each slot's own rank (rows beyond it are zero, as in the slot buffers)

    def to(self, device: torch.device, slots: list[int]) -> "Problem":
        return dataclasses.replace(self, batch=LoraBatch.build(slots, device), x=self.x.to(device),
                                   lora_a=self.lora_a.to(device), scaling=self.scaling.to(device),
                                   lora_b=tuple(b.to(device) for b in self.lora_b))


def make_problem(slots: list[int], hidden: int, max_rank: int, widths: list[int], dtype: torch.dtype,
                 num_slots: int, seed: int = 0) -> Problem:
    g = torch.Generator().manual_seed(seed)
    num_slices = len(widths)
    ranks = [max(1, max_rank >> (i % 3)) for i in range(num_slots)]  # mixed ranks in one launch
    lora_a = torch.randn(num_slices, num_slots, max_rank, hidden, generator=g) / hidden ** 0.5
    lora_b = [torch.randn(num_slots, n, max_rank, generator=g) / max_rank ** 0.5 for n in widths]
    for slot, r in enumerate(ranks):
        lora_a[:, slot, r:] = 0
        for b in lora_b:
            b[slot, :, r:] = 0
    offsets, col = [], 5  # a gap before and between slices: those columns must stay untouched
    for n in widths:
        offsets.append(col)
        col += n + 3
    return Problem(
        batch=LoraBatch.build(slots),
        x=torch.randn(len(slots), hidden, generator=g).to(dtype),
        lora_a=lora_a.to(dtype),
        scaling=torch.rand(num_slices, num_slots, generator=g) * 2 + 0.5,
        lora_b=tuple(b.to(dtype) for b in lora_b),
        offsets=tuple(offsets),
        y_width=col + 2,
        ranks=ranks,
    )


def dense_oracle(p: Problem, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, with each adapter's true (unpadded) weights: h and the full y delta."""
    num_slices, _, max_rank, _ = p.lora_a.shape
    h = torch.zeros(num_slices, len(slots), max_rank)
    delta = torch.zeros(len(slots), p.y_width)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        r = p.ranks[s]
        for i in range(num_slices):
            h[i, t, :r] = p.scaling[i, s] * (p.x[t].float() @ p.lora_a[i, s, :r].float().t())
            n = p.lora_b[i].shape[1]
            hi = h[i, t, :r].to(p.x.dtype).float()  # shrink's output is stored in the model dtype
            delta[t, p.offsets[i]: p.offsets[i] + n] = hi @ p.lora_b[i][s, :, :r].float().t()
    return h, delta


def run_and_check(p: Problem, slots: list[int], shrink, expand, device: torch.device | str = "cpu") -> None:
    """Run the kernels on `device` (the reference on the CPU) and compare on the CPU."""
    num_slices, _, rank, _ = p.lora_a.shape
    dtype = p.x.dtype
    tol = TOL[dtype]
    rows_off = torch.tensor([s < 0 for s in slots])
    dev = p.to(torch.device(device), slots)

    h_ref = torch.full((num_slices, len(slots), rank), float("nan"), dtype=dtype)
    lora_ref.lora_shrink(p.x, p.lora_a, p.batch, p.scaling, h_ref)
    h = torch.full_like(h_ref, float("nan"), device=device)  # poisoned: every row the kernel skips stays NaN
    shrink(dev.x, dev.lora_a, dev.batch, dev.scaling, h)
    h = h.cpu()
    assert h[:, rows_off].isnan().all(), "shrink wrote a row whose slot is -1"
    assert not h[:, ~rows_off].isnan().any(), "shrink left an adapter row unwritten"
    torch.testing.assert_close(h[:, ~rows_off].float(), h_ref[:, ~rows_off].float(), **tol)
    h_dense, delta = dense_oracle(p, slots)
    torch.testing.assert_close(h[:, ~rows_off].float(), h_dense[:, ~rows_off], **tol)

    y0 = torch.randn(len(slots), p.y_width, generator=torch.Generator().manual_seed(7)).to(dtype)
    y0[0, 0] = float("nan")  # a NaN outside every slice must survive untouched too
    y_ref, y = y0.clone(), y0.to(device, copy=True)
    lora_ref.lora_expand(h_ref, p.lora_b, p.batch, y_ref, p.offsets)
    expand(h_ref.to(device), dev.lora_b, dev.batch, y, p.offsets)
    y = y.cpu()
    assert bit_equal(y[rows_off], y0[rows_off]), "expand changed a row whose slot is -1"
    covered = torch.zeros(p.y_width, dtype=torch.bool)
    for off, b in zip(p.offsets, p.lora_b):
        covered[off: off + b.shape[1]] = True
    assert bit_equal(y[:, ~covered], y0[:, ~covered]), "expand wrote outside its slices"
    torch.testing.assert_close(y.float(), y_ref.float(), equal_nan=True, **tol)
    torch.testing.assert_close(y[1:].float(), (y0[1:].float() + delta[1:]), **tol)


GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 runs on a GPU (the interpreter has no bf16)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", ["distinct", "uniform", "zipf", "identical", "none"])
@pytest.mark.parametrize("form", list(FORMS))
def test_popularity_modes(form: str, mode: str, dtype: torch.dtype, kernel_device) -> None:
    rng = random.Random(f"{form}-{mode}")  # str seeds are stable across runs, unlike hash()
    num_requests = 9
    lens = [1] * num_requests if form == "gathered" else [rng.randint(1, 5) for _ in range(num_requests)]
    slots = token_slots(request_slots(mode, num_requests, rng), lens)
    p = make_problem(slots, hidden=96, max_rank=16, widths=[32, 16, 16], dtype=dtype, num_slots=num_requests)
    run_and_check(p, slots, *FORMS[form], kernel_device)


@pytest.mark.parametrize(
    "rank,hidden,widths",
    [(1, 2049, [24]), (8, 64, [48, 16]), (16, 300, [40, 20, 20]), (64, 2049, [33, 17, 17])],
)
@pytest.mark.parametrize("form", list(FORMS))
def test_ranks_hidden_slices(form: str, rank: int, hidden: int, widths: list[int], kernel_device) -> None:
    rng = random.Random(rank)
    lens = [1] * 6 if form == "gathered" else [3, 1, 7, 2, 4, 1]
    slots = token_slots(request_slots("distinct", 6, rng), lens)
    p = make_problem(slots, hidden=hidden, max_rank=rank, widths=widths, dtype=torch.float32, num_slots=6)
    run_and_check(p, slots, *FORMS[form], kernel_device)


def test_more_slices_than_one_launch_takes(kernel_device) -> None:
    """Slices past MAX_FUSED_SLICES go to a second launch with the right h rows and offsets."""
    slots = [0, 0, 1, -1, 1, 2, 2, 2, 2, 2]
    widths = [16, 8, 24, 8, 40]
    assert len(widths) > lora_triton.MAX_FUSED_SLICES
    p = make_problem(slots, hidden=48, max_rank=8, widths=widths, dtype=torch.float32, num_slots=3)
    run_and_check(p, slots, *FORMS["segmented"], kernel_device)


@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_entry_points_pick_the_form_by_batch_shape(shape: str, kernel_device) -> None:
    ops = select_kernels("triton", kernel_device)
    lens = [1, 1, 1, 1, 1] if shape == "decode" else [1, 9, 1, 20, 2]
    slots = token_slots([0, 1, -1, 2, 1], lens)
    p = make_problem(slots, hidden=64, max_rank=8, widths=[32, 32], dtype=torch.float32, num_slots=3)
    assert lora_triton.use_gather(p.batch) == (shape == "decode")
    run_and_check(p, slots, ops.lora.shrink, ops.lora.expand, kernel_device)


def test_empty_batch_is_a_no_op(kernel_device) -> None:
    ops = select_kernels("triton", kernel_device)
    batch = LoraBatch.build([], kernel_device)
    h = torch.empty(2, 0, 8, device=kernel_device)
    ops.lora.shrink(torch.empty(0, 32, device=kernel_device), torch.randn(2, 3, 8, 32, device=kernel_device), batch,
                    torch.ones(2, 3, device=kernel_device), h)
    y = torch.empty(0, 40, device=kernel_device)
    ops.lora.expand(h, (torch.randn(3, 16, 8, device=kernel_device), torch.randn(3, 24, 8, device=kernel_device)),
                    batch, y, (0, 16))
    assert h.shape == (2, 0, 8) and y.shape == (0, 40)


def test_bench_smoke_runs_and_agrees(tmp_path: Path) -> None:
    """python -m benchmarks.kernels.bench_kernels --smoke: end to end under the interpreter, Triton matching torch,
    with the launch plan's split count (unsplit at this K) and 4 splits forced, decode rows as padded batches
    (gathered, and tiled: kernels.sorted_tiles).
    One timed call per config, no warm-up: the interpreter's times mean nothing, its results are the test."""
    root = ROOT_DIR
    out = tmp_path / "kernels.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.kernels.bench_kernels", "--smoke", "--projections", "down",
                           "--split-k", "plan", "4", "--padded-decode", "--attention", "--warmup", "0", "--iters", "1",
                           "--json", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "triton" in done.stdout and "%copy" in done.stdout
    report = json.loads(out.read_text())
    rows = report["results"]
    assert {r["shape"] for r in rows} == {"decode", "prefill"}
    decode = [r for r in rows if r["shape"] == "decode"]
    assert {r["batch"] for r in decode} == {"padded"} and {r["batch"] for r in rows if r not in decode} == {"eager"}
    assert {(r["impl"], r["splits"]) for r in decode} == {("torch", 1), ("triton", 1), ("triton-split4", 4),
                                                          ("triton-tiled", 1), ("triton-tiled-split4", 4)}
    assert {r["impl"] for r in rows if r not in decode} == {"torch", "triton", "triton-split4"}  # tiled: padded only
    assert all(r["median_ms"] > 0 and r["bytes_moved"] > 0 for r in rows)
    assert report["copy_gb_per_s"] > 0
    attention = report["attention"]
    assert {(r["impl"], r["seqs"]) for r in attention} == {(i, n) for i in ("torch", "triton") for n in (1, 4)}
    assert all(r["num_splits"] >= 2 for r in attention if r["impl"] == "triton")  # few decodes: split context


def test_entry_points_keep_the_reference_signatures() -> None:
    for name in ("lora_shrink", "lora_expand"):
        ref, tri = getattr(lora_ref, name), getattr(lora_triton, name)
        assert list(inspect.signature(ref).parameters) == list(inspect.signature(tri).parameters)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton kernels need a GPU")
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_bf16_on_gpu(shape: str) -> None:
    ops = select_kernels("triton", torch.device("cuda"))
    rng = random.Random(1)
    lens = [1] * 64 if shape == "decode" else [rng.randint(1, 40) for _ in range(16)]
    slots = token_slots(request_slots("zipf", len(lens), rng), lens)
    p = make_problem(slots, hidden=4096, max_rank=16, widths=[4096, 1024, 1024], dtype=torch.bfloat16,
                     num_slots=len(lens))
    cuda = p.to(torch.device("cuda"), slots)
    h = torch.full((3, len(slots), 16), float("nan"), dtype=torch.bfloat16, device="cuda")
    ops.lora.shrink(cuda.x, cuda.lora_a, cuda.batch, cuda.scaling, h)
    h_ref = torch.full_like(h, float("nan"))
    lora_ref.lora_shrink(cuda.x, cuda.lora_a, cuda.batch, cuda.scaling, h_ref)
    torch.testing.assert_close(h, h_ref, equal_nan=True, **TOL[torch.bfloat16])
    y0 = torch.randn(len(slots), p.y_width, device="cuda", dtype=torch.bfloat16)
    y, y_ref = y0.clone(), y0.clone()
    ops.lora.expand(h_ref, cuda.lora_b, cuda.batch, y, cuda.offsets)
    lora_ref.lora_expand(h_ref, cuda.lora_b, cuda.batch, y_ref, cuda.offsets)
    off = torch.tensor([s < 0 for s in slots], device="cuda")
    assert torch.equal(y[off], y0[off])
    torch.testing.assert_close(y, y_ref, **TOL[torch.bfloat16])
