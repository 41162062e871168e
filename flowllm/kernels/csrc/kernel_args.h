/* The typed interface of the kernels: each kernel `flowllm_<name>` takes one
 * `const struct flowllm_<name>_args *` and returns 0, or what it found wrong in its inputs
 * before writing anything (an index out of range), for the caller to raise.
 *
 * Each struct's fields are listed once, in an X-macro F(struct, type, name), which declares
 * the structs and the kernels' prototypes. The kernels (C) and the torch ops that call them
 * (ops.cpp, C++) both include this header, so the compiler matches every field by name and
 * type on both sides. Every field is 8 bytes (pointers, int64_t, double), so a struct has
 * no padding and is a whole number of int64 words, the unit of ops.cpp's call lists.
 * Pointers name the element type they point to: bf16_t and f16_t are the raw bits of
 * bfloat16 and IEEE half values, void a tensor whose dtype another field gives. */
#ifndef FLOWLLM_KERNEL_ARGS_H
#define FLOWLLM_KERNEL_ARGS_H

#include <stdint.h>

typedef uint16_t bf16_t;
typedef uint16_t f16_t;

/* ---- Field lists: F(S, type, name); the trailing parameters are element types ---- */

/* x [m, k] and y [m, n] row-major; w packed from [n, k] (csrc/linear.c); bias [n] or NULL */
#define FLOWLLM_LINEAR_F32_ARGS(F, S, ...) \
  F(S, const float *, x)                   \
  F(S, const float *, w)                   \
  F(S, const float *, bias)                \
  F(S, float *, y)                         \
  F(S, int64_t, m)                         \
  F(S, int64_t, n)                         \
  F(S, int64_t, k)

/* y is float32 when f32_out, else bfloat16 */
#define FLOWLLM_LINEAR_BF16_ARGS(F, S, ...) \
  F(S, const bf16_t *, x)                   \
  F(S, const bf16_t *, w)                   \
  F(S, const bf16_t *, bias)                \
  F(S, void *, y)                           \
  F(S, int64_t, m)                          \
  F(S, int64_t, n)                          \
  F(S, int64_t, k)                          \
  F(S, int64_t, f32_out)

/* query, out [tokens][heads][head_dim] (token strides in elements); caches [num_blocks]
 * [block_size][kv_heads][head_dim], float32 or (bf16 = 1) bfloat16; block_tables
 * [num_seqs][table_stride]; seqs, rows [n] or both NULL (sequence i, query row i);
 * window: the last positions a query sees (0: all); softcap: scores capped (0: not) */
#define FLOWLLM_DECODE_ATTENTION_ARGS(F, S, ...) \
  F(S, int64_t, bf16)                            \
  F(S, const void *, query)                      \
  F(S, int64_t, q_stride)                        \
  F(S, const void *, k_cache)                    \
  F(S, const void *, v_cache)                    \
  F(S, int64_t, num_blocks)                      \
  F(S, int64_t, block_size)                      \
  F(S, int64_t, kv_heads)                        \
  F(S, int64_t, group)                           \
  F(S, int64_t, head_dim)                        \
  F(S, const int32_t *, block_tables)            \
  F(S, int64_t, table_stride)                    \
  F(S, const int32_t *, seq_lens)                \
  F(S, int64_t, num_seqs)                        \
  F(S, const int64_t *, seqs)                    \
  F(S, const int64_t *, rows)                    \
  F(S, int64_t, n)                               \
  F(S, int64_t, num_tokens)                      \
  F(S, double, scale)                            \
  F(S, int64_t, window)                          \
  F(S, double, softcap)                          \
  F(S, void *, out)                              \
  F(S, int64_t, out_stride)

/* cache rows slots[i] <- key/value rows i: `row` elements of `elem_size` bytes each */
#define FLOWLLM_STORE_KV_ARGS(F, S, ...) \
  F(S, const void *, key)                \
  F(S, int64_t, key_stride)              \
  F(S, const void *, value)              \
  F(S, int64_t, value_stride)            \
  F(S, void *, k_cache)                  \
  F(S, void *, v_cache)                  \
  F(S, int64_t, num_slots)               \
  F(S, const int64_t *, slots)           \
  F(S, int64_t, n)                       \
  F(S, int64_t, row)                     \
  F(S, int64_t, elem_size)

/* x, out [n][d]; residual [n][d] or NULL (then x + residual is normed and written back) */
#define FLOWLLM_RMS_NORM_ARGS(F, S, T) \
  F(S, const T *, x)                   \
  F(S, T *, residual)                  \
  F(S, const T *, weight)              \
  F(S, T *, out)                       \
  F(S, int64_t, n)                     \
  F(S, int64_t, d)                     \
  F(S, double, eps)

#define FLOWLLM_LAYER_NORM_ARGS(F, S, T) \
  F(S, const T *, x)                     \
  F(S, T *, residual)                    \
  F(S, const T *, weight)                \
  F(S, const T *, bias)                  \
  F(S, T *, out)                         \
  F(S, int64_t, n)                       \
  F(S, int64_t, d)                       \
  F(S, double, eps)

/* x rows of row_stride elements, rotated in place; table [table_rows][2][rot] */
#define FLOWLLM_ROPE_ARGS(F, S, T) \
  F(S, T *, x)                     \
  F(S, const T *, table)           \
  F(S, int64_t, table_rows)        \
  F(S, const int64_t *, positions) \
  F(S, int64_t, n)                 \
  F(S, int64_t, heads)             \
  F(S, int64_t, head_dim)          \
  F(S, int64_t, row_stride)        \
  F(S, int64_t, rot)

