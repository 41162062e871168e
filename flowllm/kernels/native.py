"""CPU kernels in C (`flowllm/kernels/csrc/*.c`), in one Python extension module:
prebuilt in a wheel, or compiled once per machine.

Why C: at small batches a decode step is bound by how fast weights and K/V stream from
memory, and by the fixed cost of each torch call. A product over a weight stored in the
order the kernel reads it streams near the machine's copy rate from one thread, faster than
oneDNN and `F.linear` read it, and one C call costs a fraction of a torch op's fixed cost
(benchmarks/README.md "Linear step" and "Kernel design figures").

Two builds exist (`ISAS`), AVX-512 (F, BW, VL, DQ) and AVX2 + FMA + F16C, each of every
source: the kernels are written once over the vector layer of `csrc/isa.h`, which the
build's target flags resolve to 16 or 8 float32 lanes. The AVX-512 build adds
`-mavx512vnni` where the CPU has VNNI, so three variants exist (`native_build`, which
holds what compiles: sources, flags, the compiler's command). Which library runs:

- prebuilt: a wheel (`make wheel`, setup.py) holds every variant, compiled when it was
  built, in `kernels/prebuilt/<variant>/` beside a digest of the sources and flags it was
  built from; the CPU's variant loads from there when that digest is this checkout's, so
  a server needs no compiler, and a checkout whose libraries were built in place
  (`setup.py build_ext --inplace`) and whose C changed since compiles instead;
- compiled: otherwise the sources are compiled with the system C compiler (`$CC`, else
  `cc`/`gcc`) into `$FLOWLLM_CACHE/kernels/<hash>/`, the hash covering the sources, the
  flags and the compiler's version, written atomically (a crash leaves no half library).

`FLOWLLM_NATIVE_ISA=avx2` forces the AVX2 build on an AVX-512 machine (the tests run
both); `auto` (the default) takes the widest the CPU runs. The bf16 linear product needs
AVX512-BF16: the AVX-512 build compiles it for that by its own target attribute, it is
called only where the CPU has it (`has_bf16`), and the AVX2 build leaves it out
(`has_bf16` False). Elsewhere — another architecture, no prebuilt library and no
compiler, `FLOWLLM_NATIVE_KERNELS=0` — `library()` returns None and the callers keep
their torch paths; `status()` says which build runs, prebuilt or compiled, or why none
does, and the server prints it at startup.

Calling convention: every kernel `flowllm_<name>` takes one argument struct,
`int64_t flowllm_<name>(const struct flowllm_<name>_args *)` (`csrc/kernel_args.h`), and
returns 0 or what it found wrong in its inputs before writing anything (an index out of
range). `NativeLibrary.kernel(symbol)` binds one: a `Kernel` called with named arguments,
which `flowllm.kernels.kernel_args` checks and packs into the struct's bytes, run by
`NativeLibrary.call(address, struct) -> status` (csrc/module.c) with the GIL released.
Binding compares the library's layout of the struct with the Python declaration, so a
library and a Python side that disagree fail there, not in a kernel. A thread's calls can
also be recorded into a call list and replayed in one call (`flowllm.kernels.call_plan`).

Parallel loops use OpenMP, without an OpenMP runtime of the library's own: it is linked
without libgomp, and its OpenMP calls bind when it loads to the runtime torch has loaded
(imported first; torch loads its `libgomp.so.1` into the global namespace), so the kernels
share torch's thread pool, and a wheel's libraries need nothing beyond glibc (auditwheel
finds it manylinux-consistent; a vendored libgomp would be a second pool). Which thread
runs them on how many threads is `flowllm.openmp`'s rule.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch  # noqa: F401  (loaded before the library: its libgomp is the one the kernels use)

from flowllm.cache_dir import flowllm_cache_dir
from flowllm.kernels import native_build
from flowllm.kernels.kernel_args import ARGS, c_layout
from flowllm.kernels.native_build import ISAS, LIBRARY_NAME, MODULE_NAME, Variant

DISABLE_ENV = "FLOWLLM_NATIVE_KERNELS"
ISA_ENV = "FLOWLLM_NATIVE_ISA"
NO_COMPILER = "no C compiler (cc, gcc or $CC)"

_log = structlog.get_logger("flowllm.kernels")


class Kernel:
    """One kernel bound to its argument struct: `kernel(name=value, ...) -> status`."""

    def __init__(self, lib: NativeLibrary, symbol: str) -> None:
        self.symbol = symbol
        self.address = lib.address(symbol)
        self.args = ARGS[symbol]
        self._call = lib.call

    def __call__(self, **named: object) -> int:
        """Run the kernel on these arguments (see kernel_args: each checked first)."""
        return self._call(self.address, self.args.pack(**named))


class NativeLibrary:
    """The loaded library and what this CPU lets it run."""

    def __init__(self, path: Path, has_bf16: bool, isa: str, build_id: str, origin: str) -> None:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        if spec is None or spec.loader is None:
            raise OSError(f"cannot load {path} as a Python extension")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ImportError as e:  # an OpenMP symbol no loaded runtime provides, say
            raise OSError(f"cannot load {path}: {e}") from e
        self.call: Callable[[int, bytes], int] = module.call
        # this thread's calls also go to a call list, between these two (see call_plan)
        self.record_start: Callable[[], None] = module.record_start
        self.record_stop: Callable[[], bytes] = module.record_stop
        self._symbols = ctypes.CDLL(str(path))  # the same loaded file, for kernel addresses
        self.path = path
        self.isa = isa
        # what the weights cached in the kernels' layouts are keyed by (weight_cache)
        self.build_id = build_id
        self.origin = origin  # "prebuilt" (from the wheel) or "compiled" (on this machine)
        self.has_bf16 = has_bf16 and isa == "avx512"
        self.layouts = c_layout(self._symbols)
        self._omp_max_threads = ctypes.CFUNCTYPE(ctypes.c_int)(
            self.address("flowllm_omp_max_threads")
        )
        self.run_calls = self.kernel("flowllm_run_calls")

    def address(self, name: str) -> int:
        """A function's address."""
        fn = getattr(self._symbols, name)
        return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)

    def kernel(self, symbol: str) -> Kernel:
        """The kernel `symbol` bound to its argument struct; OSError when the library's
        struct is not the one `kernel_args` declares."""
        declared = ARGS[symbol].layout()
        if self.layouts.get(symbol) != declared:
            raise OSError(
                f"{self.path}: {symbol}'s argument struct is {self.layouts.get(symbol)}, "
                f"the Python side declares {declared}"
            )
        return Kernel(self, symbol)

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


