"""Switching the whole process between the builds of the CPU kernels, so that a test runs
on each build the machine can run whatever the environment forces: the AVX-512 build, the
same without VNNI's byte dots (as a CPU lacking them builds it), the AVX2 build, and none
(the torch paths)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from flowllm.kernels import native

KERNEL_BUILDS = ("avx512", "avx512-no-vnni", "avx2", "torch")
NO_VNNI = frozenset({"avx512_vnni"})


@contextmanager
def use_kernel_build(name: str) -> Iterator[native.NativeLibrary | None]:
    """Within the block, `native.library()` is build `name` (None for "torch"); skips the
    test where the CPU cannot run it, or the environment turned the kernels off."""
    isa = "avx512" if name == "avx512-no-vnni" else name
    if name != "torch":
        if not native.enabled():
            pytest.skip(f"{native.DISABLE_ENV}=0: no native build")
        if not native.cpu_flags() >= native.ISAS[isa].cpu_flags:
            pytest.skip(f"this CPU cannot run the {isa} build")
    saved = {key: os.environ.get(key) for key in (native.ISA_ENV, native.DISABLE_ENV)}
    load = native._load
    if name == "torch":
        os.environ[native.DISABLE_ENV] = "0"
    else:
        os.environ[native.ISA_ENV] = isa
    native.reload()
    if name == "avx512-no-vnni":
        lib = native.isa_library(isa, without=NO_VNNI)
        status = native.NativeStatus(isa, "without VNNI", lib.origin, lib.variant, lib.has_bf16)
        lib.activate()
        native._load = lambda: (lib, status)  # type: ignore[assignment]
    try:
        built = native.library()
        if name != "torch" and built is None:
            pytest.skip(native.status().describe())
        yield built
    finally:
        native._load = load  # type: ignore[method-assign]
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        native.reload()
