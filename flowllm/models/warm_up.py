"""Compile and capture on CUDA before serving, so that no step waits on either.

Triton compiles a kernel variant the first time it is launched, and a step that waits for
a compilation takes seconds. At start-up the runner runs one prefill of the largest step
(the prefill and store kernels, and torch's and cuBLAS' lazy set-up) and captures the CUDA
graph of every decode capture size (the decode and split-merge kernels, under the launch
parameters of the longest context). Their time and the graphs' memory are logged. The
graphs' memory, like an eager step's activations, comes from outside the engine's
`gpu_memory_utilization` share, which the weights and the KV cache fill.
"""

from __future__ import annotations

import time

import structlog
import torch

from flowllm.messages import ScheduledRows
from flowllm.models.runner import ModelRunner

_log = structlog.get_logger("flowllm.models")


def warm_up(runner: ModelRunner, prefill_tokens: int) -> None:
    """Run a prefill of `prefill_tokens` tokens (at most what the cache holds) and capture
    the runner's decode graphs; nothing off CUDA. The prefill writes its K/V into the
    first blocks, which no sequence holds yet."""
    device = runner.device
    if device.type != "cuda" or not runner.kv_caches:
        return
    started = time.perf_counter()
    tokens = min(prefill_tokens, runner.kv_caches[0][0].shape[0] * runner.block_size)
    if tokens > 0:
        runner.run(
            ScheduledRows(
                seq_ids=(0,),
                query_lens=(tokens,),
                token_ids=(0,) * tokens,
                num_computed_tokens=(0,),
                block_tables=(tuple(range(-(-tokens // runner.block_size))),),
                sample=(True,),
                num_output_tokens=(0,),
            )
        )
    torch.cuda.synchronize(device)
    compiled = time.perf_counter()
    plans = runner.plans
    captured, graph_bytes = 0, 0
    if plans is not None and plans.buckets is not None:
        free_before, _ = torch.cuda.mem_get_info(device)
        captured = plans.capture(runner.workspace)
        torch.cuda.synchronize(device)
        graph_bytes = free_before - torch.cuda.mem_get_info(device)[0]
    _log.info(
        "warm-up done",
        prefill_tokens=tokens,
        prefill_s=round(compiled - started, 2),
        cuda_graphs=captured,
        capture_sizes=plans.buckets.sizes if plans is not None and plans.buckets else (),
        capture_s=round(time.perf_counter() - compiled, 2),
        graphs_mib=round(graph_bytes / 2**20, 1),
        refused=plans.refused if plans is not None else None,
    )
