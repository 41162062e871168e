/* The Python side of the library: one function, call(kernel_address, args), that runs a
 * kernel on its argument struct (kernel_args.h) with the GIL released and returns the
 * kernel's status. `args` is any buffer of the struct's bytes, which
 * flowllm/kernels/kernel_args.py builds from named, checked arguments; it is copied here
 * into an aligned buffer the kernel reads. One generic entry costs a fraction of a
 * microsecond, where ctypes spends microseconds converting a call's arguments.
 *
 * Between record_start() and record_stop() a thread's calls are also appended, as they
 * ran, to a call list ([address, words, struct as int64 words...] per call) that
 * record_stop returns as bytes; the kernel flowllm_run_calls replays such a list in one
 * call (see flowllm/kernels/call_plan.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_args.h"

#define MAX_WORDS 32 /* the largest argument struct, in int64 words */

typedef int64_t (*kernel_fn)(const void *);

/* The calling thread's call list while it records, else NULL. */
typedef struct {
  int64_t *data;
  size_t len, cap;
} CallList;
static _Thread_local CallList *recording = NULL;

static int append(CallList *list, const int64_t *values, size_t n) {
  if (list->len + n > list->cap) {
    size_t cap = list->cap ? list->cap : 1024;
    while (cap < list->len + n) cap *= 2;
    int64_t *grown = realloc(list->data, cap * sizeof *grown);
    if (grown == NULL) return -1;
    list->data = grown;
    list->cap = cap;
  }
  memcpy(list->data + list->len, values, n * sizeof *values);
  list->len += n;
  return 0;
}

/* Runs the calls in order and returns the first nonzero status (the calls after it do
 * not run). */
int64_t flowllm_run_calls(const struct flowllm_run_calls_args *a) {
  const int64_t *list = a->calls;
  for (int64_t i = 0; i + 2 <= a->len;) {
    kernel_fn fn = (kernel_fn)(intptr_t)list[i];
    int64_t status = fn(list + i + 2);
    if (status) return status;
    i += 2 + list[i + 1];
  }
  return 0;
}

static PyObject *call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "call() takes a kernel address and its argument struct");
    return NULL;
  }
  kernel_fn fn = (kernel_fn)PyLong_AsVoidPtr(args[0]);
  if (fn == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null kernel address");
    return NULL;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE)) return NULL;
  const Py_ssize_t size = view.len;
  int64_t words[MAX_WORDS];
  if (size <= 0 || size % 8 || size > (Py_ssize_t)sizeof words) {
    PyBuffer_Release(&view);
    PyErr_Format(PyExc_ValueError, "an argument struct is 8 to %d bytes, a multiple of 8, got %zd",
                 (int)sizeof words, size);
    return NULL;
  }
  memcpy(words, view.buf, (size_t)size);
  PyBuffer_Release(&view);
  int64_t status;
  Py_BEGIN_ALLOW_THREADS status = fn(words);
  Py_END_ALLOW_THREADS;
  if (recording != NULL) {
    int64_t head[2] = {(int64_t)(intptr_t)fn, (int64_t)(size / 8)};
    if (append(recording, head, 2) || append(recording, words, (size_t)(size / 8)))
      return PyErr_NoMemory();
  }
  return PyLong_FromLongLong(status);
}

static void discard(CallList *list) {
  if (list == NULL) return;
  free(list->data);
  free(list);
}

static PyObject *record_start(PyObject *self, PyObject *unused) {
  (void)self, (void)unused;
  if (recording != NULL) {
    PyErr_SetString(PyExc_RuntimeError, "this thread is already recording");
    return NULL;
  }
  recording = calloc(1, sizeof *recording);
  if (recording == NULL) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

static PyObject *record_stop(PyObject *self, PyObject *unused) {
  (void)self, (void)unused;
  CallList *list = recording;
  if (list == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "this thread is not recording");
    return NULL;
  }
  recording = NULL;
  PyObject *bytes = PyBytes_FromStringAndSize((const char *)list->data,
                                              (Py_ssize_t)(list->len * sizeof(int64_t)));
  discard(list);
  return bytes;
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(kernel_address, args) -> status: run a kernel on its argument struct's bytes."},
    {"record_start", record_start, METH_NOARGS,
     "record_start(): append this thread's calls to a call list from now on."},
    {"record_stop", record_stop, METH_NOARGS,
     "record_stop() -> bytes: stop recording; the call list as native int64s."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "flowllm_cpu_kernels",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_flowllm_cpu_kernels(void) { return PyModule_Create(&module); }
