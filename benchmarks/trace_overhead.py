"""What recording a trace costs: offline generation with and without a TraceRecorder.

The same greedy workload (random-token prompts, ignore_eos, all submitted at once) runs on
one loaded model with recording off, then with every channel recorded in full (logits as
raw float32: 200 KB per sampled row with GPT-2's vocabulary), with logits as top-8
digests (what the committed traces use), and with every channel but execute -> sample.
Each mode runs `--repeats` times, alternating; the best time counts.

    .venv/bin/python benchmarks/trace_overhead.py                  # tiny GPT-2, 16 x 32 tokens
    .venv/bin/python benchmarks/trace_overhead.py --shape gpt2-124m --requests 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_fixtures import build_gpt2_dir

from flowllm.config import engine_config
from flowllm.engine.async_engine import AsyncEngine
from flowllm.engine.loading import build_services
from flowllm.messages import GenerateRequest, SamplingParams
from flowllm.stages.services import EngineServices
from flowllm.traces.recorder import TraceRecorder

SHAPES = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4},
    "gpt2-124m": {"n_layer": 12, "n_embd": 768, "n_head": 12},
}
MODES = ("off", "full", "digest", "no-logits")


async def _generate(
    services: EngineServices, requests: list[GenerateRequest], recorder: TraceRecorder | None
) -> int:
    tokens = 0
    async with AsyncEngine.start(services=services.fresh(), recorder=recorder) as engine:
        boxes = [engine.submit(r) for r in requests]
        for box in boxes:
            async for chunk in box:
                tokens += len(chunk.token_ids)
    return tokens


def run_once(
    services: EngineServices, requests: list[GenerateRequest], mode: str, trace_dir: Path
) -> tuple[float, int, int]:
    """(seconds, output tokens, trace bytes) of one run in `mode`."""
    recorder: TraceRecorder | None = None
    if mode == "full":
        recorder = TraceRecorder(trace_dir)
    elif mode == "digest":
        recorder = TraceRecorder(trace_dir, digest_k=8)
    elif mode == "no-logits":
        channels = [
            "validate.in", "tokenize.in", "schedule.requests", "execute.in",
            "schedule.step_results", "detokenize.in", "schedule.finishes", "deliver.in",
            "deliver.errors",
        ]  # fmt: skip
        recorder = TraceRecorder(trace_dir, channels=channels)
    started = time.perf_counter()
    tokens = anyio.run(_generate, services, requests, recorder)
    elapsed = time.perf_counter() - started
    size = sum(f.stat().st_size for f in trace_dir.glob("*")) if recorder else 0
    return elapsed, tokens, size


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        model = build_gpt2_dir(Path(tmp) / "model", seed=0, **SHAPES[args.shape])
        services = build_services(
            engine_config(str(model), dtype="float32", kv_cache_memory=256 << 20)
        )
        generator = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        requests = [
            GenerateRequest(
                request_id=f"r{i}",
                model=services.served_model_name,
                params=params,
                arrival_time=time.monotonic(),
                prompt_token_ids=tuple(
                    torch.randint(0, 50000, (args.input_len,), generator=generator).tolist()
                ),
            )
            for i in range(args.requests)
        ]
        run_once(services, requests[:2], "off", Path(tmp) / "warm")  # warm up
        best: dict[str, tuple[float, int, int]] = {}
        for repeat in range(args.repeats):
            for mode in MODES:
                trace_dir = Path(tmp) / f"trace-{mode}-{repeat}"
                result = run_once(services, requests, mode, trace_dir)
                if mode not in best or result[0] < best[mode][0]:
                    best[mode] = result
        print(
            f"{args.shape}, {args.requests} requests x {args.input_len} in / "
            f"{args.output_len} out, best of {args.repeats}, torch threads "
            f"{torch.get_num_threads()}"
        )
        print(f"{'mode':<10} {'seconds':>8} {'tok/s':>8} {'ratio':>6} {'trace MB':>9}")
        base = best["off"][0]
        for mode in MODES:
            seconds, tokens, size = best[mode]
            print(
                f"{mode:<10} {seconds:>8.3f} {tokens / seconds:>8.1f} {seconds / base:>6.3f} "
                f"{size / 1e6:>9.2f}"
            )


if __name__ == "__main__":
    main()
