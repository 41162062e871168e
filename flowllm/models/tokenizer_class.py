"""The tokenizer class transformers' AutoTokenizer chose for a set of tokenizer files,
remembered in the flowllm cache so that later loads of the same files skip AutoTokenizer.

Why: AutoTokenizer imports transformers' configuration module, which imports torch (over a
second) wherever torch is installed. A front process needs no torch (it tokenizes,
detokenizes and speaks HTTP), and loads its tokenizer at every start. The choice depends
on the tokenizer's files, the model's config and transformers' own rules, so it is keyed
by all three: the files' contents and transformers' version. A record that names no
tokenizer class transformers has is ignored.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from flowllm.cache_dir import flowllm_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# What AutoTokenizer reads to choose (the tokenizer's files and the model's config).
CHOICE_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json")


def _record_path(path: Path) -> Path:
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    for name in CHOICE_FILES:
        file = path / name
        digest.update(name.encode())
        digest.update(file.read_bytes() if file.is_file() else b"\0missing")
    return flowllm_cache_dir() / "tokenizer-classes" / digest.hexdigest()[:32]


def recorded_class(path: Path) -> type[PreTrainedTokenizerFast] | None:
    """The class recorded for the tokenizer files in `path`, or None."""
    import transformers

    try:
        name = _record_path(path).read_text().strip()
    except OSError:
        return None
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerFast):
        return cls
    return None


def record_class(path: Path, cls: type) -> None:
    """Remember `cls` for the tokenizer files in `path` (nothing when transformers does not
    export it by name, or the cache cannot be written)."""
    import transformers

    if getattr(transformers, cls.__name__, None) is not cls:
        return
    target = _record_path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(cls.__name__)
        os.replace(tmp, target)  # readers see the whole name or none
    except OSError:
        Path(tmp).unlink(missing_ok=True)