@dataclass(frozen=True)
class NativeStatus:
    """Which build of the kernels runs (isa None: none), prebuilt or compiled, and why not
    the widest."""

    isa: str | None
    reason: str = ""
    origin: str = ""

    def describe(self) -> str:
        """One line for the startup log."""
        if self.isa == "avx512":
            return f"native CPU kernels: {self.origin} AVX-512 build, every kernel on"
        if self.isa == "avx2":
            why = f" ({self.reason})" if self.reason else ""
            return (
                f"native CPU kernels: {self.origin} AVX2 build{why}: every kernel on but the "
                "bf16 linear product (AVX512-BF16), whose layers run on torch"
            )
        return f"native CPU kernels off ({self.reason}): every kernel on torch"


def requested_isa() -> str:
    """`FLOWLLM_NATIVE_ISA`: auto (the default), avx512 or avx2."""
    value = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if value not in {"auto", *ISAS}:
        raise ValueError(f"{ISA_ENV} must be auto, {' or '.join(ISAS)}, got {value!r}")
    return value


@functools.cache
def _load() -> tuple[NativeLibrary | None, NativeStatus]:
    if not enabled():
        return None, NativeStatus(None, f"{DISABLE_ENV}=0")
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return None, NativeStatus(None, f"{platform.machine()} is not x86-64")
    try:
        wanted = requested_isa()
    except ValueError as e:
        return None, NativeStatus(None, str(e))
    flags = cpu_flags()
    runnable = [isa for isa in ISAS.values() if flags >= isa.cpu_flags]
    if wanted != "auto":
        runnable = [isa for isa in runnable if isa.name == wanted]
    if not runnable:
        what = "AVX-512 or AVX2+FMA+F16C" if wanted == "auto" else ISAS[wanted].name
        return None, NativeStatus(None, f"the CPU lacks {what}")
    compiler = native_build.find_compiler()
    if compiler is None and not any(_prebuilt(isa.variant(flags)) for isa in runnable):
        return None, NativeStatus(None, NO_COMPILER)
    failures: list[str] = []
    for isa in runnable:
        try:
            lib = isa_library(isa.name, compiler)
        except (OSError, subprocess.CalledProcessError) as exc:
            output = getattr(exc, "stderr", "") or str(exc)
            _log.warning("native_kernels_build_failed", isa=isa.name, output=output[-2000:])
            first = next((ln for ln in output.splitlines() if "error" in ln), output[:200])
            failures.append(f"the {isa.name} build failed: {first.strip()}")
            continue
        reason = "; ".join(failures) or ("forced by " + ISA_ENV if wanted != "auto" else "")
        if not failures and wanted == "auto" and isa.name != "avx512":
            reason = "the CPU lacks AVX-512"
        return lib, NativeStatus(isa.name, reason, lib.origin)
    return None, NativeStatus(None, "; ".join(failures))


