/* y = x W^T + b for a few rows of x, over a weight packed in the order it is read.

Layout (built by flowllm/kernels/cpu_linear.py): the n outputs are cut into blocks of 16
(the last padded with zero rows) and each block is stored contiguously, column by column,
so a block's product streams one run of memory, one 64-byte line per step:
  fp32: [n/16][k][16]            step c: W[16 rows][c]          * x[r][c]
  bf16: [n/16][k/2][16][2]       step p: W[16 rows][2p, 2p + 1] . x[r][2p, 2p + 1]  (dpbf16)
(k rounded up to even for bf16, the pad column zero). Each step's weight line is loaded
once and multiplied into every row of x (up to ROWS at a time, CHAINS accumulators per
row), so m rows cost one pass over W per ROWS rows; the rows of a block after the first
ROWS read it again from cache. Blocks are split across OpenMP threads; a thread's blocks
are contiguous, so each thread streams one run, prefetched PREFETCH lines ahead.

Accumulation is fp32 in both; bf16 outputs are rounded to nearest even after the bias. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 16   /* outputs per block: one 512-bit fp32 vector */
#define ROWS 8     /* rows of x sharing one pass over a block */
#define UNROLL 4   /* weight lines per inner iteration */
#define PREFETCH 32 /* lines ahead (2 KiB); measured: as fast at one row, ~10% faster at four */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Accumulators per row, step c adding into chain c % CHAINS: two cover most of the FMA
   latency at one row (four measured no faster, and fit only 6 rows in the registers). The
   same for every row count, so a row's sums do not depend on how many rows share its pass:
   a row's output is the same whichever batch it is in. */
#define CHAINS 2

/* Output lanes of block b that exist (the last block may be partial). */
ALWAYS_INLINE __mmask16 block_mask(int b, int n) {
    const int left = n - b * BLOCK;
    return left >= BLOCK ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

ALWAYS_INLINE __m512 sum_chains(const __m512* acc) {
    __m512 s = acc[0];
    for (int j = 1; j < CHAINS; j++) s = _mm512_add_ps(s, acc[j]);
    return s;
}

/* Block b of every row of x, ROWS rows at a time: ROWS_FN(x rows, w, bias, y rows, b, n, k,
   M) with M a constant, so each group size compiles to its own unrolled loop. */
#define ROW_GROUPS(ROWS_FN, x, w, bias, y, b, m, n, k)                                  \
    for (int r0 = 0; r0 < (m); r0 += ROWS) {                                            \
        const size_t xo = (size_t)r0 * (k), yo = (size_t)r0 * (n);                       \
        switch ((m) - r0 < ROWS ? (m) - r0 : ROWS) {                                    \
            case 1: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, 1); break;                \
            case 2: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, 2); break;                \
            case 3: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, 3); break;                \
            case 4: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, 4); break;                \
            case 5: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, 5); break;                \
            case 6: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, 6); break;                \
            case 7: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, 7); break;                \
            default: ROWS_FN(x + xo, w, bias, y + yo, b, n, k, ROWS); break;            \
        }                                                                               \
    }

/* ---- fp32 ---- */

/* out[r] = block wb [k][16] times x row r, for M rows (M a constant after inlining). */
ALWAYS_INLINE void block_f32(const float* x, const float* wb, int k, int M, __m512* out) {
    __m512 acc[ROWS][CHAINS];
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
#pragma GCC unroll 4
        for (int j = 0; j < CHAINS; j++) acc[r][j] = _mm512_setzero_ps();
    int c = 0;
    for (; c + UNROLL <= k; c += UNROLL) {
        _mm_prefetch((const char*)(wb + (size_t)(c + PREFETCH) * BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + (size_t)(c + PREFETCH + 1) * BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + (size_t)(c + PREFETCH + 2) * BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + (size_t)(c + PREFETCH + 3) * BLOCK), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int u = 0; u < UNROLL; u++) {
            const __m512 w = _mm512_loadu_ps(wb + (size_t)(c + u) * BLOCK);
#pragma GCC unroll 8
            for (int r = 0; r < M; r++)
                acc[r][u % CHAINS] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[(size_t)r * k + c + u]),
                                                acc[r][u % CHAINS]);
        }
    }
    for (; c < k; c++) {
        const __m512 w = _mm512_loadu_ps(wb + (size_t)c * BLOCK);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++)
            acc[r][0] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[(size_t)r * k + c]), acc[r][0]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) out[r] = sum_chains(acc[r]);
}

/* Rows [0, M) of x against block b, bias added, stored into y. */
ALWAYS_INLINE void rows_f32(const float* x, const float* w, const float* bias, float* y,
                            int b, int n, int k, int M) {
    __m512 out[ROWS];
    block_f32(x, w + (size_t)b * BLOCK * k, k, M, out);
    const __mmask16 mask = block_mask(b, n);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + b * BLOCK) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
        _mm512_mask_storeu_ps(y + (size_t)r * n + b * BLOCK, mask, _mm512_add_ps(out[r], bv));
}

/* x [m, k], w packed from [n, k], bias [n] or NULL -> y [m, n]. */
static void linear_f32(const float* x, const float* w, const float* bias, float* y, int m,
                       int n, int k) {
    const int blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) ROW_GROUPS(rows_f32, x, w, bias, y, b, m, n, k);
}

/* ---- bf16 ---- */

