"""The native CPU kernels and their torch ops: built once into the flowllm cache, reused,
switchable off, sharing torch's OpenMP thread pool, and the ops' library built per torch
release."""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flowllm.cache_dir import flowllm_cache_dir
from flowllm.kernels import native, native_build

needs_native = pytest.mark.skipif(
    native.library() is None, reason="no AVX-512 or AVX2 CPU, or no C compiler here"
)


def _start(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter with its own flowllm cache and only the native
    settings in `env` (not those the suite runs under)."""
    inherited = {
        k: v for k, v in os.environ.items() if k not in (native.DISABLE_ENV, native.ISA_ENV)
    }
    full_env = {**inherited, "FLOWLLM_CACHE": str(cache), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=full_env, check=True,
    )  # fmt: skip


def _run(code: str, cache: Path, **env: str) -> str:
    """`_start`'s stdout (where structlog's default configuration also prints)."""
    return _start(code, cache, **env).stdout.strip()


def _cached_copy(library: Path, cache: Path) -> None:
    """A copy in `cache` of a library this suite's process built, where a fresh process
    finds it current (its directory is named by its sources' digest): so a test of another
    build compiles only that one."""
    target = cache / "kernels" / library.parent.name / library.name
    target.parent.mkdir(parents=True)
    shutil.copy2(library, target)


def test_builds_wherever_it_can_run() -> None:
    """On an x86-64 CPU with the features and C and C++ compilers, the kernels and their ops
    must build: a broken build would otherwise only skip every native test."""
    if not (
        platform.machine().lower() in {"x86_64", "amd64"}
        and any(native.cpu_flags() >= isa.cpu_flags for isa in native.ISAS.values())
        and (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
        and (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))
        and native.enabled()
    ):
        pytest.skip("this machine cannot run the native kernels")
    assert native.library() is not None


PRINT_PATH = """
    from flowllm.kernels import native
    lib = native.library()
    print(lib.path if lib else None)
"""
PRINT_BOTH = """
    import sys
    import torch
    from flowllm.kernels import native
    lib = native.library()
    print("torch.utils.cpp_extension" in sys.modules)
    print(native._ops_library().path)
    x = torch.randn(2, 32)
    out = torch.empty(2, 16)
    torch.ops.flowllm.silu_mul(x, out)
    print(torch.allclose(out, torch.nn.functional.silu(x[:, :16]) * x[:, 16:]))
    print(lib.path)
"""


@needs_native
def test_built_once_into_the_cache_and_reused(tmp_path: Path) -> None:
    """The kernels and their ops' library: compiled on a first start, which says so, writes
    nothing to stderr (the server's log lines are all JSON) and imports no part of torch
    that looks for CUDA (torch.utils.cpp_extension, which logs on a CUDA build without
    one); then reused silently; the ops run."""
    first_start = _start(PRINT_BOTH, tmp_path)
    assert first_start.stderr == ""
    out = first_start.stdout.strip().splitlines()
    assert "compiling the native kernels (once)" in out[0]  # a first start says so
    assert sum("compiling the native kernels (once)" in line for line in out) == 2
    cpp_extension, ops, ran, first = out[-4], Path(out[-3]), out[-2], Path(out[-1])
    assert cpp_extension == "False"
    assert ran == "True"
    for library in (first, ops):
        assert library.is_file() and library.is_relative_to(tmp_path / "kernels")
        leftovers = [p for p in library.parent.iterdir() if p != library]
        assert leftovers == []  # no temporary files left behind
    assert ops.name == native_build.OPS_NAME
    mtimes = [first.stat().st_mtime_ns, ops.stat().st_mtime_ns]
    again = _run(PRINT_BOTH, tmp_path).splitlines()
    assert again == ["False", str(ops), "True", str(first)]  # silently
    assert [first.stat().st_mtime_ns, ops.stat().st_mtime_ns] == mtimes  # not rebuilt


def test_switched_off_by_the_environment(tmp_path: Path) -> None:
    assert _run(PRINT_PATH, tmp_path, FLOWLLM_NATIVE_KERNELS="0") == "None"
    assert not (tmp_path / "kernels").exists()


@needs_native
def test_a_failed_build_falls_back_to_none(tmp_path: Path) -> None:
    out = _run(PRINT_PATH, tmp_path, CC="/bin/false")
    assert "native_kernels_build_failed" in out  # the reason is logged
    assert out.splitlines()[-1] == "None"


@needs_native
def test_a_failed_ops_build_is_reported(tmp_path: Path) -> None:
    """Without the ops' library no kernel can run: a failed C++ build leaves the kernels
    off, with the reason."""
    library = native.library()
    assert library is not None
    _cached_copy(library.path, tmp_path)  # the kernels built: only the ops' build runs
    out = _run(STATUS, tmp_path, CXX="/bin/false").splitlines()
    assert out[-1] == "None False"
    assert "native CPU kernels off" in out[-2]


def test_the_ops_library_is_per_torch_release() -> None:
    """A prebuilt ops library built beside another torch release is not current here: its
    digest covers the release, as its directory's name does."""
    abi = native_build.torch_abi()
    assert abi.name == f"ops-torch{abi.version}" and abi.version == ".".join(
        torch.__version__.split(".")[:2]
    )
    other = dataclasses.replace(abi, version="2.99")
    assert other.digest() != abi.digest() and other.name != abi.name
    flipped = dataclasses.replace(abi, cxx11_abi=not abi.cxx11_abi)
    assert flipped.digest() != abi.digest()


def test_ops_of_another_torch_release_are_named_when_none_can_be_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel beside another torch release than its own, on a machine without a C++
    compiler: no ops, and the reason names both releases."""
    abi = native_build.torch_abi()
    other = tmp_path / "ops-torch2.99"
    other.mkdir()
    (other / native_build.OPS_NAME).write_bytes(b"")
    (other / native_build.DIGEST_NAME).write_text("another release's\n")
    monkeypatch.setattr(native_build, "PREBUILT_DIR", tmp_path)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        OSError,
        match=rf"no torch ops for torch {abi.version} \(prebuilt: "
        r"ops-torch2\.99\) and no C\+\+ compiler",
    ):
        native._ops_library.__wrapped__()


@needs_native
def test_kernels_share_torchs_thread_pool() -> None:
    lib = native.library()
    assert lib is not None
    before = torch.get_num_threads()
    try:
        for n in (1, 2, before):
            torch.set_num_threads(n)
            assert lib.omp_max_threads() == n
    finally:
        torch.set_num_threads(before)


STATUS = """
    from flowllm.kernels import native
    lib = native.library()
    print(native.status().describe())
    print(lib.isa if lib else None, lib is not None and lib.has_bf16)
"""


def test_the_avx2_build_is_forced_by_the_environment(tmp_path: Path) -> None:
    if not native.cpu_flags() >= native.ISAS["avx2"].cpu_flags or native.library() is None:
        pytest.skip("this machine cannot run the AVX2 build")
    _cached_copy(native._ops_library().path, tmp_path)  # the ops built: only the kernels' runs
    out = _run(STATUS, tmp_path, FLOWLLM_NATIVE_ISA="avx2").splitlines()
    assert out[-1] == "avx2 False"  # no bf16 linear product in the AVX2 build
    assert "AVX2 build (forced by FLOWLLM_NATIVE_ISA)" in out[-2]


def test_a_failed_build_is_reported_with_the_reason(tmp_path: Path) -> None:
    if native.library() is None:
        pytest.skip("no native kernels here")
    compiler = tmp_path / "cc"
    compiler.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'quant.c:1: error: boom' >&2\nexit 1\n"
    )
    compiler.chmod(0o755)
    out = _run(STATUS, tmp_path, CC=str(compiler)).splitlines()
    assert out[-1] == "None False"
    assert "native CPU kernels off" in out[-2] and "error: boom" in out[-2]
    assert "avx512 build failed" in out[-2] and "avx2 build failed" in out[-2]


def test_an_unknown_isa_is_refused(tmp_path: Path) -> None:
    out = _run(STATUS, tmp_path, FLOWLLM_NATIVE_ISA="sse2").splitlines()
    assert out[-1] == "None False" and "FLOWLLM_NATIVE_ISA must be" in out[-2]


def test_a_prebuilt_library_serves_only_while_its_sources_are_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prebuilt library loads when the digest beside it is that of the sources and flags
    this checkout holds; built from other sources (the C changed since), it is stale and the
    library is compiled instead, or, without a compiler, none is had."""
    if not native.cpu_flags() >= native.ISAS["avx2"].cpu_flags or native.library() is None:
        pytest.skip("this machine cannot run the AVX2 build")
    variant = native.ISAS["avx2"].variant(native.cpu_flags())
    root = tmp_path / "prebuilt"
    (root / "avx2").mkdir(parents=True)
    shutil.copy2(native.isa_library("avx2").path, root / "avx2" / native_build.LIBRARY_NAME)
    digest = root / "avx2" / native_build.DIGEST_NAME
    monkeypatch.setattr(native_build, "PREBUILT_DIR", root)
    load = native.isa_library.__wrapped__  # not the process's cached libraries
    compiled_root = flowllm_cache_dir() / "kernels"

    lib = load("avx2")  # no digest beside it: not trusted
    assert lib.origin == "compiled" and lib.path.is_relative_to(compiled_root)

    digest.write_text(variant.digest() + "\n")
    lib = load("avx2")
    assert (lib.origin, lib.path) == ("prebuilt", root / "avx2" / native_build.LIBRARY_NAME)
    assert lib.build_id == f"avx2-prebuilt-{variant.digest()[:16]}"
    assert lib.omp_max_threads() == torch.get_num_threads()

    other = tmp_path / "csrc"  # the sources before their last change
    shutil.copytree(native_build.SOURCE_DIR, other)
    with (other / "linear.c").open("a") as f:
        f.write("/* another version */\n")
    with monkeypatch.context() as m:
        m.setattr(native_build, "SOURCE_DIR", other)
        digest.write_text(variant.digest() + "\n")
    lib = load("avx2")
    assert lib.origin == "compiled" and lib.path.is_relative_to(compiled_root)

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # and no compiler: no library
    with pytest.raises(OSError, match="no C compiler"):
        load("avx2")
