/* y = x W^T + b over weights kept quantized, decoded in registers as they are read, so a
 * product reads only the quantized bytes (flowllm/kernels/quant_linear.py builds them).

Layout of W [n, k], every row cut into groups of G values along k, each group one scale s
and one offset m (0 without offsets), a value being q * s + m:
  q4: codes uint8 [n][k / 2], each 64 values as 32 bytes, byte j = q[j] | q[j + 32] << 4,
      q in [0, 16), G = 32, k a multiple of 64;
  q8: codes int8 [n][k], G a multiple of 16;
  scales, offsets: [n][k / G], float16 or float32.

Products with G a multiple of 32 (every format but Q6_K's groups of 16) and rows of a
multiple of 64 values run on integers,
as llama.cpp's do: each row of x is quantized to int8 in blocks of 32 (scale absmax / 127,
rounded to nearest), each block's dot product with the codes is summed exactly in int32
lanes (maddubs: unsigned x signed bytes; a signed code's sign moves onto x), and scaled by
the weight group's s times the block's x scale; the offsets add m times the block's exact
float sum of x. So W's values are exact and x is rounded to 8 bits a block, the error
bounded by sum |w| x (x block scale) / 2. Other groups dequantize to float32 in registers
and multiply with x as it is.

Each output row is one dot product per row of x: its codes read once per pass of up to
ROWS rows of x (the row's codes stay in L1 for the next pass). Output rows are split
across OpenMP threads in contiguous runs. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#include "kernel_args.h"

#define ROWS 4              /* rows of x per pass over a weight row */
#define PARALLEL_FROM 65536 /* weight values x rows of x from which threads split */
#define QBLOCK 32           /* values of x per int8 block */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float load_scale(const void *p, size_t i, int f16) {
  return f16 ? f16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* x rows quantized to int8 blocks of 32, with each block's scale and exact float sum. */
typedef struct {
  int8_t *q;  /* [m][k] */
  float *d;   /* [m][k / 4]: each block's scale once per int32 lane of a vi (4 values) */
  float *sum; /* [m][k / 32] */
} QuantX;

static int quantize_x(const float *x, int m, int k, QuantX *qx) {
  const size_t blocks = (size_t)m * (k / QBLOCK);
  qx->q = malloc((size_t)m * k + (size_t)m * k / 4 * sizeof(float) + blocks * sizeof(float));
  if (!qx->q) return -1;
  qx->d = (float *)(qx->q + (size_t)m * k);
  qx->sum = qx->d + (size_t)m * k / 4;
#pragma omp parallel for schedule(static) if (blocks >= 4096)
  for (size_t b = 0; b < blocks; b++) {
    const float *xb = x + b * QBLOCK;
    float amax = 0.0f, sum = 0.0f;
    for (int i = 0; i < QBLOCK; i++) {
      amax = fmaxf(amax, fabsf(xb[i]));
      sum += xb[i];
    }
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < QBLOCK; i++) qx->q[b * QBLOCK + i] = (int8_t)nearbyintf(xb[i] * inv);
    for (int i = 0; i < QBLOCK / 4; i++) qx->d[b * (QBLOCK / 4) + i] = d;
    qx->sum[b] = sum;
  }
  return 0;
}

/* One weight row's group scales (or offsets) as float32 per block of 32: `out` [k / 32]. */
ALWAYS_INLINE void block_scales(const void *src, int k, int G, int f16, float *out) {
  const int blocks = k / QBLOCK, per = G / QBLOCK;
  if (f16 && per == 1) {
    int b = 0;
    for (; b + VL <= blocks; b += VL) vf_store(out + b, vf_load_f16((const uint16_t *)src + b));
    for (; b < blocks; b++) out[b] = load_scale(src, b, 1);
  } else {
    for (int b = 0; b < blocks; b++) out[b] = load_scale(src, b / per, f16);
  }
}