@functools.cache
def isa_library(
    isa: str, compiler: str | None = None, without: frozenset[str] = frozenset()
) -> NativeLibrary:
    """The library of build `isa` (a key of ISAS), whatever the environment asks: the tests
    run the AVX2 build beside the AVX-512 one, and that one `without` an optional feature
    (avx512_vnni) as a CPU lacking it runs it. The prebuilt variant when it is current,
    else compiled (by `compiler`, else the system's). Raises OSError or
    CalledProcessError when neither can be had."""
    variant = ISAS[isa].variant(cpu_flags() - without)
    has_bf16 = "avx512_bf16" in cpu_flags()
    path = _prebuilt(variant)
    if path is not None:
        build_id = f"{variant.name}-prebuilt-{variant.digest()[:16]}"
        return NativeLibrary(path, has_bf16, isa, build_id, "prebuilt")
    compiler = compiler or native_build.find_compiler()
    if compiler is None:
        raise OSError(NO_COMPILER)
    path = _build(compiler, flowllm_cache_dir() / "kernels", variant)
    return NativeLibrary(path, has_bf16, isa, f"{isa}-{path.parent.name}", "compiled")


def library() -> NativeLibrary | None:
    """The kernels of the widest build this CPU runs (or the one `FLOWLLM_NATIVE_ISA`
    forces), prebuilt or built on first use; None where none can run (see the module
    docstring)."""
    return _load()[0]


def reload() -> None:
    """Forget the loaded build, so that the next `library()` reads the environment again:
    the tests switch builds (`FLOWLLM_NATIVE_ISA`) within one process. The kernels' callers
    bind per library, so they follow."""
    _load.cache_clear()


def status() -> NativeStatus:
    """Which build runs, or why none does (building it first if it has not been)."""
    return _load()[1]


def _prebuilt(variant: Variant) -> Path | None:
    return native_build.prebuilt_library(native_build.PREBUILT_DIR, variant)


def _build(compiler: str, root: Path, variant: Variant) -> Path:
    """Compile `variant` into `root/<hash>/` unless that library exists already."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    digest = hashlib.sha256()
    for part in (compiler, version, LIBRARY_NAME, native_build.python_include()):
        digest.update(part.encode())
    digest.update(variant.digest().encode())
    target = root / digest.hexdigest()[:16] / LIBRARY_NAME
    if target.is_file():
        return target
    _log.info(
        "compiling the native kernels (once)",
        compiler=compiler,
        isa=variant.name,
        target=str(target),
    )
    started = time.perf_counter()
    native_build.compile_library(compiler, variant, target)
    _log.info("native kernels ready", seconds=round(time.perf_counter() - started, 1))
    return target
