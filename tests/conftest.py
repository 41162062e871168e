"""Shared pytest fixtures: the GPT-2 tokenizer, GPT-2 model directories, an offline HF cache,
and the bundled SmolLM2, all built without network.

The builders live in tests/model_fixtures.py; here they get their scope. Directory fixtures
are session-scoped and must be treated as read-only by tests.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import huggingface_hub  # noqa: F401
import pytest
import structlog

# huggingface_hub reads HF_HUB_OFFLINE, HF_HOME, HF_ENDPOINT... once, when first imported.
# Importing it here, before any test sets those variables, keeps its module constants equal to
# the real environment whatever order tests run in.
sys.path.insert(0, str(Path(__file__).parent))

from kernel_builds import KERNEL_BUILDS, use_kernel_build
from model_fixtures import (
    GPT2_REPO_ID,
    build_gpt2_dir,
    populate_hf_cache,
    write_gpt2_tokenizer_files,
)

from flowllm.kernels import native

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


@pytest.fixture(params=list(native.ISAS))
def native_build(request: pytest.FixtureRequest) -> Iterator[native.NativeLibrary]:
    """The process's native library as each build in turn, so a test runs every kernel
    under both ISAs whatever the environment forces; skipped where the CPU lacks the
    build's features, the kernels are off, or the build fails."""
    with use_kernel_build(request.param) as lib:
        assert lib is not None
        yield lib


@pytest.fixture(params=KERNEL_BUILDS)
def kernel_build(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each kernel build in turn, the torch paths included, for the whole process, so a test
    checks every product path whatever the environment forces; skipped where the CPU cannot
    run a build or the kernels are off."""
    with use_kernel_build(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _structlog_configuration() -> Iterator[None]:
    """Each test starts from the same logging configuration: a command run in one test
    (`--log-level warning`) must not silence the log another test reads."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


# The tiny GPT-2: 2 layers, 64 wide, 4 heads of 16, the real 50257-token vocabulary.
TINY_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4}


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only the real GPT-2 tokenizer files."""
    dest = tmp_path_factory.mktemp("gpt2-tokenizer")
    write_gpt2_tokenizer_files(dest)
    return dest


@pytest.fixture(scope="session")
def gpt2_tokenizer(gpt2_tokenizer_dir: Path) -> PreTrainedTokenizerFast:
    """The real GPT-2 tokenizer (transformers' GPT2Tokenizer, a PreTrainedTokenizerFast)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gpt2_tokenizer_dir))


@pytest.fixture(scope="session")
def gpt2_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GPT-2 (64 wide, 4 heads) with random weights and the real tokenizer."""
    return build_gpt2_dir(tmp_path_factory.mktemp("gpt2-tiny"), seed=0, **TINY_GPT2)


@pytest.fixture(scope="session")
def gpt2_124m_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The full GPT-2 124M shape (12 layers, 768 wide) with random weights; ~500 MB, built once
    per session and only when a test asks for it."""
    return build_gpt2_dir(tmp_path_factory.mktemp("gpt2-124m"), seed=0)


@pytest.fixture(scope="session")
def gpt2_hf_home(tmp_path_factory: pytest.TempPathFactory, gpt2_tiny_dir: Path) -> Path:
    """An HF_HOME whose hub cache holds the tiny GPT-2 as openai-community/gpt2."""
    home = tmp_path_factory.mktemp("hf-home")
    populate_hf_cache(home / "hub", GPT2_REPO_ID, gpt2_tiny_dir)
    return home


@pytest.fixture
def hf_home_with_gpt2(gpt2_hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point HF_HOME at a cache holding `openai-community/gpt2` (the tiny model) and go offline.

    Yields the HF_HOME directory (the hub cache is `HF_HOME/hub`).
    """
    monkeypatch.setenv("HF_HOME", str(gpt2_hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield gpt2_hf_home


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled SmolLM2-135M-Instruct converted to an HF directory (read-only for tests).

    Reuses an up-to-date conversion in the user's flowllm cache when there is one; otherwise
    converts once per session into a temporary cache (about 10 s).
    """
    from flowllm.models.bundled import ensure_bundled_model, find_bundled_model

    found = find_bundled_model()
    if found is not None:
        return found
    return ensure_bundled_model(tmp_path_factory.mktemp("flowllm-cache"))


@pytest.fixture
def flowllm_cache_with_smollm2(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point FLOWLLM_CACHE at the cache holding `smollm2_dir`, so the name
    `smollm2-135m-instruct` resolves to it without converting again. Returns the cache."""
    cache = smollm2_dir.parent.parent  # <cache>/models/smollm2-135m-instruct
    monkeypatch.setenv("FLOWLLM_CACHE", str(cache))
    return cache
