"""flowllm installed from its wheel serves with the wheel's prebuilt CPU kernels and their
torch ops, on a machine without a C or C++ compiler.

The wheel is built from a copy of the checkout (so that the build leaves nothing in the
tree) as `make wheel` builds it, installed into a fresh virtual environment that borrows
this one's packages (torch included) through a `.pth` file, and `flowllm serve` runs from
there with a PATH holding only that environment's scripts, no `$CC` or `$CXX` and an empty
flowllm cache: a compiler-less server. Its greedy completion is transformers' greedy continuation
on the same checkpoint.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import pytest
from model_fixtures import greedy_continuation
from server_process import REPO, TINY_FLAGS, ServerProcess

from flowllm.kernels import native, native_build

pytestmark = [
    pytest.mark.wheel,
    pytest.mark.skipif(
        platform.machine().lower() not in {"x86_64", "amd64"}
        or native_build.find_compiler() is None
        or not native.cpu_flags() >= native.ISAS["avx2"].cpu_flags,
        reason="the wheel's kernels are built and run on x86-64 with a C compiler and AVX2",
    ),
]

# What the wheel is built from (pyproject.toml names README.md as the long description).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "flowllm")
VARIANTS = {"avx512-avx512_vnni", "avx512", "avx2"}
PROMPT = "The quick brown fox jumps over the lazy dog. Then the dog"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `make wheel` builds, built from a copy of the checkout."""
    source = tmp_path_factory.mktemp("wheel-source")
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "prebuilt")
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
         "--no-index", "-w", str(dist), str(source)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment holding the wheel, this environment's packages on its path."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # A plain path: the .pth files there (this checkout's editable install) are not read.
    (Path(site) / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
         str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return root


def test_the_wheel_is_a_platform_wheel_with_every_variant(wheel: Path) -> None:
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    platform_tag = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name.endswith(f"-cp{version}-cp{version}-{platform_tag}.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        assert "Root-Is-Purelib: false" in zf.read(metadata).decode()
    prebuilt = "flowllm/kernels/prebuilt"
    for variant in VARIANTS:
        assert f"{prebuilt}/{variant}/{native_build.LIBRARY_NAME}" in names
        assert f"{prebuilt}/{variant}/{native_build.DIGEST_NAME}" in names
    ops = native_build.torch_abi().name  # the ops, for the torch the wheel was built beside
    assert f"{prebuilt}/{ops}/{native_build.OPS_NAME}" in names
    assert f"{prebuilt}/{ops}/{native_build.DIGEST_NAME}" in names
    assert {n.split("/")[3] for n in names if n.startswith(prebuilt + "/")} == {*VARIANTS, ops}
    assert "flowllm/kernels/csrc/linear.c" in names  # a checkout that changes them recompiles


def test_the_wheel_needs_no_library_beyond_glibc(wheel: Path) -> None:
    """auditwheel finds the wheel consistent with a manylinux tag: the kernels bring no
    OpenMP runtime of their own (no libgomp), they use the one torch loads, and the ops link
    no torch library, they bind to those torch loaded."""
    shown = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    verdict = " ".join(shown.split())
    assert re.search(r'consistent with the following platform tag: "manylinux_2_\d+_', verdict)
    assert "libgomp" not in verdict
    assert "libtorch" not in verdict and "libc10" not in verdict


@pytest.fixture(scope="module")
def oracle(gpt2_tiny_dir: Path, gpt2_tokenizer: Any) -> str:
    """transformers' greedy continuation of PROMPT on the tiny GPT-2."""
    prompt_ids = gpt2_tokenizer.encode(PROMPT)
    return str(gpt2_tokenizer.decode(greedy_continuation(gpt2_tiny_dir, prompt_ids, NEW_TOKENS)))


@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_serves_with_the_prebuilt_kernels_without_a_compiler(
    isa: str, venv: Path, gpt2_tiny_dir: Path, oracle: str, tmp_path: Path
) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"CC", "CXX", "PYTHONPATH", native.ISA_ENV, native.DISABLE_ENV}
    }
    cache = tmp_path / "cache"
    env |= {"PATH": str(venv / "bin"), "FLOWLLM_CACHE": str(cache), native.ISA_ENV: isa}
    for compiler in ("cc", "gcc", "c++", "g++"):
        assert shutil.which(compiler, path=env["PATH"]) is None
    server = ServerProcess(
        gpt2_tiny_dir, [*TINY_FLAGS, "--log-level", "info"], python=venv / "bin" / "python",
        env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        server.wait_healthy()
        whole = server.client().completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        log = server.output()
    finally:
        server.stop()
    assert whole.choices[0].text == oracle
    if isa == "avx2":
        assert "native CPU kernels: prebuilt AVX2 build (forced by FLOWLLM_NATIVE_ISA)" in log
    elif native.cpu_flags() >= native.ISAS["avx512"].cpu_flags:
        assert "native CPU kernels: prebuilt AVX-512 build, every kernel on" in log
    else:
        assert "native CPU kernels: prebuilt AVX2 build (the CPU lacks AVX-512)" in log
    assert not (cache / "kernels").exists()  # nothing compiled
