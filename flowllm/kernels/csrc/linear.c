/* y = x W^T + b for a few rows of x, over a weight packed in the order it is read.

Layout (built by flowllm/kernels/cpu_linear.py): the n outputs are cut into blocks of 16
(the last padded with zero rows) and each block is stored contiguously, column by column,
so a block's product streams one run of memory, one 64-byte line per step:
  fp32: [n/16][k][16]            step c: W[16 rows][c]          * x[r][c]
  bf16: [n/16][k/2][16][2]       step p: W[16 rows][2p, 2p + 1] . x[r][2p, 2p + 1]  (dpbf16)
(k rounded up to even for bf16, the pad column zero). Each step's weight line is loaded
once and multiplied into every row of x (up to ROWS at a time, CHAINS accumulators per
row), so m rows cost one pass over W per ROWS rows; the rows of a block after the first
ROWS read it again from cache. From PAIRED_FROM rows on, two blocks share a pass, so each
broadcast value of x feeds two weight lines (at many rows the broadcasts, not the weights,
bound the product: 355-384 GFLOP/s -> 421-455 bf16 at 2,048 rows, two threads, where
oneDNN reads 406-433). Blocks are split across OpenMP threads; a thread's blocks are
contiguous, so each thread streams one run, prefetched PREFETCH lines ahead.

The fp32 product is written over the vector layer (isa.h): a line is BV vectors (one of
AVX-512, two of AVX2), and AVX2's 16 registers hold the accumulators of fewer rows, so
there ROWS is smaller and blocks never pair. The bf16 product needs AVX512-BF16 (dpbf16):
it is compiled for it by its own target attribute in the AVX-512 build, called only where
the CPU has it (flowllm/kernels/native.py `has_bf16`), and absent from the AVX2 build.

Accumulation is fp32 in both; bf16 outputs are rounded to nearest even after the bias. */
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"
#include "kernel_args.h"

#define BLOCK 16        /* outputs per block: one 64-byte fp32 line */
#define BV (BLOCK / VL) /* vectors per fp32 line */
#define UNROLL 4        /* weight lines per inner iteration */
#define PREFETCH 32     /* lines ahead (2 KiB): helps from a few rows on (benchmarks/README.md) */
#define MAX_NB 2        /* blocks per pass, at most */
#if VL == 16
#define ROWS 8         /* rows of x sharing one pass over a block */
#define PAIRED_FROM 16 /* rows from which blocks go two per pass */
#define PAIRED_ROWS 6  /* rows per pass then: 6 x 2 blocks x CHAINS accumulators */
#else
#define ROWS 3 /* 3 rows x CHAINS x BV accumulators, 2 weight vectors and x: 15 registers */
#define PAIRED_FROM INT_MAX
#define PAIRED_ROWS 1
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Accumulators per row, step c adding into chain c % CHAINS: two cover most of the FMA
   latency at one row (four measured no faster, and fit only 6 rows in the registers). The
   same for every row count, so a row's sums do not depend on how many rows share its pass:
   a row's output is the same whichever batch it is in. */
#define CHAINS 2
#define SUMS (CHAINS * BV) /* accumulators per row and block: chain c's vector v at c BV + v */

/* Vector v of a line's sum over its chains. */
ALWAYS_INLINE vf sum_chains(const vf *acc, int v) {
  vf s = acc[v];
  for (int c = 1; c < CHAINS; c++) s = vf_add(s, acc[c * BV + v]);
  return s;
}

/* Blocks b .. b + NB - 1 of every row of x, G rows at a time: ROWS_FN(x rows, w, bias,
   y rows, b, n, k, M, NB) with M and NB constants, so each group size compiles to its own
   unrolled loop (G <= ROWS; a case past G is never reached, AT_MOST keeps it in bounds). */
#define AT_MOST(c, G) ((c) < (G) ? (c) : (G))
#define ROW_GROUPS(ROWS_FN, G, NB, x, w, bias, y, b, m, n, k)                      \
  for (int r0 = 0; r0 < (m); r0 += (G)) {                                          \
    const size_t xo = (size_t)r0 * (k), yo = (size_t)r0 * (n);                     \
    switch ((m) - r0 < (G) ? (m) - r0 : (G)) {                                     \
      case 1: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, 1, NB); break;             \
      case 2: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, AT_MOST(2, G), NB); break; \
      case 3: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, AT_MOST(3, G), NB); break; \
      case 4: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, AT_MOST(4, G), NB); break; \
      case 5: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, AT_MOST(5, G), NB); break; \
      case 6: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, AT_MOST(6, G), NB); break; \
      case 7: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, AT_MOST(7, G), NB); break; \
      default: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, G, NB); break;            \
    }                                                                              \
  }

