"""--kv-cache-dtype fp8_e4m3 / fp8_e5m2: the stored bytes, both attention paths, the engine against an
oracle, the pool's capacity, and the refusals.

The oracle is transformers + peft whose attention sees every key and value rounded to the cache's fp8
format (post-rope, as the engine stores them, with vLLM's unit scale and saturation): the engine's
greedy tokens are that model's argmax and its logprobs agree within 1e-4, for mixed adapters, after
preemption and on prefix-cache hits. Against the float cache (what fp8 costs) the tiny model's
teacher-forced logprobs move by at most FLOAT_CACHE_TOL: its keys and values are small (|x| ~ 0.1),
where fp8's few mantissa bits and e4m3's subnormals show most.
"""
from __future__ import annotations

import os

import pytest
import torch

from kernels import attention_ref, attention_triton
from kernels.attention_ref import reads_exactly, storage, to_cache_dtype
from kernels.metadata import AttentionBatch
from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from server.engine import LLM, SamplingParams
from server.engine.config import EngineConfig
from server.engine.kv_cache_dtype import resolve_kv_cache_dtype
from tests.engine_helpers import GREEDY, generate_through_preemption_and_prefix_hits, random_prompts

VOCAB = 512
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ORACLE_TOL = 1e-4  # against the fp8-rounded transformers + peft: float32 rounding only
# Against the float cache, on the tiny model (measured: 0.23 for e4m3, 0.46 for e5m2 on 10 prompts).
FLOAT_CACHE_TOL = {"fp8_e4m3": 0.3, "fp8_e5m2": 0.6}
triton_available = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or the interpreter")


