"""CPU kernels in C (`flowllm/kernels/csrc/*.c`), run as torch ops (`torch.ops.flowllm.*`,
`csrc/ops.cpp`): prebuilt in a wheel, or compiled once per machine. This module is the one
place that chooses which build runs.

Why C: at small batches a decode step is bound by how fast weights and K/V stream from
memory, and by the fixed cost of each torch call. A product over a weight stored in the
order the kernel reads it streams near the machine's copy rate from one thread, faster than
oneDNN and `F.linear` read it, and one op call into C costs a fraction of a composite
torch op's (benchmarks/README.md "Linear step" and "Kernel design figures").

Two libraries run them:

- the kernels, one library per ISA build (`ISAS`): AVX-512 (F, BW, VL, DQ) and AVX2 + FMA
  + F16C, each of every source, written once over the vector layer of `csrc/isa.h`, which
  the build's target flags resolve to 16 or 8 float32 lanes. The AVX-512 build adds
  `-mavx512vnni` where the CPU has VNNI, so three variants exist (`native_build`, which
  holds what compiles: sources, flags, the compilers' commands). Plain C, no torch.
- the ops, one library per torch release: each kernel registered with a typed schema, a
  CPU implementation that checks its tensors and runs the kernel of the build in use, and
  a Meta one that checks and runs nothing (fake tensors, torch.compile). Loading a build
  (`NativeLibrary.activate`) binds its kernels there.

Which libraries load:

- prebuilt: a wheel (`make wheel`, setup.py) holds every variant and the ops for the torch
  it was built beside, in `kernels/prebuilt/<name>/`, each beside a digest of the sources
  and flags it was built from; they load when that digest is this checkout's, so a server
  needs no compiler;
- compiled: otherwise the sources are compiled with the system's compilers (`$CC`, else
  `cc`/`gcc`; `$CXX`, else `c++`/`g++`) into `$FLOWLLM_CACHE/kernels/<hash>/`, the hash
  covering the sources, the flags, the torch release and the compiler's version, written
  atomically (a crash leaves no half library). This stays for what a wheel cannot hold:
  an editable checkout, whose sources change, and a torch release other than the wheel's
  (torch's C++ ABI changes between releases).

`FLOWLLM_NATIVE_ISA=avx2` forces the AVX2 build on an AVX-512 machine (the tests run
both); `auto` (the default) takes the widest the CPU runs. The bf16 linear product needs
AVX512-BF16: the AVX-512 build compiles it for that by its own target attribute, the op runs
it only where the CPU has it (`has_bf16`), and the AVX2 build leaves it out (`has_bf16`
False). Elsewhere — another architecture, no prebuilt library and no compiler,
`FLOWLLM_NATIVE_KERNELS=0` — `library()` returns None and the callers keep their torch
paths; `status()` says which build runs, prebuilt or compiled, or why none does, and the
server prints it at startup.

Neither library links what torch already loaded. The kernels' OpenMP calls bind to torch's
`libgomp.so.1` (in the global namespace), so they share torch's thread pool; the ops'
torch symbols bind to torch's own libraries, which `_OpsLibrary` makes global first. So the
wheel's libraries need nothing beyond glibc and libstdc++ (auditwheel finds them
manylinux-consistent; a vendored libgomp would be a second pool). Which thread runs the
kernels on how many threads is `flowllm.openmp`'s rule.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from flowllm.cache_dir import flowllm_cache_dir
from flowllm.kernels import native_build
from flowllm.kernels.native_build import ISAS, LIBRARY_NAME, OPS_NAME, Variant
from flowllm.kernels.reference import KernelInputError

DISABLE_ENV = "FLOWLLM_NATIVE_KERNELS"
ISA_ENV = "FLOWLLM_NATIVE_ISA"
NO_COMPILER = "no C compiler (cc, gcc or $CC)"
NO_CXX_COMPILER = "no C++ compiler for the torch ops (c++, g++ or $CXX)"
# the libraries of torch's that the ops library's symbols bind to
TORCH_LIBRARIES = ("libc10.so", "libtorch_cpu.so")

_log = structlog.get_logger("flowllm.kernels")


class NativeLibrary:
    """One build's kernel library and what this CPU lets it run; `activate` makes the torch
    ops run its kernels."""

    def __init__(
        self, path: Path, has_bf16: bool, variant: Variant, build_id: str, origin: str
    ) -> None:
        try:
            self._symbols = ctypes.CDLL(str(path))
        except OSError as e:  # an OpenMP symbol no loaded runtime provides, say
            raise OSError(f"cannot load {path}: {e}") from e
        self.path = path
        self.isa = isa = variant.isa.name
        self.variant = variant.name
        # what the weights cached in the kernels' layouts are keyed by (weight_cache)
        self.build_id = build_id
        self.origin = origin  # "prebuilt" (from the wheel) or "compiled" (on this machine)
        self.has_bf16 = has_bf16 and isa == "avx512"
        self._omp_max_threads: Callable[[], int] = self._symbols.flowllm_omp_max_threads

    def activate(self) -> None:
        """Run the torch ops on this build's kernels from now on (the ops library loaded
        first: OSError when it cannot be)."""
        _ops_library().use(self)

    def omp_max_threads(self) -> int:
        """The OpenMP pool size the kernels see (torch's, when they share its runtime)."""
        return int(self._omp_max_threads())


class _OpsLibrary:
    """The loaded ops library: `torch.ops.flowllm`, and the build its kernels come from."""

    def __init__(self, path: Path) -> None:
        torch_lib = Path(torch.__file__).parent / "lib"
        for name in TORCH_LIBRARIES:  # global, so that the ops' torch symbols bind to them
            ctypes.CDLL(str(torch_lib / name), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
        torch.ops.load_library(str(path))
        for name in ("record_start", "record_stop", "run_calls"):  # not pure: kept in traces
            torch.fx.node.has_side_effect(getattr(torch.ops.flowllm, name).default)
        self.path = path
        self._symbols = ctypes.CDLL(str(path))
        self._use = self._symbols.flowllm_ops_use
        self._use.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        self._use.restype = ctypes.c_int
        self.active: NativeLibrary | None = None

    def use(self, lib: NativeLibrary | None) -> None:
        if lib is self.active:
            return
        if lib is None:
            self._symbols.flowllm_ops_clear()
        else:
            error = ctypes.create_string_buffer(1024)
            if self._use(str(lib.path).encode(), int(lib.has_bf16), error, len(error)):
                raise OSError(f"the torch ops cannot run {lib.path}: {error.value.decode()}")
        self.active = lib


@functools.cache
def _ops_library() -> _OpsLibrary:
    """The ops library for the running torch, prebuilt or compiled (OSError or
    CalledProcessError when neither can be had)."""
    abi = native_build.torch_abi()
    path = native_build.prebuilt_library(
        native_build.PREBUILT_DIR, abi.name, OPS_NAME, abi.digest()
    )
    if path is None:
        compiler = native_build.find_cxx_compiler()
        if compiler is None:
            built = sorted(p.parent.name for p in native_build.PREBUILT_DIR.glob(f"*/{OPS_NAME}"))
            prebuilt = f" (prebuilt: {', '.join(built)})" if built else ""
            raise OSError(f"no torch ops for torch {abi.version}{prebuilt} and {NO_CXX_COMPILER}")
        path = _build(
            compiler, abi.name, OPS_NAME, abi.digest(),
            lambda target: native_build.compile_ops(compiler, abi, target),
        )  # fmt: skip
    return _OpsLibrary(path)


def call(op: Callable[..., object], *args: object) -> None:
    """Run one of the ops (`torch.ops.flowllm.*`) for a layer's module: what it refuses (a
    dtype, shape or layout, an index its kernel checks) raised as KernelInputError, and no
    build in use as KernelInputError too."""
    if _load()[0] is None:
        raise KernelInputError("the native kernels are not available on this machine")
    try:
        op(*args)
    except (TypeError, ValueError) as e:
        raise KernelInputError(str(e)) from None


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
    variant: str = ""  # the build with its optional features (avx512-avx512_vnni)
    has_bf16: bool = False

    def describe(self) -> str:
        """One line for the startup log."""
        if self.isa == "avx512":
            bf16 = "" if self.has_bf16 else " but the bf16 linear product (no AVX512-BF16)"
            return (
                f"native CPU kernels: {self.origin} AVX-512 build, every kernel on{bf16} "
                f"(variant {self.variant})"
            )
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
            lib.activate()
        except (OSError, subprocess.CalledProcessError) as exc:
            output = getattr(exc, "stderr", "") or str(exc)
            _log.warning("native_kernels_build_failed", isa=isa.name, output=output[-2000:])
            first = next((ln for ln in output.splitlines() if "error" in ln), output[:200])
            failures.append(f"the {isa.name} build failed: {first.strip()}")
            continue
        reason = "; ".join(failures) or ("forced by " + ISA_ENV if wanted != "auto" else "")
        if not failures and wanted == "auto" and isa.name != "avx512":
            reason = "the CPU lacks AVX-512"
        return lib, NativeStatus(isa.name, reason, lib.origin, lib.variant, lib.has_bf16)
    return None, NativeStatus(None, "; ".join(failures))


@functools.cache
def isa_library(
    isa: str, compiler: str | None = None, without: frozenset[str] = frozenset()
) -> NativeLibrary:
    """The library of build `isa` (a key of ISAS), whatever the environment asks: the tests
    run the AVX2 build beside the AVX-512 one, and that one `without` an optional feature
    (avx512_vnni) as a CPU lacking it runs it. The prebuilt variant when it is current,
    else compiled (by `compiler`, else the system's). Raises OSError or
    CalledProcessError when neither can be had. Not active until `activate`d."""
    variant = ISAS[isa].variant(cpu_flags() - without)
    has_bf16 = "avx512_bf16" in cpu_flags()
    path = _prebuilt(variant)
    if path is not None:
        build_id = f"{variant.name}-prebuilt-{variant.digest()[:16]}"
        return NativeLibrary(path, has_bf16, variant, build_id, "prebuilt")
    compiler = compiler or native_build.find_compiler()
    if compiler is None:
        raise OSError(NO_COMPILER)
    path = _build(
        compiler, variant.name, LIBRARY_NAME, variant.digest(),
        lambda target: native_build.compile_library(compiler, variant, target),
    )  # fmt: skip
    return NativeLibrary(path, has_bf16, variant, f"{isa}-{path.parent.name}", "compiled")


def library() -> NativeLibrary | None:
    """The kernels of the widest build this CPU runs (or the one `FLOWLLM_NATIVE_ISA`
    forces), prebuilt or built on first use, and active; None where none can run (see the
    module docstring)."""
    return _load()[0]


def reload() -> None:
    """Forget the chosen build, so that the next `library()` reads the environment again:
    the tests switch builds (`FLOWLLM_NATIVE_ISA`) within one process, and the ops follow."""
    _load.cache_clear()
    if _ops_library.cache_info().currsize:
        _ops_library().use(None)


def status() -> NativeStatus:
    """Which build runs, or why none does (building it first if it has not been)."""
    return _load()[1]


def _prebuilt(variant: Variant) -> Path | None:
    return native_build.prebuilt_library(
        native_build.PREBUILT_DIR, variant.name, LIBRARY_NAME, variant.digest()
    )


def _build(
    compiler: str, name: str, library: str, digest: str, compile: Callable[[Path], None]
) -> Path:
    """`library` compiled by `compile` into `$FLOWLLM_CACHE/kernels/<hash>/` unless it is
    there already; the hash covers `digest` (sources and flags) and the compiler."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256("\0".join((compiler, version, library, digest)).encode())
    target = flowllm_cache_dir() / "kernels" / key.hexdigest()[:16] / library
    if target.is_file():
        return target
    _log.info("compiling the native kernels (once)", compiler=compiler, build=name,
              target=str(target))  # fmt: skip
    started = time.perf_counter()
    compile(target)
    _log.info("native kernels ready", seconds=round(time.perf_counter() - started, 1))
    return target
