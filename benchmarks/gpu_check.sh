#!/usr/bin/env bash
# One check of flowllm on a CUDA machine (an NVIDIA H100/H200 with Python 3.12, PyTorch
# and Triton installed, and no network), within a fixed time budget:
#
#   setup       the wheels of benchmarks/gpu_wheels.sh installed into $SITE (--no-index
#               --no-deps: torch, triton and the nvidia packages are never touched), the
#               versions that matter printed, flowllm's server and offline API imported
#   host_steps  benchmarks/pipeline_overhead.py on this machine's CPU: the graph's own work
#               per step around an instant model, in one process and with the engine core
#               in its own, vocabularies of 1,024 and 50,257 (nothing runs on the GPU)
#   kernels     tests/kernels/test_kernel_triton_attention.py, the Triton kernels compiled
#               for the GPU (TRITON_INTERPRET unset), and tests/models/test_decode_graphs.py,
#               decode steps captured as CUDA graphs against eager ones, pytest-xdist's
#               workers where present
#   serving     benchmarks/serving_efficiency.py on cuda: a random GPT-2 of the 124M shape,
#               bf16, 256 prompts of 128 tokens, 128 out, offline and served at
#               concurrency 64 and 256
#   throughput  benchmarks/throughput.py on cuda: the same shape and workload offline
#               beside transformers' generate, one request at a time and in one static
#               batch of 256
#   async_steps the same offline run, flowllm alone, with two steps in flight
#               (examples/graphs/async-scheduling.yaml)
#
# Each part runs under `timeout`, capped by what is left of $BUDGET; a part that fails or
# times out is reported and the next runs. The logs, the JSON figures and a summary go to
# $OUT (10 files). Exit status: 0 when every part passed.
#
#   bash benchmarks/gpu_check.sh              # on the GPU machine, from anywhere
#   bash benchmarks/gpu_check.sh --dry-run    # a rehearsal on a CPU: tiny settings, the
#                                             # kernels in Triton's interpreter
# Environment: WHEELS (default <repo>/.whl), SITE (/tmp/site), PYTHON (python3), OUT
# (/tmp/gpu-check), BUDGET (seconds, 420), DEVICE (cuda; cpu is the same as --dry-run).
#
# The part functions run in a child bash (`bash -c NAME`), which shellcheck cannot follow.
# shellcheck disable=SC2317
set -u -o pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
WHEELS=${WHEELS:-$REPO/.whl}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-check}
BUDGET=${BUDGET:-420}
DEVICE=${DEVICE:-cuda}
if [ "${1:-}" = "--dry-run" ]; then
  DEVICE=cpu
elif [ -n "${1:-}" ]; then
  echo "usage: $0 [--dry-run]" >&2
  exit 2
fi
mkdir -p "$OUT"
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 # nothing is fetched: every model here is built on the spot

STARTED=$(date +%s)
PARTS=()
declare -A STATUS SECONDS_TAKEN

# run_part NAME CAP COMMAND...: COMMAND under `timeout` (at most CAP seconds and what is
# left of the budget), its output in $OUT/NAME.log.
run_part() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - STARTED)))
  local limit=$((cap < left ? cap : left))
  PARTS+=("$name")
  if [ "$limit" -lt 15 ]; then
    STATUS[$name]="skipped: ${left}s of the budget left"
    SECONDS_TAKEN[$name]=0
    echo "=== $name: skipped, ${left}s of the budget left"
    return
  fi
  echo "=== $name (timeout ${limit}s) $(date -u +%H:%M:%S)"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=20 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  SECONDS_TAKEN[$name]=$(($(date +%s) - t0))
  case $rc in
    0) STATUS[$name]="ok" ;;
    124 | 137) STATUS[$name]="TIMED OUT after ${limit}s" ;;
    *) STATUS[$name]="FAILED (exit $rc)" ;;
  esac
  echo "=== $name: ${STATUS[$name]} in ${SECONDS_TAKEN[$name]}s; last lines of $name.log:"
  tail -n 12 "$OUT/$name.log" | cut -c1-240
}