/* Blocks of every row: one per pass below PAIRED_FROM rows, else two (PAIRED_ROWS rows at
   a time, so the accumulators fit AVX-512's 32 registers); the odd last block goes alone. */
// clang-format off: it would put the _Pragma and the loop on one line
#define FOR_BLOCKS(ROWS_FN, x, w, bias, y, m, n, k)                                \
  do {                                                                             \
    const int blocks = ((n) + BLOCK - 1) / BLOCK, nb = (m) >= PAIRED_FROM ? 2 : 1; \
    _Pragma("omp parallel for schedule(static)")                                   \
    for (int t = 0; t < (blocks + nb - 1) / nb; t++) {                             \
      const int b = t * nb;                                                        \
      if (nb == 2 && b + 1 < blocks) {                                             \
        ROW_GROUPS(ROWS_FN, PAIRED_ROWS, 2, x, w, bias, y, b, m, n, k);            \
      } else {                                                                     \
        ROW_GROUPS(ROWS_FN, ROWS, 1, x, w, bias, y, b, m, n, k);                   \
      }                                                                            \
    }                                                                              \
  } while (0)
// clang-format on

/* Both dtypes' passes: zeroed accumulators, and the UNROLL weight lines (64 bytes each)
   PREFETCH lines ahead of `step` in each of the NB blocks (bstride bytes apart). */
ALWAYS_INLINE void zero_accumulators(vf acc[ROWS][MAX_NB][SUMS], int M, int NB) {
#pragma GCC unroll 8
  for (int r = 0; r < M; r++)
#pragma GCC unroll 2
    for (int j = 0; j < NB; j++)
#pragma GCC unroll 4
      for (int c = 0; c < SUMS; c++) acc[r][j][c] = vf_zero();
}

ALWAYS_INLINE void prefetch_ahead(const char *step, size_t bstride, int NB) {
#pragma GCC unroll 2
  for (int j = 0; j < NB; j++)
#pragma GCC unroll 4
    for (int u = 0; u < UNROLL; u++)
      _mm_prefetch(step + j * bstride + (size_t)(PREFETCH + u) * 64, _MM_HINT_T0);
}

/* ---- fp32 ---- */

/* out[r][j] = block j of NB (at wb + j * bstride, each [k][16]) times x row r, for M rows
   (M and NB constants after inlining; see blocks_bf16 for why two blocks per pass). */
