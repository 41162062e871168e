"""oneDNN compiles a product per row count and caches it: with the bound that importing the
model layers sets, the heap of a process that ran a oneDNN linear at 200 row counts holds
no more than the bound's compiled kernels; with oneDNN's default bound (set here as an
operator would) it holds one per row count. Each case runs in a fresh process: the caches
read their capacity at their first use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flowllm.models import glibc_heap, onednn_caches
from flowllm.models.layers import onednn_packs

ROW_COUNTS = 200

# Runs a packed fp32 Linear (oneDNN's layout: the native kernels are off) at ROW_COUNTS row
# counts and prints how many bytes glibc's heap and mmapped chunks gained meanwhile.
SCRIPT = textwrap.dedent(
    f"""
    import json
    import torch
    from flowllm.models.glibc_heap import in_use
    from flowllm.models.layers import Linear

    linear = Linear(64, 256, True, torch.float32, torch.device("cpu"))
    linear.pack()
    assert linear.layout == "onednn", linear.layout
    with torch.no_grad():
        linear(torch.randn(1, 64))
        before = in_use()
        for rows in range(2, {ROW_COUNTS} + 2):
            linear(torch.randn(rows, 64))
    print(json.dumps({{"grown": in_use() - before}}))
    """
)


def heap_growth(**env: str) -> int:
    ours = (*onednn_caches.ONEDNN_VARIABLES, onednn_caches.IDEEP_VARIABLE)
    base = {k: v for k, v in os.environ.items() if k not in ours}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**base, "FLOWLLM_NATIVE_KERNELS": "0", **env},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    grown: int = json.loads(result.stdout.splitlines()[-1])["grown"]
    return grown


needs_onednn = pytest.mark.skipif(
    not onednn_packs(torch.float32, torch.device("cpu")) or glibc_heap.in_use() is None,
    reason="needs oneDNN's packed fp32 products and glibc's mallinfo2 (2.33+)",
)


@needs_onednn
def test_compiled_products_stay_within_the_bound() -> None:
    # oneDNN's cache and the one of the thread that ran the products
    bound = 2 * onednn_caches.CACHE_ENTRIES * onednn_caches.ENTRY_BYTES
    assert heap_growth() < bound + (1 << 20)  # + a MiB for the allocator's own bookkeeping


@needs_onednn
def test_an_operators_capacity_is_kept() -> None:
    grown = heap_growth(
        ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024"
    )  # oneDNN's and ideep's defaults: every row count stays compiled
    assert grown > ROW_COUNTS * onednn_caches.ENTRY_BYTES


def test_bound_caches_sets_unset_variables_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*onednn_caches.ONEDNN_VARIABLES, onednn_caches.IDEEP_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    onednn_caches.bound_caches(8)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "8"
    assert os.environ["LRU_CACHE_CAPACITY"] == "8"
    assert "DNNL_PRIMITIVE_CACHE_CAPACITY" not in os.environ

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "100")  # oneDNN's older name
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "200")
    onednn_caches.bound_caches(8)
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    assert os.environ["DNNL_PRIMITIVE_CACHE_CAPACITY"] == "100"
    assert os.environ["LRU_CACHE_CAPACITY"] == "200"

    with pytest.raises(ValueError, match="at least 0"):
        onednn_caches.bound_caches(-1)