@pytest.mark.parametrize("name", FP8)
def test_the_cast_saturates_and_rounds_to_nearest(name):
    dtype = FP8[name]
    big = torch.finfo(dtype).max
    x = torch.tensor([1e9, -1e9, 3 * big, 0.0, 1.0, -0.3])
    got = to_cache_dtype(x, dtype).float()
    assert got[:3].tolist() == [big, -big, big]  # never NaN (e4m3fn) or inf (e5m2)
    assert torch.equal(got[3:], x[3:].to(dtype).float())
    fine = torch.linspace(-4, 4, 1001)
    rel = ((to_cache_dtype(fine, dtype).float() - fine).abs() / fine.abs().clamp(min=0.25)).max()
    assert rel <= {"fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}[name] * 1.0001  # half a step of 3 / 2 mantissa bits


def test_fp8_values_read_exactly_in_half_precision():
    """What lets the Triton kernels read an fp8 pool in bf16/fp16 on tensor cores (kernels.attention_ref)."""
    for dtype in FP8.values():
        values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        values = values[values.isfinite()]  # e5m2 has infinities, which the cast saturates
        for half in (torch.bfloat16, torch.float16):
            assert reads_exactly(dtype, half)
            assert torch.equal(to_cache_dtype(values, dtype).to(half).float(), values)
    assert not reads_exactly(torch.float32, torch.bfloat16) and reads_exactly(torch.bfloat16, torch.bfloat16)


def fp8_case(dtype, context_lens, query_lens, block_size=16, hq=4, hkv=2, d=32, seed=0):
    """Caches with random fp8 prefixes (unused slots NaN-free garbage: fp8 bytes from randn * 8)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in zip(context_lens, query_lens)]
    blocks = sum(need) + 2
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    k_cache = to_cache_dtype(torch.randn(blocks, block_size, hkv, d, generator=g) * 8, dtype)
    v_cache = to_cache_dtype(torch.randn(blocks, block_size, hkv, d, generator=g) * 8, dtype)
    t = sum(query_lens)
    q = torch.randn(t, hq, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g) * 40, torch.randn(t, hkv, d, generator=g)  # some past e4m3's 448
    batch = AttentionBatch.build(tables, context_lens, query_lens, block_size)
    return q, k, v, k_cache, v_cache, batch


@triton_available
@pytest.mark.parametrize("name", FP8)
def test_triton_and_torch_store_the_same_bytes_and_attend_alike(name):
    q, k, v, k_cache, v_cache, batch = fp8_case(FP8[name], [37, 0, 5, 16], [1, 23, 9, 1])
    kr, vr, kt, vt = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    attention_ref.write_kv(k, v, kr, vr, batch.slot_mapping)
    attention_triton.write_kv(k, v, kt, vt, batch.slot_mapping)
    assert torch.equal(storage(kr), storage(kt)) and torch.equal(storage(vr), storage(vt))
    flat = kr.view(-1, *kr.shape[2:])[batch.slot_mapping]  # [T, Hkv, D] what was stored
    assert torch.equal(storage(flat), storage(to_cache_dtype(k, kr.dtype)))
    assert not kr.float().isnan().any() and not kr.float().isinf().any()
    out_ref, out_tri = torch.empty_like(q), torch.empty_like(q)
    attention_ref.paged_attention(q, kr, vr, batch, 0.17, out_ref)
    attention_triton.paged_attention(q, kt, vt, batch, 0.17, out_tri)
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)  # values up to ~30: float32 sums
    # The fp8 cache reads as its float values: the same attention over a float32 copy.
    out_f32 = torch.empty_like(q)
    attention_ref.paged_attention(q, kr.float(), vr.float(), batch, 0.17, out_f32)
    torch.testing.assert_close(out_ref, out_f32, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", FP8)
def test_padded_write_skips_padding_rows(name):
    _, k, v, k_cache, v_cache, batch = fp8_case(FP8[name], [3, 7], [1, 1])
    slots = batch.slot_mapping.clone()
    slots[1] = -1  # a padding row
    before = storage(k_cache).clone()
    attention_ref.write_kv_padded(k, v, k_cache, v_cache, slots)
    flat = storage(k_cache).view(-1, *k_cache.shape[2:])
    assert torch.equal(flat[slots[0]], storage(to_cache_dtype(k[0], k_cache.dtype)))
    changed = (flat != before.view_as(flat)).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [int(slots[0])]


# ---- the engine against the fp8-rounded transformers + peft ----

@pytest.fixture(scope="module")
def fp8_logprobs(tiny_model_dir, tiny_adapters):
    """fp8_logprobs(kv_cache_dtype, adapter_name_or_None, ids) -> [len(ids), V]: log_softmax of
    transformers (+ peft) float32 logits whose attention reads K/V rounded to that fp8 format."""
    from peft import PeftModel
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for name, dtype in FP8.items():
        def attention(module, query, key, value, *args, _dtype=dtype, **kw):  # key, value: [B, Hkv, L, D]
            return sdpa_attention_forward(module, query, to_cache_dtype(key, _dtype).float(),
                                          to_cache_dtype(value, _dtype).float(), *args, **kw)
        AttentionInterface.register(f"loraplex_{name}", attention)
    models: dict[tuple, torch.nn.Module] = {}

    @torch.inference_mode()
    def get(kv_dtype: str, adapter: str | None, ids: list[int]) -> torch.Tensor:
        if (kv_dtype, adapter) not in models:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                         attn_implementation=f"loraplex_{kv_dtype}")
            if adapter is not None:
                model = PeftModel.from_pretrained(model, tiny_adapters[adapter])
            models[kv_dtype, adapter] = model.eval()
        logits = models[kv_dtype, adapter](input_ids=torch.tensor([ids])).logits[0]  # [L, V]
        return torch.log_softmax(logits.float(), dim=-1)

    return get


def check_against_oracle(fp8_logprobs, kv_dtype, prompts, names, outs) -> None:
    """Each greedy token is the oracle's argmax (ties aside) and its logprob the oracle's within ORACLE_TOL."""
    for prompt, name, out in zip(prompts, names, outs):
        ref = fp8_logprobs(kv_dtype, name, prompt + out.token_ids[:-1])  # [L, V]
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert abs(entry.logprob - float(row[token])) <= ORACLE_TOL, (name, i)
            assert float(row.max() - row[token]) <= ORACLE_TOL, f"{name}: token {i} is not the oracle's argmax"


def fp8_llm(model_dir, adapters, kv_dtype, **kw) -> LLM:
    kw = {"max_loras": 4, "kv_cache_blocks": 128, "max_model_len": 256, **kw}
    llm = LLM(model_dir, device="cpu", dtype="float32", kv_cache_dtype=kv_dtype, **kw)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


@pytest.mark.parametrize("kv_dtype", FP8)
def test_mixed_adapters_match_the_fp8_oracle_and_stay_near_the_float_cache(
        kv_dtype, tiny_model_dir, tiny_adapters, fp8_logprobs):
    llm = fp8_llm(tiny_model_dir, tiny_adapters, kv_dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == FP8[kv_dtype]
    names = [None, *tiny_adapters] * 2
    prompts = random_prompts(len(names), (3, 40), VOCAB, seed=21)
    params = SamplingParams(max_tokens=8, logprobs=0, prompt_logprobs=0, **GREEDY)
    outs = llm.generate(prompts, params, adapters=names)
    check_against_oracle(fp8_logprobs, kv_dtype, prompts, names, outs)
    # What the cache's rounding costs, teacher-forced on the prompts: bounded, and not nothing.
    float_llm = fp8_llm(tiny_model_dir, tiny_adapters, "auto")
    float_outs = float_llm.generate(prompts, params, adapters=names)
    gap = max(abs(a.logprob - b.logprob) for o, f in zip(outs, float_outs)
              for a, b in zip(o.prompt_logprobs[1:], f.prompt_logprobs[1:]))
    print(f"{kv_dtype} vs the float cache: max |prompt logprob diff| = {gap:.3g}")
    assert 1e-3 < gap <= FLOAT_CACHE_TOL[kv_dtype]


def test_preemption_and_prefix_hits_match_the_fp8_oracle(tiny_model_dir, tiny_adapters, fp8_logprobs):
    # 8 sequences of ~50 + 24 tokens in 18 blocks of 16: preemption is certain; the shared 33-token
    # prefix is served from the cache (two full blocks) to those that come after its first writer.
    adapters = {n: tiny_adapters[n] for n in ("r8_all", "r4_qv")}
    llm = fp8_llm(tiny_model_dir, adapters, "fp8_e4m3", kv_cache_blocks=18, max_model_len=128)
    prompts, names, outs = generate_through_preemption_and_prefix_hits(llm, VOCAB)
    assert any(o.num_cached_tokens >= 32 for o in outs)
    check_against_oracle(fp8_logprobs, "fp8_e4m3", prompts, names, outs)
    assert llm.engine.stats().kv_blocks.used == 0


@triton_available
def test_the_triton_path_matches_the_fp8_oracle(tiny_model_dir, tiny_adapters, fp8_logprobs):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    adapters = {"r8_all": tiny_adapters["r8_all"]}
    llm = LLM(tiny_model_dir, device=device, dtype="float32", kernels="triton", max_loras=2, kv_cache_blocks=32,
              max_model_len=128, kv_cache_dtype="fp8_e5m2")
    llm.add_adapter("r8_all", adapters["r8_all"])
    names = ["r8_all", None]
    prompts = random_prompts(2, (6, 20), VOCAB, seed=41)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, logprobs=0, **GREEDY), adapters=names)
    check_against_oracle(fp8_logprobs, "fp8_e5m2", prompts, names, outs)


# ---- capacity and refusals ----

def test_the_same_bytes_hold_four_times_the_blocks(tiny_model_dir):
    budget = 1 << 20
    pools = {d: LLM(tiny_model_dir, device="cpu", dtype="float32", cpu_kv_cache_bytes=budget, max_model_len=256,
                    kv_cache_dtype=d).engine.kv_pool for d in ("auto", "fp8_e4m3", "fp8_e5m2")}
    assert pools["auto"].dtype == "float32" and pools["fp8_e5m2"].dtype == "fp8_e5m2"
    assert pools["fp8_e4m3"].blocks == pools["fp8_e5m2"].blocks == 4 * pools["auto"].blocks
    assert all(p.bytes <= budget and p.bytes > budget - p.bytes // p.blocks for p in pools.values())
    assert pools["fp8_e4m3"].tokens == pools["fp8_e4m3"].blocks * 16


@pytest.mark.parametrize("value, message", [("int8", "int8 KV is not implemented"), ("fp16", "supported: auto, fp8"),
                                            ("", "supported")])
def test_unsupported_names_are_refused(tiny_model_dir, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.of(model=str(tiny_model_dir), kv_cache_dtype=value)


def test_e4m3_needs_ada_or_hopper_on_a_gpu():
    gpu = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="compute capability >= 8.9.*has 8.0: use fp8_e5m2"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.float16, gpu, capability=(8, 0))
    assert resolve_kv_cache_dtype("fp8", torch.float16, gpu, capability=(9, 0)) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16, gpu, capability=(8, 0)) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, gpu, capability=(8, 0)) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32, torch.device("cpu")) == torch.float8_e4m3fn


def test_cli_flag_reaches_the_server_config(tmp_path):
    parser = build_parser()
    flag = next(a for a in parser._subparsers._group_actions[0].choices["serve"]._actions
                if a.dest == "kv_cache_dtype")
    assert "auto (default)" in flag.help and flag.default == "auto"
    base = ["serve", "--data-dir", str(tmp_path), "--admin-token", "x" * 16]
    assert ServerConfig.from_args(parser.parse_args(base), env={}).engine.cache.kv_cache_dtype == "auto"
    args = parser.parse_args(base + ["--kv-cache-dtype", "fp8_e5m2"])
    assert ServerConfig.from_args(args, env={}).engine.cache.kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ConfigError, match="--kv-cache-dtype 'int8' is not supported"):
        ServerConfig.from_args(parser.parse_args(base + ["--kv-cache-dtype", "int8"]), env={})


def test_the_admin_view_shows_the_pool_dtype_and_capacity(tmp_path, tiny_model_dir, redis_server, core_starter):
    from tests.fixtures_server import api_redis_url, running_server, server_config

    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server),
                           kv_cache_dtype="fp8_e5m2", kv_cache_blocks=40)
    with running_server(config, starter=core_starter) as server:
        _, key = server.new_tenant()
        r = server.client(key).completions.create(model=server.state.model_id, prompt=[5, 6, 7], max_tokens=3,
                                                   temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        view = server.admin("GET", "/admin/engine").json()["kv_cache"]
    per_block = 2 * 2 * 16 * 2 * 16  # k and v, 2 layers, 16 tokens, 2 kv heads, head_dim 16, one byte each
    assert view == {"dtype": "fp8_e5m2", "requested_dtype": "fp8_e5m2", "blocks": 40, "block_size": 16,
                    "tokens": 640, "bytes": 40 * per_block}
