/* Greedy sampling's argmax along the rows of float32 logits, as torch.argmax(x, dim=1):
 * the first index of each row's maximum, and the first NaN if the row holds one (argmax
 * ranks NaN above everything). torch's CPU argmax along rows is a scalar loop; this is one
 * vectorized pass per row that keeps each lane's best value and its first index. */
#include <math.h>
#include <stdint.h>

#include "flowllm.h"
#include "kernel_args.h"

static int64_t argmax_row_f32(const float *x, int64_t n) {
  const vf lowest = vf_set1(-INFINITY);
  vi at = vi_iota();
  vf best = lowest;
  vi best_at = at; /* a row of -inf answers 0, as torch */
  for (int64_t j = 0; j < n; j += VL) {
    const vf v = vf_select(vm_first(n - j), lowest, vf_load_n(x + j, n - j));
    const unsigned nan = vm_bits(vf_isnan(v));
    if (nan) return j + __builtin_ctz(nan);
    const vm gt = vf_gt(v, best); /* strict: the first one kept */
    best = vf_select(gt, best, v);
    best_at = vi_select(gt, best_at, at);
    at = vi_add(at, vi_set1(VL));
  }
  float values[VL];
  int32_t indices[VL];
  vf_store(values, best);
  vi_store(indices, best_at);
  const float max = vf_max_of(best);
  int64_t first = INT64_MAX;
  for (int l = 0; l < VL; l++)
    if (values[l] == max && indices[l] < first) first = indices[l];
  return first;
}

#define PARALLEL_ELEMENTS (1 << 20) /* smaller batches run on the calling thread */

int64_t flowllm_argmax_rows_f32(const struct flowllm_argmax_rows_f32_args *a) {
  const int64_t rows = a->rows, cols = a->cols;
  const int64_t parallel_from = rows * cols >= PARALLEL_ELEMENTS ? 2 : rows + 1;
  FOR_ROWS(i, rows, parallel_from, a->out[i] = argmax_row_f32(a->x + i * a->row_stride, cols));
  return 0;
}
