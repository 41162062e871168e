/* The Python side of the library: one function, call(kernel_address, *args), that packs
 * its arguments (ints, addresses, floats as double bits) into an int64 array, runs the
 * kernel with the GIL released and returns the kernel's status. Every kernel is
 * `int64_t k(const int64_t *a)`, returning 0, or what it found wrong in its inputs (an
 * index out of range, say) before touching any output, for the caller to raise.
 * One generic entry costs ~0.2 us a call, where ctypes spent ~2 us converting 8 arguments,
 * which at 300 kernel calls per decode step was most of their gain. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ARGS 24

typedef int64_t (*kernel_fn)(const int64_t *);

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
  Py_END_ALLOW_THREADS return PyLong_FromLongLong(status);
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(kernel_address, *args) -> status: run a kernel on its arguments packed as int64."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "flowllm_cpu_kernels",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_flowllm_cpu_kernels(void) { return PyModule_Create(&module); }
