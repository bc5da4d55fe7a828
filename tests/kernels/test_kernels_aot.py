"""The ahead-of-time compile check: every Triton variant the engine can launch, compiled for sm_90 and
sm_80 with no GPU (benchmarks/aot/aot_check.py), and proof that each of its checks can fail.

The compiles run in subprocesses: @triton.jit must give real JIT functions there, and the suite
runs with TRITON_INTERPRET=1 on machines without a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from benchmarks.aot import aot
from kernels.metadata import TILE_ROWS, LoraBatch
from tests.repo import ROOT_DIR as ROOT




def have_ptxas() -> bool:
    try:
        return Path(triton.knobs.nvidia.ptxas.path).is_file()
    except Exception:  # noqa: BLE001 - no CUDA backend in this Triton build
        return False


needs_ptxas = pytest.mark.skipif(not have_ptxas(), reason="this Triton has no ptxas to compile for CUDA")


def run_python(code: str, tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `code` from a file (@triton.jit needs its source) in a process without the interpreter."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@needs_ptxas
def test_default_set_compiles_every_kernel_for_hopper_and_ampere(tmp_path: Path) -> None:
    out = tmp_path / "aot.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.aot.aot_check", "--json", str(out)], cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "AOT check passed" in done.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and not report["errors"]
    assert set(report["kernels"]) == set(aot.all_kernels())  # every kernel in kernels/ was launched and compiled
    assert {s.split("/")[0] for s in report["shapes"]} == {"llama3-8b", "qwen2-7b", "llama3.2-1b", "mixtral-8x7b"}
    for name, k in report["kernels"].items():
        for cap, limit in aot.SHARED_LIMITS.items():
            t = k[f"sm_{cap}"]
            assert t["variants"] >= 1 and 0 <= t["max_shared"] <= limit, (name, cap, t)
            assert t["max_registers"] > 0 and "spill_bytes" in t, (name, cap, t)
    # --quantization int8's matmul (kernels.int8_triton), int8 lm_head included, in registers: fp32's
    # 64 x 64 tiles spilled 16-18 KB per thread before its smaller ones.
    # --quantization int4's (kernels.int4_triton), its fp32 tiles at int8's smaller size.
    for quant in ("int8", "int4"):
        assert any(s.endswith(f"/{quant}") for s in report["shapes"])
        k = report["kernels"][f"_{quant}_linear_kernel"]
        assert all(k[f"sm_{cap}"]["spill_bytes"] == 0 for cap in aot.SHARED_LIMITS), k
    # fp32 at max_lora_rank 512 was 262-328 KB of shared memory before rank tiles (issue 12, fault 3).
    assert any(s.endswith("fp32/r512") for s in report["shapes"])


@needs_ptxas
def test_a_tile_too_large_fails_the_check(tmp_path: Path) -> None:
    """A segmented-shrink K tile of 512 needs ~390 KB of shared memory in bf16: over both limits."""
    done = run_python(
        "import sys\n"
        "import kernels.lora_tiles as t\n"
        "t.WIDE = t.LoraTiles(shrink_k=512, expand_n=128, rank_cap=64, gather_elems=4096)\n"
        "from benchmarks.aot import aot_check\n"
        "sys.exit(aot_check.main(['--models', 'llama3.2-1b', '--dtypes', 'bf16', '--max-lora-ranks', '64',\n"
        "                         '--compile-only', '_sgmv_shrink_kernel']))\n", tmp_path)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    assert "AOT check FAILED" in done.stdout
    for cap, limit in aot.SHARED_LIMITS.items():
        assert f"_sgmv_shrink_kernel sm_{cap}: " in done.stdout and f"over the {limit}-byte per-block limit" in \
            done.stdout


@needs_ptxas
def test_a_32_bit_row_offset_fails_the_check(tmp_path: Path) -> None:
    """The check reads each variant's TTIR: a token row times its stride in i32 is reported."""
    done = run_python(
        "import torch, triton, triton.language as tl\n"
        "from benchmarks.aot import aot\n"
        "@triton.jit\n"
        "def _narrow_kernel(y_ptr, stride_yt, N, BLOCK: tl.constexpr):\n"
        "    t = tl.program_id(0)\n"
        "    cols = tl.arange(0, BLOCK)\n"
        "    tl.store(y_ptr + t * stride_yt + cols, 1.0, mask=cols < N)\n"
        "y = torch.empty(80000, 28672, device='meta')\n"
        "with aot.capture() as launches:\n"
        "    _narrow_kernel[(80000,)](y, y.stride(0), 28672, BLOCK=128)\n"
        "print(aot.compile_variant(aot.Specialiser().variant(launches[0], 90), 90).errors)\n", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "a row offset is computed in 32 bits" in done.stdout and "arith.muli %t, %stride_yt : i32" in done.stdout


@needs_ptxas
def test_row_offsets_are_64_bit_past_2_31_elements(tmp_path: Path) -> None:
    """Llama-3-8B's gate_up expand at 80k tokens (y is 2.29e9 elements, on meta: nothing allocated): the
    plan's last row times y's stride is past 2^31, and every compiled variant forms it in 64 bits."""
    tokens, width = 80000, 2 * 14336
    slots = [-1] * (tokens - 7) + [0] * 5 + [1, 2]  # one tiled run and two gathered tokens, at the end
    batch = LoraBatch.build(slots, "cpu", [16] * 8)
    last_row = max(int(batch.plan.gather[:, 0].max()),
                   *(int(batch.plan.tiles[h][:, 0].max()) for h in TILE_ROWS if batch.plan.num_tiles(h)))
    assert last_row * width + width - 1 >= 2**31  # the offsets the kernels form really pass 2^31
    done = run_python(f"""
import torch
from benchmarks.aot import aot
from kernels import lora_triton
from kernels.metadata import LoraBatch
meta = dict(device="meta", dtype=torch.bfloat16)
batch = LoraBatch.build({slots!r}, "meta", [16] * 8)
x, y = torch.empty({tokens}, 4096, **meta), torch.empty({tokens}, {width}, **meta)
a, h = torch.empty(2, 8, 16, 4096, **meta), torch.empty(2, {tokens}, 16, **meta)
b = tuple(torch.empty(8, 16, 14336, **meta).transpose(1, 2) for _ in "gu")
with aot.capture() as launches:
    lora_triton.lora_shrink(x, a, batch, torch.empty(2, 8, device="meta"), h)
    lora_triton.lora_expand(h, b, batch, y, (0, 14336))
print(sorted(launch.name for launch in launches))
spec = aot.Specialiser()
print([e for launch in launches for e in aot.compile_variant(spec.variant(launch, 90), 90).errors])
""", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    names, errors = done.stdout.strip().splitlines()[-2:]
    assert names == str(sorted(["_bgmv_shrink_kernel", "_sgmv_shrink_kernel", "_bgmv_expand_kernel",
                                "_sgmv_expand_kernel"]))
    assert errors == "[]"


def test_grid_limits_and_empty_grids_are_errors() -> None:
    def launch(grid):
        return aot.Launch(kernel=type("K", (), {"fn": aot.grid_errors})(), args=(), kwargs={}, grid=grid)

    assert aot.grid_errors(launch((2**31 - 1, 65535, 65535))) == []
    assert "dimension 1 is 65536" in aot.grid_errors(launch((1, 65536, 1)))[0]
    assert "dimension 0 is 0" in aot.grid_errors(launch((0, 1, 1)))[0]
    assert "dimension 0 is 2147483648" in aot.grid_errors(launch((2**31, 1, 1)))[0]


def test_capture_records_launches_without_running_them() -> None:
    """Under the interpreter too: meta tensors have no storage, so running would fail."""
    from kernels import attention_triton

    k = torch.empty(3, 2, 16, device="meta")
    cache = torch.empty(4, 16, 2, 16, device="meta")
    with aot.capture() as launches:
        attention_triton.write_kv(k, k, cache, cache, torch.empty(3, dtype=torch.int64, device="meta"))
    assert [(l.name, l.grid) for l in launches] == [("_write_kv_kernel", (3,))]


def test_every_kernel_is_found_and_an_unlaunched_one_is_reported() -> None:
    kernels = {"_sgmv_shrink_kernel", "_bgmv_shrink_kernel", "_sgmv_expand_kernel", "_bgmv_expand_kernel",
               "_write_kv_kernel", "_paged_attention_kernel", "_decode_kernel", "_combine_splits_kernel",
               "_int8_linear_kernel", "_int4_linear_kernel", "_expert_shrink_kernel", "_expert_expand_kernel",
               "_rms_norm_kernel"}
    assert set(aot.all_kernels()) == kernels
    assert aot.unlaunched(kernels) == []
    assert aot.unlaunched(kernels - {"_combine_splits_kernel"}) == ["_combine_splits_kernel"]


def test_narrow_products_follow_the_stride_through_splats() -> None:
    narrow = """
    %a = tt.splat %stride_yt : i32 -> tensor<16x1xi32> loc(#loc1)
    %b = arith.muli %rows, %a : tensor<16x1xi32> loc(#loc2)
    """
    wide = """
    %a = arith.extsi %stride_yt : i32 to i64 loc(#loc1)
    %b = tt.splat %a : i64 -> tensor<16x1xi64> loc(#loc1)
    %c = arith.muli %rows, %b : tensor<16x1xi64> loc(#loc2)
    %d = arith.muli %cols, %stride_yn : tensor<16x1xi32> loc(#loc2)
    """
    assert len(aot.narrow_row_products(narrow)) == 1
    assert aot.narrow_row_products(wide) == []


@needs_ptxas
def test_fp8_kv_attention_compiles_without_spills_e4m3_for_hopper_only(tmp_path: Path) -> None:
    """--kv-cache-dtype: bf16 queries read an fp8 pool converted to bf16 on tensor cores (no fp32 upcast,
    which spilled ~1.9 KB per prefill program); an e4m3 pool is compiled for sm_90 only, as the engine
    refuses it below compute capability 8.9."""
    out = tmp_path / "aot-kv.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.aot.aot_check", "--models", "llama3.2-1b",
                           "--dtypes", "bf16", "--max-lora-ranks", "64", "--kv-cache-dtypes", "fp8_e4m3", "fp8_e5m2",
                           "--quantizations", "none", "--lora-page-rows", "0", "--compile-only",
                           "_decode_kernel", "_paged_attention_kernel", "_write_kv_kernel", "--json", str(out)],
                          cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["shapes"] == ["llama3.2-1b/bf16/r64/kv-fp8_e4m3", "llama3.2-1b/bf16/r64/kv-fp8_e5m2"]
    for name in ("_decode_kernel", "_paged_attention_kernel"):
        k = report["kernels"][name]
        assert k["sm_90"]["variants"] == 2 and k["sm_80"]["variants"] == 1, (name, k)  # e4m3: no sm_80
        assert k["sm_90"]["spill_bytes"] == k["sm_80"]["spill_bytes"] == 0, (name, k)


def test_verify_steps_and_every_padded_context_are_in_the_check() -> None:
    """Speculative verify steps as the engine runs them (eager: a 5-token query per sequence; padded: one
    one-token row per token, server.engine.decode_graphs), and every padded decode and verify context the
    engine captures as a CUDA graph, each at its own token count."""
    from benchmarks.aot.aot_check import capture_shape
    from benchmarks.aot.aot_shapes import EngineShape

    by_scenario, _ = capture_shape(EngineShape("llama3.2-1b", "bf16", 64))
    names = {name: {launch.name for launch in launches} for name, launches in by_scenario.items()}
    for rows in (1, 8, 32):
        assert "_paged_attention_kernel" in names[f"verify-{rows}x5"]
        assert "_decode_kernel" in names[f"verify-{rows}x5-padded"]
        assert "_paged_attention_kernel" not in names[f"verify-{rows}x5-padded"]
    writes = [launch.grid[0] for launch in by_scenario["padded decode and verify"] if launch.name == "_write_kv_kernel"]
    decode = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    verify = {rows * width for rows in (1, 2, 4, 8, 16, 24, 31) for width in (2, 3, 4, 5)}
    assert sorted(set(writes)) == sorted(set(decode) | verify)  # 31 x 5 = 155 token rows among them
    assert len(writes) == 3 * len(set(writes))  # without LoRA, with LoRA, with LoRA and DoRA
    # The same contexts on the tiled LoRA plan (kernels.metadata.PADDED_LORA_FORM): the INDEXED segmented
    # kernels, at a 16-row tile, and no gathered one.
    tiled = [launch for launch in by_scenario["padded decode and verify, tiled LoRA"] if "mv_" in launch.name]
    assert {launch.name for launch in tiled} == {"_sgmv_shrink_kernel", "_sgmv_expand_kernel"}
    assert all(launch.kwargs["INDEXED"] and launch.kwargs["BLOCK_M"] == 16 for launch in tiled)
    assert not any(launch.kwargs["INDEXED"] for launch in by_scenario["padded decode and verify"]
                   if launch.name.startswith("_sgmv"))
    # The one layer's input norm, its residual add fused with the MLP's norm, the final norm: one launch each.
    norms = [launch for launch in by_scenario["padded decode and verify"] if launch.name == "_rms_norm_kernel"]
    assert len(norms) == 3 * len(writes)
    assert sorted(launch.grid[0] for launch in norms[::3]) == sorted(writes)  # one program per token row
