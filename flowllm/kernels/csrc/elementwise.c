/* Fused elementwise ops of a Llama layer: RMSNorm (with the residual add before it), rotary
 * embeddings in place, SiLU(gate) * up; GPT-2's LayerNorm (with its residual add) and tanh
 * GELU. Each replaces 3-6 torch calls of 3-8 us apiece,
 * which at batch 1 cost as much as the layer's attention.
 *
 * Rounding follows the torch ops they replace, so bf16 results differ from them only
 * where float32 sums are added in another order: every intermediate torch rounds to the
 * model dtype is rounded here too (round to nearest even). Math is float32. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "flowllm.h"
#include "kernel_args.h"

/* ---- RMSNorm ------------------------------------------------------------------------ */

/* h = x (+ residual, rounded to the dtype and written back to residual);
 * out = w * (h * rsqrt(mean(h^2) + eps)), as F.rms_norm (fp32) or transformers' formula
 * (bf16: the normalized row is rounded to bf16 before the weight multiplies it). */
static void rms_norm_row_f32(const float *xi, float *ri, const float *w, float *oi, int64_t d,
                             float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    __m512 h = _mm512_loadu_ps(xi + j);
    if (ri) {
      h = _mm512_add_ps(h, _mm512_loadu_ps(ri + j));
      _mm512_storeu_ps(ri + j, h);
    }
    acc = _mm512_fmadd_ps(h, h, acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; j < d; j++) {
    float h = xi[j];
    if (ri) ri[j] = h = h + ri[j];
    sum += h * h;
  }
  const float *h = ri ? ri : xi;
  float inv = 1.0f / sqrtf(sum / (float)d + eps);
  __m512 vinv = _mm512_set1_ps(inv);
  for (j = 0; j + 16 <= d; j += 16)
    _mm512_storeu_ps(
        oi + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(h + j), vinv), _mm512_loadu_ps(w + j)));
  for (; j < d; j++) oi[j] = h[j] * inv * w[j];
}

static void rms_norm_row_bf16(const uint16_t *xi, uint16_t *ri, const uint16_t *w, uint16_t *oi,
                              int64_t d, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    __m512 h = bf16x16_load(xi + j);
    if (ri) {
      h = bf16x16_round(_mm512_add_ps(h, bf16x16_load(ri + j)));
      bf16x16_store(ri + j, h);
    }
    acc = _mm512_fmadd_ps(h, h, acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; j < d; j++) {
    float h = bf16_to_f32(xi[j]);
    if (ri) {
      ri[j] = f32_to_bf16(h + bf16_to_f32(ri[j]));
      h = bf16_to_f32(ri[j]);
    }
    sum += h * h;
  }
  const uint16_t *h = ri ? ri : xi;
  float inv = 1.0f / sqrtf(sum / (float)d + eps);
  __m512 vinv = _mm512_set1_ps(inv);
  for (j = 0; j + 16 <= d; j += 16) {
    __m512 normed = bf16x16_round(_mm512_mul_ps(bf16x16_load(h + j), vinv));
    bf16x16_store(oi + j, _mm512_mul_ps(normed, bf16x16_load(w + j)));
  }
  for (; j < d; j++) {
    float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(h[j]) * inv));
    oi[j] = f32_to_bf16(normed * bf16_to_f32(w[j]));
  }
}

/* ---- LayerNorm ------------------------------------------------------------------------ */

/* h = x (+ residual, rounded to the dtype and written back to residual);
 * out = (h - mean(h)) * rsqrt(var(h) + eps) * w + b, float32 math rounded once, as
 * F.layer_norm. Two passes over h for the moments (the row is in L1). One body for both
 * dtypes: LOAD(m, p) and STORE(p, m, v) move the lanes of mask m, ROUND rounds as the
 * dtype stores. */
#define F32_LOAD(m, p) _mm512_maskz_loadu_ps(m, p)
#define F32_STORE(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define F32_ROUND(v) (v)
#define BF16_ROUND(v) bf16x16_round(v)
#define LAYER_NORM_ROW(suffix, T, LOAD, STORE, ROUND)                                             \
  static void layer_norm_row_##suffix(const T *x, T *r, const T *w, const T *b, T *o, int64_t d,  \
                                      float eps) {                                                \
    __m512 acc = _mm512_setzero_ps();                                                             \
    for (int64_t j = 0; j < d; j += 16) {                                                         \
      const __mmask16 m = lanes16(d - j);                                                         \
      __m512 h = LOAD(m, x + j);                                                                  \
      if (r) {                                                                                    \
        h = ROUND(_mm512_add_ps(h, LOAD(m, r + j)));                                              \
        STORE(r + j, m, h);                                                                       \
      }                                                                                           \
      acc = _mm512_add_ps(acc, h);                                                                \
    }                                                                                             \
    const T *h = r ? r : x;                                                                       \
    const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(acc) / (float)d);                     \
    acc = _mm512_setzero_ps();                                                                    \
    for (int64_t j = 0; j < d; j += 16) {                                                         \
      const __mmask16 m = lanes16(d - j);                                                         \
      const __m512 c = _mm512_maskz_sub_ps(m, LOAD(m, h + j), mean);                              \
      acc = _mm512_fmadd_ps(c, c, acc);                                                           \
    }                                                                                             \
    const __m512 rstd = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)d + eps)); \
    for (int64_t j = 0; j < d; j += 16) {                                                         \
      const __mmask16 m = lanes16(d - j);                                                         \
      const __m512 c = _mm512_mul_ps(_mm512_sub_ps(LOAD(m, h + j), mean), rstd);                  \
      STORE(o + j, m, _mm512_fmadd_ps(c, LOAD(m, w + j), LOAD(m, b + j)));                        \
    }                                                                                             \
  }
