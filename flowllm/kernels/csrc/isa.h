/* The vector layer every kernel is written over: `vf` is a vector of VL float32 lanes, `vi`
 * one of VL int32 lanes (4 VL bytes), `vm` a choice of lanes (a comparison's result), and
 * the operations below are all the kernels use, so one source compiles for AVX-512 (16
 * lanes) and for AVX2 + FMA + F16C (8 lanes). The build's target flags choose
 * (flowllm/kernels/native.py). Each operation computes the same values on both: only the
 * number of lanes, and so the order in which a kernel adds across them, differs. */
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
/* VL integral floats in [-128, 127] stored as int8. */
static inline void vf_store_i8(int8_t *p, vf v) {
  _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
/* min and max answer b where either lane is NaN. */
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
/* c - a b, rounded once. */
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
/* To the nearest integer, ties to even. */
static inline vf vf_round(vf v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* v 2^n for integral n in [-252, 252], rounded once (to a subnormal or infinity past
 * float32's exponents). */
static inline vf vf_scale_pow2(vf v, vf n) { return _mm512_scalef_ps(v, n); }
/* Lane t of the result: the sum of v[t]'s lanes. */
static inline vf vf_transpose_sums(const vf v[VL]) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; i++) /* 256-bit halves: v[2i] in 128-bit lanes 0-1, v[2i+1] in 2-3 */
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++) /* 128-bit lane l: row 4i + l */
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++) /* lane l: rows 8i + l and 8i + 4 + l, two floats each */
    z[i] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * i], y[2 * i + 1]),
                         _mm512_unpackhi_ps(y[2 * i], y[2 * i + 1]));
  __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]));
  __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]));
  /* float 4l + i of w holds row l + 4i */
  __m512 w = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, w);
}

/* Lane choices. */
typedef __mmask16 vm;
/* The first min(n, VL) lanes (none for n <= 0). */
static inline vm vm_first(int64_t n) {
  return n >= VL ? (vm)0xFFFF : n <= 0 ? (vm)0 : (vm)((1u << n) - 1);
}
static inline vm vf_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
static inline vm vf_eq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline vm vf_isnan(vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
static inline vm vm_and(vm a, vm b) { return (vm)(a & b); }
static inline vm vm_or(vm a, vm b) { return (vm)(a | b); }
/* Bit i set where lane i is chosen. */
static inline unsigned vm_bits(vm m) { return m; }
/* b in the lanes of m, a in the others. */
static inline vf vf_select(vm m, vf a, vf b) { return _mm512_mask_mov_ps(a, m, b); }
/* The first n lanes from p, 0 in the others; the first n lanes to p. */
static inline vf vf_load_n(const float *p, int64_t n) {
  return _mm512_maskz_loadu_ps(vm_first(n), p);
}
static inline void vf_store_n(float *p, int64_t n, vf v) {
  _mm512_mask_storeu_ps(p, vm_first(n), v);
}

/* bfloat16: VL values widened (exactly), float32 lanes rounded to bf16 (to nearest even, a
 * NaN kept a quiet NaN) and kept as float32 (low 16 bits zero), or rounded and stored. */
static inline vf vf_load_bf16(const uint16_t *p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline vf vf_round_bf16(vf v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
  r = _mm512_mask_or_epi32(r, vf_isnan(v), u, _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(r);
}
static inline void vf_store_bf16(uint16_t *p, vf v) {
  __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(vf_round_bf16(v)), 16);
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(hi));
}
static inline vf vf_load_bf16_n(const uint16_t *p, int64_t n) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(vm_first(n), p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline void vf_store_bf16_n(uint16_t *p, int64_t n, vf v) {
  __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(vf_round_bf16(v)), 16);
  _mm256_mask_storeu_epi16(p, vm_first(n), _mm512_cvtepi32_epi16(hi));
}
/* 2 VL bf16 values read by one load: the even-numbered ones as floats (widened by a shift),
 * or the odd-numbered ones (by a mask); stored: v rounded into the even- or odd-numbered
 * slots, the others left as they are. */
static inline vf vf_bf16_even(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
static inline vf vf_bf16_odd(const uint16_t *p) {
  const __m512i pair = _mm512_loadu_si512(p);
  return _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000)));
}
static inline void vf_store_bf16_even(uint16_t *p, vf v) {
  const __m512i r = _mm512_castps_si512(vf_round_bf16(v));
  _mm512_mask_storeu_epi16(p, 0x55555555, _mm512_srli_epi32(r, 16));
}
static inline void vf_store_bf16_odd(uint16_t *p, vf v) {
  _mm512_mask_storeu_epi16(p, 0xAAAAAAAA, _mm512_castps_si512(vf_round_bf16(v)));
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

/* Integer vectors of 4 VL bytes (VL int32 lanes, or 2 VL int16 ones). */
typedef __m512i vi;
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vf vf_from_vi(vi v) { return _mm512_cvtepi32_ps(v); }
/* Bytes: each byte's low nibble, or (high) its high one; |w| (as unsigned); s with w's
 * sign (negated where w < 0). */
static inline vi vi_nibbles_of(vi v, int high) {
  return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(15));
}
static inline vi vi_abs8(vi w) { return _mm512_abs_epi8(w); }
static inline vi vi_sign8(vi s, vi w) {
  return _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(w), _mm512_setzero_si512(), s);
}
/* int16 lanes: each pair of unsigned u times signed s bytes, summed (saturating); int16
 * lanes added; pairs of int16 lanes summed into int32 ones. */
