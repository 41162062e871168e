/* The Python side of the library: one function, call(kernel_address, *args), that packs
 * its arguments (ints, addresses, floats as double bits) into an int64 array, runs the
 * kernel with the GIL released and returns the kernel's status. Every kernel is
 * `int64_t k(const int64_t *a)`, returning 0, or what it found wrong in its inputs (an
 * index out of range, say) before touching any output, for the caller to raise.
 * One generic entry costs ~0.2 us a call, where ctypes spent ~2 us converting 8 arguments,
 * which at 300 kernel calls per decode step was most of their gain.
 *
 * Between record_start() and record_stop() a thread's calls are also appended, as they
 * ran, to a call list ([address, nargs, args...] per call) that record_stop returns as
 * bytes; the kernel flowllm_run_calls replays such a list in one call (see
 * flowllm/kernels/call_plan.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ARGS 24

typedef int64_t (*kernel_fn)(const int64_t *);

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

/* a: call list address, its length in int64s. Runs the calls in order and returns the
 * first nonzero status (the calls after it do not run). */
int64_t flowllm_run_calls(const int64_t *a) {
  const int64_t *list = (const int64_t *)(intptr_t)a[0];
  int64_t len = a[1];
  for (int64_t i = 0; i + 2 <= len;) {
    kernel_fn fn = (kernel_fn)(intptr_t)list[i];
    int64_t nargs = list[i + 1];
    int64_t status = fn(list + i + 2);
    if (status) return status;
    i += 2 + nargs;
  }
  return 0;
}

static PyObject *call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs < 1 || nargs > MAX_ARGS + 1) {
    PyErr_Format(PyExc_TypeError, "call() takes a kernel address and at most %d arguments",
                 MAX_ARGS);
    return NULL;
  }
  kernel_fn fn = (kernel_fn)PyLong_AsVoidPtr(args[0]);
  if (fn == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null kernel address");
    return NULL;
  }
  int64_t packed[MAX_ARGS];
  for (Py_ssize_t i = 1; i < nargs; i++) {
    PyObject *arg = args[i];
    if (PyFloat_Check(arg)) {
      double d = PyFloat_AS_DOUBLE(arg);
      memcpy(&packed[i - 1], &d, sizeof d);
    } else {
      packed[i - 1] = (int64_t)PyLong_AsLongLong(arg);
      if (packed[i - 1] == -1 && PyErr_Occurred()) return NULL;
    }
  }
  int64_t status;
  Py_BEGIN_ALLOW_THREADS status = fn(packed);
  Py_END_ALLOW_THREADS;
  if (recording != NULL) {
    int64_t head[2] = {(int64_t)(intptr_t)fn, (int64_t)(nargs - 1)};
    if (append(recording, head, 2) || append(recording, packed, (size_t)(nargs - 1)))
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
  PyObject *bytes =
      PyBytes_FromStringAndSize((const char *)list->data, (Py_ssize_t)(list->len * sizeof(int64_t)));
  discard(list);
  return bytes;
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(kernel_address, *args) -> status: run a kernel on its arguments packed as int64."},
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
