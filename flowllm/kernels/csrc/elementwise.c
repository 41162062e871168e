/* Fused elementwise ops of a Llama layer: RMSNorm (with the residual add before it), rotary
 * embeddings in place, SiLU(gate) * up; GPT-2's LayerNorm (with its residual add) and tanh
 * GELU. Each replaces 3-6 small torch calls, whose fixed costs at batch 1 add up to as
 * much as the layer's attention (benchmarks/README.md, "Kernel design figures").
 *
 * Rounding follows the torch ops they replace, so bf16 results differ from them only
 * where float32 sums are added in another order: every intermediate torch rounds to the
 * model dtype is rounded here too (round to nearest even). Math is float32. */
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
  vf acc = vf_zero();
  int64_t j = 0;
  for (; j + VL <= d; j += VL) {
    vf h = vf_load(xi + j);
    if (ri) {
      h = vf_add(h, vf_load(ri + j));
      vf_store(ri + j, h);
    }
    acc = vf_fma(h, h, acc);
  }
  float sum = vf_sum(acc);
  for (; j < d; j++) {
    float h = xi[j];
    if (ri) ri[j] = h = h + ri[j];
    sum += h * h;
  }
  const float *h = ri ? ri : xi;
  float inv = 1.0f / sqrtf(sum / (float)d + eps);
  const vf vinv = vf_set1(inv);
  for (j = 0; j + VL <= d; j += VL)
    vf_store(oi + j, vf_mul(vf_mul(vf_load(h + j), vinv), vf_load(w + j)));
  for (; j < d; j++) oi[j] = h[j] * inv * w[j];
}

static void rms_norm_row_bf16(const uint16_t *xi, uint16_t *ri, const uint16_t *w, uint16_t *oi,
                              int64_t d, float eps) {
  vf acc = vf_zero();
  int64_t j = 0;
  for (; j + VL <= d; j += VL) {
    vf h = vf_load_bf16(xi + j);
    if (ri) {
      h = vf_round_bf16(vf_add(h, vf_load_bf16(ri + j)));
      vf_store_bf16(ri + j, h);
    }
    acc = vf_fma(h, h, acc);
  }
  float sum = vf_sum(acc);
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
  const vf vinv = vf_set1(inv);
  for (j = 0; j + VL <= d; j += VL) {
    const vf normed = vf_round_bf16(vf_mul(vf_load_bf16(h + j), vinv));
    vf_store_bf16(oi + j, vf_mul(normed, vf_load_bf16(w + j)));
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
 * dtypes: LOAD(p, n) and STORE(p, n, v) move the first n lanes (at most VL), ROUND rounds
 * as the dtype stores. */
#define F32_ROUND(v) (v)
#define LAYER_NORM_ROW(suffix, T, LOAD, STORE, ROUND)                                            \
  static void layer_norm_row_##suffix(const T *x, T *r, const T *w, const T *b, T *o, int64_t d, \
                                      float eps) {                                               \
    vf acc = vf_zero();                                                                          \
    for (int64_t j = 0; j < d; j += VL) {                                                        \
      vf h = LOAD(x + j, d - j);                                                                 \
      if (r) {                                                                                   \
        h = ROUND(vf_add(h, LOAD(r + j, d - j)));                                                \
        STORE(r + j, d - j, h);                                                                  \
      }                                                                                          \
      acc = vf_add(acc, h);                                                                      \
    }                                                                                            \
    const T *h = r ? r : x;                                                                      \
    const vf mean = vf_set1(vf_sum(acc) / (float)d);                                             \
    acc = vf_zero();                                                                             \
    for (int64_t j = 0; j < d; j += VL) {                                                        \
      const vf c = vf_select(vm_first(d - j), vf_zero(), vf_sub(LOAD(h + j, d - j), mean));      \
      acc = vf_fma(c, c, acc);                                                                   \
    }                                                                                            \
    const vf rstd = vf_set1(1.0f / sqrtf(vf_sum(acc) / (float)d + eps));                         \
    for (int64_t j = 0; j < d; j += VL) {                                                        \
      const vf c = vf_mul(vf_sub(LOAD(h + j, d - j), mean), rstd);                               \
      STORE(o + j, d - j, vf_fma(c, LOAD(w + j, d - j), LOAD(b + j, d - j)));                    \
    }                                                                                            \
  }
LAYER_NORM_ROW(f32, float, vf_load_n, vf_store_n, F32_ROUND)
LAYER_NORM_ROW(bf16, uint16_t, vf_load_bf16_n, vf_store_bf16_n, vf_round_bf16)

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
  for (; j + VL <= inter; j += VL) vf_store(o + j, vf_mul(vf_silu(vf_load(g + j)), vf_load(u + j)));
  for (; j < inter; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

static void silu_mul_row_bf16(const uint16_t *g, uint16_t *o, int64_t inter) {
  const uint16_t *u = g + inter;
  int64_t j = 0;
  for (; j + VL <= inter; j += VL) {
    const vf act = vf_round_bf16(vf_silu(vf_load_bf16(g + j)));
    vf_store_bf16(o + j, vf_mul(act, vf_load_bf16(u + j)));
  }
  for (; j < inter; j++) {
    float gj = bf16_to_f32(g[j]);
    float act = bf16_to_f32(f32_to_bf16(gj / (1.0f + expf(-gj))));
    o[j] = f32_to_bf16(act * bf16_to_f32(u[j]));
  }
}

/* ---- GELU, tanh approximation ----------------------------------------------------------- */

/* 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))); float32 math, bf16 rounded once, as
 * torch's `F.gelu(x, approximate="tanh")` does. */
static inline vf vf_gelu_tanh(vf x) {
  const vf x3 = vf_mul(vf_mul(x, x), x);
  const vf u = vf_mul(vf_set1(0.7978845608f), vf_fma(vf_set1(0.044715f), x3, x));
  return vf_mul(vf_mul(vf_set1(0.5f), x), vf_add(vf_set1(1.0f), vf_tanh(u)));
}

#define GELU_CHUNK 4096 /* elements per parallel work item */

static void gelu_tanh_chunk_f32(const float *x, float *y, int64_t n) {
  int64_t j = 0;
  for (; j + VL <= n; j += VL) vf_store(y + j, vf_gelu_tanh(vf_load(x + j)));
  if (j < n) vf_store_n(y + j, n - j, vf_gelu_tanh(vf_load_n(x + j, n - j)));
}

static void gelu_tanh_chunk_bf16(const uint16_t *x, uint16_t *y, int64_t n) {
  int64_t j = 0;
  for (; j + VL <= n; j += VL) vf_store_bf16(y + j, vf_gelu_tanh(vf_load_bf16(x + j)));
  if (j < n) vf_store_bf16_n(y + j, n - j, vf_gelu_tanh(vf_load_bf16_n(x + j, n - j)));
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
