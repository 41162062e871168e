"""Compiling the native CPU kernels: the kernels (`csrc/*.c`) into one library per ISA
variant, and their torch ops (`csrc/ops.cpp`) into one library per torch version; the
sources, the builds (`ISAS`) and their variants, the flags and the compilers' commands.

Only the standard library, and nothing of flowllm (torch only in `torch_abi`, what the ops
are built against): setup.py loads this file by its path to compile a wheel's prebuilt
libraries into `prebuilt/`, one per variant a CPU may need and the ops for the torch the
wheel is built beside; `native.py` loads those, or compiles here on first use what is not
there or was built from other sources.

A variant is a build with the optional features it compiles in (`-mavx512vnni` where the
CPU has VNNI): `avx512-avx512_vnni`, `avx512` and `avx2`. Beside each prebuilt library lies
the digest of the sources and flags it was built from (`DIGEST_NAME`): a checkout whose C
changed after its libraries were built in place does not load them.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).with_name("csrc")
PREBUILT_DIR = Path(__file__).with_name("prebuilt")
LIBRARY_NAME = "libflowllm_kernels.so"
OPS_SOURCE = SOURCE_DIR / "ops.cpp"
OPS_NAME = "libflowllm_ops.so"
DIGEST_NAME = "sources.sha256"
COMMON_FLAGS = ("-O3", "-std=c11", "-fPIC", "-fopenmp", "-fno-math-errno")
# Linked without -fopenmp, so without libgomp: the OpenMP calls bind when the library loads
# to the runtime torch has loaded (native.py's docstring says why).
LINK_FLAGS = ("-shared", "-lm")
# Linked without libtorch: its symbols bind when the library loads to the libraries torch
# has loaded (native.py), so the ops library needs nothing beyond glibc and libstdc++.
OPS_FLAGS = ("-O2", "-std=c++20", "-fPIC", "-shared", "-w")


@dataclass(frozen=True)
class Isa:
    """One build of the library: its target flags, the CPU flags it needs, and target flags
    added where the CPU has a feature (`optional`: feature, flag)."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    optional: tuple[tuple[str, str], ...] = ()

    def variant(self, cpu: frozenset[str]) -> Variant:
        """The variant a CPU with these flags runs: every optional feature it has."""
        return Variant(self, frozenset(f for f, _ in self.optional if f in cpu))

    def variants(self) -> list[Variant]:
        """Every variant of this build: each subset of its optional features."""
        features = [feature for feature, _ in self.optional]
        return [
            Variant(self, frozenset(chosen))
            for n in range(len(features), -1, -1)
            for chosen in itertools.combinations(features, n)
        ]


@dataclass(frozen=True)
class Variant:
    """A build with the optional features it compiles in."""

    isa: Isa
    features: frozenset[str]

    @property
    def name(self) -> str:
        return "-".join((self.isa.name, *sorted(self.features)))

    @property
    def flags(self) -> tuple[str, ...]:
        optional = (flag for feature, flag in self.isa.optional if feature in self.features)
        return (*COMMON_FLAGS, *self.isa.flags, *optional)

    def digest(self) -> str:
        """What the library is built from: the flags and every source and header."""
        return _digest((*self.flags, *LINK_FLAGS), [*SOURCE_DIR.glob("*.c"), *_headers()])


def _headers() -> list[Path]:
    return list(SOURCE_DIR.glob("*.h"))


def _digest(flags: tuple[str, ...], sources: list[Path]) -> str:
    digest = hashlib.sha256(" ".join(flags).encode())
    for src in sorted(sources):
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class TorchAbi:
    """What the ops library is compiled against: a torch release (major.minor), its headers
    and its C++ ABI. A library built for one release does not load beside another."""

    version: str
    include_dirs: tuple[str, ...]
    cxx11_abi: bool

    @property
    def name(self) -> str:
        return f"ops-torch{self.version}"

    @property
    def flags(self) -> tuple[str, ...]:
        return (*OPS_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(self.cxx11_abi)}")

    def digest(self) -> str:
        """The flags, the torch release, and the ops' source and headers."""
        return _digest((*self.flags, self.version), [OPS_SOURCE, *_headers()])


