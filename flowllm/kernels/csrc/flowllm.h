/* Shared inline helpers of the native kernels: bfloat16 <-> float32 conversions (round to
 * nearest even, NaN kept quiet) and a vectorized exp for activations. AVX-512F only. */
#ifndef FLOWLLM_H
#define FLOWLLM_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* 16 bf16 values widened to float32. */
static inline __m512 bf16x16_load(const uint16_t *p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* float32 values rounded to the nearest bf16 (still as float32, low 16 bits zero). */
static inline __m512 bf16x16_round(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(r);
}

/* Round 16 float32 values to bf16 and store them. */
static inline void bf16x16_store(uint16_t *p, __m512 v) {
  __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(bf16x16_round(v)), 16);
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(hi));
}

/* The mask of the first min(left, 16) lanes. */
static inline __mmask16 lanes16(int64_t left) {
  return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* The first lanes of m, as bf16x16_load (the others 0). */
static inline __m512 bf16x16_maskz_load(__mmask16 m, const uint16_t *p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Round and store the lanes of m, as bf16x16_store. */
static inline void bf16x16_mask_store(uint16_t *p, __mmask16 m, __m512 v) {
  __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(bf16x16_round(v)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(hi));
}

/* exp(x) to ~1 ulp (Cephes' polynomial on x - n ln2, scaled by 2^n); 0 and inf past the
 * ends of float32's range, as expf (the clamp only keeps infinities out of the reduction). */
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

/* silu(x) = x / (1 + exp(-x)). */
static inline __m512 silu16(__m512 x) {
  __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* Run body(i) for i in [0, n): on torch's OpenMP pool when n reaches `parallel_from`,
 * serially otherwise (entering a parallel region costs ~1 us even when it runs alone). */
// clang-format off: it would put the _Pragma and the loop on one line
#define FOR_ROWS(i, n, parallel_from, body)                  \
  do {                                                       \
    if ((n) >= (parallel_from)) {                            \
      _Pragma("omp parallel for schedule(static)")           \
      for (int64_t i = 0; i < (n); i++) { body; }            \
    } else {                                                 \
      for (int64_t i = 0; i < (n); i++) { body; }            \
    }                                                        \
  } while (0)
// clang-format on

#endif