ALWAYS_INLINE float dot_f32(const float *a, const float *b, int n) {
  vf acc = vf_zero();
  int i = 0;
  for (; i + VL <= n; i += VL) acc = vf_fma(vf_load(a + i), vf_load(b + i), acc);
  float s = vf_sum(acc);
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* Integer path: one weight row against M rows of quantized x: out[r]. */
ALWAYS_INLINE void row_dots_int(const QuantX *qx, int r0, const void *codes, const float *sc,
                                const float *mn, int k, int M, int q4, float *out) {
  const int blocks = k / QBLOCK;
  vf acc[ROWS];
#pragma GCC unroll 4
  for (int r = 0; r < M; r++) acc[r] = vf_zero();
  const int step = 4 * VL; /* values per vi */
  for (int i0 = 0; i0 < k; i0 += 64) {
    vi w[64 / (4 * VL)];
    if (q4) {
      vi_nibbles((const uint8_t *)codes + i0 / 2, w);
    } else {
#pragma GCC unroll 2
      for (int v = 0; v < 64 / step; v++) w[v] = vi_load((const int8_t *)codes + i0 + v * step);
    }
#pragma GCC unroll 2
    for (int v = 0; v < 64 / step; v++) {
      const int at = i0 + v * step, b = at / QBLOCK;
      const vf ws = vf_block_scales(sc + b);
#pragma GCC unroll 4
      for (int r = 0; r < M; r++) {
        const size_t row = (size_t)(r0 + r);
        const vi xv = vi_load(qx->q + row * k + at);
        const vi d = q4 ? vi_dot_u8s8(w[v], xv) : vi_dot_s8s8(w[v], xv);
        const vf s = vf_mul(ws, vf_load(qx->d + (row * k + at) / 4));
        acc[r] = vf_fma(vf_from_vi(d), s, acc[r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < M; r++) {
    out[r] = vf_sum(acc[r]);
    if (mn) out[r] += dot_f32(mn, qx->sum + (size_t)(r0 + r) * blocks, blocks);
  }
}

/* Float path (q8 codes in groups of 16): one weight row against M rows of x: out[r]. */
ALWAYS_INLINE void row_dots_float(const float *x, const void *codes, const void *scales,
                                  const void *mins, int k, int G, int M, int f16, float *out) {
  vf acc[ROWS][2];
#pragma GCC unroll 4
  for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = vf_zero();
  for (int g = 0; g < k / G; g++) {
    const vf s = vf_set1(load_scale(scales, g, f16));
    const vf m = mins ? vf_set1(load_scale(mins, g, f16)) : vf_zero();
    const int8_t *p = (const int8_t *)codes + g * G;
#pragma GCC unroll 2
    for (int c = 0; c < G; c += VL) {
      const vf w = vf_fma(vf_from_i8(p + c), s, m);
#pragma GCC unroll 4
      for (int r = 0; r < M; r++) {
        const int chain = (c / VL) & 1;
        acc[r][chain] = vf_fma(w, vf_load(x + (size_t)r * k + g * G + c), acc[r][chain]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < M; r++) out[r] = vf_sum(vf_add(acc[r][0], acc[r][1]));
}

/* Output row j of every row of x, ROWS rows at a time. */
ALWAYS_INLINE void output_row(const float *x, const QuantX *qx, const uint8_t *codes,
                              const char *scales, const char *mins, const float *bias, float *y,
                              int64_t j, int m, int n, int k, int G, int q4, int f16) {
  const size_t row_bytes = q4 ? (size_t)k / 2 : (size_t)k;
  const size_t scale_bytes = (size_t)(k / G) * (f16 ? 2 : 4);
  const void *c = codes + (size_t)j * row_bytes;
  const void *s = scales + (size_t)j * scale_bytes;
  const void *o = mins ? mins + (size_t)j * scale_bytes : NULL;
  const float b = bias ? bias[j] : 0.0f;
  float sc[qx ? k / QBLOCK + 1 : 1], mn[qx && o ? k / QBLOCK + 1 : 1];
  if (qx) {
    block_scales(s, k, G, f16, sc);
    if (o) block_scales(o, k, G, f16, mn);
  }
  for (int r0 = 0; r0 < m; r0 += ROWS) {
    float out[ROWS];
    const int rows = m - r0 < ROWS ? m - r0 : ROWS;
    if (qx) {
      const float *on = o ? mn : NULL;
      switch (rows) {
        case 1: row_dots_int(qx, r0, c, sc, on, k, 1, q4, out); break;
        case 2: row_dots_int(qx, r0, c, sc, on, k, 2, q4, out); break;
        case 3: row_dots_int(qx, r0, c, sc, on, k, 3, q4, out); break;
        default: row_dots_int(qx, r0, c, sc, on, k, ROWS, q4, out); break;
      }
    } else {
      const float *xr = x + (size_t)r0 * k;
      switch (rows) {
        case 1: row_dots_float(xr, c, s, o, k, G, 1, f16, out); break;
        case 2: row_dots_float(xr, c, s, o, k, G, 2, f16, out); break;
        case 3: row_dots_float(xr, c, s, o, k, G, 3, f16, out); break;
        default: row_dots_float(xr, c, s, o, k, G, ROWS, f16, out); break;
      }
    }
    for (int r = 0; r < rows; r++) y[(size_t)(r0 + r) * n + j] = out[r] + b;
  }
}

/* x [m, k], W, bias [n] or NULL -> y [m, n]: output rows split across threads. One
   function per layout (Q4, F16 constants), so OpenMP's outlined loop is specialized.
   Returns -1 when the scratch for x cannot be allocated (before writing y). */
// clang-format off: it would put the _Pragma and the loop on one line
#define QLINEAR(NAME, Q4, F16)                                                              \
  int64_t flowllm_##NAME(const struct flowllm_##NAME##_args *a) {                           \
    const float *x = a->x;                                                                  \
    const uint8_t *codes = (const uint8_t *)a->codes;                                       \
    const char *scales = (const char *)a->scales, *mins = (const char *)a->mins;            \
    const int m = (int)a->m, n = (int)a->n, k = (int)a->k, G = (int)a->group;               \
    QuantX qx;                                                                              \
    const int integer = G % QBLOCK == 0 && k % 64 == 0;                                     \
    if (integer && quantize_x(x, m, k, &qx)) return -1;                                     \
    _Pragma("omp parallel for schedule(static) if ((int64_t)n * k * m >= PARALLEL_FROM)")   \
    for (int64_t j = 0; j < n; j++)                                                         \
      output_row(x, integer ? &qx : NULL, codes, scales, mins, a->bias, a->y, j, m, n, k, G, \
                 Q4, F16);                                                                  \
    if (integer) free(qx.q);                                                                \
    return 0;                                                                               \
  }
// clang-format on

/* ---- Entry points (kernel_args.h) ---- */

QLINEAR(qlinear_q4_f16, 1, 1)
QLINEAR(qlinear_q4_f32, 1, 0)
QLINEAR(qlinear_q8_f16, 0, 1)
QLINEAR(qlinear_q8_f32, 0, 0)

/* float32 -> bfloat16, rounded to nearest even (NaN kept quiet). */
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Row j of W dequantized into dst [k] float32. */
ALWAYS_INLINE void dequant_row(const uint8_t *codes, const char *scales, const char *mins,
                               int64_t j, int k, int G, int q4, int f16, float *dst) {
  const size_t row_bytes = q4 ? (size_t)k / 2 : (size_t)k;
  const size_t scale_bytes = (size_t)(k / G) * (f16 ? 2 : 4);
  const uint8_t *c = codes + (size_t)j * row_bytes;
  const char *s = scales + (size_t)j * scale_bytes;
  const char *o = mins ? mins + (size_t)j * scale_bytes : NULL;
  if (q4) { /* G = 32: the pair's low nibbles are group 2p, its high ones 2p + 1 */
    for (int p = 0; p < k / 64; p++)
      for (int h = 0; h < 2; h++) {
        const vf sv = vf_set1(load_scale(s, 2 * p + h, f16));
        const vf mv = o ? vf_set1(load_scale(o, 2 * p + h, f16)) : vf_zero();
        for (int cc = 0; cc < 32; cc += VL) {
          vf lo, hi;
          vf_from_nibbles(c + 32 * p + cc, &lo, &hi);
          vf_store(dst + 64 * p + 32 * h + cc, vf_fma(h ? hi : lo, sv, mv));
        }
      }
  } else {
    for (int g = 0; g < k / G; g++) {
      const vf sv = vf_set1(load_scale(s, g, f16));
      const vf mv = o ? vf_set1(load_scale(o, g, f16)) : vf_zero();
      for (int cc = 0; cc < G; cc += VL)
        vf_store(dst + g * G + cc, vf_fma(vf_from_i8((const int8_t *)c + g * G + cc), sv, mv));
    }
  }
}

/* Rows of W dequantized to float32: out[i] = W[ids[i]] (ids int64; 0: rows row0 ...).
   Returns 1 + i for the first id out of [0, n), before writing anything. */
ALWAYS_INLINE int64_t dequant_rows(const void *codes, const void *scales_p, const void *mins_p,
                                   const int64_t *ids, int64_t rows, int64_t row0, float *out,
                                   int n, int k, int G, int q4, int f16) {
  const char *scales = scales_p, *mins = mins_p;
  if (ids)
    for (int64_t i = 0; i < rows; i++)
      if (ids[i] < 0 || ids[i] >= n) return 1 + i;
  if (!ids && (row0 < 0 || row0 + rows > n)) return 1;
#pragma omp parallel for schedule(static) if (rows * k >= PARALLEL_FROM)
  for (int64_t i = 0; i < rows; i++)
    dequant_row(codes, scales, mins, ids ? ids[i] : row0 + i, k, G, q4, f16, out + (size_t)i * k);
  return 0;
}

/* Rows row0 .. row0 + rows of W as bfloat16 in the native bf16 linear kernel's layout
   (csrc/linear.c: [rows' / 16][k / 2][16][2], rows' = rows rounded up to 16, pad rows 0),
   so large batches multiply a dequantized tile at the bf16 kernel's speed. k is even. */
ALWAYS_INLINE int64_t dequant_bf16_blocks(const void *codes, const void *scales_p,
                                          const void *mins_p, int64_t rows, int64_t row0,
                                          uint16_t *out, int n, int k, int G, int q4, int f16) {
  const char *scales = scales_p, *mins = mins_p;
  if (row0 < 0 || row0 + rows > n || k % 2) return 1;
  const int64_t blocks = (rows + 15) / 16;
#pragma omp parallel for schedule(static) if (rows * k >= PARALLEL_FROM)
  for (int64_t b = 0; b < blocks; b++) {
    /* the block's 16 rows as float32, then each column pair of them as 16 bf16 pairs */
    float *tmp = malloc((size_t)16 * k * sizeof(float));
    uint32_t *dst = (uint32_t *)(out + (size_t)b * k * 16);
    if (tmp == NULL) continue; /* never with a few tens of KiB */
    for (int lane = 0; lane < 16; lane++) {
      const int64_t i = b * 16 + lane;
      if (i < rows) {
        dequant_row(codes, scales, mins, row0 + i, k, G, q4, f16, tmp + (size_t)lane * k);
      } else {
        memset(tmp + (size_t)lane * k, 0, (size_t)k * sizeof(float));
      }
    }
    for (int p = 0; p < k / 2; p++)
      for (int lane = 0; lane < 16; lane++) {
        const float *t = tmp + (size_t)lane * k + 2 * p;
        dst[(size_t)p * 16 + lane] = (uint32_t)to_bf16(t[0]) | (uint32_t)to_bf16(t[1]) << 16;
      }
    free(tmp);
  }
  return 0;
}

#define DEQUANT(NAME, Q4, F16)                                                                     \
  int64_t flowllm_dequant_##NAME(const struct flowllm_dequant_##NAME##_args *a) {                  \
    return dequant_rows(a->codes, a->scales, a->mins, a->ids, a->rows, a->row0, a->out, (int)a->n, \
                        (int)a->k, (int)a->group, Q4, F16);                                        \
  }                                                                                                \
  int64_t flowllm_dequant_bf16_##NAME(const struct flowllm_dequant_bf16_##NAME##_args *a) {        \
    return dequant_bf16_blocks(a->codes, a->scales, a->mins, a->rows, a->row0, a->out, (int)a->n,  \
                               (int)a->k, (int)a->group, Q4, F16);                                 \
  }

DEQUANT(q4_f16, 1, 1)
DEQUANT(q4_f32, 1, 0)
DEQUANT(q8_f16, 0, 1)
DEQUANT(q8_f32, 0, 0)