ISAS = {
    "avx512": Isa(
        "avx512",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"),
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}),
        (("avx512_vnni", "-mavx512vnni"),),  # one instruction for quant.c's byte dots
    ),
    "avx2": Isa(
        "avx2",
        ("-mavx2", "-mfma", "-mf16c"),
        frozenset({"avx2", "fma", "f16c"}),
    ),
}


def variants() -> list[Variant]:
    """Every variant of every build: what a wheel holds, so that it serves any x86-64 CPU."""
    return [variant for isa in ISAS.values() for variant in isa.variants()]


def torch_abi() -> TorchAbi:
    """The ABI of the torch this Python imports (ImportError without one)."""
    import torch

    # torch's headers, where its wheel puts them (torch.utils.cpp_extension.include_paths
    # names the same, but importing that module looks for CUDA and logs when it finds none)
    include = Path(torch.__file__).parent / "include"
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return TorchAbi(version, (str(include),), bool(torch.compiled_with_cxx11_abi()))


def find_compiler() -> str | None:
    """The system C compiler: `$CC`, else `cc`, else `gcc`."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def find_cxx_compiler() -> str | None:
    """The system C++ compiler: `$CXX`, else `c++`, else `g++`."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def compile_library(compiler: str, variant: Variant, target: Path) -> None:
    """Compile `variant` into `target`, each source on its own core, then link; the library
    is written whole or not at all (a crash leaves no half library). Raises
    CalledProcessError with the compiler's output on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    includes = ("-I", str(SOURCE_DIR))
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:

        def compile_one(source: Path) -> str:
            obj = f"{tmp}/{source.stem}.o"
            cmd = [compiler, *variant.flags, *includes, "-c", str(source), "-o", obj]
            subprocess.run(cmd, capture_output=True, text=True, check=True)
            return obj

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, sorted(SOURCE_DIR.glob("*.c"))))
        library = f"{tmp}/{target.name}"
        cmd = [compiler, *objects, "-o", library, *LINK_FLAGS]
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        os.replace(library, target)


def compile_ops(compiler: str, abi: TorchAbi, target: Path) -> None:
    """Compile the ops library for `abi` into `target`, written whole or not at all. Raises
    CalledProcessError with the compiler's output on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{d}" for d in (str(SOURCE_DIR), *abi.include_dirs)]
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        library = f"{tmp}/{target.name}"
        cmd = [compiler, *abi.flags, *includes, str(OPS_SOURCE), "-o", library]
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        os.replace(library, target)


def prebuilt_library(root: Path, name: str, library: str, digest: str) -> Path | None:
    """`root/name/library` (in a `prebuilt` directory) if it is there and was built from
    what `digest` describes; None otherwise."""
    path = root / name / library
    try:
        stored = (root / name / DIGEST_NAME).read_text().strip()
    except OSError:
        return None
    return path if path.is_file() and stored == digest else None


def build_prebuilt(root: Path, compiler: str, cxx: str | None, abi: TorchAbi | None) -> list[Path]:
    """Compile every variant into `root/<variant>/` and the ops for `abi` (where there are a
    torch and a C++ compiler) into `root/<abi.name>/`, each beside its digest; returns the
    libraries."""
    built = []
    for variant in variants():
        target = root / variant.name / LIBRARY_NAME
        compile_library(compiler, variant, target)
        (target.parent / DIGEST_NAME).write_text(variant.digest() + "\n")
        built.append(target)
    if abi is None or cxx is None:
        return built
    target = root / abi.name / OPS_NAME
    compile_ops(cxx, abi, target)
    (target.parent / DIGEST_NAME).write_text(abi.digest() + "\n")
    built.append(target)
    return built
