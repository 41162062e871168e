"""Benchmarks a user runs against a server: `flowllm bench serve`, a load generator.

Kept import-light: `flowllm.cli` builds its parser from `flowllm.bench.args` without
pulling in httpx, numpy or transformers; the work lives in `flowllm.bench.serve`.
"""
