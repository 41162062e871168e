"""Only the model's thread opens an OpenMP pool: the load's pool ends with its thread, and
the event loop's thread and the other stages' threads run their torch work on one thread
(flowllm/openmp.py). A pool's threads take the OS name of the thread that opened
it, so the threads that are not Python's, by name, say whose pools exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = """
import ctypes, json, os, sys, threading, time
ctypes.CDLL(None).prctl(15, b"test-main")  # PR_SET_NAME: what this thread's children inherit
import torch
torch.set_num_threads(2)
from flowllm import LLM, SamplingParams

def not_python():
    python = {t.native_id for t in threading.enumerate()}
    named = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) not in python:
            try:
                named[tid] = open(f"/proc/self/task/{tid}/comm").read().strip()
            except FileNotFoundError:  # ended meanwhile
                pass
    return named

before = not_python()
llm = LLM(sys.argv[1], max_model_len=256)
# A batch whose sampling and prefill are large enough for torch and the kernels to run
# parallel regions, then one short request whose steps may run on the loop.
llm.generate(["Hello world " * 20] * 12 + ["Hi"],
             SamplingParams(max_tokens=16, temperature=0.8, seed=1))
llm.generate(["Hi"], SamplingParams(max_tokens=8))
deadline = time.monotonic() + 10  # a pool's threads end on their own, just after its thread
while True:
    new = {tid: name for tid, name in not_python().items() if tid not in before}
    if all(name == "flowllm-model" for name in new.values()) or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(json.dumps({"model_threads": llm.services.model_threads, "new": sorted(new.values())}))
"""


def test_only_the_models_thread_opens_a_pool(gpt2_tiny_dir: Path) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OPENBLAS_NUM_THREADS": "1"}
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(gpt2_tiny_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["model_threads"] == 2
    assert seen["new"] == ["flowllm-model"]  # the model's pool: one thread beside its own
