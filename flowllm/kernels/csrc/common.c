/* Library-wide helpers: the OpenMP pool size the kernels run with (a plain C function,
 * called through ctypes by the tests that check the pool is torch's). */
#include <omp.h>

int flowllm_omp_max_threads(void) { return omp_get_max_threads(); }
