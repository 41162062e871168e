"""The shared model fixtures are what they claim to be, checked against transformers and
huggingface_hub themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import snapshot_download
from model_fixtures import GPT2_COMMIT, GPT2_REPO_ID, gpt2_config
from safetensors import safe_open


def test_gpt2_tokenizer_is_the_real_vocabulary(gpt2_tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    assert isinstance(gpt2_tokenizer, PreTrainedTokenizerFast)
    assert gpt2_tokenizer("Hello")["input_ids"] == [15496]
    assert gpt2_tokenizer("Hello world<|endoftext|>")["input_ids"] == [15496, 995, 50256]
    assert gpt2_tokenizer.eos_token_id == 50256
    assert gpt2_tokenizer.model_max_length == 1024
    assert gpt2_tokenizer.decode([15496, 50256], skip_special_tokens=True) == "Hello"
    assert len(gpt2_tokenizer) == 50257


def test_gpt2_tiny_dir_loads_in_transformers(gpt2_tiny_dir: Path) -> None:
    from transformers import GPT2LMHeadModel

    config = json.loads((gpt2_tiny_dir / "config.json").read_text())
    assert config.keys() == gpt2_config().keys()
    assert (config["n_layer"], config["n_embd"]) == (2, 64)
    with safe_open(str(gpt2_tiny_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        # Conv1D layout [in, out], no "transformer." prefix, no attn.bias buffers.
        assert f.get_slice("h.0.attn.c_attn.weight").get_shape() == [64, 192]
    assert "wte.weight" in names and not any(n.endswith(".attn.bias") for n in names)
    model, info = GPT2LMHeadModel.from_pretrained(str(gpt2_tiny_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[15496, 995]])).logits
    assert logits.shape == (1, 2, 50257)
    assert torch.isfinite(logits).all() and 0.01 < logits.std().item() < 10


def test_hf_cache_is_found_offline_by_huggingface_hub(hf_home_with_gpt2: Path) -> None:
    path = snapshot_download(
        GPT2_REPO_ID,
        cache_dir=hf_home_with_gpt2 / "hub",
        local_files_only=True,
        allow_patterns=["*.json", "*.safetensors", "*.txt"],
    )
    assert Path(path).name == GPT2_COMMIT
    assert (Path(path) / "model.safetensors").is_file()


def test_hf_cache_incomplete_snapshot_is_detected(
    hf_home_with_gpt2: Path, tmp_path: Path
) -> None:
    """The cached tree listing is real: huggingface_hub notices a file missing from it."""
    from huggingface_hub.errors import IncompleteSnapshotError

    snapshot = next((hf_home_with_gpt2 / "hub").glob("models--*/snapshots/*"))
    link = snapshot / "merges.txt"
    target = link.readlink()
    link.unlink()
    try:
        with pytest.raises(IncompleteSnapshotError):
            snapshot_download(
                GPT2_REPO_ID, cache_dir=hf_home_with_gpt2 / "hub", local_files_only=True
            )
    finally:
        link.symlink_to(target)
