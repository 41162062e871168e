"""glibc's heap: how much of it is in use, and giving its free pages back to the system.

Why: `keep_freed_memory_mapped` raises glibc's trim and mmap thresholds so that a
step's large temporaries reuse freed heap instead of fresh mappings; glibc then never
gives back the heap a burst of steps freed, and the process stays as large as its largest
burst. `trim` (glibc's `malloc_trim(0)`) gives it back: it shrinks the top of the main
heap and releases every whole free page inside the heaps of all arenas. The execute
stage calls it once steps have stopped coming (`flowllm.stages.idle_heap_trim`).

The C library is looked up once; where it is not glibc (musl, macOS) every function here
does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

_log = structlog.get_logger("flowllm.models")
_STATM = Path("/proc/self/statm")


class Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33+): the heap's statistics, in bytes."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError as e:
        _log.debug("no C library to load", error=str(e))
        return None


@functools.cache
def _function(name: str, restype: Any) -> Callable[..., Any] | None:
    lib = libc()
    fn: Callable[..., Any] | None = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        _log.debug("the C library has no glibc heap function", function=name)
        return None
    fn.restype = restype  # type: ignore[attr-defined]
    return fn


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8


def one_arena() -> bool:
    """Make every thread that allocates from now on share the main heap (M_ARENA_MAX = 1).

    With glibc's default arena per thread, each of the threads a step runs on keeps heap
    of its own, fragmented as its allocations happened to fall: the core's RSS moved by
    tens of MB between identical bursts with nothing held, and freed memory on one thread
    could not serve another. A thread that allocated before keeps its own arena, so a
    process that runs steps calls this before it starts any thread (the core process,
    first thing). False where the C library has no mallopt."""
    return _mallopt(((_M_ARENA_MAX, 1),))


def keep_freed_memory_mapped() -> bool:
    """Let glibc reuse freed heap memory for large tensors instead of unmapping it.

    A CPU step allocates many large temporaries (gathered KV, activations, logits). By
    default glibc serves each from a fresh mmap, so every step pays page faults and page
    zeroing on all of them (benchmarks/README.md "Heap reuse for step temporaries" has the
    figures). Process-wide and idempotent; returns False where the C library has no mallopt.

    The thresholds alone do not reach allocations on worker threads (execute and sample
    run there): a thread's own arena holds at most 64 MiB a heap, and a larger block is
    mmapped and unmapped every time whatever the thresholds say. So this also limits the
    arenas to one (`one_arena`). What the heap keeps this way is given back once the
    engine goes idle (`trim`).
    """
    thresholds = (
        (_M_MMAP_THRESHOLD, 1 << 30),
        (_M_TRIM_THRESHOLD, 1 << 30),
        (_M_TOP_PAD, 64 << 20),
    )
    return _mallopt(thresholds) and one_arena()


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    lib = libc()
    mallopt = getattr(lib, "mallopt", None) if lib is not None else None
    if mallopt is None:
        return False
    return all(mallopt(param, value) for param, value in settings)


def in_use() -> int | None:
    """Bytes the heap holds in use: blocks in its arenas plus mmapped blocks (None without
    glibc's `mallinfo2`)."""
    mallinfo2 = _function("mallinfo2", Mallinfo2)
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def resident_bytes() -> int | None:
    """The process's resident set size (None where `/proc` does not show it)."""
    try:
        pages = int(_STATM.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def trim() -> bool:
    """Give every free page of the heap back to the system (`malloc_trim(0)`); False where
    the C library has no `malloc_trim`. Blocks other threads' allocations while it runs."""
    malloc_trim = _function("malloc_trim", ctypes.c_int)
    if malloc_trim is None:
        return False
    resident = resident_bytes()
    started = time.perf_counter()
    malloc_trim(ctypes.c_size_t(0))
    seconds = time.perf_counter() - started
    after = resident_bytes()
    returned = resident - after if resident is not None and after is not None else None
    _log.debug("heap trimmed", ms=round(seconds * 1e3, 2), returned_bytes=returned,
               resident_bytes=after, in_use_bytes=in_use())  # fmt: skip
    return True
