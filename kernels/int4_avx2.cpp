// The int4 weight-only base projection for float32 activations on AVX2 + FMA CPUs
// (kernels/int4_avx2.py builds and loads it; the semantics and shapes are documented there).
//
// Why not torch's own: aten._weight_int4pack_mm_for_cpu is vectorized for half-precision
// activations; with float32 ones it took 44 ms for an 8-row smol135 gate_up against 1.1 ms for the
// float32 matmul on an AVX2 EPYC.
//
// The arithmetic per group g of a row: sum_k x[k] (s q[k] + m) = sum_k x[k] (s q[k]) + m sum_k x[k],
// so the inner loop is int8_avx2's (widen, convert, scale, FMA) and the offset is applied once per
// group from the sum of x over the group, which the caller computes once per call. 8 packed bytes widen to 16
// weights: their low nibbles are the even input channels, their high ones the odd, so the caller hands
// x with each block of 16 channels reordered evens first (xe) and both halves load contiguously.
// Half a byte of weight traffic per weight instead of 4.
#include <immintrin.h>
#include <stdint.h>

#include <vector>

namespace {

inline void load_w16(const uint8_t* p, __m256& lo, __m256& hi) {  // 8 bytes -> even, odd channels' q
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One output column o for NT token rows: y[t, o] = sum_g (sum_{k in g} xe[t, k] s[g] q[o, k] + m[g] xsum[t, g]) + b.
template <int NT>
inline void row_tile(const float* xe, int64_t ldx, const float* xsum, int64_t G, const uint8_t* wr, const float* sr,
                     const float* mr, int64_t K, int64_t gs, float b, float* y, int64_t ldy) {
  // Independent FMA chains per token (an FMA's latency is 4-5 cycles): few tokens unroll two blocks of 16
  // and keep their even and odd halves apart; 8 tokens are 8 chains already, and more accumulators
  // than 8 ymm registers would spill.
  constexpr int U = NT <= 2 ? 2 : 1;  // blocks of 16 channels per iteration
  constexpr int C = NT <= 4 ? 2 * U : 1;  // accumulators per token
  __m256 acc[C][NT];
  float mterm[NT];
  for (int t = 0; t < NT; ++t) {
    mterm[t] = 0.0f;
    for (int c = 0; c < C; ++c) acc[c][t] = _mm256_setzero_ps();
  }
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += gs, ++gi) {
    const int64_t g1 = g0 + gs < K ? g0 + gs : K;  // group sizes are multiples of 32 and K of 16
    const __m256 s = _mm256_set1_ps(sr[gi]);
    int64_t k = g0;
    for (; k + 16 * U <= g1; k += 16 * U) {
      for (int u = 0; u < U; ++u) {
        __m256 lo, hi;
        load_w16(wr + (k + 16 * u) / 2, lo, hi);
        lo = _mm256_mul_ps(lo, s);
        hi = _mm256_mul_ps(hi, s);
        for (int t = 0; t < NT; ++t) {
          const float* xt = xe + t * ldx + k + 16 * u;
          acc[(2 * u) % C][t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xt), acc[(2 * u) % C][t]);
          acc[(2 * u + 1) % C][t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xt + 8), acc[(2 * u + 1) % C][t]);
        }
      }
    }
    for (; k < g1; k += 16) {
      __m256 lo, hi;
      load_w16(wr + k / 2, lo, hi);
      lo = _mm256_mul_ps(lo, s);
      hi = _mm256_mul_ps(hi, s);
      for (int t = 0; t < NT; ++t) {
        acc[0][t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xe + t * ldx + k), acc[0][t]);
        acc[C - 1][t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xe + t * ldx + k + 8), acc[C - 1][t]);
      }
    }
    for (int t = 0; t < NT; ++t) mterm[t] += mr[gi] * xsum[t * G + gi];
  }
  for (int t = 0; t < NT; ++t) {
    for (int c = 1; c < C; ++c) acc[0][t] = _mm256_add_ps(acc[0][t], acc[c][t]);
    y[t * ldy] = hsum(acc[0][t]) + mterm[t] + b;
  }
}