static inline vi vi_dot_pairs(vi u, vi s) { return _mm512_maddubs_epi16(u, s); }
static inline vi vi_add16(vi a, vi b) { return _mm512_add_epi16(a, b); }
static inline vi vi_sum_pairs(vi v) { return _mm512_madd_epi16(v, _mm512_set1_epi16(1)); }
/* Integer lanes: 0, 1, ..., VL - 1; v in every lane; sums; b in the lanes of m; stored. */
static inline vi vi_iota(void) {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline vi vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_select(vm m, vi a, vi b) { return _mm512_mask_mov_epi32(a, m, b); }
static inline vm vi_lt(vi a, vi b) { return _mm512_cmplt_epi32_mask(a, b); }
static inline void vi_store(int32_t *p, vi v) { _mm512_storeu_si512(p, v); }
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
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
/* Two exact powers of two, 2^a and 2^(n - a) with a = n / 2 both normal floats: v 2^a is
 * exact (|v| near 1), so only the second product rounds, as scalef's one rounding. */
static inline vf vf_scale_pow2(vf v, vf n) {
  const __m256i ni = _mm256_cvtps_epi32(n), a = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const vf pa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23));
  const vf pb =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, a), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(v, pa), pb);
}
static inline vf vf_transpose_sums(const vf v[VL]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  /* u0: rows 0-3 of the low 128-bit halves, then of the high ones; u1: rows 4-7 */
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

typedef __m256 vm; /* all ones in a chosen lane */
static inline vm vm_first(int64_t n) {
  const int32_t count = n >= VL ? VL : n <= 0 ? 0 : (int32_t)n;
  const __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), at));
}
static inline vm vf_gt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
static inline vm vf_eq(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
static inline vm vf_isnan(vf v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }
static inline vm vm_and(vm a, vm b) { return _mm256_and_ps(a, b); }
static inline vm vm_or(vm a, vm b) { return _mm256_or_ps(a, b); }
static inline unsigned vm_bits(vm m) { return (unsigned)_mm256_movemask_ps(m); }
static inline vf vf_select(vm m, vf a, vf b) { return _mm256_blendv_ps(a, b, m); }
static inline vf vf_load_n(const float *p, int64_t n) {
  return _mm256_maskload_ps(p, _mm256_castps_si256(vm_first(n)));
}
static inline void vf_store_n(float *p, int64_t n, vf v) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(vm_first(n)), v);
}

static inline vf vf_load_bf16(const uint16_t *p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline vf vf_round_bf16(vf v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, quiet, _mm256_castps_si256(vf_isnan(v))));
}
static inline void vf_store_bf16(uint16_t *p, vf v) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(vf_round_bf16(v)), 16);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128((__m128i *)p, h);
}
static inline vf vf_load_bf16_n(const uint16_t *p, int64_t n) {
  uint16_t t[VL] = {0};
  memcpy(t, p, (size_t)(n >= VL ? VL : n <= 0 ? 0 : n) * sizeof *t);
  return vf_load_bf16(t);
}
static inline void vf_store_bf16_n(uint16_t *p, int64_t n, vf v) {
  uint16_t t[VL];
  vf_store_bf16(t, v);
  memcpy(p, t, (size_t)(n >= VL ? VL : n <= 0 ? 0 : n) * sizeof *t);
}
/* The stores rewrite the other slots with what they held: the caller owns all 2 VL. */
static inline vf vf_bf16_even(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)p), 16));
}
static inline vf vf_bf16_odd(const uint16_t *p) {
  const __m256i pair = _mm256_loadu_si256((const __m256i *)p);
  return _mm256_castsi256_ps(_mm256_and_si256(pair, _mm256_set1_epi32((int)0xFFFF0000)));
}
static inline void vf_store_bf16_even(uint16_t *p, vf v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(vf_round_bf16(v)), 16);
  const __m256i old = _mm256_loadu_si256((const __m256i *)p);
  _mm256_storeu_si256((__m256i *)p, _mm256_blend_epi16(old, r, 0x55));
}
static inline void vf_store_bf16_odd(uint16_t *p, vf v) {
  const __m256i r = _mm256_castps_si256(vf_round_bf16(v));
  const __m256i old = _mm256_loadu_si256((const __m256i *)p);
  _mm256_storeu_si256((__m256i *)p, _mm256_blend_epi16(old, r, 0xAA));
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
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vf vf_from_vi(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi vi_nibbles_of(vi v, int high) {
  return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
}
static inline vi vi_abs8(vi w) { return _mm256_abs_epi8(w); }
static inline vi vi_sign8(vi s, vi w) { return _mm256_sign_epi8(s, w); }
static inline vi vi_dot_pairs(vi u, vi s) { return _mm256_maddubs_epi16(u, s); }
static inline vi vi_add16(vi a, vi b) { return _mm256_add_epi16(a, b); }
static inline vi vi_sum_pairs(vi v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }
static inline vi vi_iota(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
static inline vi vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_select(vm m, vi a, vi b) {
  return _mm256_blendv_epi8(a, b, _mm256_castps_si256(m));
}
static inline vm vi_lt(vi a, vi b) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(b, a)); }
static inline void vi_store(int32_t *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
#else
#error "isa.h needs AVX-512F or AVX2 with FMA"
#endif

/* One IEEE half (F16C, which every AVX2 CPU with FMA has) as float32. */
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

#endif
