"""A first start says what it is doing: the bundled model's conversion reports its
progress, and compiling the native kernels is announced and timed (both only once)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from flowllm.kernels import native, native_build
from flowllm.models.bundled import PROGRESS_STEP, ensure_bundled_model


def test_converting_the_bundled_model_reports_progress(tmp_path: Path) -> None:
    with capture_logs() as logs:
        ensure_bundled_model(tmp_path)
    events = [e for e in logs if e["event"] == "converting the bundled model"]
    weights = [e for e in events if e["step"] == "weights"]
    percents = [e["percent"] for e in weights]
    assert percents == sorted(percents) and percents[-1] == 100
    assert len(weights) == 100 // PROGRESS_STEP + 1  # 0 %, 10 %, ..., 100 %
    assert weights[-1]["tensors"] == weights[-1]["of"]
    steps = [e["step"] for e in events]
    assert (
        steps.index("weights") < steps.index("writing model.safetensors") < steps.index("tokenizer")
    )
    assert logs[0]["event"] == "converting the bundled model (once)"
    assert logs[-1]["event"] == "bundled model ready"
    with capture_logs() as again:  # converted once: nothing more to say
        ensure_bundled_model(tmp_path)
    assert again == []


def test_compiling_the_kernels_is_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("FLOWLLM_CACHE", str(tmp_path))
    avx2 = native.ISAS["avx2"].variant(native.cpu_flags())

    def build() -> Path:
        return native._build(
            compiler, avx2.name, native_build.LIBRARY_NAME, avx2.digest(),
            lambda target: native_build.compile_library(compiler, avx2, target),
        )  # fmt: skip

    with capture_logs() as logs:
        target = build()
    assert target.is_file() and target.is_relative_to(tmp_path)
    assert [e["event"] for e in logs] == [
        "compiling the native kernels (once)",
        "native kernels ready",
    ]
    assert logs[1]["seconds"] >= 0
    with capture_logs() as again:
        assert build() == target
    assert again == []
