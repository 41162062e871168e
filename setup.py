"""The build's one addition to pyproject.toml: the native CPU kernels compiled into the wheel.

`build_ext` compiles every variant of the kernels (flowllm/kernels/native_build.py, loaded
by its path: it needs no installed flowllm) into the build's
`flowllm/kernels/prebuilt/<variant>/`, and their torch ops against the torch installed
beside it (so built with --no-build-isolation) into `prebuilt/ops-torch<X.Y>/`, so that a
wheel built on one x86-64 machine runs its kernels on any, beside that torch release,
without a compiler. The wheel is therefore a platform wheel. An editable install compiles
nothing (its kernels compile on first use, as the sources change); neither does a build on
another architecture or without a C compiler (said so; the kernels then compile at run time
where a compiler is, or stay off).
"""

from __future__ import annotations

import importlib.util
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

KERNELS = Path(__file__).resolve().parent / "flowllm" / "kernels"


def native_build() -> ModuleType:
    """flowllm/kernels/native_build.py, loaded alone."""
    spec = importlib.util.spec_from_file_location(
        "flowllm_native_build", KERNELS / "native_build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    """build_ext that compiles the kernels' variants (`build_ext --inplace`: into the tree)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        build = native_build()
        if platform.machine().lower() not in {"x86_64", "amd64"}:
            print(f"flowllm: no prebuilt kernels on {platform.machine()}", file=sys.stderr)
            return
        compiler = build.find_compiler()
        if compiler is None:
            print("flowllm: no C compiler (cc, gcc or $CC): no prebuilt kernels", file=sys.stderr)
            return
        root = (
            KERNELS / "prebuilt"
            if self.inplace
            else Path(self.build_lib) / "flowllm" / "kernels" / "prebuilt"
        )
        try:
            abi = build.torch_abi()
        except ImportError:
            abi = None
            print(
                "flowllm: no torch to build the kernels' ops against (install torch first and "
                "build with --no-build-isolation): they compile on first use",
                file=sys.stderr,
            )
        cxx = build.find_cxx_compiler()
        if cxx is None:
            print(
                "flowllm: no C++ compiler (c++, g++ or $CXX): the kernels' ops compile on "
                "first use",
                file=sys.stderr,
            )
        started = time.perf_counter()
        built = build.build_prebuilt(root, compiler, cxx, abi)
        seconds = time.perf_counter() - started
        print(
            f"flowllm: {len(built)} kernel libraries compiled in {seconds:.1f} s", file=sys.stderr
        )


class PlatformDistribution(Distribution):
    """A platform wheel (cpXY-cpXY-<platform>), as it holds compiled libraries."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_ext": BuildKernels}, distclass=PlatformDistribution)