ALWAYS_INLINE void blocks_f32(const float *x, const float *wb, size_t bstride, int k, int M, int NB,
                              vf out[][MAX_NB][BV]) {
  vf acc[ROWS][MAX_NB][SUMS];
  zero_accumulators(acc, M, NB);
  int c = 0;
  for (; c + UNROLL <= k; c += UNROLL) {
    prefetch_ahead((const char *)(wb + (size_t)c * BLOCK), bstride * sizeof(float), NB);
#pragma GCC unroll 4
    for (int u = 0; u < UNROLL; u++) {
      vf w[MAX_NB][BV];
#pragma GCC unroll 2
      for (int j = 0; j < NB; j++)
#pragma GCC unroll 2
        for (int v = 0; v < BV; v++)
          w[j][v] = vf_load(wb + j * bstride + (size_t)(c + u) * BLOCK + v * VL);
#pragma GCC unroll 8
      for (int r = 0; r < M; r++) {
        const vf xv = vf_set1(x[(size_t)r * k + c + u]);
#pragma GCC unroll 2
        for (int j = 0; j < NB; j++)
#pragma GCC unroll 2
          for (int v = 0; v < BV; v++) {
            vf *a = &acc[r][j][u % CHAINS * BV + v];
            *a = vf_fma(w[j][v], xv, *a);
          }
      }
    }
  }
  for (; c < k; c++) {
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
#pragma GCC unroll 2
      for (int j = 0; j < NB; j++)
#pragma GCC unroll 2
        for (int v = 0; v < BV; v++)
          acc[r][j][v] = vf_fma(vf_load(wb + j * bstride + (size_t)c * BLOCK + v * VL),
                                vf_set1(x[(size_t)r * k + c]), acc[r][j][v]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < M; r++)
#pragma GCC unroll 2
    for (int j = 0; j < NB; j++)
#pragma GCC unroll 2
      for (int v = 0; v < BV; v++) out[r][j][v] = sum_chains(acc[r][j], v);
}

/* Rows [0, M) of x against blocks b .. b + NB - 1, bias added, stored into y (the outputs
   of the last block that exist). */
ALWAYS_INLINE void rows_f32(const float *x, const float *w, const float *bias, float *y, int b,
                            int n, int k, int M, int NB) {
  vf out[ROWS][MAX_NB][BV];
  const size_t bstride = (size_t)BLOCK * k;
  blocks_f32(x, w + (size_t)b * bstride, bstride, k, M, NB, out);
#pragma GCC unroll 2
  for (int j = 0; j < NB; j++) {
    const int o = (b + j) * BLOCK;
#pragma GCC unroll 2
    for (int v = 0; v < BV; v++) {
      const int left = n - o - v * VL;
      const vf bv = bias ? vf_load_n(bias + o + v * VL, left) : vf_zero();
#pragma GCC unroll 8
      for (int r = 0; r < M; r++)
        vf_store_n(y + (size_t)r * n + o + v * VL, left, vf_add(out[r][j][v], bv));
    }
  }
}

/* x [m, k], w packed from [n, k], bias [n] or NULL -> y [m, n]. */
static void linear_f32(const float *x, const float *w, const float *bias, float *y, int m, int n,
                       int k) {
  FOR_BLOCKS(rows_f32, x, w, bias, y, m, n, k);
}

/* The entry points (kernel_args.h): this one and, in the AVX-512 build, flowllm_linear_bf16. */
int64_t flowllm_linear_f32(const struct flowllm_linear_f32_args *a) {
  linear_f32(a->x, a->w, a->bias, a->y, (int)a->m, (int)a->n, (int)a->k);
  return 0;
}

/* ---- bf16 (AVX-512 build only) ---- */

#if defined(__AVX512F__)
#define BF16 __attribute__((target("avx512bf16")))
_Static_assert(BV == 1, "a bf16 line is one AVX-512 vector");

/* Output lanes of block b that exist (the last block may be partial). */
ALWAYS_INLINE __mmask16 block_mask(int b, int n) { return vm_first(n - b * BLOCK); }

/* The bf16 pair x[i], x[i + 1] broadcast to every 32-bit lane. */
BF16 ALWAYS_INLINE __m512bh pair_bf16(const uint16_t *x, size_t i) {
  uint32_t v;
  memcpy(&v, x + i, sizeof v);
  return (__m512bh)_mm512_set1_epi32((int)v);
}

/* out[r][j] = block j of NB (at wb + j * bstride, each [kp][16][2]) times x row r (k bf16
   values; an odd k's last pair is x[k - 1] and a zero, never the next row's first value).
   Two blocks per pass reuse each broadcast x pair for two weight lines: at many rows the
   product is bound by those broadcasts, not by the weights. Every output's sum runs in
   the same order whatever NB and M are, so a row's result does not depend on its batch. */
BF16 ALWAYS_INLINE void blocks_bf16(const uint16_t *x, const uint16_t *wb, size_t bstride, int k,
                                    int M, int NB, __m512 out[][MAX_NB]) {
  const int pairs = k / 2;
  const size_t line = 2 * BLOCK; /* bf16 values per step */
  vf acc[ROWS][MAX_NB][SUMS];
  zero_accumulators(acc, M, NB);
  int p = 0;
  for (; p + UNROLL <= pairs; p += UNROLL) {
    prefetch_ahead((const char *)(wb + (size_t)p * line), bstride * sizeof(uint16_t), NB);
#pragma GCC unroll 4
    for (int u = 0; u < UNROLL; u++) {
      __m512bh w[MAX_NB];
#pragma GCC unroll 2
      for (int j = 0; j < NB; j++)
        w[j] = (__m512bh)_mm512_loadu_si512(wb + j * bstride + (size_t)(p + u) * line);
#pragma GCC unroll 8
      for (int r = 0; r < M; r++) {
        const __m512bh xp = pair_bf16(x, (size_t)r * k + 2 * (p + u));
#pragma GCC unroll 2
        for (int j = 0; j < NB; j++)
          acc[r][j][u % CHAINS] = _mm512_dpbf16_ps(acc[r][j][u % CHAINS], w[j], xp);
      }
    }
  }
  for (; p < pairs; p++) {
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
#pragma GCC unroll 2
      for (int j = 0; j < NB; j++)
        acc[r][j][0] = _mm512_dpbf16_ps(
            acc[r][j][0], (__m512bh)_mm512_loadu_si512(wb + j * bstride + (size_t)p * line),
            pair_bf16(x, (size_t)r * k + 2 * p));
  }
  if (k & 1) {
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) {
      const __m512i last = _mm512_set1_epi32(x[(size_t)r * k + k - 1]);
#pragma GCC unroll 2
      for (int j = 0; j < NB; j++)
        acc[r][j][0] = _mm512_dpbf16_ps(
            acc[r][j][0], (__m512bh)_mm512_loadu_si512(wb + j * bstride + (size_t)pairs * line),
            (__m512bh)last);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < M; r++)
#pragma GCC unroll 2
    for (int j = 0; j < NB; j++) out[r][j] = sum_chains(acc[r][j], 0);
}

/* bf16 [16] (masked) -> fp32 [16]: the bf16 bits are the fp32's upper half. */
BF16 ALWAYS_INLINE __m512 load_bf16(const uint16_t *p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Rows [0, M) of x against blocks b .. b + NB - 1 with the bias added, as fp32 sums in
   out[][]; each block's output mask in masks[]. */
BF16 ALWAYS_INLINE void sums_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, int b,
                                  int n, int k, int M, int NB, __m512 out[][MAX_NB],
                                  __mmask16 *masks) {
  const size_t bstride = 2 * BLOCK * (size_t)((k + 1) / 2);
  blocks_bf16(x, w + (size_t)b * bstride, bstride, k, M, NB, out);
#pragma GCC unroll 2
  for (int j = 0; j < NB; j++) {
    masks[j] = block_mask(b + j, n);
    const __m512 bv = bias ? load_bf16(bias + (b + j) * BLOCK, masks[j]) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) out[r][j] = _mm512_add_ps(out[r][j], bv);
  }
}

