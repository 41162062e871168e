"""GGUF files of small random models, written in the tests with the `gguf` package's writer
(as llama.cpp's converter lays them out), and a Q4_K quantizer (gguf's Python package only
dequantizes the K formats).

- `quantize_q4_k`: float32 [n, k] -> Q4_K blocks, the scales and mins chosen per 32 values
  from their range (llama.cpp searches better ones; any valid blocks serve here).
- `gemma_for_gguf`: a random Gemma 2 or 3 whose options a GGUF file can carry.
- `moe_for_gguf`: a random Qwen3-MoE, OLMoE or Mixtral as llama.cpp runs them.
- `write_gguf`: a transformers Llama/Qwen2/Qwen3/Phi-3/Gemma 2/Gemma 3/SmolLM3/Qwen3-MoE/
  OLMoE/Mixtral model as a GGUF file (Mixtral's as a `llama` file with experts): its
  config as metadata, a byte-level BPE tokenizer of the model's vocabulary size, its 2-D
  weights in the given format (norms, biases and routers float32), each projection of a
  layer's experts as one 3-D tensor of the experts' blocks, Llama's Q/K rows permuted,
  Phi-3's LongRoPE factors stored as tensors and Gemma's norms as 1 + w, as llama.cpp's
  converter does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = "<|im_end|>"


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> uint8 [n, k / 256 * 144] Q4_K blocks."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15.0  # [n, b, 8]
    mn = -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)  # [n, b]
    dmin = (mn.max(-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63)
    mq = np.clip(np.round(np.divide(mn, dmin32, out=np.zeros_like(mn), where=dmin32 > 0)), 0, 63)
    sc, mq = sc.astype(np.uint8), mq.astype(np.uint8)
    eff_s = (d32 * sc)[..., None]
    eff_m = (dmin32 * mq)[..., None]
    q = np.clip(
        np.round(np.divide(x + eff_m, eff_s, out=np.zeros_like(x), where=eff_s > 0)), 0, 15
    ).astype(np.uint8)  # [n, b, 8, 32]
    scales = np.zeros((n, k // 256, 12), dtype=np.uint8)
    scales[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = (mq[..., :4] & 63) | ((mq[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 15) | ((mq[..., 4:] & 15) << 4)
    pairs = q.reshape(n, k // 256, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    blocks = np.concatenate(
        [
            d.view(np.uint8).reshape(n, k // 256, 2),
            dmin.view(np.uint8).reshape(n, k // 256, 2),
            scales,
            qs,
        ],
        axis=-1,
    )
    return blocks.reshape(n, -1)


def _encode(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """w in qtype, or in Q8_0 where its rows are not whole Q4_K super-blocks (as llama.cpp's
    quantizer falls back)."""
    if qtype == GGMLQuantizationType.Q4_K:
        if w.shape[1] % 256 == 0:
            return quantize_q4_k(w), qtype
        qtype = GGMLQuantizationType.Q8_0
    return gguf.quants.quantize(w, qtype), qtype


def byte_level_vocab(size: int) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE vocabulary of `size` tokens: the 256
    byte symbols, merges of pairs of them, then the two chat tokens (control)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    base = list(bytes_to_unicode().values())
    letters = [bytes_to_unicode()[b] for b in b"etaoinshrdlucmfw"]
    merges = [f"{a} {b}" for a in letters for b in letters][: size - 256 - 2]
    tokens = base + [m.replace(" ", "") for m in merges] + ["<|im_start|>", EOS]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, merges, types


def _rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rows -> llama.cpp's interleaved order (the inverse of gguf_file.rope_row_order)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: Any, path: Path, qtype: GGMLQuantizationType, tokenizer: bool = True) -> Path:
    """Write `model` (a transformers Llama/Qwen2/Qwen3/Phi-3/Gemma/SmolLM3 causal LM) to `path` as
    GGUF (without tokenizer metadata if not `tokenizer`)."""
    cfg = model.config
    arch = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}.get(
        cfg.model_type, cfg.model_type
    )
    gemma = arch in ("gemma2", "gemma3")
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    if arch == "gemma3":  # the global layers' rope; the sliding ones' theta is llama.cpp's
        assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
        rope = rope["full_attention"]
        if rope["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if cfg.model_type in ("qwen3_moe", "olmoe", "mixtral"):
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None):
            w.add_key_value(f"{arch}.{key}", float(getattr(cfg, key)), gguf.GGUFValueType.FLOAT32)
    if rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_rope_scaling_attn_factors(
            math.sqrt(
                1
                + math.log(cfg.max_position_embeddings / cfg.original_max_position_embeddings)
                / math.log(cfg.original_max_position_embeddings)
            )
        )
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
    if tokenizer:
        tokens, merges, types = byte_level_vocab(cfg.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch != "llama" else "gpt2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(len(tokens) - 2)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
        "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_exps": "ffn_gate_exps",
        "mlp.experts.up_exps": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
    }  # fmt: skip
    if gemma:
        layer_names.update(
            post_attention_layernorm="post_attention_norm",
            pre_feedforward_layernorm="ffn_norm",
            post_feedforward_layernorm="post_ffw_norm",
        )
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = _experts_apart(state)
    for name, t in state.items():
        if name in names:
            gname = names[name]
        else:
            parts = name.split(".")  # model.layers.{i}.{module...}.{weight|bias}
            gname = f"blk.{parts[2]}.{layer_names['.'.join(parts[3:-1])]}.{parts[-1]}"
        a = t.detach().to(torch.float32).numpy()
        if gemma and name.endswith("norm.weight"):
            a = a + 1.0
        if arch in ("llama", "smollm3") and (".q_proj." in name or ".k_proj." in name):
            a = _rope_permute(a, heads if ".q_proj." in name else kv_heads)
        if a.ndim == 3:  # the experts' blocks, each expert's rows encoded alone
            encoded = [_encode(expert, qtype) for expert in a]
            w.add_tensor(gname, np.stack([d for d, _ in encoded]), raw_dtype=encoded[0][1])
        elif a.ndim == 2 and gname.endswith("ffn_gate_inp.weight"):
            w.add_tensor(gname, np.ascontiguousarray(a))  # llama.cpp keeps routers float
        elif a.ndim == 2:
            data, used = _encode(a, qtype)
            w.add_tensor(gname, data, raw_dtype=used)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _experts_apart(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' 3-D expert parameters under names the layer map knows, its fused
    gate/up [E, 2I, d] as the file's two tensors (`ffn_gate_exps`, `ffn_up_exps`)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            layer = name.removesuffix("mlp.experts.gate_up_proj")
            out[f"{layer}mlp.experts.gate_exps.weight"] = gate
            out[f"{layer}mlp.experts.up_exps.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            out[f"{name}.weight"] = t
        else:
            out[name] = t
    return out


def moe_for_gguf(family: str) -> torch.nn.Module:
    """A random Qwen3-MoE ("qwen3_moe"), OLMoE or Mixtral as llama.cpp runs them: every
    layer sparse, the top-k weights renormalized (OLMoE's not); 8 experts of width 256, top
    2, hidden 256 (so Q4_K super-blocks fit)."""
    kw: dict[str, object] = dict(
        num_hidden_layers=3, hidden_size=256, vocab_size=512, max_position_embeddings=256,
        initializer_range=0.05, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=2, pad_token_id=0, bos_token_id=510, eos_token_id=511,
    )  # fmt: skip
    torch.manual_seed(25)
    ref: Any
    if family == "qwen3_moe":
        ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **kw, intermediate_size=512, head_dim=64, moe_intermediate_size=256,
            num_experts=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        ))  # fmt: skip
    elif family == "olmoe":
        ref = OlmoeForCausalLM(OlmoeConfig(**kw, intermediate_size=256, num_experts=8))
    else:
        ref = MixtralForCausalLM(
            MixtralConfig(**kw, intermediate_size=256, num_local_experts=8)
        )
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return ref.eval()


def gemma_for_gguf(version: int) -> torch.nn.Module:
    """A random Gemma whose attention scale and layer pattern are llama.cpp's (which a file
    does not carry): query_pre_attn_scalar = head_dim, Gemma 3's five sliding layers to one
    global (7 layers: the 6th global), its sliding layers' theta 10000; hidden 256, so Q4_K
    super-blocks fit."""
    kw: dict[str, object] = dict(
        num_hidden_layers=7 if version == 3 else 3, hidden_size=256, intermediate_size=512,
        vocab_size=512, max_position_embeddings=256, initializer_range=0.05,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=13, pad_token_id=0, bos_token_id=510, eos_token_id=511,
    )  # fmt: skip
    torch.manual_seed(20 + version)
    if version == 2:
        cfg = Gemma2Config(**kw, attn_logit_softcapping=1.5, final_logit_softcapping=3.0)
        ref = Gemma2ForCausalLM(cfg)
    else:
        cfg = Gemma3TextConfig(
            **kw, final_logit_softcapping=4.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )  # fmt: skip
        ref = Gemma3ForCausalLM(cfg)
        assert [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"] == [5]
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    return ref.eval()


def dequantized_like(model: Any, path: Path) -> Any:
    """`model` with each weight replaced by the GGUF file's dequantized value (the file's
    reference: what the quantized model approximates and the dequantized one computes)."""
    from flowllm.models.gguf_file import iter_tensors, open_reader

    reader = open_reader(path)
    weights = dict(iter_tensors(reader, model.config, dequantize=True))
    weights.update(_experts_together(weights, model))
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = (
                "model.embed_tokens.weight"
                if name == "lm_head.weight" and name not in weights
                else name
            )
            p.copy_(weights[key])
    return model


def _experts_together(weights: dict[str, Any], model: Any) -> dict[str, torch.Tensor]:
    """The file's per-expert weights as transformers' 3-D parameters of `model`."""
    out = {}
    for name, _ in model.named_parameters():
        layer, sep, proj = name.rpartition("mlp.experts.")
        if not sep:
            continue
        count = model.config.num_local_experts
        if proj == "gate_up_proj":
            out[name] = torch.stack([
                torch.cat((weights[f"{layer}mlp.experts.{e}.gate_proj.weight"],
                           weights[f"{layer}mlp.experts.{e}.up_proj.weight"]))
                for e in range(count)
            ])  # fmt: skip
        else:
            out[name] = torch.stack(
                [weights[f"{layer}mlp.experts.{e}.down_proj.weight"] for e in range(count)]
            )
    return out
