"""A bound on oneDNN's caches of compiled products, which torch's CPU products fill with one
entry per input shape.

Why: oneDNN compiles each product (the packed `Linear` path wherever the native kernels do
not serve; also torch's other oneDNN ops) for its exact shapes, and keeps the compiled
kernel twice: in oneDNN's process-wide primitive cache and in ideep's cache of the thread
that ran it, 1,024 entries each by default. A server's steps bring a new row count each
time the batch or a prefill chunk changes size, and each costs JIT code per linear shape,
so the process grows by a compiled kernel per row count and shape until either cache
evicts, which looks like a leak (docs/reliability.md, failure 14, has the figures).

`CACHE_ENTRIES` bounds both. A step's products at one row count take one entry per linear
shape (GPT-2 and Llama have five: QKV, attention output, up or gate-up, down, LM head), so
16 entries keep the last three row counts a step ran at: a decode batch that grows or
shrinks by one sequence stays compiled, and a miss recompiles (benchmarks/README.md "oneDNN
cache bound" has its cost). The caches then hold at most `CACHE_ENTRIES` × `ENTRY_BYTES` in
oneDNN's, and as much again in ideep's per thread that runs products (the step's worker,
and packing's threads for the weights' reorders). Few entries also keep the heap compact:
the kept kernels are long-lived blocks among a step's large temporaries, in the heap that
`glibc_heap.keep_freed_memory_mapped` never trims, and the more are kept, the more of it they
hold apart (docs/reliability.md, failure 14, compares the capacities tried).

Both caches read their capacity from the environment once: oneDNN at the process's first
primitive, ideep in each thread at that thread's first product. So the bound is set when
`flowllm.models.layers` (which makes the products) is imported, before any model exists;
an operator's own setting of either variable is kept.
"""

from __future__ import annotations

import os

CACHE_ENTRIES = 16
ENTRY_BYTES = 300 * 1024  # one cache's share of a compiled fp32 product, measured
# oneDNN's variable (its older name is read when the new one is unset), and ideep's
ONEDNN_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
IDEEP_VARIABLE = "LRU_CACHE_CAPACITY"


def bound_caches(entries: int = CACHE_ENTRIES) -> None:
    """Cap both caches at `entries` unless the environment already sets them; takes effect
    only where the cache has not read its capacity yet (see module)."""
    if entries < 0:
        raise ValueError(f"a cache capacity must be at least 0, got {entries}")
    if not any(name in os.environ for name in ONEDNN_VARIABLES):
        os.environ[ONEDNN_VARIABLES[0]] = str(entries)
    os.environ.setdefault(IDEEP_VARIABLE, str(entries))