/* gate_up [n][2 inter] -> out [n][inter] */
#define FLOWLLM_SILU_MUL_ARGS(F, S, T) \
  F(S, const T *, gate_up)             \
  F(S, T *, out)                       \
  F(S, int64_t, n)                     \
  F(S, int64_t, inter)

#define FLOWLLM_GELU_TANH_ARGS(F, S, T) \
  F(S, const T *, x)                    \
  F(S, T *, y)                          \
  F(S, int64_t, numel)

/* x [rows] rows of row_stride elements -> out [rows]; cols < 2^31 */
#define FLOWLLM_ARGMAX_ARGS(F, S, ...) \
  F(S, const float *, x)               \
  F(S, int64_t, rows)                  \
  F(S, int64_t, cols)                  \
  F(S, int64_t, row_stride)            \
  F(S, int64_t *, out)

/* x [m][k] -> y [m][n]; W [n][k] as codes C, scales and offsets SC [n][k / group]
 * (mins NULL: no offsets), bias [n] or NULL; interleaved: W's codes, scales and offsets
 * in the 16-row interleaved layout (csrc/quant.c describes the layouts); x, bias and y
 * float32, or bfloat16 with bf16 set */
#define FLOWLLM_QLINEAR_ARGS(F, S, C, SC) \
  F(S, const void *, x)                   \
  F(S, const C *, codes)                  \
  F(S, const SC *, scales)                \
  F(S, const SC *, mins)                  \
  F(S, const void *, bias)                \
  F(S, void *, y)                         \
  F(S, int64_t, m)                        \
  F(S, int64_t, n)                        \
  F(S, int64_t, k)                        \
  F(S, int64_t, group)                    \
  F(S, int64_t, interleaved)              \
  F(S, int64_t, bf16)

/* out [rows][k] float32 = W[ids[i]], or W[row0 + i] when ids is NULL */
#define FLOWLLM_DEQUANT_ARGS(F, S, C, SC) \
  F(S, const C *, codes)                  \
  F(S, const SC *, scales)                \
  F(S, const SC *, mins)                  \
  F(S, const int64_t *, ids)              \
  F(S, int64_t, rows)                     \
  F(S, int64_t, row0)                     \
  F(S, float *, out)                      \
  F(S, int64_t, n)                        \
  F(S, int64_t, k)                        \
  F(S, int64_t, group)                    \
  F(S, int64_t, interleaved)

/* ---- Every kernel: K(name, field list, element types...) ---- */

#define FLOWLLM_QUANT_KERNELS(K, name, LIST) \
  K(name##_q4_f16, LIST, uint8_t, f16_t)     \
  K(name##_q4_f32, LIST, uint8_t, float)     \
  K(name##_q8_f16, LIST, int8_t, f16_t)      \
  K(name##_q8_f32, LIST, int8_t, float)

#define FLOWLLM_TYPED_KERNELS(K, name, LIST) \
  K(name##_f32, LIST, float)                 \
  K(name##_bf16, LIST, bf16_t)

#define FLOWLLM_KERNELS(K)                                      \
  K(linear_f32, FLOWLLM_LINEAR_F32_ARGS)                        \
  K(linear_bf16, FLOWLLM_LINEAR_BF16_ARGS)                      \
  K(decode_attention, FLOWLLM_DECODE_ATTENTION_ARGS)            \
  K(store_kv, FLOWLLM_STORE_KV_ARGS)                            \
  FLOWLLM_TYPED_KERNELS(K, rms_norm, FLOWLLM_RMS_NORM_ARGS)     \
  FLOWLLM_TYPED_KERNELS(K, layer_norm, FLOWLLM_LAYER_NORM_ARGS) \
  FLOWLLM_TYPED_KERNELS(K, rope, FLOWLLM_ROPE_ARGS)             \
  FLOWLLM_TYPED_KERNELS(K, silu_mul, FLOWLLM_SILU_MUL_ARGS)     \
  FLOWLLM_TYPED_KERNELS(K, gelu_tanh, FLOWLLM_GELU_TANH_ARGS)   \
  K(argmax_rows_f32, FLOWLLM_ARGMAX_ARGS)                       \
  FLOWLLM_QUANT_KERNELS(K, qlinear, FLOWLLM_QLINEAR_ARGS)       \
  FLOWLLM_QUANT_KERNELS(K, dequant, FLOWLLM_DEQUANT_ARGS)

#ifdef __cplusplus
extern "C" {
#endif

#define FLOWLLM_ARG_FIELD(S, type, name) type name;
#define FLOWLLM_ARGS_STRUCT(kernel, LIST, ...)   \
  struct flowllm_##kernel##_args {               \
    LIST(FLOWLLM_ARG_FIELD, kernel, __VA_ARGS__) \
  };                                             \
  int64_t flowllm_##kernel(const struct flowllm_##kernel##_args *a);
FLOWLLM_KERNELS(FLOWLLM_ARGS_STRUCT)
#undef FLOWLLM_ARGS_STRUCT
#undef FLOWLLM_ARG_FIELD

/* The calling thread's OpenMP pool size, as the kernels see it. */
int flowllm_omp_max_threads(void);

#ifdef __cplusplus
}
#endif

#endif
