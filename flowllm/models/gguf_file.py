"""A GGUF file as a model: its config and tokenizer through transformers' GGUF support, its
tensors through the `gguf` package's reader, under the HF names flowllm's models load.

Quantized tensors in a format the kernels serve (`quant_linear.GGUF_FORMATS`) come out as
QuantizedWeight, kept quantized, unless `dequantize` asks for float32; other formats
(IQ*, Q2_K, Q3_K, Q5_0, ...) are dequantized by gguf at load. llama.cpp stores a Llama's
Q/K rows permuted for its RoPE kernel; they are put back in HF's order here (a row
permutation, which whole quantized rows allow). Qwen2, Qwen3 and Phi-3 files are not
permuted. A Phi-3 file keeps q/k/v fused (`attn_qkv`) and gate/up fused (`ffn_up`), as
the HF checkpoint does, and its LongRoPE factors as tensors, which go to the config here
with the metadata transformers' GGUF reader leaves out (the rotary width, the original
context, the attention factor, the sliding window). Gemma 2 and 3 files store each norm's
1 + w (llama.cpp's RMSNorm multiplies by its weight), given back here as HF's w, and
their score caps and global rope scaling in metadata transformers' reader drops; their
attention scale is llama.cpp's (`_complete_gemma`). A SmolLM3 file has Llama's layout (Q/K
permuted); transformers' reader has no config for it, so it is read here
(`_config_from_metadata`), as an OLMoE file's is. Qwen3-MoE, OLMoE and Mixtral files
(Mixtral's are `llama` files with an `expert_count`, which transformers' reader reads as
a dense Llama: `_complete_experts` makes the config Mixtral's) hold each projection of a
layer's experts as one 3-D tensor [experts, rows, in] (`ffn_gate_exps`, ...): it is split
here into each expert's weight, a quantized slice staying quantized on its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowllm.cache_dir import flowllm_cache_dir
from flowllm.kernels.quant_linear import GGUF_FORMATS, QuantizedWeight, from_gguf
from flowllm.models.layers import Weight, config_get

# llama.cpp's architecture names -> the HF model type whose layout its tensors have
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "smollm3": "smollm3",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
}
_OWN_CONFIG = frozenset({"smollm3", "olmoe"})  # configs transformers' GGUF reader lacks
_GEMMA = frozenset({"gemma2", "gemma3"})
_PERMUTED_QK = frozenset({"llama", "smollm3"})

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# where an architecture's layer tensors differ from the Llama names above
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# a sparse layer's router, and its experts' 3-D tensors (split by `_experts`)
_MOE_LAYER = {
    **_LAYER,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_ARCH_LAYER = {
    "llama": _MOE_LAYER,  # Mixtral's files are llama's
    "phi3": {**_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen3moe": _MOE_LAYER,
    "olmoe": _MOE_LAYER,
    "gemma2": _GEMMA_LAYER,
    "gemma3": _GEMMA_LAYER,
}


class GGUFError(ValueError):
    """The GGUF file cannot be served; the message says why."""


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """A llama.cpp tensor name of `arch` under HF's names; None: not a tensor of ours."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] not in ("weight", "bias"):
        return None
    layer = _ARCH_LAYER.get(arch, _LAYER).get(parts[2])
    return None if layer is None else f"model.layers.{parts[1]}.{layer}.{parts[3]}"


def rope_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """The row index undoing llama.cpp's Q/K permutation: llama.cpp interleaves each head's
    rows in pairs (x_i, x_{i + D/2}) for its RoPE; HF keeps the two halves apart. Per head,
    rows [D/2, 2] -> [2, D/2]."""
    half = rows // n_heads // 2
    return torch.arange(rows).view(n_heads, half, 2).transpose(1, 2).reshape(rows)


def open_reader(path: Path) -> Any:
    """gguf's reader over the file (memory-mapped), with a clear error for a bad file."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise GGUFError(f"cannot read GGUF file {path}: {e}") from e


def architecture(reader: Any) -> str:
    """The file's llama.cpp architecture, checked against those flowllm runs."""
    field = reader.fields.get("general.architecture")
    arch = None if field is None else field.contents()
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return str(arch)


def load_config(path: Path, reader: Any) -> Any:
    """The transformers config transformers builds from the file's metadata, completed from
    the file where transformers leaves a default: head_dim (`attention.key_length`), tied
    embeddings (no `output.weight`) and q/k/v biases (Llama and Qwen3 have them optionally)."""
    from transformers import AutoConfig

    arch = architecture(reader)
    try:
        if arch in _OWN_CONFIG:
            config = _config_from_metadata(reader, arch)
        else:
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GGUFError(f"cannot read the model config from {path}: {e}") from e
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length.contents())
    names = {t.name for t in reader.tensors}
    config.tie_word_embeddings = "output.weight" not in names
    if arch != "qwen2":
        config.attention_bias = "blk.0.attn_q.bias" in names
    if arch == "phi3":
        _complete_phi3(config, reader)
    if arch in _GEMMA:
        _complete_gemma(config, reader, arch)
    if arch == "qwen3moe":
        _complete_qwen3moe(config, reader)
    if arch == "llama" and _field(reader, "llama.expert_count"):
        _complete_experts(config, reader)
    return config