LAYER_NORM_ROW(f32, float, F32_LOAD, F32_STORE, F32_ROUND)
LAYER_NORM_ROW(bf16, uint16_t, bf16x16_maskz_load, bf16x16_mask_store, BF16_ROUND)

/* ---- Rotary embeddings ---------------------------------------------------------------- */

/* In place on the first `rot` dims of each head of x (row i, head h at
 * x + i * row_stride + h * head_dim): x <- x * cos + roll(x, rot / 2) * sin, with the
 * [max_pos, 2, rot] table of (cos | cos) and (-sin | sin) rows indexed by position. bf16
 * rounds as torch's `(x * cos).addcmul_(roll, sin)`: x * cos, then the sum. */
#define ROPE_MAX_ROT 1024

static void rope_row_f32(float *row, const float *cs, int64_t heads, int64_t head_dim,
                         int64_t rot) {
  const int64_t half = rot / 2;
  const float *sn = cs + rot;
  for (int64_t h = 0; h < heads; h++) {
    float *v = row + h * head_dim;
    float tmp[ROPE_MAX_ROT];
    for (int64_t j = 0; j < rot; j++) tmp[j] = v[j];
    for (int64_t j = 0; j < rot; j++)
      v[j] = tmp[j] * cs[j] + tmp[j < half ? j + half : j - half] * sn[j];
  }
}

static void rope_row_bf16(uint16_t *row, const uint16_t *cs, int64_t heads, int64_t head_dim,
                          int64_t rot) {
  const int64_t half = rot / 2;
  const uint16_t *sn = cs + rot;
  for (int64_t h = 0; h < heads; h++) {
    uint16_t *v = row + h * head_dim;
    float tmp[ROPE_MAX_ROT];
    for (int64_t j = 0; j < rot; j++) tmp[j] = bf16_to_f32(v[j]);
    for (int64_t j = 0; j < rot; j++) {
      float xc = bf16_to_f32(f32_to_bf16(tmp[j] * bf16_to_f32(cs[j])));
      float rolled = tmp[j < half ? j + half : j - half];
      v[j] = f32_to_bf16(xc + rolled * bf16_to_f32(sn[j]));
    }
  }
}

/* ---- SiLU(gate) * up ---------------------------------------------------------------- */

/* out[i] = silu(gate_up[i, :inter]) * gate_up[i, inter:]; bf16 rounds silu's result first,
 * as `F.silu(gate) * up` does. */
static void silu_mul_row_f32(const float *g, float *o, int64_t inter) {
  const float *u = g + inter;
  int64_t j = 0;
  for (; j + 16 <= inter; j += 16)
    _mm512_storeu_ps(o + j, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + j)), _mm512_loadu_ps(u + j)));
  for (; j < inter; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

static void silu_mul_row_bf16(const uint16_t *g, uint16_t *o, int64_t inter) {
  const uint16_t *u = g + inter;
  int64_t j = 0;
  for (; j + 16 <= inter; j += 16) {
    __m512 act = bf16x16_round(silu16(bf16x16_load(g + j)));
    bf16x16_store(o + j, _mm512_mul_ps(act, bf16x16_load(u + j)));
  }
  for (; j < inter; j++) {
    float gj = bf16_to_f32(g[j]);
    float act = bf16_to_f32(f32_to_bf16(gj / (1.0f + expf(-gj))));
    o[j] = f32_to_bf16(act * bf16_to_f32(u[j]));
  }
}

/* ---- GELU, tanh approximation ----------------------------------------------------------- */

/* 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), with tanh(u) = 1 - 2 / (exp(2u) + 1)
 * (exp16 saturates to 0 and inf, so tanh reaches -1 and 1); float32 math, bf16 rounded
 * once, as torch's `F.gelu(x, approximate="tanh")` does. */
static inline __m512 gelu_tanh16(__m512 x) {
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608f),
                                 _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
  const __m512 e = exp16(_mm512_add_ps(u, u));
  const __m512 tanh_u =
      _mm512_sub_ps(_mm512_set1_ps(1.0f),
                    _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x),
                       _mm512_add_ps(_mm512_set1_ps(1.0f), tanh_u));
}

