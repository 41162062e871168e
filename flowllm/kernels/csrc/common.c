/* Library-wide helpers: the OpenMP pool size the kernels run with. */
#include <omp.h>
#include <stdint.h>

/* Plain C, for ctypes: the calling thread's pool size. */
int flowllm_omp_max_threads(void) { return omp_get_max_threads(); }

/* a: threads. OpenMP keeps the pool size per thread, and torch sets it in a thread only at
 * that thread's first parallel op, so a worker thread that calls a kernel first would run
 * it on OpenMP's default (every core) instead of torch's count. */
int64_t flowllm_omp_set_threads(const int64_t *a) {
  omp_set_num_threads((int)a[0]);
  return 0;
}