def _field(reader: Any, key: str) -> Any:
    """A metadata field's value; None when the file has none."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _config_from_metadata(reader: Any, arch: str) -> Any:
    """The config of a file whose architecture transformers' GGUF reader does not know
    (SmolLM3, OLMoE), from its metadata: a SmolLM3's layers without RoPE are every fourth,
    the rule llama.cpp applies to the architecture, which is SmolLM3's default interval;
    an OLMoE's experts are `expert_count` of `feed_forward_length`, top
    `expert_used_count`, their weights not renormalized, as llama.cpp runs it."""
    from transformers import OlmoeConfig, SmolLM3Config

    def field(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None and default is None:
            raise KeyError(f"{arch}.{key}")
        return default if value is None else value

    tokens = reader.fields.get("tokenizer.ggml.tokens")  # its length, not its strings
    vocab = field("vocab_size", len(tokens.data) if tokens is not None else None)
    heads = int(field("attention.head_count"))
    common: dict[str, Any] = dict(
        vocab_size=int(vocab),
        hidden_size=int(field("embedding_length")),
        intermediate_size=int(field("feed_forward_length")),
        num_hidden_layers=int(field("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(field("attention.head_count_kv", heads)),
        max_position_embeddings=int(field("context_length")),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(field("rope.freq_base"))},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch == "olmoe":
        return OlmoeConfig(
            **common,
            num_experts=int(field("expert_count")),
            num_experts_per_tok=int(field("expert_used_count")),
            norm_topk_prob=False,
        )
    return SmolLM3Config(**common, no_rope_layer_interval=4)


def _complete_gemma(config: Any, reader: Any, arch: str) -> None:
    """Gemma's score caps and (Gemma 3) its global layers' rope scaling, from the metadata
    transformers' GGUF reader drops; its attention scale as llama.cpp sets it, which the
    file does not hold: 1/sqrt(hidden / heads) for the 27B models (46 layers for Gemma 2,
    62 for Gemma 3), 1/sqrt(head_dim) for the others."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _field(reader, f"{arch}.{key}")
        if value is not None:
            setattr(config, key, float(value))
    big = config.num_hidden_layers == (46 if arch == "gemma2" else 62)
    config.query_pre_attn_scalar = (
        config.hidden_size // config.num_attention_heads if big else config.head_dim
    )
    if arch == "gemma3" and _field(reader, "gemma3.rope.scaling.type") == "linear":
        factor = float(_field(reader, "gemma3.rope.scaling.factor"))
        params = {kind: dict(p) for kind, p in dict(config.rope_parameters).items()}
        params["full_attention"].update(rope_type="linear", factor=factor)
        config.rope_parameters = params


def _complete_qwen3moe(config: Any, reader: Any) -> None:
    """The experts' width (`expert_feed_forward_length`); every layer sparse and the top-k
    weights renormalized, as llama.cpp runs every Qwen3-MoE file."""
    config.moe_intermediate_size = int(_field(reader, "qwen3moe.expert_feed_forward_length"))
    config.decoder_sparse_step = 1
    config.mlp_only_layers = []
    config.norm_topk_prob = True


def _complete_experts(config: Any, reader: Any) -> None:
    """A `llama` file with experts is a Mixtral: its experts' count and top k, which
    transformers' Llama reader drops."""
    config.model_type = "mixtral"
    config.architectures = ["MixtralForCausalLM"]
    config.num_local_experts = int(_field(reader, "llama.expert_count"))
    config.num_experts_per_tok = int(_field(reader, "llama.expert_used_count"))