#define BF16 __attribute__((target("avx512bf16")))

/* The bf16 pair x[i], x[i + 1] broadcast to every 32-bit lane. */
BF16 ALWAYS_INLINE __m512bh pair_bf16(const uint16_t* x, size_t i) {
    uint32_t v;
    memcpy(&v, x + i, sizeof v);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

/* out[r] = block wb [kp][16][2] times x row r (k bf16 values; an odd k's last pair is
   x[k - 1] and a zero, never the next row's first value). */
BF16 ALWAYS_INLINE void block_bf16(const uint16_t* x, const uint16_t* wb, int k, int M,
                                   __m512* out) {
    const int pairs = k / 2;
    const size_t line = 2 * BLOCK;  /* bf16 values per step */
    __m512 acc[ROWS][CHAINS];
#pragma GCC unroll 8
    for (int r = 0; r < M; r++)
#pragma GCC unroll 4
        for (int j = 0; j < CHAINS; j++) acc[r][j] = _mm512_setzero_ps();
    int p = 0;
    for (; p + UNROLL <= pairs; p += UNROLL) {
        _mm_prefetch((const char*)(wb + (size_t)(p + PREFETCH) * line), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + (size_t)(p + PREFETCH + 1) * line), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + (size_t)(p + PREFETCH + 2) * line), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + (size_t)(p + PREFETCH + 3) * line), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int u = 0; u < UNROLL; u++) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512(wb + (size_t)(p + u) * line);
#pragma GCC unroll 8
            for (int r = 0; r < M; r++)
                acc[r][u % CHAINS] = _mm512_dpbf16_ps(acc[r][u % CHAINS], w,
                                                 pair_bf16(x, (size_t)r * k + 2 * (p + u)));
        }
    }
    for (; p < pairs; p++) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(wb + (size_t)p * line);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++)
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, pair_bf16(x, (size_t)r * k + 2 * p));
    }
    if (k & 1) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(wb + (size_t)pairs * line);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++) {
            const __m512i last = _mm512_set1_epi32(x[(size_t)r * k + k - 1]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, (__m512bh)last);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) out[r] = sum_chains(acc[r]);
}

/* bf16 [16] (masked) -> fp32 [16]: the bf16 bits are the fp32's upper half. */
BF16 ALWAYS_INLINE __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Rows [0, M) of x against block b with the bias added, as fp32 sums in out[]. */
BF16 ALWAYS_INLINE __mmask16 sums_bf16(const uint16_t* x, const uint16_t* w,
                                       const uint16_t* bias, int b, int n, int k, int M,
                                       __m512* out) {
    const size_t line = 2 * BLOCK;
    block_bf16(x, w + (size_t)b * line * ((k + 1) / 2), k, M, out);
    const __mmask16 mask = block_mask(b, n);
    const __m512 bv = bias ? load_bf16(bias + b * BLOCK, mask) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) out[r] = _mm512_add_ps(out[r], bv);
    return mask;
}

/* ... stored into y as bf16 (rounded to nearest even) ... */
BF16 ALWAYS_INLINE void rows_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                  uint16_t* y, int b, int n, int k, int M) {
    __m512 out[ROWS];
    const __mmask16 mask = sums_bf16(x, w, bias, b, n, k, M, out);
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(out[r]);
        _mm256_mask_storeu_epi16(y + (size_t)r * n + b * BLOCK, mask, h);
    }
}

/* ... or as the fp32 sums themselves (an LM head's logits: rounding them to bf16 would
   merge near-ties, ulp 0.125 at 25). */
BF16 ALWAYS_INLINE void rows_bf16_f32(const uint16_t* x, const uint16_t* w,
                                      const uint16_t* bias, float* y, int b, int n, int k,
                                      int M) {
    __m512 out[ROWS];
    const __mmask16 mask = sums_bf16(x, w, bias, b, n, k, M, out);
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) _mm512_mask_storeu_ps(y + (size_t)r * n + b * BLOCK, mask, out[r]);
}

/* x [m, k], w packed from [n, k], bias [n] or NULL, all bf16 -> y [m, n], bf16 or (f32_out)
   fp32. */
BF16 static void linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                             void* y, int m, int n, int k, int f32_out) {
    const int blocks = (n + BLOCK - 1) / BLOCK;
    uint16_t* y16 = (uint16_t*)y;
    float* y32 = (float*)y;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) {
        if (f32_out) {
            ROW_GROUPS(rows_bf16_f32, x, w, bias, y32, b, m, n, k);
        } else {
            ROW_GROUPS(rows_bf16, x, w, bias, y16, b, m, n, k);
        }
    }
}

/* ---- Entry points (module.c's convention). a: x, packed w, bias (0: none), y, m, n, k
   (and for bf16, f32_out: y is fp32) ---- */

int64_t flowllm_linear_f32(const int64_t* a) {
    linear_f32((const float*)a[0], (const float*)a[1], (const float*)a[2], (float*)a[3],
               (int)a[4], (int)a[5], (int)a[6]);
    return 0;
}

BF16 int64_t flowllm_linear_bf16(const int64_t* a) {
    linear_bf16((const uint16_t*)a[0], (const uint16_t*)a[1], (const uint16_t*)a[2],
                (void*)a[3], (int)a[4], (int)a[5], (int)a[6], (int)a[7]);
    return 0;
}
