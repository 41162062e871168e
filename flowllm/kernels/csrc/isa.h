/* The vector layer of the kernels built for more than one ISA (quant.c): `vf` is a vector
 * of VL float32 lanes and the operations below are all those kernels use, so one source
 * compiles for AVX-512 (16 lanes) and for AVX2 + FMA + F16C (8 lanes). The build's target
 * flags choose (flowllm/kernels/native.py). */
#ifndef FLOWLLM_ISA_H
#define FLOWLLM_ISA_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm512_set1_ps(v); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
/* VL signed bytes as floats. */
static inline vf vf_from_i8(const int8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* VL bytes of nibble pairs: their low nibbles (*lo) and high nibbles (*hi) as floats. */
static inline void vf_from_nibbles(const uint8_t *p, vf *lo, vf *hi) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm256_set1_ps(v); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf_sum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline vf vf_from_i8(const int8_t *p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void vf_from_nibbles(const uint8_t *p, vf *lo, vf *hi) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
  *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#else
#error "isa.h needs AVX-512F or AVX2 with FMA"
#endif

/* One IEEE half (F16C, which every AVX2 CPU with FMA has) as float32. */
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

#endif
