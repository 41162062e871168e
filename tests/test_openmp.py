"""One OpenMP pool per process: a thread's pool size is its own, and a passing thread
takes its pool with it."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from flowllm import openmp
from flowllm.kernels import native


def _in_new_thread(fn: object) -> object:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    thread.start()
    thread.join()
    return out[0]


def _named(name: str) -> int:
    """The process's threads whose OS name is `name`."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            count += Path(f"/proc/self/task/{tid}/comm").read_text().strip() == name
        except FileNotFoundError:  # ended meanwhile
            continue
    return count


def test_size_pool_sizes_the_calling_thread_alone() -> None:
    """The kernels and torch see the size; the caller and threads started later do not."""
    lib = native.library()
    fresh = _in_new_thread(openmp.pool_size)

    def one() -> tuple[int, int | None]:
        openmp.size_pool(1)
        return openmp.pool_size(), None if lib is None else lib.omp_max_threads()

    seen = _in_new_thread(one)
    assert seen == (1, None if lib is None else 1)
    assert _in_new_thread(openmp.pool_size) == fresh  # a later thread starts as before
    main = openmp.pool_size()
    assert _in_new_thread(lambda: (openmp.size_pool(main + 1), openmp.pool_size())[1]) == main + 1
    assert openmp.pool_size() == main


def test_one_thread_holds_for_the_block_then_restores() -> None:
    before = openmp.pool_size()
    with openmp.one_thread():
        assert openmp.pool_size() == 1
        assert torch.get_num_threads() == 1
    assert openmp.pool_size() == before


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a pool needs two CPUs")
def test_a_passing_thread_takes_its_pool_with_it() -> None:
    """Its result comes back, its exception is raised again, and the pool threads its
    parallel regions opened end with it."""
    x = torch.randn(512, 512)

    def parallel_work() -> int:
        ctypes.CDLL(None).prctl(15, b"test-passing")  # PR_SET_NAME: its pool inherits it
        openmp.size_pool(2)
        (x @ x).sum()
        return _named("test-passing")

    assert openmp.in_passing_thread(parallel_work) >= 2  # the thread and its pool's
    deadline = time.monotonic() + 10  # a pool's threads end on their own, just after it
    while _named("test-passing") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _named("test-passing") == 0

    def fails() -> None:
        raise KeyError("lost")

    with pytest.raises(KeyError, match="lost"):
        openmp.in_passing_thread(fails)
