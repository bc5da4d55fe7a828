"""benchmarks/profile/kernel_classes.py: kernel names into classes, per-step tables."""
from __future__ import annotations

import pytest

from benchmarks.profile.kernel_classes import (ATTENTION, CLASSES, ELEMENTWISE, GEMM, LORA_EXPAND, LORA_SHRINK, OTHER,
                                               class_table, kernel_class, kernel_report, kernel_table)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name, cls", [
    ("_bgmv_shrink_kernel", LORA_SHRINK),
    ("_sgmv_shrink_kernel", LORA_SHRINK),
    ("_bgmv_expand_kernel", LORA_EXPAND),
    ("_sgmv_expand_kernel", LORA_EXPAND),
    ("_decode_kernel", ATTENTION),
    ("_combine_splits_kernel", ATTENTION),
    ("_write_kv_kernel", ATTENTION),
    ("_paged_attention_kernel", ATTENTION),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", GEMM),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", GEMM),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", GEMM),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)", GEMM),
    ("_int8_linear_kernel", GEMM),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>(...)",
     ELEMENTWISE),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>(...)",
     ELEMENTWISE),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(...)", ELEMENTWISE),
    ("void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>(...)", ELEMENTWISE),
    ("Memcpy HtoD (Pinned -> Device)", OTHER),
    ("Memset (Device)", OTHER),
])
def test_kernel_class(name, cls):
    assert kernel_class(name) == cls


KERNELS = [("_bgmv_shrink_kernel", 20.0), ("_bgmv_shrink_kernel", 22.0), ("nvjet_a", 100.0), ("nvjet_b", 50.0),
           ("_decode_kernel", 30.0), ("Memset (Device)", 1.0)] * 2  # 2 steps


def test_kernel_table_ranks_by_device_time_per_step():
    rows = kernel_table(KERNELS, steps=2, top=3)
    assert [(r.name, r.kernel_class, r.count_per_step, r.us_per_step) for r in rows] == [
        ("nvjet_a", GEMM, 1.0, 100.0), ("nvjet_b", GEMM, 1.0, 50.0), ("_bgmv_shrink_kernel", LORA_SHRINK, 2.0, 42.0)]


def test_class_table_lists_every_class_in_order():
    rows = class_table(KERNELS, steps=2)
    assert [r.kernel_class for r in rows] == list(CLASSES)
    by = {r.kernel_class: (r.count_per_step, r.us_per_step) for r in rows}
    assert by == {LORA_SHRINK: (2.0, 42.0), LORA_EXPAND: (0.0, 0.0), ATTENTION: (1.0, 30.0), GEMM: (2.0, 150.0),
                  ELEMENTWISE: (0.0, 0.0), OTHER: (1.0, 1.0)}


def test_kernel_report_is_json_ready():
    report = kernel_report(KERNELS, steps=2, top=15)
    assert report["device_us_per_step"] == pytest.approx(223.0)
    assert len(report["kernels"]) == 5 and report["kernels"][0]["name"] == "nvjet_a"
    assert sum(c["us_per_step"] for c in report["classes"]) == pytest.approx(223.0)
    assert kernel_report([], steps=3)["device_us_per_step"] == 0.0  # nothing seen (graph kernels hidden)
