"""CPU kernels in C (`flowllm/kernels/csrc/*.c`), compiled once per machine into one Python
extension module.

Why C: at small batches a decode step is bound by how fast weights and K/V stream from
memory, and by the fixed cost of each torch call. A product over a weight stored in the
order the kernel reads it streams at the machine's copy rate from one thread (~28-30 GB/s
here, bf16 and fp32 alike) where oneDNN and `F.linear` read 9-21 GB/s, and one C call
costs ~1-2 µs where a torch op costs 5-15 µs.

The sources are compiled with the system C compiler (`$CC`, else `cc`/`gcc`) into
`$FLOWLLM_CACHE/kernels/<hash>/`, the hash covering the sources, the flags and the
compiler's version, and written atomically (a crash leaves no half library). x86-64 with
AVX-512 (F, BW, VL) is required; bf16 functions are compiled for AVX512-BF16 by their own
target attribute and called only where the CPU has it (`has_bf16`). Elsewhere — another
architecture, no compiler, `FLOWLLM_NATIVE_KERNELS=0` — `library()` returns None and the
callers keep their torch paths; a failed build is logged once with the compiler's output.

Calling convention: every kernel is `int64_t name(const int64_t *args)`, returning 0 or
what it found wrong in its inputs before writing anything (an index out of range); Python
runs it with `NativeLibrary.call(address, *args) -> status` (csrc/module.c), which packs
ints, tensor addresses and floats (as double bits) and releases the GIL for the call
(~0.2 µs; ctypes took ~2 µs to convert 8 arguments). `NativeLibrary.address(name)` looks
a kernel up once. A thread's calls can also be recorded into a call list and replayed
in one call (`flowllm.kernels.call_plan`).

Parallel loops use OpenMP. torch is imported first and has loaded its own `libgomp.so.1`,
which the library's `libgomp.so.1` dependency resolves to, so the kernels share torch's
thread pool. OpenMP keeps the pool size per thread and torch sets it in a thread only at
that thread's first parallel op, so whoever runs kernels on a worker thread calls
`follow_torch_threads()` there first (the model runner does, every step).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch  # loaded before the library: its libgomp is the one the kernels use

from flowllm.cache import flowllm_cache_dir

SOURCE_DIR = Path(__file__).with_name("csrc")
MODULE_NAME = "flowllm_cpu_kernels"
LIBRARY_NAME = MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
FLAGS = (
    "-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno",
    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
)  # fmt: skip
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"})
DISABLE_ENV = "FLOWLLM_NATIVE_KERNELS"

_log = structlog.get_logger("flowllm.kernels")


class NativeLibrary:
    """The loaded library and what this CPU lets it run."""

    def __init__(self, path: Path, has_bf16: bool) -> None:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        if spec is None or spec.loader is None:
            raise OSError(f"cannot load {path} as a Python extension")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.call: Callable[..., int] = module.call
        # this thread's calls also go to a call list, between these two (see call_plan)
        self.record_start: Callable[[], None] = module.record_start
        self.record_stop: Callable[[], bytes] = module.record_stop
        self._symbols = ctypes.CDLL(str(path))  # the same loaded file, for kernel addresses
        self.path = path
        self.has_bf16 = has_bf16
        self._omp_max_threads = ctypes.CFUNCTYPE(ctypes.c_int)(
            self.address("flowllm_omp_max_threads")
        )
        self._set_threads = self.address("flowllm_omp_set_threads")
        self.run_calls = self.address("flowllm_run_calls")  # a: call list, its length

    def address(self, name: str) -> int:
        """A kernel's address, for `call`."""
        fn = getattr(self._symbols, name)
        return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)

    def follow_torch_threads(self) -> None:
        """Size the calling thread's OpenMP pool as torch's (`torch.get_num_threads()`)."""
        self.call(self._set_threads, torch.get_num_threads())

    def omp_max_threads(self) -> int:
        """The OpenMP pool size the kernels see (torch's, when they share its runtime)."""
        return int(self._omp_max_threads())


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def enabled() -> bool:
    """False when `FLOWLLM_NATIVE_KERNELS` is 0/false/no/off."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


@functools.cache
def library() -> NativeLibrary | None:
    """The compiled kernels, built on first use; None where they cannot run (see module)."""
    if not enabled() or platform.machine().lower() not in {"x86_64", "amd64"}:
        return None
    flags = cpu_flags()
    if not flags >= REQUIRED_CPU_FLAGS:
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _log.warning("native_kernels_unavailable", reason="no C compiler (cc, gcc or $CC)")
        return None
    try:
        path = _build(compiler, flowllm_cache_dir() / "kernels")
    except (OSError, subprocess.CalledProcessError) as exc:
        output = getattr(exc, "stderr", "") or str(exc)
        _log.warning("native_kernels_unavailable", reason="build failed", output=output[-2000:])
        return None
    return NativeLibrary(path, has_bf16="avx512_bf16" in flags)


def _python_include() -> str:
    return sysconfig.get_paths()["include"]


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def _build(compiler: str, root: Path) -> Path:
    """Compile the sources into `root/<hash>/` unless that library exists already."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    digest = hashlib.sha256()
    for part in (compiler, version, " ".join(FLAGS), LIBRARY_NAME, _python_include()):
        digest.update(part.encode())
    for src in [*_sources(), *sorted(SOURCE_DIR.glob("*.h"))]:
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    target = root / digest.hexdigest()[:16] / LIBRARY_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        includes = ["-I", str(SOURCE_DIR), "-I", _python_include()]
        cmd = [compiler, *FLAGS, *includes, *map(str, _sources()), "-o", tmp, "-lm"]
        _log.info("compiling the native kernels (once)", compiler=compiler, target=str(target))
        started = time.perf_counter()
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        os.replace(tmp, target)
        _log.info("native kernels ready", seconds=round(time.perf_counter() - started, 1))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
