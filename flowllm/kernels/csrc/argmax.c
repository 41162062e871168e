/* Greedy sampling's argmax along the rows of float32 logits, as torch.argmax(x, dim=1):
 * the first index of each row's maximum, and the first NaN if the row holds one (argmax
 * ranks NaN above everything). torch's CPU argmax along rows is a scalar loop; this is one
 * vectorized pass per row that keeps each lane's best value and its first index. */
#include <math.h>
#include <stdint.h>

#include "flowllm.h"
#include "kernel_args.h"

/* Keep, lane by lane, the greater of (v, at) and (best, best_at): strictly greater, so the
 * first index seen is kept. */
static inline void keep_greater(vf v, vi at, vf *best, vi *best_at) {
  const vm gt = vf_gt(v, *best);
  *best = vf_select(gt, *best, v);
  *best_at = vi_select(gt, *best_at, at);
}

/* (b, b_at) into (a, a_at), lane by lane: the greater value, on a tie the smaller index. */
static inline void merge_best(vf b, vi b_at, vf *a, vi *a_at) {
  const vm take = vm_or(vf_gt(b, *a), vm_and(vf_eq(b, *a), vi_lt(b_at, *a_at)));
  *a = vf_select(take, *a, b);
  *a_at = vi_select(take, *a_at, b_at);
}

/* Independent running maxima, each over every CHAINS-th vector: one compare-and-select
 * chain does not wait for the previous vector's, so a row in cache is read at the loads'
 * pace rather than at one chain's latency per vector. */
#define CHAINS 4

static int64_t argmax_row_f32(const float *x, int64_t n) {
  const vf lowest = vf_set1(-INFINITY);
  vf best[CHAINS];
  vi best_at[CHAINS];
  for (int c = 0; c < CHAINS; c++) {
    best[c] = lowest;
    best_at[c] = vi_iota(); /* a row of -inf answers 0, as torch */
  }
  vi at = vi_iota();
  int64_t j = 0;
  for (; j + CHAINS * VL <= n; j += CHAINS * VL) {
    for (int c = 0; c < CHAINS; c++) {
      const vf v = vf_load(x + j + c * VL);
      const unsigned nan = vm_bits(vf_isnan(v));
      if (nan) return j + c * VL + __builtin_ctz(nan);
      keep_greater(v, at, &best[c], &best_at[c]);
      at = vi_add(at, vi_set1(VL));
    }
  }
  for (; j < n; j += VL) {
    const vf v = vf_select(vm_first(n - j), lowest, vf_load_n(x + j, n - j));
    const unsigned nan = vm_bits(vf_isnan(v));
    if (nan) return j + __builtin_ctz(nan);
    keep_greater(v, at, &best[0], &best_at[0]);
    at = vi_add(at, vi_set1(VL));
  }
  for (int c = 1; c < CHAINS; c++) merge_best(best[c], best_at[c], &best[0], &best_at[0]);
  float values[VL];
  int32_t indices[VL];
  vf_store(values, best[0]);
  vi_store(indices, best_at[0]);
  const float max = vf_max_of(best[0]);
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
