/* Library-wide helpers: the OpenMP pool size the kernels run with. */
#include <omp.h>

#include "kernel_args.h"

/* Plain C, for ctypes: a check that the kernels run on the OpenMP runtime torch loaded
 * (flowllm/openmp.py). */
int flowllm_omp_max_threads(void) { return omp_get_max_threads(); }
