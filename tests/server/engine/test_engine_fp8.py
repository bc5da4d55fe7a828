"""`quantization="fp8"`: the quantizer's bound, `torch._scaled_mm` (torch's CPU build has it) against
the same math in plain float32, the refusals off Hopper/Ada, and the whole model path (fused
projections, LoRA on top) against transformers + peft whose projections run that same w8a8 math.

The engine serves fp8 only on CUDA with compute capability >= 8.9; the model-path test lifts that
refusal on the CPU to run the exact code a GPU would (float32 activations here, bfloat16 there)."""
from __future__ import annotations

import pytest
import torch

from kernels.fp8_weights import (FP8_MAX, Fp8Weight, dequantize_fp8, fp8_linear_ref, quantize_activations,
                                 quantize_fp8, scaled_mm_linear)
from server.engine import LLM, SamplingParams
from server.engine.config import EngineConfig, QuantizationConfig
from tests.engine_helpers import GREEDY, random_prompts

pytestmark = pytest.mark.unit

VOCAB = 512
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_round_trip_error_is_at_most_half_an_fp8_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g) * torch.logspace(-4, 1, 96)[:, None]  # rows of very different ranges
    w[3] = 0.0
    q = quantize_fp8(w)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32 and q.scale.shape == (96,)
    back = dequantize_fp8(q)
    # e4m3: 3 mantissa bits, so half a step is 2^-4 of the value; below 2^-6 (subnormals) it is 2^-10 absolute.
    bound = torch.maximum(w.abs() * 2**-4, q.scale[:, None] * 2**-10)
    assert torch.all((back - w).abs() <= bound * (1 + 1e-6))
    assert torch.all(back[3] == 0)
    rows = torch.arange(96) != 3
    assert torch.all(q.qweight.float().abs().amax(dim=1)[rows] == FP8_MAX)  # each row's largest value is 448
    assert not q.qweight.float().isnan().any()


def test_fused_quantization_equals_per_projection():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 48, generator=g), torch.randn(16, 48, generator=g) * 5
    fused, qa, qb = quantize_fp8(torch.cat([a, b])), quantize_fp8(a), quantize_fp8(b)
    assert torch.equal(fused.qweight.view(torch.uint8), torch.cat([qa.qweight, qb.qweight]).view(torch.uint8))
    assert torch.equal(fused.scale, torch.cat([qa.scale, qb.scale]))


def test_unaligned_projections_are_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_fp8(torch.randn(24, 40))


def test_activation_scales_are_per_token():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 3e3, -7.0]])
    xq, a = quantize_activations(x)  # [3, 3], [3, 1]
    assert a.shape == (3, 1) and a[1, 0] == 1.0 and torch.all(xq[1].float() == 0)
    assert torch.equal(xq.float().abs().amax(dim=1)[[0, 2]], torch.tensor([FP8_MAX, FP8_MAX]))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_equals_its_float32_semantics(dtype, tol, bias):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g)
    x = (torch.randn(11, 96, generator=g) * torch.logspace(-2, 2, 11)[:, None]).to(dtype)  # [T, in]
    b = torch.randn(64, generator=g).to(dtype) if bias else None
    q = quantize_fp8(w)
    ref = fp8_linear_ref(x, q, b)  # [T, out] float32
    y = scaled_mm_linear(x, q, b)
    assert y.dtype == dtype and y.shape == (11, 64)
    assert ((y.float() - ref).abs() <= tol * ref.abs().amax(dim=1, keepdim=True)).all()
    out = torch.empty(11, 64, dtype=dtype)
    assert scaled_mm_linear(x, q, b, out=out) is out and torch.equal(out, y)
    # And w8a8 stays near the float product: each row within 10% of its largest entry.
    exact = x.float() @ w.t() + (0 if b is None else b.float())
    assert ((y.float() - exact).abs() <= 0.1 * exact.abs().amax(dim=1, keepdim=True)).all()


# ---- refusals ----

def test_fp8_is_refused_off_ada_and_hopper(tiny_model_dir):
    config = EngineConfig.of(model=str(tiny_model_dir), quantization="fp8")
    with pytest.raises(ValueError, match=r"needs an NVIDIA GPU of compute capability >= 8.9.*not cpu.*int8"):
        config.quantization.check_device(torch.device("cpu"))
    gpu = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="cuda:0 has 8.0"):
        config.quantization.check_device(gpu, torch.bfloat16, capability=(8, 0))
    with pytest.raises(ValueError, match="pass --dtype bfloat16"):
        config.quantization.check_device(gpu, torch.float16, capability=(9, 0))
    config.quantization.check_device(gpu, torch.bfloat16, capability=(9, 0))
    config.quantization.check_device(gpu, torch.bfloat16, capability=(8, 9))


def test_an_fp8_engine_on_the_cpu_fails_at_start_with_the_reason(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization 'fp8' needs an NVIDIA GPU"):
        LLM(tiny_model_dir, device="cpu", kv_cache_blocks=16, max_model_len=64, quantization="fp8")


def test_unknown_quantizations_name_what_is_supported(tiny_model_dir):
    with pytest.raises(ValueError, match="supported: int8, int4, fp8 or none"):
        EngineConfig.of(model=str(tiny_model_dir), quantization="nf4")


# ---- the model path, refusal lifted on the CPU ----

@pytest.fixture()
def fp8_llm(tiny_model_dir, tiny_adapters, monkeypatch):
    monkeypatch.setattr(QuantizationConfig, "check_device", lambda self, *a, **k: None)
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=128, max_model_len=256,
              quantization="fp8")
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    return llm


def w8a8_logprobs(model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers (+ peft) float32 logits with every decoder projection's base product
    replaced by fp8_linear_ref on its quantize_fp8 weight: [len(ids), V]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in PROJECTIONS:
            q, bias = quantize_fp8(module.weight.data), module.bias

            def forward(x, q=q, bias=bias):  # x [..., in]
                return fp8_linear_ref(x.reshape(-1, x.shape[-1]), q, bias).view(*x.shape[:-1], -1)
            module.forward = forward
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)  # wraps each Linear: base_layer keeps its forward
    with torch.inference_mode():
        return torch.log_softmax(model.eval()(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def test_mixed_adapters_match_peft_on_the_same_w8a8_projections(fp8_llm, tiny_model_dir, tiny_adapters):
    layer = fp8_llm.engine.model.layers[0]
    assert all(isinstance(m.weight, Fp8Weight) for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    names = [None, "r8_all", "r16_rslora", "r4_qv"]
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=3)
    outs = fp8_llm.generate(prompts, SamplingParams(max_tokens=6, logprobs=0, **GREEDY), adapters=names)
    gap = 0.0
    for prompt, name, out in zip(prompts, names, outs):
        ref = w8a8_logprobs(tiny_model_dir, tiny_adapters[name] if name else None, prompt + out.token_ids[:-1])
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + i]  # [V]
            gap = max(gap, abs(entry.logprob - float(row[token])))
            assert float(row.max() - row[token]) <= 1e-4, f"{name}: token {i} is not the oracle's argmax"
    print(f"fp8 engine vs w8a8 peft: max |logprob diff| = {gap:.3g}")
    assert gap <= 1e-4  # float32 activations: rounding order only (measured 1.7e-6)