/* ... stored into y as bf16 (rounded to nearest even) ... */
BF16 ALWAYS_INLINE void rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                                  uint16_t *y, int b, int n, int k, int M, int NB) {
  __m512 out[ROWS][MAX_NB];
  __mmask16 masks[MAX_NB];
  sums_bf16(x, w, bias, b, n, k, M, NB, out, masks);
#pragma GCC unroll 8
  for (int r = 0; r < M; r++)
#pragma GCC unroll 2
    for (int j = 0; j < NB; j++) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(out[r][j]);
      _mm256_mask_storeu_epi16(y + (size_t)r * n + (b + j) * BLOCK, masks[j], h);
    }
}

/* ... or as the fp32 sums themselves (an LM head's logits: rounding them to bf16 would
   merge near-ties, ulp 0.125 at 25). */
BF16 ALWAYS_INLINE void rows_bf16_f32(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                                      float *y, int b, int n, int k, int M, int NB) {
  __m512 out[ROWS][MAX_NB];
  __mmask16 masks[MAX_NB];
  sums_bf16(x, w, bias, b, n, k, M, NB, out, masks);
#pragma GCC unroll 8
  for (int r = 0; r < M; r++)
#pragma GCC unroll 2
    for (int j = 0; j < NB; j++)
      _mm512_mask_storeu_ps(y + (size_t)r * n + (b + j) * BLOCK, masks[j], out[r][j]);
}

/* x [m, k], w packed from [n, k], bias [n] or NULL, all bf16 -> y [m, n], bf16 or (f32_out)
   fp32. */
BF16 static void linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, void *y,
                             int m, int n, int k, int f32_out) {
  if (f32_out) {
    FOR_BLOCKS(rows_bf16_f32, x, w, bias, (float *)y, m, n, k);
  } else {
    FOR_BLOCKS(rows_bf16, x, w, bias, (uint16_t *)y, m, n, k);
  }
}

BF16 int64_t flowllm_linear_bf16(const struct flowllm_linear_bf16_args *a) {
  linear_bf16(a->x, a->w, a->bias, a->y, (int)a->m, (int)a->n, (int)a->k, (int)a->f32_out);
  return 0;
}
#endif
