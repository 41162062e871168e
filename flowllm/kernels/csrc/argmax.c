/* Greedy sampling's argmax along the rows of float32 logits, as torch.argmax(x, dim=1):
 * the first index of each row's maximum, and the first NaN if the row holds one (argmax
 * ranks NaN above everything). torch's CPU argmax along rows is a scalar loop; this is one
 * vectorized pass per row that keeps each lane's best value and its first index. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "flowllm.h"
#include "kernel_args.h"

static int64_t argmax_row_f32(const float *x, int64_t n) {
  const __m512i step = _mm512_set1_epi32(16);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_at = at; /* a row of -inf answers 0, as torch */
  for (int64_t j = 0; j < n; j += 16) {
    __mmask16 m = lanes16(n - j);
    __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + j);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan) return j + __builtin_ctz(nan);
    __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* strict: first one kept */
    best = _mm512_mask_mov_ps(best, gt, v);
    best_at = _mm512_mask_mov_epi32(best_at, gt, at);
    at = _mm512_add_epi32(at, step);
  }
  float max = _mm512_reduce_max_ps(best);
  __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(max), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(top, best_at);
}

#define PARALLEL_ELEMENTS (1 << 20) /* smaller batches run on the calling thread */

int64_t flowllm_argmax_rows_f32(const struct flowllm_argmax_rows_f32_args *a) {
  const int64_t rows = a->rows, cols = a->cols;
  const int64_t parallel_from = rows * cols >= PARALLEL_ELEMENTS ? 2 : rows + 1;
  FOR_ROWS(i, rows, parallel_from, a->out[i] = argmax_row_f32(a->x + i * a->row_stride, cols));
  return 0;
}
