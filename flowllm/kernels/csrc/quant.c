/* y = x W^T + b over weights kept quantized, dequantized in registers as they are read, so
 * a product reads only the quantized bytes (flowllm/kernels/quant_linear.py builds them).

Layout of W [n, k], every row cut into groups of G values along k, each group one scale s
and one offset m (0 without offsets), a value being q * s + m:
  q4: codes uint8 [n][k / 2], each 32 values as 16 bytes, byte j = q[j] | q[j + 16] << 4
      (llama.cpp's Q4_0/Q4_1 block order), q in [0, 16);
  q8: codes int8 [n][k];
  scales, offsets: [n][k / G], float16 or float32.
G is a multiple of 32 (q4) or 16 (q8). Each output row is one dot product per row of x:
its codes, then its scales, read once per pass of up to ROWS rows of x (the row's codes
stay in L1 for the next pass). Output rows are split across OpenMP threads in contiguous
runs. Sums are float32; a value's dequantization is the one fma(q, s, m), as gguf's. */
#include <stddef.h>
#include <stdint.h>

#include "isa.h"

#define ROWS 4                /* rows of x per pass over a weight row */
#define PARALLEL_FROM 65536   /* weight values x rows of x from which threads split */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float load_scale(const void *p, size_t i, int f16) {
  return f16 ? f16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* One weight row (codes, scales and offsets of it) against M rows of x: out[r]. */
