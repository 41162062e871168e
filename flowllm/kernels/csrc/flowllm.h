/* Shared inline helpers of the native kernels: bfloat16 <-> float32 conversions (round to
 * nearest even, NaN kept quiet), a vectorized exp and tanh for activations over the vector layer
 * (isa.h), and the loop that splits rows across threads. */
#ifndef FLOWLLM_H
#define FLOWLLM_H

#include <stdint.h>
#include <string.h>

#include "isa.h"

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

/* exp(x) to ~1 ulp (Cephes' polynomial on x - n ln2, scaled by 2^n); 0 and inf past the
 * ends of float32's range, as expf (the clamp only keeps infinities out of the reduction). */
static inline vf vf_exp(vf x) {
  x = vf_min(vf_max(x, vf_set1(-104.0f)), vf_set1(89.0f));
  const vf n = vf_round(vf_mul(x, vf_set1(1.44269504f)));
  vf r = vf_fnma(n, vf_set1(0.693359375f), x);
  r = vf_fnma(n, vf_set1(-2.12194440e-4f), r);
  vf p = vf_set1(1.9875691500e-4f);
  p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
  p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
  p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
  p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
  p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
  p = vf_fma(vf_mul(p, r), r, vf_add(r, vf_set1(1.0f)));
  return vf_scale_pow2(p, n);
}

/* tanh(x) = 1 - 2 / (exp(2x) + 1): vf_exp saturates to 0 and inf, so it reaches -1 and 1. */
static inline vf vf_tanh(vf x) {
  const vf e = vf_exp(vf_add(x, x));
  return vf_sub(vf_set1(1.0f), vf_div(vf_set1(2.0f), vf_add(e, vf_set1(1.0f))));
}

/* silu(x) = x / (1 + exp(-x)). */
static inline vf vf_silu(vf x) {
  return vf_div(x, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), x))));
}

/* Run body(i) for i in [0, n): on torch's OpenMP pool when n reaches `parallel_from`,
 * serially otherwise (entering a parallel region has a fixed cost even when it runs alone). */
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