def _complete_phi3(config: Any, reader: Any) -> None:
    """What Phi-3's HF config holds and transformers' GGUF reader drops: the rotary width
    (Phi-4-mini rotates 3/4 of each head), the sliding window, and LongRoPE (its factors
    are the file's `rope_factors_*` tensors)."""
    head_dim = int(config.hidden_size // config.num_attention_heads)
    rot = _field(reader, "phi3.rope.dimension_count")
    params = dict(config.rope_parameters or {})
    params["partial_rotary_factor"] = 1.0 if rot is None else int(rot) / head_dim
    config.sliding_window = _field(reader, "phi3.attention.sliding_window") or None
    original = _field(reader, "phi3.rope.scaling.original_context_length")
    if original is not None:
        config.original_max_position_embeddings = int(original)
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        params.update(
            rope_type="longrope",
            long_factor=_dense(factors["rope_factors_long.weight"]).tolist(),
            short_factor=_dense(factors["rope_factors_short.weight"]).tolist(),
        )
        attn_factor = _field(reader, "phi3.rope.scaling.attn_factor")
        if attn_factor is not None:
            params["attention_factor"] = float(attn_factor)
    config.rope_parameters = params


def _dense(t: Any) -> torch.Tensor:
    """A float tensor of any GGUF type as float32, by gguf's own dequantization."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type.name in ("F32", "F16"):
        w = np.asarray(t.data, dtype=np.float32).reshape(shape)
    else:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return torch.from_numpy(np.array(w, order="C"))


def iter_tensors(
    reader: Any, hf_config: Any, dequantize: bool = False
) -> Iterator[tuple[str, Weight]]:
    """(HF name, tensor or QuantizedWeight) for every tensor of the file; quantized 2-D
    tensors of a served format stay quantized unless `dequantize`."""
    arch = architecture(reader)
    n_heads = int(config_get(hf_config, "num_attention_heads"))
    n_kv = int(config_get(hf_config, "num_key_value_heads", n_heads))
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue  # rope_freqs and other derived tensors flowllm computes itself
        type_name = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(shape) == 3:
            yield from _experts(t, name, shape, dequantize)
            continue
        w: Weight
        if type_name in GGUF_FORMATS and len(shape) == 2 and not dequantize:
            try:
                w = from_gguf(t.data, type_name, (shape[0], shape[1]))
            except ValueError as e:
                raise GGUFError(f"GGUF tensor {t.name!r}: {e}") from e
        else:
            w = _dense(t)
        if arch in _GEMMA and name.endswith("norm.weight"):
            w = _dense(t) - 1.0  # the file holds 1 + w
        if arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            heads = n_heads if ".q_proj." in name else n_kv
            order = rope_row_order(w.shape[0], heads)
            w = w.take_rows(order) if isinstance(w, QuantizedWeight) else w[order].contiguous()
        yield name, w


def _experts(
    t: Any, name: str, shape: tuple[int, ...], dequantize: bool
) -> Iterator[tuple[str, Weight]]:
    """A 3-D expert tensor (`name` with `.experts.` in it) as each expert's [rows, in]
    weight under `.experts.{e}.`: slices of the file's blocks, quantized as they are unless
    `dequantize` or their format is not served."""
    if ".experts." not in name:
        raise GGUFError(f"GGUF tensor {t.name!r} of shape {shape} is not an expert tensor")
    quantized = t.tensor_type.name in GGUF_FORMATS and not dequantize
    dense = None if quantized else _dense(t)
    for e in range(shape[0]):
        w: Weight
        if dense is not None:
            w = dense[e]
        else:
            try:
                w = from_gguf(t.data[e], t.tensor_type.name, (shape[1], shape[2]))
            except ValueError as err:
                raise GGUFError(f"GGUF tensor {t.name!r}: {err}") from err
        yield name.replace(".experts.", f".experts.{e}.", 1), w


def load_tokenizer(path: Path, cache_dir: Path | None = None) -> Any:
    """The tokenizer (and chat template) transformers rebuilds from the file's metadata,
    saved once under the flowllm cache: rebuilding takes seconds (benchmarks/README.md,
    "Start-up"), loading the saved one under a second. The entry is keyed by the file's
    path, size and modification time, and written to a temporary directory first and
    renamed, so a crash leaves no half-written entry."""
    from transformers import AutoTokenizer

    entry = tokenizer_cache_entry(path, cache_dir)
    if entry.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except Exception:  # an entry that cannot be read is rebuilt over
            shutil.rmtree(entry, ignore_errors=True)
    try:
        tokenizer = rebuild_tokenizer(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GGUFError(
            f"cannot build a tokenizer from {path}: {e}; give one with --tokenizer"
        ) from e
    with contextlib.suppress(OSError):  # a cache that cannot be written only costs time
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".tmp", dir=entry.parent))
        try:
            tokenizer.save_pretrained(str(tmp))
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def rebuild_tokenizer(path: Path) -> Any:
    """transformers' tokenizer rebuilt from the GGUF file's metadata (slow). AutoTokenizer
    reads the file's model config first to pick a class, which transformers cannot for
    some architectures (SmolLM3): the fast class then reads the file's tokenizer alone."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def tokenizer_cache_entry(path: Path, cache_dir: Path | None = None) -> Path:
    """Where the tokenizer rebuilt from the GGUF file `path` is kept."""
    st = path.stat()
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    root = cache_dir or flowllm_cache_dir()
    return root / "gguf-tokenizers" / hashlib.sha256(key).hexdigest()[:32]
