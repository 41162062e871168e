/* Library-wide helpers: the OpenMP pool size the kernels run with, and the layout of the
 * kernels' argument structs. */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#include "kernel_args.h"

/* Plain C, for ctypes: the calling thread's pool size, as the kernels see it (a check that
 * they run on the OpenMP runtime torch loaded, flowllm/openmp.py). */
int flowllm_omp_max_threads(void) { return omp_get_max_threads(); }

#define LAYOUT_FIELD(S, type, name) \
  {"flowllm_" #S "_args", #name, #type, offsetof(struct flowllm_##S##_args, name), sizeof(type)},
#define LAYOUT_STRUCT(kernel, LIST, ...)                                         \
  LIST(LAYOUT_FIELD, kernel, __VA_ARGS__){"flowllm_" #kernel "_args", "", "", 0, \
                                          sizeof(struct flowllm_##kernel##_args)},

static const struct flowllm_field layout[] = {FLOWLLM_KERNELS(LAYOUT_STRUCT)};

/* Plain C, for ctypes (flowllm/kernels/kernel_args.py compares it with its own). */
int64_t flowllm_args_layout(const struct flowllm_field **out) {
  *out = layout;
  return (int64_t)(sizeof layout / sizeof layout[0]);
}
