"""glibc's heap, tuned as the runner tunes it, keeps what a burst freed until `trim` gives
it back; `in_use` counts the burst's blocks. Checked against the kernel's own count of the
process's resident pages, in a fresh process (the tuning is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from flowllm.models import glibc_heap

BURST_MB = 128

# Allocates and touches BURST_MB one-MiB blocks, frees them, and prints the heap in use
# and the resident bytes at each point.
SCRIPT = textwrap.dedent(
    f"""
    import ctypes, json
    from flowllm.models import glibc_heap

    assert glibc_heap.keep_freed_memory_mapped()
    libc = glibc_heap.libc()
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    points = {{"start": (glibc_heap.in_use(), glibc_heap.resident_bytes())}}
    blocks = [libc.malloc(1 << 20) for _ in range({BURST_MB})]
    for block in blocks:
        ctypes.memset(block, 1, 1 << 20)
    points["burst"] = (glibc_heap.in_use(), glibc_heap.resident_bytes())
    for block in blocks:
        libc.free(block)
    points["freed"] = (glibc_heap.in_use(), glibc_heap.resident_bytes())
    assert glibc_heap.trim()
    points["trimmed"] = (glibc_heap.in_use(), glibc_heap.resident_bytes())
    print(json.dumps(points))
    """
)


def has_glibc() -> bool:
    lib = glibc_heap.libc()
    return lib is not None and hasattr(lib, "mallinfo2") and hasattr(lib, "malloc_trim")


@pytest.mark.skipif(not has_glibc(), reason="needs glibc 2.33+ (mallinfo2, malloc_trim)")
def test_trim_gives_back_what_a_burst_freed() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    points = {k: (heap / 2**20, rss / 2**20) for k, (heap, rss) in
              json.loads(result.stdout.splitlines()[-1]).items()}  # fmt: skip
    start, burst, freed, trimmed = (points[k] for k in ("start", "burst", "freed", "trimmed"))
    assert burst[0] - start[0] >= BURST_MB  # in use: the blocks and their headers
    assert freed[0] - start[0] < 1
    assert burst[1] - start[1] >= BURST_MB * 0.9  # resident: the touched pages
    assert freed[1] - start[1] >= BURST_MB * 0.9  # freed but kept: the tuned heap never trims
    assert freed[1] - trimmed[1] >= BURST_MB * 0.9  # given back


# Mallocs a block on a new thread and prints whether it lies in the main heap ([heap] in
# /proc/self/maps), with the arenas limited to one first or not.
THREAD_BLOCK_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys, threading
    from flowllm.models import glibc_heap

    if sys.argv[1] == "one":
        assert glibc_heap.one_arena()
    libc = glibc_heap.libc()
    libc.malloc.restype = ctypes.c_void_p
    found = []
    threading.Thread(target=lambda: found.append(libc.malloc(4096))).start()
    while not found:
        pass
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            print(start <= found[0] < end)
    """
)


@pytest.mark.skipif(not has_glibc(), reason="needs glibc's mallopt")
@pytest.mark.parametrize(("arenas", "in_main_heap"), [("one", "True"), ("default", "False")])
def test_one_arena_puts_a_new_threads_blocks_in_the_main_heap(
    arenas: str, in_main_heap: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", THREAD_BLOCK_SCRIPT, arenas],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [in_main_heap]


def test_without_glibc_everything_degrades(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(glibc_heap, "libc", lambda: None)
    glibc_heap._function.cache_clear()
    try:
        assert glibc_heap.in_use() is None
        assert glibc_heap.trim() is False
        assert glibc_heap.one_arena() is False
        assert glibc_heap.keep_freed_memory_mapped() is False
    finally:
        glibc_heap._function.cache_clear()
