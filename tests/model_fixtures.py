"""Test fixtures' model directories, without network.

Plain functions so benchmarks can use them too (`sys.path.insert(0, "tests")`); the pytest
fixtures in conftest.py wrap them with the right scope.

- The seeded random GPT-2 checkpoints come from `flowllm.models.random_gpt2` (shared with
  trace replay), re-exported here.
- `build_next_token_qwen3_dir`: a Qwen3 checkpoint whose greedy next token is a fixed
  function of the current token, so that a test scripts what it generates.
- `build_tiny_dir`: a tiny random checkpoint of one of the architectures built on Llama's
  layer (Mistral, SmolLM3, Phi-3, Gemma 2, Gemma 3, Qwen3-MoE, OLMoE, Mixtral), with the
  real GPT-2 tokenizer, as transformers saves it; each with the options that set it apart
  (a window shorter than the e2e prompts, layers without RoPE, LongRoPE, score caps,
  experts and a dense layer among sparse ones).
- `greedy_continuation`: transformers' greedy tokens on a checkpoint, the oracle of a
  served greedy completion.
- `populate_hf_cache`: lays a directory out as huggingface_hub's cache does
  (`models--org--name/{blobs,snapshots/<commit>,refs/main,trees/<commit>.json}`), so that
  `snapshot_download` finds it offline through its real code path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from flowllm.models.random_gpt2 import (
    GPT2_EOS,
    GPT2_EOS_ID,
    GPT2_VOCAB_SIZE,
    CheckpointBuildError,
    build_gpt2_dir,
    gpt2_config,
    gpt2_state_dict,
    gpt2_vocab_files,
    write_gpt2_tokenizer_files,
)

__all__ = [
    "GPT2_COMMIT",
    "GPT2_EOS",
    "GPT2_EOS_ID",
    "GPT2_REPO_ID",
    "GPT2_VOCAB_SIZE",
    "QWEN3_STYLE_TEMPLATE",
    "THINKING_MODEL",
    "TINY_ARCHITECTURES",
    "CheckpointBuildError",
    "build_gpt2_dir",
    "build_next_token_qwen3_dir",
    "build_tiny_dir",
    "gpt2_config",
    "gpt2_state_dict",
    "gpt2_vocab_files",
    "greedy_continuation",
    "populate_hf_cache",
    "write_gpt2_tokenizer_files",
]

GPT2_REPO_ID = "openai-community/gpt2"
# openai-community/gpt2's main commit at the time of writing; any 40-hex string would do.
GPT2_COMMIT = "607a30d783dfa663caf39e06633721c8d4cfcd7e"
# ChatML with the end of Qwen3's template: with `enable_thinking: false` the generation
# prompt closes an empty thinking part.
QWEN3_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# A thinking model's script for `build_next_token_qwen3_dir`: each token's next. After
# the template's "assistant\n" it thinks "<think> I think</think>" and answers "\n\n Yes.";
# after the empty thinking part of `enable_thinking: false` ("</think>\n\n") it answers
# " Yes." at once.
THINKING_MODEL = {
    "\n": "<think>",
    "<think>": " I",
    " I": " think",
    " think": "</think>",
    "</think>": "\n\n",
    "\n\n": " Yes",
    " Yes": ".",
    ".": "<|endoftext|>",
}

# Files bigger than this (or safetensors) are stored with Git LFS on the Hub, which changes
# how huggingface_hub names their blobs (sha256 instead of the git blob sha1).
_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


# Each architecture: (config class, model class, what sets it apart), 2 layers 64 wide
# (a mixture of experts: its experts' count, top k and width).
TINY_ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 512,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.2, 1.5, 2.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
            },
        },
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "sliding_window": 8,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 10.0,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {"num_experts": 8, "num_experts_per_tok": 3, "intermediate_size": 32},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
    ),
}


def build_tiny_dir(dest: Path, architecture: str, seed: int = 0) -> Path:
    """Write a tiny random checkpoint of `architecture` (a key of TINY_ARCHITECTURES) with
    the real GPT-2 tokenizer into `dest`, as transformers' save_pretrained lays it out."""
    import torch
    import transformers

    config_name, model_name, extra = TINY_ARCHITECTURES[architecture]
    kw: dict[str, Any] = dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=GPT2_VOCAB_SIZE, max_position_embeddings=1024,
        bos_token_id=GPT2_EOS_ID, eos_token_id=GPT2_EOS_ID, pad_token_id=None,
        initializer_range=0.1, tie_word_embeddings=True,
    )  # fmt: skip
    config = getattr(transformers, config_name)(**{**kw, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    write_gpt2_tokenizer_files(dest)
    return dest


def greedy_continuation(model_dir: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens after `prompt_ids`, each step computed from scratch (no
    cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def _git_blob_sha1(data: bytes) -> str:
    """The git object id of a file's contents (what the Hub reports as a blob id / etag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def populate_hf_cache(
    hub_cache: Path, repo_id: str, src_dir: Path, commit: str = GPT2_COMMIT
) -> Path:
    """Lay out `src_dir`'s files as huggingface_hub's cache would after a download.

    `hub_cache` is `$HF_HOME/hub`. Blobs are named by their etag (sha256 for LFS files, the
    git blob sha1 otherwise), snapshot entries are relative symlinks to them, `refs/main`
    holds the commit, and `trees/<commit>.json` is the cached tree listing that
    snapshot_download checks offline for completeness. Returns the snapshot directory.
    """
    repo_dir = hub_cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo_dir / "blobs", repo_dir / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)  # no trailing newline, as the hub writes it
    tree: dict[str, dict[str, object]] = {}
    for src in sorted(p for p in src_dir.rglob("*") if p.is_file()):
        rel = src.relative_to(src_dir).as_posix()
        size = src.stat().st_size
        if src.suffix in _LFS_SUFFIXES:
            sha256 = hashlib.sha256()
            with src.open("rb") as f:
                for chunk in iter(lambda f=f: f.read(1 << 24), b""):
                    sha256.update(chunk)
            blob_id = sha256.hexdigest()
            pointer = (
                f"version https://git-lfs.github.com/spec/v1\noid sha256:{blob_id}\nsize {size}\n"
            ).encode()
            tree[rel] = {
                "size": size,
                "blob_id": _git_blob_sha1(pointer),
                "lfs_sha256": blob_id,
                "lfs_size": size,
            }
        else:
            blob_id = _git_blob_sha1(src.read_bytes())
            tree[rel] = {"size": size, "blob_id": blob_id}
        blob = blobs / blob_id
        if not blob.exists():
            try:
                os.link(src, blob)  # same filesystem: no copy of a 500 MB file
            except OSError:
                shutil.copyfile(src, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    trees = repo_dir / "trees"
    trees.mkdir(exist_ok=True)
    listing = {"format_version": 1, "files": tree}
    (trees / f"{commit}.json").write_text(json.dumps(listing, indent=1))
    return snapshot


def build_next_token_qwen3_dir(
    dest: Path,
    next_token: dict[str, str],
    *,
    added_tokens: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> Path:
    """A one-layer Qwen3 with the GPT-2 tokenizer (plus `added_tokens`) whose greedy next
    token is `next_token[current]`, each a single token of the tokenizer.

    Attention and the MLP write nothing (zero output projections), so the last layer sees
    only the current token's embedding: the tokens in `next_token` get orthonormal
    embeddings, and the LM head scores `next_token[t]` with t's embedding, every other
    token 0. A token outside `next_token` has a zero embedding (all logits 0). Written as
    float32 safetensors with its tokenizer (and `chat_template`) beside it.
    """
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    write_gpt2_tokenizer_files(dest)
    tokenizer = AutoTokenizer.from_pretrained(str(dest))
    tokenizer.add_tokens(list(added_tokens))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(dest))

    def token_id(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise CheckpointBuildError(f"{text!r} is not one token: {ids}")
        return int(ids[0])

    width = 8 * max(2, -(-len(next_token) // 8))
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=width // 2,
        max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=GPT2_EOS_ID, eos_token_id=GPT2_EOS_ID, torch_dtype="float32",
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (current, following) in enumerate(next_token.items()):
            model.model.embed_tokens.weight[token_id(current), k] = 1.0
            model.lm_head.weight[token_id(following), k] = 1.0
    model.save_pretrained(str(dest), safe_serialization=True)
    return dest