#define GELU_CHUNK 4096 /* elements per parallel work item */

static void gelu_tanh_chunk_f32(const float *x, float *y, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(y + j, gelu_tanh16(_mm512_loadu_ps(x + j)));
  if (j < n) {
    const __mmask16 m = (__mmask16)((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(y + j, m, gelu_tanh16(_mm512_maskz_loadu_ps(m, x + j)));
  }
}

static void gelu_tanh_chunk_bf16(const uint16_t *x, uint16_t *y, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) bf16x16_store(y + j, gelu_tanh16(bf16x16_load(x + j)));
  for (; j < n; j++) {
    uint16_t in[16] = {0}, out[16];
    in[0] = x[j];
    bf16x16_store(out, gelu_tanh16(bf16x16_load(in)));
    y[j] = out[0];
  }
}

/* ---- Entry points (kernel_args.h) ---- */

#define PARALLEL_ROWS 16 /* fewer rows run on the calling thread */

#define RMS_NORM_ENTRY(suffix)                                                                     \
  int64_t flowllm_rms_norm_##suffix(const struct flowllm_rms_norm_##suffix##_args *a) {            \
    const int64_t d = a->d;                                                                        \
    FOR_ROWS(i, a->n, PARALLEL_ROWS,                                                               \
             rms_norm_row_##suffix(a->x + i * d, a->residual ? a->residual + i * d : 0, a->weight, \
                                   a->out + i * d, d, (float)a->eps));                             \
    return 0;                                                                                      \
  }
RMS_NORM_ENTRY(f32)
RMS_NORM_ENTRY(bf16)

#define LAYER_NORM_ENTRY(suffix)                                                             \
  int64_t flowllm_layer_norm_##suffix(const struct flowllm_layer_norm_##suffix##_args *a) {  \
    const int64_t d = a->d;                                                                  \
    FOR_ROWS(i, a->n, PARALLEL_ROWS,                                                         \
             layer_norm_row_##suffix(a->x + i * d, a->residual ? a->residual + i * d : 0,    \
                                     a->weight, a->bias, a->out + i * d, d, (float)a->eps)); \
    return 0;                                                                                \
  }
LAYER_NORM_ENTRY(f32)
LAYER_NORM_ENTRY(bf16)

/* Returns how many positions fall outside the table (then nothing is written). */
#define ROPE_ENTRY(suffix)                                                                  \
  int64_t flowllm_rope_##suffix(const struct flowllm_rope_##suffix##_args *a) {             \
    const int64_t *positions = a->positions, rot = a->rot;                                  \
    int64_t outside = 0;                                                                    \
    for (int64_t i = 0; i < a->n; i++)                                                      \
      outside += positions[i] < 0 || positions[i] >= a->table_rows;                         \
    if (outside) return outside;                                                            \
    FOR_ROWS(i, a->n, PARALLEL_ROWS,                                                        \
             rope_row_##suffix(a->x + i * a->row_stride, a->table + positions[i] * 2 * rot, \
                               a->heads, a->head_dim, rot));                                \
    return 0;                                                                               \
  }
ROPE_ENTRY(f32)
ROPE_ENTRY(bf16)

#define SILU_MUL_ENTRY(suffix)                                                              \
  int64_t flowllm_silu_mul_##suffix(const struct flowllm_silu_mul_##suffix##_args *a) {     \
    const int64_t inter = a->inter;                                                         \
    FOR_ROWS(i, a->n, PARALLEL_ROWS,                                                        \
             silu_mul_row_##suffix(a->gate_up + i * 2 * inter, a->out + i * inter, inter)); \
    return 0;                                                                               \
  }
SILU_MUL_ENTRY(f32)
SILU_MUL_ENTRY(bf16)

#define GELU_ENTRY(suffix)                                                                    \
  int64_t flowllm_gelu_tanh_##suffix(const struct flowllm_gelu_tanh_##suffix##_args *a) {     \
    const int64_t numel = a->numel, chunks = (numel + GELU_CHUNK - 1) / GELU_CHUNK;           \
    FOR_ROWS(c, chunks, 4,                                                                    \
             gelu_tanh_chunk_##suffix(                                                        \
                 a->x + c * GELU_CHUNK, a->y + c * GELU_CHUNK,                                \
                 numel - c * GELU_CHUNK < GELU_CHUNK ? numel - c * GELU_CHUNK : GELU_CHUNK)); \
    return 0;                                                                                 \
  }
GELU_ENTRY(f32)
GELU_ENTRY(bf16)
