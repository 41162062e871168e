/* y = x W^T + b over weights kept quantized, decoded in registers as they are read, so a
 * product reads only the quantized bytes (flowllm/kernels/quant_linear.py builds them).

Layout of W [n, k], every row cut into groups of G values along k, each group one scale s
and one offset m (0 without offsets), a value being q * s + m:
  q4: codes uint8 [n][k / 2], each 64 values as 32 bytes, byte j = q[j] | q[j + 32] << 4,
      q in [0, 16), G = 32, k a multiple of 64;
  q8: codes int8 [n][k], G a multiple of 16;
  scales, offsets: [n][k / G], float16 or float32.
Interleaved (`interleaved` set; quant_linear interleaves every integer weight at load, the
product of integer weights reads only this layout): n a multiple of 16 (pad rows zero),
and each 16 rows' codes stored as [row bytes / 4][16] dwords (4 bytes of each of the 16
rows, then the next 4), their scales and offsets as [k / G][16], so that the product reads
both in the order it uses them.

Products with G a multiple of 32 (every format but Q6_K's groups of 16) and rows of a
multiple of 64 values run on integers, as llama.cpp's do: each row of x is quantized to
int8 in blocks of 32 (scale absmax / 127, rounded to nearest), each block's dot product
with the codes is summed exactly in integer lanes (block_dot), and scaled by the weight
group's s times the block's x scale; the offsets add m times the block's sum of rounded
values (its scale times its codes' sum, llama.cpp's Q8_1 form). So the product is exactly
W's values against x rounded to 8 bits a block, the error sum w (x rounded - x), bounded by
sum |w| x (x block scale) / 2. (Adding m times x's exact float sum instead weighs that
error by the codes s q alone, 0..15 for Q4_1, and reads a higher perplexity:
benchmarks/README.md, "Kernel design figures".) Other groups
dequantize to float32 in registers and multiply with x as it is. x, the bias and y are float32, or
bfloat16 (`bf16`): x widened as it is read, y rounded once.

Integer products run 16 output rows at a time (output_group): each vector of codes holds 4
codes of each of VL of the 16 rows, unpacked once per block and dotted with up to XROWS
rows of x, each row's 4 int8 values broadcast (vpdpbusd with AVX-512 VNNI, pmaddubsw and
pmaddwd elsewhere), so an extra row of x costs byte dots and a scale, not another unpack,
and no output needs a horizontal sum. The float path takes one output row at a time
(output_row), its codes read once per pass of up to ROWS rows of x. Outputs are split
across OpenMP threads in contiguous runs. A product streams its weights once, so its reads
of codes and scales are prefetched AHEAD bytes ahead: with the hardware prefetchers alone,
a step's products waited on memory. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "flowllm.h"
#include "isa.h"
#include "kernel_args.h"

#define ROWS 4              /* rows of x per pass over a weight row (the float path) */
#define PARALLEL_FROM 65536 /* weight values x rows of x from which threads split */
#define QBLOCK 32           /* values of x per int8 block */
/* bytes of codes prefetched ahead of a product's reads (of scales, an eighth of it) */
#define AHEAD 8192

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float load_scale(const void *p, size_t i, int f16) {
  return f16 ? f16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Activations (x, the bias, y) are float32, or bfloat16 with `bf16` set: widened exactly as
   they are read, and y rounded to bf16 once, from the float32 sum plus the bias. */
ALWAYS_INLINE vf load_x(const void *x, size_t i, int bf16) {
  return bf16 ? vf_load_bf16((const uint16_t *)x + i) : vf_load((const float *)x + i);
}
ALWAYS_INLINE float load_act(const void *p, size_t i, int bf16) {
  return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
ALWAYS_INLINE void store_act(void *p, size_t i, float v, int bf16) {
  if (bf16)
    ((uint16_t *)p)[i] = f32_to_bf16(v);
  else
    ((float *)p)[i] = v;
}

/* x rows quantized to int8 blocks of 32, with each block's scale and sum of rounded values. */
typedef struct {
  int8_t *q;     /* [m][k] */
  float *d;      /* [m][k / 32] */
  float *sum;    /* [m][k / 32]: each block's sum of rounded values, d qsum */
  int32_t *qsum; /* [m][k / 32]: each block's sum of codes */
} QuantX;

static int quantize_x(const void *x, int bf16, int m, int k, QuantX *qx) {
  const size_t blocks = (size_t)m * (k / QBLOCK);
  qx->q = malloc((size_t)m * k + blocks * (2 * sizeof(float) + sizeof(int32_t)));
  if (!qx->q) return -1;
  qx->d = (float *)(qx->q + (size_t)m * k);
  qx->sum = qx->d + blocks;
  qx->qsum = (int32_t *)(qx->sum + blocks);
#pragma omp parallel for schedule(static) if (blocks >= 4096)
  for (size_t b = 0; b < blocks; b++) {
    const size_t xb = b * QBLOCK;
    vf amax = vf_zero();
    for (int i = 0; i < QBLOCK; i += VL) amax = vf_max(amax, vf_abs(load_x(x, xb + i, bf16)));
    const float top = vf_max_of(amax), d = top / 127.0f;
    const vf inv = vf_set1(top > 0.0f ? 127.0f / top : 0.0f);
    vf qsum = vf_zero();
    for (int i = 0; i < QBLOCK; i += VL) {
      const vf q = vf_round(vf_mul(load_x(x, xb + i, bf16), inv));
      vf_store_i8(qx->q + b * QBLOCK + i, q);
      qsum = vf_add(qsum, q);
    }
    qx->qsum[b] = (int32_t)vf_sum(qsum); /* exact: at most 32 x 127 */
    qx->d[b] = d;
    qx->sum[b] = d * (float)qx->qsum[b];
  }
  return 0;
}

/* bf16 x [count] (a multiple of VL) widened to float32 for the float path; NULL when out of
   memory. */
static float *widen_x(const uint16_t *x, size_t count) {
  float *out = malloc(count * sizeof(float));
  if (out)
    for (size_t i = 0; i < count; i += VL) vf_store(out + i, vf_load_bf16(x + i));
  return out;
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

/* Output row j (q8 codes in rows) of every row of x, ROWS rows at a time. */
ALWAYS_INLINE void output_row(const float *x, const uint8_t *codes, const char *scales,
                              const char *mins, const void *bias, void *y, int bf16, int64_t j,
                              int m, int n, int k, int G, int f16) {
  const size_t scale_bytes = (size_t)(k / G) * (f16 ? 2 : 4);
  const void *c = codes + (size_t)j * k;
  const void *s = scales + (size_t)j * scale_bytes;
  const void *o = mins ? mins + (size_t)j * scale_bytes : NULL;
  const float b = bias ? load_act(bias, j, bf16) : 0.0f;
  for (int i = 0; i < k; i += 64) __builtin_prefetch((const char *)c + AHEAD + i);
  for (size_t i = 0; i < scale_bytes; i += 64) {
    __builtin_prefetch((const char *)s + AHEAD / 8 + i);
    if (o) __builtin_prefetch((const char *)o + AHEAD / 8 + i);
  }
  for (int r0 = 0; r0 < m; r0 += ROWS) {
    float out[ROWS];
    const int rows = m - r0 < ROWS ? m - r0 : ROWS;
    const float *xr = x + (size_t)r0 * k;
    switch (rows) {
      case 1: row_dots_float(xr, c, s, o, k, G, 1, f16, out); break;
      case 2: row_dots_float(xr, c, s, o, k, G, 2, f16, out); break;
      case 3: row_dots_float(xr, c, s, o, k, G, 3, f16, out); break;
      default: row_dots_float(xr, c, s, o, k, G, ROWS, f16, out); break;
    }
    for (int r = 0; r < rows; r++) store_act(y, (size_t)(r0 + r) * n + j, out[r] + b, bf16);
  }
}

#define LANES 16                 /* output rows per group of the interleaved layout */
#define HALVES (LANES / VL)      /* vectors per group of LANES outputs */
#define XROWS (VL == 16 ? 8 : 4) /* rows of x per pass over a group's codes */

/* Where row j's group scale g (or offset) is: the row layout's [n][S], or the interleaved
   [n / 16][S][16]. */
ALWAYS_INLINE size_t scale_index(int64_t j, int g, int S, int interleaved) {
  return interleaved ? ((size_t)(j / LANES) * S + g) * LANES + j % LANES : (size_t)j * S + g;
}

/* VL interleaved scales (or offsets) as float32 lanes. */
ALWAYS_INLINE vf lane_scales(const char *p, size_t i, int f16) {
  return f16 ? vf_load_f16((const uint16_t *)p + i) : vf_load((const float *)p + i);
}

static inline int32_t load_i32(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

/* ---- Byte dots of one block of 32 values: w[t][h] holds the codes at position t (4 bytes
   of each of VL rows) of half h of a group, prepared once per block by block_codes; each
   row of x dots them by block_dot, its 4 int8 values at t broadcast. ---- */
#if defined(__AVX512VNNI__)
/* vpdpbusd (unsigned codes x signed x, summed in int32): q8 codes enter offset by 128, the
   dot corrected by 128 times the block's sum of x's codes. */
ALWAYS_INLINE void block_codes(const int32_t *col, int q4, int high, vi w[8][HALVES],
                               vi sign[8][HALVES]) {
  (void)sign;
#pragma GCC unroll 8
  for (int t = 0; t < 8; t++)
#pragma GCC unroll 2
    for (int h = 0; h < HALVES; h++) {
      const vi raw = vi_load(col + t * LANES + h * VL);
      w[t][h] = q4 ? vi_nibbles_of(raw, high) : _mm512_xor_si512(raw, _mm512_set1_epi8((char)0x80));
    }
}
ALWAYS_INLINE vi block_dot(vi w[8][HALVES], vi sign[8][HALVES], int h, const int8_t *xq,
                           int32_t qsum, int q4) {
  (void)sign;
  /* two chains, so that one row alone is not bound by their latency */
  vi d[2] = {q4 ? vi_set1(0) : vi_set1(-128 * qsum), vi_set1(0)};
#pragma GCC unroll 8
  for (int t = 0; t < 8; t++)
    d[t & 1] = _mm512_dpbusd_epi32(d[t & 1], w[t][h], vi_set1(load_i32(xq + 4 * t)));
  return vi_add(d[0], d[1]);
}
#else
/* pmaddubsw (pairs of unsigned x signed bytes, summed in int16), then pmaddwd by ones into
   int32. q4 codes (< 16) against |x| < 128 sum a whole block in int16 (8 x 2 x 15 x 127 <
   2^15); q8 codes enter as |w|, their signs moved onto x, each position widened at once. */
ALWAYS_INLINE void block_codes(const int32_t *col, int q4, int high, vi w[8][HALVES],
                               vi sign[8][HALVES]) {
#pragma GCC unroll 8
  for (int t = 0; t < 8; t++)
#pragma GCC unroll 2
    for (int h = 0; h < HALVES; h++) {
      const vi raw = vi_load(col + t * LANES + h * VL);
      w[t][h] = q4 ? vi_nibbles_of(raw, high) : vi_abs8(raw);
      sign[t][h] = raw;
    }
}
ALWAYS_INLINE vi block_dot(vi w[8][HALVES], vi sign[8][HALVES], int h, const int8_t *xq,
                           int32_t qsum, int q4) {
  (void)qsum;
  vi d = vi_set1(0);
#pragma GCC unroll 8
  for (int t = 0; t < 8; t++) {
    const vi x = vi_set1(load_i32(xq + 4 * t));
    if (q4)
      d = vi_add16(d, vi_dot_pairs(w[t][h], x));
    else
      d = vi_add(d, vi_sum_pairs(vi_dot_pairs(w[t][h], vi_sign8(x, sign[t][h]))));
  }
  return q4 ? vi_sum_pairs(d) : d;
}
#endif

/* One group of LANES output rows (tw: its [row_bytes / 4][LANES] dwords of codes; ws, wm:
   its [k / G][LANES] scales and offsets, wm NULL: none) against M rows of quantized x from
   r0: acc[r][h] = the group's sums for row r0 + r, VL outputs a half. A block of 32 values
   costs a row of x 8 byte dots a half, one conversion and two multiply-adds for all 16
   outputs. */
ALWAYS_INLINE void group_dots(const QuantX *qx, int r0, int M, const int32_t *tw, const char *ws,
                              const char *wm, int k, int G, int q4, int f16,
                              vf acc[XROWS][HALVES]) {
  const int blocks = k / QBLOCK, per = G / QBLOCK;
  const size_t esize = f16 ? 2 : 4;
#pragma GCC unroll 8
  for (int r = 0; r < M; r++)
#pragma GCC unroll 2
    for (int h = 0; h < HALVES; h++) acc[r][h] = vf_zero();
  for (int b = 0; b < blocks; b++) {
    /* q4 block b: the low nibbles of its chunk's bytes, or (b odd) the high ones */
    const int32_t *col = tw + (size_t)(q4 ? b / 2 : b) * 8 * LANES;
    const size_t at = (size_t)(b / per) * LANES;
    if (!q4 || b % 2 == 0)
#pragma GCC unroll 8
      for (int t = 0; t < 8; t++) __builtin_prefetch((const char *)col + AHEAD + t * 64);
    __builtin_prefetch(ws + at * esize + AHEAD / 8);
    if (wm) __builtin_prefetch(wm + at * esize + AHEAD / 8);
    vi w[8][HALVES], sign[8][HALVES];
    block_codes(col, q4, b & 1, w, sign);
    vf sb[HALVES], mb[HALVES];
#pragma GCC unroll 2
    for (int h = 0; h < HALVES; h++) {
      sb[h] = lane_scales(ws, at + h * VL, f16);
      mb[h] = wm ? lane_scales(wm, at + h * VL, f16) : vf_zero();
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) {
      const size_t row = (size_t)(r0 + r);
      const int8_t *xq = qx->q + row * k + b * QBLOCK;
      const vf dx = vf_set1(qx->d[row * blocks + b]);
      const vf xsum = vf_set1(qx->sum[row * blocks + b]);
#pragma GCC unroll 2
      for (int h = 0; h < HALVES; h++) {
        const vi d = block_dot(w, sign, h, xq, qx->qsum[row * blocks + b], q4);
        acc[r][h] = vf_fma(vf_from_vi(d), vf_mul(sb[h], dx), acc[r][h]);
        if (wm) acc[r][h] = vf_fma(mb[h], xsum, acc[r][h]);
      }
    }
  }
}

/* Output rows 16 gi .. 16 gi + 16 (those below n) of every row of x. */
ALWAYS_INLINE void output_group(const QuantX *qx, const uint8_t *codes, const char *scales,
                                const char *mins, const void *bias, void *y, int bf16, int64_t gi,
                                int m, int n, int k, int G, int q4, int f16) {
  const size_t row_bytes = q4 ? (size_t)k / 2 : (size_t)k;
  const size_t scale_bytes = (size_t)(k / G) * LANES * (f16 ? 2 : 4);
  const int32_t *tw = (const int32_t *)(codes + (size_t)gi * LANES * row_bytes);
  const char *ws = scales + (size_t)gi * scale_bytes;
  const char *wm = mins ? mins + (size_t)gi * scale_bytes : NULL;
  const int64_t j0 = gi * LANES;
  vf bv[HALVES];
#pragma GCC unroll 2
  for (int h = 0; h < HALVES; h++) {
    const int64_t j = j0 + h * VL;
    bv[h] = !bias  ? vf_zero()
            : bf16 ? vf_load_bf16_n((const uint16_t *)bias + j, n - j)
                   : vf_load_n((const float *)bias + j, n - j);
  }
  for (int r0 = 0; r0 < m; r0 += XROWS) {
    vf acc[XROWS][HALVES];
    const int rows = m - r0 < XROWS ? m - r0 : XROWS;
    switch (rows) {
      case 1: group_dots(qx, r0, 1, tw, ws, wm, k, G, q4, f16, acc); break;
      case 2: group_dots(qx, r0, 2, tw, ws, wm, k, G, q4, f16, acc); break;
      case 3: group_dots(qx, r0, 3, tw, ws, wm, k, G, q4, f16, acc); break;
#if XROWS > 4
      case 4: group_dots(qx, r0, 4, tw, ws, wm, k, G, q4, f16, acc); break;
      case 5: group_dots(qx, r0, 5, tw, ws, wm, k, G, q4, f16, acc); break;
      case 6: group_dots(qx, r0, 6, tw, ws, wm, k, G, q4, f16, acc); break;
      case 7: group_dots(qx, r0, 7, tw, ws, wm, k, G, q4, f16, acc); break;
#endif
      default: group_dots(qx, r0, XROWS, tw, ws, wm, k, G, q4, f16, acc); break;
    }
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 2
      for (int h = 0; h < HALVES; h++) {
        const int64_t j = j0 + h * VL;
        const size_t at = (size_t)(r0 + r) * n + j;
        const vf v = vf_add(acc[r][h], bv[h]);
        if (bf16)
          vf_store_bf16_n((uint16_t *)y + at, n - j, v);
        else
          vf_store_n((float *)y + at, n - j, v);
      }
  }
}

/* x [m, k], W, bias [n] or NULL -> y [m, n]: groups of 16 outputs (integer products, W
   interleaved) or output rows (the float path, W in rows) split across threads. One
   function per layout (Q4, F16 constants), so OpenMP's outlined loop is specialized.
   Returns -1 when the scratch for x cannot be allocated, -2 for W in the other layout than
   its product reads (before writing y). k is a multiple of 16. */
// clang-format off: it would put the _Pragma and the loop on one line
#define QLINEAR(NAME, Q4, F16)                                                              \
  int64_t flowllm_##NAME(const struct flowllm_##NAME##_args *a) {                           \
    const uint8_t *codes = (const uint8_t *)a->codes;                                       \
    const char *scales = (const char *)a->scales, *mins = (const char *)a->mins;            \
    const int m = (int)a->m, n = (int)a->n, k = (int)a->k, G = (int)a->group;               \
    const int integer = G % QBLOCK == 0 && k % 64 == 0;                                     \
    if ((a->interleaved != 0) != integer) return -2;                                        \
    const int bf16 = a->bf16 != 0;                                                          \
    QuantX qx;                                                                              \
    float *wide = NULL; /* the float path's x, widened from bf16 */                         \
    if (integer && quantize_x(a->x, bf16, m, k, &qx)) return -1;                            \
    if (!integer && bf16 && !(wide = widen_x(a->x, (size_t)m * k))) return -1;              \
    const float *x = integer ? NULL : bf16 ? wide : (const float *)a->x;                    \
    const int64_t items = integer ? (n + LANES - 1) / LANES : n;                            \
    _Pragma("omp parallel for schedule(static) if ((int64_t)n * k * m >= PARALLEL_FROM)")   \
    for (int64_t t = 0; t < items; t++) {                                                   \
      if (integer)                                                                          \
        output_group(&qx, codes, scales, mins, a->bias, a->y, bf16, t, m, n, k, G, Q4, F16);\
      else                                                                                  \
        output_row(x, codes, scales, mins, a->bias, a->y, bf16, t, m, n, k, G, F16);        \
    }                                                                                       \
    if (integer) free(qx.q);                                                                \
    free(wide);                                                                             \
    return 0;                                                                               \
  }
// clang-format on

/* ---- Entry points (kernel_args.h) ---- */

QLINEAR(qlinear_q4_f16, 1, 1)
QLINEAR(qlinear_q4_f32, 1, 0)
QLINEAR(qlinear_q8_f16, 0, 1)
QLINEAR(qlinear_q8_f32, 0, 0)

/* Row j of W (rows or interleaved layout) dequantized into dst [k] float32. */
ALWAYS_INLINE void dequant_row(const uint8_t *codes, const char *scales, const char *mins,
                               int64_t j, int k, int G, int q4, int f16, int interleaved,
                               float *dst) {
  const size_t row_bytes = q4 ? (size_t)k / 2 : (size_t)k, esize = f16 ? 2 : 4;
  const int S = k / G;
  uint8_t gathered[interleaved ? row_bytes : 1];
  const uint8_t *c = codes + (size_t)j * row_bytes;
  if (interleaved) { /* dword t of row j: the group's [t][j % 16] */
    const uint8_t *group = codes + (size_t)(j / LANES) * LANES * row_bytes;
    for (size_t t = 0; t < row_bytes / 4; t++)
      memcpy(gathered + 4 * t, group + (t * LANES + j % LANES) * 4, 4);
    c = gathered;
  }
  const char *s = scales + scale_index(j, 0, S, interleaved) * esize;
  const char *o = mins ? mins + scale_index(j, 0, S, interleaved) * esize : NULL;
  const size_t stride = interleaved ? LANES : 1; /* between a row's scales */
  if (q4) { /* G = 32: the pair's low nibbles are group 2p, its high ones 2p + 1 */
    for (int p = 0; p < k / 64; p++)
      for (int h = 0; h < 2; h++) {
        const size_t g = (size_t)(2 * p + h) * stride;
        const vf sv = vf_set1(load_scale(s, g, f16));
        const vf mv = o ? vf_set1(load_scale(o, g, f16)) : vf_zero();
        for (int cc = 0; cc < 32; cc += VL) {
          vf lo, hi;
          vf_from_nibbles(c + 32 * p + cc, &lo, &hi);
          vf_store(dst + 64 * p + 32 * h + cc, vf_fma(h ? hi : lo, sv, mv));
        }
      }
  } else {
    for (int g = 0; g < S; g++) {
      const vf sv = vf_set1(load_scale(s, g * stride, f16));
      const vf mv = o ? vf_set1(load_scale(o, g * stride, f16)) : vf_zero();
      for (int cc = 0; cc < G; cc += VL)
        vf_store(dst + g * G + cc, vf_fma(vf_from_i8((const int8_t *)c + g * G + cc), sv, mv));
    }
  }
}

/* Rows of W dequantized to float32: out[i] = W[ids[i]] (ids int64; 0: rows row0 ...).
   Returns 1 + i for the first id out of [0, n), before writing anything. */
ALWAYS_INLINE int64_t dequant_rows(const void *codes, const void *scales_p, const void *mins_p,
                                   const int64_t *ids, int64_t rows, int64_t row0, float *out,
                                   int n, int k, int G, int q4, int f16, int interleaved) {
  const char *scales = scales_p, *mins = mins_p;
  if (ids)
    for (int64_t i = 0; i < rows; i++)
      if (ids[i] < 0 || ids[i] >= n) return 1 + i;
  if (!ids && (row0 < 0 || row0 + rows > n)) return 1;
#pragma omp parallel for schedule(static) if (rows * k >= PARALLEL_FROM)
  for (int64_t i = 0; i < rows; i++)
    dequant_row(codes, scales, mins, ids ? ids[i] : row0 + i, k, G, q4, f16, interleaved,
                out + (size_t)i * k);
  return 0;
}

#define DEQUANT(NAME, Q4, F16)                                                                     \
  int64_t flowllm_dequant_##NAME(const struct flowllm_dequant_##NAME##_args *a) {                  \
    return dequant_rows(a->codes, a->scales, a->mins, a->ids, a->rows, a->row0, a->out, (int)a->n, \
                        (int)a->k, (int)a->group, Q4, F16, a->interleaved != 0);                   \
  }

DEQUANT(q4_f16, 1, 1)
DEQUANT(q4_f32, 1, 0)
DEQUANT(q8_f16, 0, 1)
DEQUANT(q8_f32, 0, 0)
