"""Compiling the native CPU kernels (`csrc/*.c`) into their Python extension module: the
sources, the builds (`ISAS`) and their variants, the flags and the compiler's command.

Only the standard library, and nothing of flowllm or torch: setup.py loads this file by its
path to compile a wheel's prebuilt libraries, one per variant a CPU may need, into
`prebuilt/<variant>/`; `native.py` loads one of those, or compiles its variant here on
first use where none is there or it was built from other sources.

A variant is a build with the optional features it compiles in (`-mavx512vnni` where the
CPU has VNNI): `avx512-avx512_vnni`, `avx512` and `avx2`. Beside each prebuilt library lies
its variant's digest of the sources and flags (`DIGEST_NAME`): a checkout whose C changed
after its libraries were built in place does not load them.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).with_name("csrc")
PREBUILT_DIR = Path(__file__).with_name("prebuilt")
MODULE_NAME = "flowllm_cpu_kernels"
LIBRARY_NAME = MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
DIGEST_NAME = "sources.sha256"
COMMON_FLAGS = ("-O3", "-std=c11", "-fPIC", "-fopenmp", "-fno-math-errno")
# Linked without -fopenmp, so without libgomp: the OpenMP calls bind when the library loads
# to the runtime torch has loaded (native.py's docstring says why).
LINK_FLAGS = ("-shared", "-lm")


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
        digest = hashlib.sha256(" ".join((*self.flags, *LINK_FLAGS)).encode())
        for src in sorted([*SOURCE_DIR.glob("*.c"), *SOURCE_DIR.glob("*.h")]):
            digest.update(src.name.encode())
            digest.update(src.read_bytes())
        return digest.hexdigest()


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


def find_compiler() -> str | None:
    """The system C compiler: `$CC`, else `cc`, else `gcc`."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def python_include() -> str:
    return sysconfig.get_paths()["include"]


def compile_library(compiler: str, variant: Variant, target: Path) -> None:
    """Compile `variant` into `target`, each source on its own core, then link; the library
    is written whole or not at all (a crash leaves no half library). Raises
    CalledProcessError with the compiler's output on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    includes = ("-I", str(SOURCE_DIR), "-I", python_include())
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


def prebuilt_library(root: Path, variant: Variant) -> Path | None:
    """`variant`'s library in `root` (a `prebuilt` directory) if it is there and was built
    from the sources and flags this checkout holds; None otherwise."""
    library = root / variant.name / LIBRARY_NAME
    try:
        stored = (root / variant.name / DIGEST_NAME).read_text().strip()
    except OSError:
        return None
    return library if library.is_file() and stored == variant.digest() else None


def build_prebuilt(root: Path, compiler: str) -> list[Path]:
    """Compile every variant into `root/<variant>/`, each beside its digest; returns the
    libraries."""
    built = []
    for variant in variants():
        target = root / variant.name / LIBRARY_NAME
        compile_library(compiler, variant, target)
        (target.parent / DIGEST_NAME).write_text(variant.digest() + "\n")
        built.append(target)
    return built
