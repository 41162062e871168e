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
    from flowllm.models.runner import keep_freed_memory_mapped

    assert keep_freed_memory_mapped()
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


def test_without_glibc_everything_degrades(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(glibc_heap, "libc", lambda: None)
    glibc_heap._function.cache_clear()
    try:
        assert glibc_heap.in_use() is None
        assert glibc_heap.trim() is False
    finally:
        glibc_heap._function.cache_clear()
