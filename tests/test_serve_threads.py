"""`flowllm serve` keeps a core for its event loop unless told otherwise."""

from __future__ import annotations

from flowllm.cli import build_parser
from flowllm.cli.serve import serving_threads


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
