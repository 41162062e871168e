"""Switched off (`FLOWLLM_NATIVE_KERNELS=0`), the native CPU kernels leave the models on
their torch paths, which must match transformers just as well: the equivalence tests'
mixed prefill/decode steps run again in a process where the kernels are off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowllm.kernels import native


@pytest.mark.skipif(
    native.library() is None, reason="the torch paths already run every test on this machine"
)
def test_torch_paths_match_transformers() -> None:
    tests = Path(__file__).with_name("test_model_equivalence.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
         "-k", "mixed_steps or bfloat16_close"],
        env={**os.environ, "FLOWLLM_NATIVE_KERNELS": "0"},
        capture_output=True, text=True, cwd=tests.parent.parent, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
