"""One OpenMP pool per process, owned by the thread that runs the model's steps.

torch and the native kernels share GNU OpenMP, which gives every thread that runs a
parallel region on more than one thread a pool of threads of its own, kept for as long as
that thread lives. Once the pools' threads outnumber the CPUs, it cuts every spin-wait
short, so each region wakes its threads through the kernel, which slows a small step's
parallel products (benchmarks/README.md, "One OpenMP pool per process", has the figures).
So the engine keeps one pool: the model's thread sizes its pool to the configured threads
(`size_pool`), every other thread that runs torch work runs it on one (`size_pool(1)` at
its start, `one_thread()` around a graph run on an event loop), and the model loads in a
thread that ends, and its pool with it, once loaded (`in_passing_thread`).

OpenMP keeps the pool size per thread, and torch sets it at a thread's first parallel op
(to `torch.set_num_threads`' value, where that was called), so `size_pool` lets torch do
that first, then sets the size through the OpenMP runtime torch loaded into the global
namespace, which changes the calling thread alone (`torch.set_num_threads` would also
change what every thread started later begins with). Importing this module loads no torch
(a front process imports the stages that use it).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")


@cache
def _runtime() -> ctypes.CDLL:
    import torch  # noqa: F401  (loads the OpenMP runtime, globally, for the lookups below)

    runtime = ctypes.CDLL(None)
    runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
    runtime.omp_get_max_threads.restype = ctypes.c_int
    return runtime


def pool_size() -> int:
    """The calling thread's pool size: the threads its next parallel region runs on."""
    import torch

    return torch.get_num_threads()  # torch's first setting of this thread happens here


def size_pool(threads: int) -> None:
    """Run the calling thread's parallel regions (torch's and the kernels') on `threads`."""
    pool_size()
    _runtime().omp_set_num_threads(max(1, threads))


@contextmanager
def one_thread() -> Iterator[None]:
    """The calling thread on one OpenMP thread for the block, then as it was."""
    before = pool_size()
    size_pool(1)
    try:
        yield
    finally:
        size_pool(before)


def in_thread(fn: Callable[..., T], *args: Any, name: str) -> Callable[[], T]:
    """Start `fn(*args)` in a new daemon thread (an interrupted caller does not wait for it
    at exit), which ends when it returns, taking any pool it opened with it; the callable
    returned waits for its result, or raises its exception."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # raised again in the caller
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future.result


def in_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a new thread that ends when it returns (`in_thread`): its result."""
    return in_thread(fn, *args, name="flowllm-load")()
