"""Test fixtures' model directories, without network.

Plain functions so benchmarks can use them too (`sys.path.insert(0, "tests")`); the pytest
fixtures in conftest.py wrap them with the right scope.

- The seeded random GPT-2 checkpoints come from `flowllm.models.random_gpt2` (shared with
  trace replay), re-exported here.
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
    "CheckpointBuildError",
    "build_gpt2_dir",
    "gpt2_config",
    "gpt2_state_dict",
    "gpt2_vocab_files",
    "populate_hf_cache",
    "write_gpt2_tokenizer_files",
]

GPT2_REPO_ID = "openai-community/gpt2"
# openai-community/gpt2's main commit at the time of writing; any 40-hex string would do.
GPT2_COMMIT = "607a30d783dfa663caf39e06633721c8d4cfcd7e"

# Files bigger than this (or safetensors) are stored with Git LFS on the Hub, which changes
# how huggingface_hub names their blobs (sha256 instead of the git blob sha1).
_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


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
