// The int8 weight-only base projection for float32 activations on AVX2 + FMA CPUs
// (kernels/int8_avx2.py builds and loads it; the semantics and shapes are documented there).
//
// Why not torch's own: aten._weight_int8pack_mm is vectorized for AVX-512 only and inductor's
// int8 WOQ GEMM template has AVX2 configurations for bfloat16 activations only; dequantizing
// the whole weight per call moves more bytes than the float32 matmul it replaces. Here each
// int8 weight row is widened to float in registers and multiplied with up to 8 token rows
// (8 accumulators, one per token, so one widening serves 8 FMAs): 1 byte of weight traffic
// per weight instead of 4, and the FMAs a float32 GEMM would do.
#include <immintrin.h>
#include <stdint.h>

namespace {

inline __m256 load_w8(const int8_t* p) {  // 8 int8 weights -> 8 floats, exactly
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One output column o for NT token rows: y[t, o] = (sum_k x[t, k] * q[o, k]) * s + b.
template <int NT>
inline void row_tile(const float* x, int64_t ldx, const int8_t* wr, int64_t K, float s, float b,
                     float* y, int64_t ldy) {
  // Independent FMA chains per token: an FMA's latency is 4-5 cycles, so few tokens unroll k.
  constexpr int U = NT <= 2 ? 4 : (NT <= 4 ? 2 : 1);
  __m256 acc[U][NT];
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < NT; ++t) acc[u][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      const __m256 w = load_w8(wr + k + 8 * u);
      for (int t = 0; t < NT; ++t)
        acc[u][t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * ldx + k + 8 * u), acc[u][t]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 w = load_w8(wr + k);
    for (int t = 0; t < NT; ++t) acc[0][t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * ldx + k), acc[0][t]);
  }
  for (int t = 0; t < NT; ++t) {
    for (int u = 1; u < U; ++u) acc[0][t] = _mm256_add_ps(acc[0][t], acc[u][t]);
    float sum = hsum(acc[0][t]);
    for (int64_t j = k; j < K; ++j) sum += x[t * ldx + j] * static_cast<float>(wr[j]);  // K % 8 tail
    y[t * ldy] = sum * s + b;
  }
}

template <int NT>
void rows(const float* x, int64_t ldx, const int8_t* w, const float* scale, const float* bias, float* y,
          int64_t ldy, int64_t K, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) row_tile<NT>(x, ldx, w + o * K, K, scale[o], bias ? bias[o] : 0.0f, y + o, ldy);
}

using RowsFn = void (*)(const float*, int64_t, const int8_t*, const float*, const float*, float*, int64_t, int64_t,
                        int64_t, int64_t);
constexpr RowsFn ROWS[9] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};
// Output rows per block: their int8 weights (32 x K bytes) stay in L1/L2 while every group of 8
// token rows passes over them, so a prefill reads the weight from memory once, not once per group.
constexpr int64_t ROW_BLOCK = 32;

}  // namespace

// y[T, O] (row stride ldy) = x[T, K] (row stride ldx) @ q[O, K]^T * scale[O] + bias[O] (bias may be null).
// Row blocks are shared out over `threads` OpenMP threads (torch's intra-op count, passed per call:
// OpenMP's own count is per calling thread and the engine steps on a thread of its own).
extern "C" void loraplex_int8_linear_f32(const float* x, int64_t ldx, const int8_t* q, const float* scale,
                                         const float* bias, float* y, int64_t ldy, int64_t T, int64_t O, int64_t K,
                                         int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t ob = 0; ob < O; ob += ROW_BLOCK) {
    const int64_t oe = ob + ROW_BLOCK < O ? ob + ROW_BLOCK : O;
    for (int64_t t = 0; t < T; t += 8) {
      const int64_t nt = T - t < 8 ? T - t : 8;
      ROWS[nt](x + t * ldx, ldx, q, scale, bias, y + t * ldy, ldy, K, ob, oe);
    }
  }
}