setup() {
  local wheels=("$WHEELS"/*.whl)
  if [ -e "${wheels[0]}" ]; then
    echo "installing ${#wheels[@]} wheels from $WHEELS into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}" || return 1
  else
    echo "no wheels in $WHEELS: using what is installed"
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  "$PY" - <<'EOF' || return 1
import importlib.metadata as metadata
import sys

print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers", "tokenizers", "huggingface_hub",
             "safetensors", "numpy", "anyio", "msgspec", "litestar", "uvicorn", "httpx",
             "structlog", "prometheus_client", "pytest", "pytest-xdist", "hypothesis"):
    try:
        print(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name} MISSING")
import torch

print("cuda available:", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
# What the parts import: the server and its API, the offline engine, the bench client.
import flowllm.api.app
import flowllm.bench.serve
import flowllm.cli.serve
import flowllm.kernels.triton_attention
import flowllm.llm
import flowllm.models.random_gpt2

flowllm.models.random_gpt2.gpt2_vocab_files()
print("flowllm imports: ok")
EOF
}

kernels() {
  local tests=tests/kernels/test_kernel_triton_attention.py graphs=tests/models/test_decode_graphs.py
  if [ "$DEVICE" = cuda ]; then
    local xdist=()
    "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 4)
    env -u TRITON_INTERPRET "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" -rfEs \
      "$tests" "$graphs"
  else # the interpreter is slow: a few kernel cases show the command works
    TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider -rfE "$tests" "$graphs" \
      -k "test_empty_batch or test_store_then_attend or bad_inputs or decode_graphs"
  fi
}

serving() {
  if [ "$DEVICE" = cuda ]; then
    "$PY" benchmarks/serving_efficiency.py --device cuda --model tiny-gpt2 --gpt2-shape 124m \
      --dtype bfloat16 --rounds 2 --num-prompts 256 --input-len 128 --output-len 128 \
      --concurrency 64 256 --startup-timeout 150 --request-timeout 120 --json "$OUT/serving.json"
  else
    "$PY" benchmarks/serving_efficiency.py --device cpu --model tiny-gpt2 --gpt2-shape tiny \
      --dtype float32 --rounds 1 --num-prompts 16 --input-len 16 --output-len 8 \
      --concurrency 4 16 --json "$OUT/serving.json"
  fi
}

throughput() {
  if [ "$DEVICE" = cuda ]; then
    "$PY" benchmarks/throughput.py --device cuda --models gpt2-124m --dtypes bfloat16 \
      --num-requests 256 --input-len 128 --output-len 128 --baselines one,static \
      --static-batch 256 --sample-batches 1 --sample-requests 4 --json "$OUT/throughput.json"
  else
    "$PY" benchmarks/throughput.py --device cpu --models gpt2-124m --dtypes bfloat16 \
      --num-requests 8 --input-len 16 --output-len 8 --baselines one,static --static-batch 8 \
      --sample-batches 1 --sample-requests 1 --json "$OUT/throughput.json"
  fi
}

# The offline run again with two steps in flight (async scheduling), flowllm alone.
async_steps() {
  if [ "$DEVICE" = cuda ]; then
    "$PY" benchmarks/throughput.py --device cuda --models gpt2-124m --dtypes bfloat16 \
      --num-requests 256 --input-len 128 --output-len 128 --baselines none \
      --graph examples/graphs/async-scheduling.yaml --json "$OUT/throughput-async.json"
  else
    "$PY" benchmarks/throughput.py --device cpu --models gpt2-124m --dtypes bfloat16 \
      --num-requests 8 --input-len 16 --output-len 8 --baselines none \
      --graph examples/graphs/async-scheduling.yaml --json "$OUT/throughput-async.json"
  fi
}

# The graph's host work per step, as the CPU targets of the step-speed work state them,
# on a host whose cores nothing else shares.
host_steps() {
  local runs=("--vocab 1024 --repeats 3" "--vocab 1024 --repeats 3 --multiprocess --steps 300"
    "--repeats 2" "--repeats 2 --multiprocess")
  [ "$DEVICE" = cuda ] || runs=("--vocab 1024 --repeats 1 --steps 16"
    "--vocab 1024 --repeats 1 --steps 16 --multiprocess")
  local flags
  for flags in "${runs[@]}"; do
    echo "### pipeline_overhead.py $flags"
    # shellcheck disable=SC2086 # the flags are words
    "$PY" benchmarks/pipeline_overhead.py $flags || return 1
  done
}

summary() {
  echo "gpu_check.sh on ${HOSTNAME:-this machine}, device $DEVICE, $(date -u +%Y-%m-%dT%H:%M:%SZ)," \
    "$(($(date +%s) - STARTED))s of a ${BUDGET}s budget"
  local name
  for name in "${PARTS[@]}"; do
    printf '  %-11s %-28s %4ss\n' "$name" "${STATUS[$name]}" "${SECONDS_TAKEN[$name]}"
  done
  local tests
  tests=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/kernels.log" 2>/dev/null | tail -n 1)
  echo "  kernel tests: ${tests:-no pytest summary line}"
  OUT="$OUT" "$PY" - <<'EOF'
import json
import os
from pathlib import Path

out = Path(os.environ["OUT"])
try:
    s = json.loads((out / "serving.json").read_text())
    print(f"  serving ({s['model']} {s.get('gpt2_shape') or ''}, {s['device']}, "
          f"{s['num_prompts']} prompts {s['input_len']}/{s['output_len']}, "
          f"server healthy in {s['server_startup_s']:.0f} s), output tok/s per round:")
    for r in s["rounds"]:
        serving = ", ".join(f"c={c} {v:.0f} ({v / r['offline_tok_s']:.2f}x)"
                            for c, v in r["serving_tok_s"].items())
        print(f"    round {r['index']}: offline {r['offline_tok_s']:.0f}; serving {serving}")
except (OSError, ValueError, KeyError, ZeroDivisionError) as exc:
    print(f"  serving: no figures ({type(exc).__name__}: {exc})")
try:
    for r in json.loads((out / "throughput.json").read_text()):
        one = r["one_tok_s"] or 0.0
        static = r["static_tok_s"] or 0.0
        print(f"  throughput ({r['model']} {r['dtype']}, {r['device']}, {r['num_requests']} "
              f"requests {r['input_len']}/{r['output_len']}): flowllm {r['flowllm_tok_s']:.0f} "
              f"tok/s in {r['steps']} steps ({r['roofline_pct']:.1f}% of roofline at "
              f"{r['matmul_gflops'] / 1000:.0f} TFLOP/s); transformers one-at-a-time "
              f"{one:.0f}, static batch of {r['static_batch']} {static:.0f} tok/s; "
              f"greedy vs transformers: {r['greedy_match']}")
except (OSError, ValueError, KeyError, TypeError) as exc:
    print(f"  throughput: no figures ({type(exc).__name__}: {exc})")
try:
    for r in json.loads((out / "throughput-async.json").read_text()):
        print(f"  async_steps (two steps in flight): flowllm {r['flowllm_tok_s']:.0f} tok/s "
              f"in {r['steps']} steps")
except (OSError, ValueError, KeyError, TypeError) as exc:
    print(f"  async_steps: no figures ({type(exc).__name__}: {exc})")
EOF
  echo "  host_steps (µs per step at 1 / 64 / 256 sequences, instant model):"
  awk '/^### / { if (run) print "    " run ": " steps; run = substr($0, 5); steps = "" }
       $1 == "default" && $2 ~ /^[0-9]+$/ { steps = steps (steps ? " / " : "") $3 }
       END { if (run) print "    " run ": " steps }' "$OUT/host_steps.log" 2>/dev/null
}

# `timeout` runs programs, not functions: each part is a function a child bash runs.
export REPO WHEELS SITE PY OUT DEVICE
export -f setup kernels serving throughput async_steps host_steps
run_part setup 60 bash -c setup
run_part host_steps 60 bash -c host_steps
run_part kernels 150 bash -c kernels
run_part serving 170 bash -c serving
run_part throughput 120 bash -c throughput
run_part async_steps 60 bash -c async_steps
echo
summary | tee "$OUT/summary.txt"
for name in "${PARTS[@]}"; do
  [ "${STATUS[$name]}" = ok ] || exit 1
done
exit 0