template <int NT>
void rows(const float* xe, int64_t ldx, const float* xsum, const uint8_t* w, const float* scale, const float* offset,
          const float* bias, float* y, int64_t ldy, int64_t K, int64_t gs, int64_t G, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o)
    row_tile<NT>(xe, ldx, xsum, G, w + o * (K / 2), scale + o * G, offset + o * G, K, gs, bias ? bias[o] : 0.0f, y + o,
                 ldy);
}

using RowsFn = void (*)(const float*, int64_t, const float*, const uint8_t*, const float*, const float*,
                        const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
constexpr RowsFn ROWS[9] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};
// Output rows per block: their packed weights (32 x K / 2 bytes) stay in L1/L2 while every group of 8
// token rows passes over them, so a prefill reads the weight from memory once, not once per group.
constexpr int64_t ROW_BLOCK = 32;

}  // namespace

// y[T, O] (row stride ldy) = x[T, K] (row stride ldx) @ w[O, K]^T + bias[O] (bias may be null), with
// w[o, k] = scale[o, k / gs] * q[o, k] + offset[o, k / gs]; q packed two per byte [O, K / 2], scale and
// offset [O, G]. K % 16 == 0, gs % 32 == 0. First, once per call (a few KB at decode sizes): xe, x with
// every block of 16 channels reordered evens first, and xsum [T, G], x's sum over each group. Then row
// blocks are shared out over `threads` OpenMP threads (torch's intra-op count).
extern "C" void loraplex_int4_linear_f32(const float* x, int64_t ldx, const uint8_t* q, const float* scale,
                                         const float* offset, const float* bias, float* y, int64_t ldy, int64_t T,
                                         int64_t O, int64_t K, int64_t gs, int64_t G, int threads) {
  std::vector<float> xe_buf(T * K), xsum_buf(T * G, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * ldx;
    float* et = xe_buf.data() + t * K;
    for (int64_t k = 0; k < K; k += 16)
      for (int j = 0; j < 8; ++j) {
        et[k + j] = xt[k + 2 * j];
        et[k + 8 + j] = xt[k + 2 * j + 1];
      }
    for (int64_t k = 0; k < K; ++k) xsum_buf[t * G + k / gs] += xt[k];
  }
  const float* xe = xe_buf.data();
  const float* xsum = xsum_buf.data();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t ob = 0; ob < O; ob += ROW_BLOCK) {
    const int64_t oe = ob + ROW_BLOCK < O ? ob + ROW_BLOCK : O;
    for (int64_t t = 0; t < T; t += 8) {
      const int64_t nt = T - t < 8 ? T - t : 8;
      ROWS[nt](xe + t * K, K, xsum + t * G, q, scale, offset, bias, y + t * ldy, ldy, K, gs, G, ob, oe);
    }
  }
}

// w[O, K] (float32, row-major, channels in their natural order) = scale * q + offset: the weight for a
// float32 GEMM where many token rows share it (a prefill), so each weight is unpacked once per call
// instead of once per 8 token rows. Rows are shared out over `threads` OpenMP threads.
extern "C" void loraplex_int4_dequant_f32(const uint8_t* q, const float* scale, const float* offset, float* w,
                                          int64_t O, int64_t K, int64_t gs, int64_t G, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t o = 0; o < O; ++o) {
    const uint8_t* qr = q + o * (K / 2);
    float* wr = w + o * K;
    for (int64_t k = 0; k < K; k += 16) {  // K % 16 == 0; a block of 16 never straddles a group
      const int64_t g = o * G + k / gs;
      const __m256 s = _mm256_set1_ps(scale[g]);
      const __m256 m = _mm256_set1_ps(offset[g]);
      __m256 even, odd;  // channels k, k + 2, ..., k + 14 and k + 1, ..., k + 15
      load_w16(qr + k / 2, even, odd);
      const __m256 a = _mm256_unpacklo_ps(even, odd);  // k+0..3 | k+8..11
      const __m256 b = _mm256_unpackhi_ps(even, odd);  // k+4..7 | k+12..15
      _mm256_storeu_ps(wr + k, _mm256_add_ps(_mm256_mul_ps(_mm256_permute2f128_ps(a, b, 0x20), s), m));
      _mm256_storeu_ps(wr + k + 8, _mm256_add_ps(_mm256_mul_ps(_mm256_permute2f128_ps(a, b, 0x31), s), m));
    }
  }
}
