"""`flowllm serve` keeps a core for its event loop unless told otherwise, and runs one front
on a CPU, several on a GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from flowllm.cli import build_parser, serve
from flowllm.cli.serve import default_api_server_count, gpu_present, serving_threads


def test_all_cores_but_one_by_default() -> None:
    assert serving_threads(None, 2, {}) == 1
    assert serving_threads(None, 8, {}) == 7
    assert serving_threads(None, 1, {}) == 1
    assert serving_threads(None, None, {}) == 1


def test_explicit_choice_and_omp_env_win() -> None:
    assert serving_threads(2, 2, {}) == 2
    assert serving_threads(0, 2, {}) == 1
    assert serving_threads(None, 8, {"OMP_NUM_THREADS": "3"}) is None
    assert serving_threads(4, 8, {"OMP_NUM_THREADS": "3"}) == 4


def test_serve_parses_cpu_threads() -> None:
    args = build_parser().parse_args(["serve", "--cpu-threads", "3"])
    assert args.cpu_threads == 3
    assert build_parser().parse_args(["serve"]).cpu_threads is None


def test_one_front_on_a_cpu_and_one_per_four_host_cores_on_a_gpu() -> None:
    assert default_api_server_count(64, gpu=False) == 1
    assert default_api_server_count(2, gpu=True) == 1
    assert default_api_server_count(8, gpu=True) == 2
    assert default_api_server_count(16, gpu=True) == 4
    assert default_api_server_count(128, gpu=True) == 4
    assert default_api_server_count(None, gpu=True) == 1
    assert build_parser().parse_args(["serve"]).api_server_count is None


def fake_torch(root: Path, cuda: str) -> None:
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text("")
    (root / "torch" / "version.py").write_text(
        f"from typing import Optional\ncuda: Optional[str] = {cuda}\n"
    )


@pytest.mark.parametrize(
    ("cuda", "driver", "env", "expected"),
    [
        ("'12.4'", True, {}, True),
        ("None", True, {}, False),  # a CPU build of torch
        ("'12.4'", False, {}, False),  # no NVIDIA driver
        ("'12.4'", True, {"CUDA_VISIBLE_DEVICES": ""}, False),
        ("'12.4'", True, {"CUDA_VISIBLE_DEVICES": "-1"}, False),
        ("'12.4'", True, {"CUDA_VISIBLE_DEVICES": "1"}, True),
    ],
)
def test_gpu_present_reads_torch_build_and_driver_without_importing_torch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cuda: str,
    driver: bool,
    env: dict[str, str],
    expected: bool,
) -> None:
    fake_torch(tmp_path, cuda)
    monkeypatch.syspath_prepend(str(tmp_path))
    real_exists = os.path.exists
    monkeypatch.setattr(
        serve.os.path, "exists", lambda p: driver if p == "/dev/nvidiactl" else real_exists(p)
    )
    torch_module = sys.modules.pop("torch", None)  # find_spec must find the fake one
    try:
        assert gpu_present(env) is expected
    finally:
        if torch_module is not None:
            sys.modules["torch"] = torch_module
