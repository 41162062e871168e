/* The vector layer of the kernels built for more than one ISA (quant.c): `vf` is a vector
 * of VL float32 lanes, `vi` one of VL int32 lanes (4 VL bytes), and the operations below
 * are all those kernels use, so one source compiles for AVX-512 (16 lanes) and for
 * AVX2 + FMA + F16C (8 lanes). The build's target
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
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_max_of(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vf_abs(vf v) { return _mm512_abs_ps(v); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
/* Rounded to the nearest integer, ties to even (as nearbyintf in the default mode). */
static inline vf vf_round(vf v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* VL integral floats in [-128, 127] stored as int8. */
static inline void vf_store_i8(int8_t *p, vf v) {
  _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}
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
/* VL float16 values as floats. */
static inline vf vf_load_f16(const uint16_t *p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* Integer vectors of 4 VL bytes (VL int32 lanes): 2 blocks of 32 codes. */
typedef __m512i vi;
#define PAIR_VECS 1 /* vectors per 64 codes */
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
/* 32 bytes of nibble pairs (byte j: code j | code j + 32 << 4) -> the 64 codes in order. */
static inline void vi_nibbles(const uint8_t *p, vi out[PAIR_VECS]) {
  const __m256i b = _mm256_loadu_si256((const __m256i *)p), m = _mm256_set1_epi8(15);
  out[0] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, m)),
                              _mm256_and_si256(_mm256_srli_epi16(b, 4), m), 1);
}
/* Each int32 lane: the sum of its 4 products of unsigned u and signed s bytes (no lane
 * of pairs saturates: |u| < 129 and |s| < 128). */
static inline vi vi_dot_u8s8(vi u, vi s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
/* The same for signed w: |w| times s with w's sign. */
static inline vi vi_dot_s8s8(vi w, vi s) {
  const __mmask64 neg = _mm512_movepi8_mask(w);
  const vi signed_s = _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s);
  return vi_dot_u8s8(_mm512_abs_epi8(w), signed_s);
}
static inline vf vf_from_vi(vi v) { return _mm512_cvtepi32_ps(v); }
/* Lane scales of the VL / 8 blocks of 32 values a vi covers: p[0] x 8, p[1] x 8. */
static inline vf vf_block_scales(const float *p) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(p[0])), _mm256_set1_ps(p[1]), 1);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm256_set1_ps(v); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
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
static inline float vf_max_of(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
static inline vf vf_abs(vf v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_round(vf v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline void vf_store_i8(int8_t *p, vf v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}

static inline void vf_from_nibbles(const uint8_t *p, vf *lo, vf *hi) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
  *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
static inline vf vf_load_f16(const uint16_t *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

typedef __m256i vi;
#define PAIR_VECS 2
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_nibbles(const uint8_t *p, vi out[PAIR_VECS]) {
  const __m256i b = _mm256_loadu_si256((const __m256i *)p), m = _mm256_set1_epi8(15);
  out[0] = _mm256_and_si256(b, m);
  out[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}
static inline vi vi_dot_u8s8(vi u, vi s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
static inline vi vi_dot_s8s8(vi w, vi s) {
  return vi_dot_u8s8(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
}
static inline vf vf_from_vi(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vf vf_block_scales(const float *p) { return _mm256_set1_ps(p[0]); }
#else
#error "isa.h needs AVX-512F or AVX2 with FMA"
#endif

/* One IEEE half (F16C, which every AVX2 CPU with FMA has) as float32. */
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

#endif
