/* Library-wide helpers: the OpenMP pool size the kernels run with. */
#include <omp.h>

int flowllm_omp_max_threads(void) { return omp_get_max_threads(); }