ALWAYS_INLINE void row_dots(const float *x, const void *codes, const void *scales,
                            const void *mins, int k, int G, int M, int q4, int f16,
                            float *out) {
  vf acc[ROWS][2];
#pragma GCC unroll 4
  for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = vf_zero();
  const int groups = k / G;
  for (int g = 0; g < groups; g++) {
    const vf s = vf_set1(load_scale(scales, g, f16));
    const vf m = mins ? vf_set1(load_scale(mins, g, f16)) : vf_zero();
    const int base = g * G;
    if (q4) {
      const uint8_t *p = (const uint8_t *)codes + base / 2;
      for (int h = 0; h < G; h += 32) {
#pragma GCC unroll 2
        for (int c = 0; c < 16; c += VL) {
          vf lo, hi;
          vf_from_nibbles(p + h / 2 + c, &lo, &hi);
          lo = vf_fma(lo, s, m);
          hi = vf_fma(hi, s, m);
#pragma GCC unroll 4
          for (int r = 0; r < M; r++) {
            const float *xr = x + (size_t)r * k + base + h + c;
            acc[r][0] = vf_fma(lo, vf_load(xr), acc[r][0]);
            acc[r][1] = vf_fma(hi, vf_load(xr + 16), acc[r][1]);
          }
        }
      }
    } else {
      const int8_t *p = (const int8_t *)codes + base;
#pragma GCC unroll 2
      for (int c = 0; c < G; c += VL) {
        const vf w = vf_fma(vf_from_i8(p + c), s, m);
#pragma GCC unroll 4
        for (int r = 0; r < M; r++) {
          const int chain = (c / VL) & 1;
          acc[r][chain] = vf_fma(w, vf_load(x + (size_t)r * k + base + c), acc[r][chain]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < M; r++) out[r] = vf_sum(vf_add(acc[r][0], acc[r][1]));
}

/* Output row j of every row of x, ROWS rows of x at a time. */
ALWAYS_INLINE void output_row(const float *x, const uint8_t *codes, const char *scales,
                              const char *mins, const float *bias, float *y, int64_t j, int m,
                              int n, int k, int G, int q4, int f16) {
  const size_t row_bytes = q4 ? (size_t)k / 2 : (size_t)k;
  const size_t scale_bytes = (size_t)(k / G) * (f16 ? 2 : 4);
  const void *c = codes + (size_t)j * row_bytes;
  const void *s = scales + (size_t)j * scale_bytes;
  const void *o = mins ? mins + (size_t)j * scale_bytes : NULL;
  const float b = bias ? bias[j] : 0.0f;
  for (int r0 = 0; r0 < m; r0 += ROWS) {
    float out[ROWS];
    const float *xr = x + (size_t)r0 * k;
    switch (m - r0 < ROWS ? m - r0 : ROWS) {
      case 1: row_dots(xr, c, s, o, k, G, 1, q4, f16, out); break;
      case 2: row_dots(xr, c, s, o, k, G, 2, q4, f16, out); break;
      case 3: row_dots(xr, c, s, o, k, G, 3, q4, f16, out); break;
      default: row_dots(xr, c, s, o, k, G, ROWS, q4, f16, out); break;
    }
    const int rows = m - r0 < ROWS ? m - r0 : ROWS;
    for (int r = 0; r < rows; r++) y[(size_t)(r0 + r) * n + j] = out[r] + b;
  }
}

ALWAYS_INLINE void qlinear(const int64_t *a, int q4, int f16) {
  const float *x = (const float *)a[0];
  const uint8_t *codes = (const uint8_t *)a[1];
  const char *scales = (const char *)a[2], *mins = (const char *)a[3];
  const float *bias = (const float *)a[4];
  float *y = (float *)a[5];
  const int m = (int)a[6], n = (int)a[7], k = (int)a[8], G = (int)a[9];
  if ((int64_t)n * k * m >= PARALLEL_FROM) {
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) output_row(x, codes, scales, mins, bias, y, j, m, n, k, G, q4, f16);
  } else {
    for (int64_t j = 0; j < n; j++) output_row(x, codes, scales, mins, bias, y, j, m, n, k, G, q4, f16);
  }
}

/* ---- Entry points (module.c's convention). a: x [m, k] f32, codes, scales, offsets (0:
   none), bias [n] f32 (0: none), y [m, n] f32, m, n, k, G ---- */

int64_t flowllm_qlinear_q4_f16(const int64_t *a) { qlinear(a, 1, 1); return 0; }
int64_t flowllm_qlinear_q4_f32(const int64_t *a) { qlinear(a, 1, 0); return 0; }
int64_t flowllm_qlinear_q8_f16(const int64_t *a) { qlinear(a, 0, 1); return 0; }
int64_t flowllm_qlinear_q8_f32(const int64_t *a) { qlinear(a, 0, 0); return 0; }

/* Rows of W dequantized to float32: out[i] = W[ids[i]] (ids int64; 0: rows row0 ...).
   Returns 1 + i for the first id out of [0, n), before writing anything. */
ALWAYS_INLINE int64_t dequant_rows(const int64_t *a, int q4, int f16) {
  const uint8_t *codes = (const uint8_t *)a[0];
  const char *scales = (const char *)a[1], *mins = (const char *)a[2];
  const int64_t *ids = (const int64_t *)a[3];
  const int64_t rows = a[4], row0 = a[5];
  float *out = (float *)a[6];
  const int n = (int)a[7], k = (int)a[8], G = (int)a[9];
  if (ids)
    for (int64_t i = 0; i < rows; i++)
      if (ids[i] < 0 || ids[i] >= n) return 1 + i;
  if (!ids && (row0 < 0 || row0 + rows > n)) return 1;
  const size_t row_bytes = q4 ? (size_t)k / 2 : (size_t)k;
  const size_t scale_bytes = (size_t)(k / G) * (f16 ? 2 : 4);
#pragma omp parallel for schedule(static) if (rows * k >= PARALLEL_FROM)
  for (int64_t i = 0; i < rows; i++) {
    const int64_t j = ids ? ids[i] : row0 + i;
    const uint8_t *c = codes + (size_t)j * row_bytes;
    const char *s = scales + (size_t)j * scale_bytes;
    const char *o = mins ? mins + (size_t)j * scale_bytes : NULL;
    float *dst = out + (size_t)i * k;
    for (int g = 0; g < k / G; g++) {
      const vf sv = vf_set1(load_scale(s, g, f16));
      const vf mv = o ? vf_set1(load_scale(o, g, f16)) : vf_zero();
      const int base = g * G;
      if (q4) {
        for (int h = 0; h < G; h += 32)
          for (int cc = 0; cc < 16; cc += VL) {
            vf lo, hi;
            vf_from_nibbles(c + (base + h) / 2 + cc, &lo, &hi);
            vf_store(dst + base + h + cc, vf_fma(lo, sv, mv));
            vf_store(dst + base + h + 16 + cc, vf_fma(hi, sv, mv));
          }
      } else {
        for (int cc = 0; cc < G; cc += VL)
          vf_store(dst + base + cc, vf_fma(vf_from_i8((const int8_t *)c + base + cc), sv, mv));
      }
    }
  }
  return 0;
}

/* a: codes, scales, offsets (0: none), ids (0: a range), rows, row0, out [rows, k] f32, n,
   k, G */
int64_t flowllm_dequant_q4_f16(const int64_t *a) { return dequant_rows(a, 1, 1); }
int64_t flowllm_dequant_q4_f32(const int64_t *a) { return dequant_rows(a, 1, 0); }
int64_t flowllm_dequant_q8_f16(const int64_t *a) { return dequant_rows(a, 0, 1); }
int64_t flowllm_dequant_q8_f32(const int64_t *a) { return dequant_rows(a, 0, 0); }
