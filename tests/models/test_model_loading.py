"""Weight loading, architecture lookup, dtype resolution and KV cache sizing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from flowllm.config import ConfigError
from flowllm.engine.loading import model_bytes
from flowllm.kernels import cpu_linear
from flowllm.models import dtype as dtype_mod
from flowllm.models import layers
from flowllm.models.errors import KVCacheError
from flowllm.models.gpt2 import GPT2Model
from flowllm.models.kv_cache import KVCacheSpec, allocate_kv_cache, gpu_cache_budget
from flowllm.models.layers import Linear
from flowllm.models.llama import LlamaModel, Phi3Model
from flowllm.models.registry import UnsupportedModelError, WeightLoadError, model_class_for
from flowllm.models.rope import rope_frequencies, rope_parameters


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    return GPT2LMHeadModel(cfg).eval()


def tiny_llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, tie_word_embeddings=tied,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def test_registry_by_architecture_and_model_type() -> None:
    assert model_class_for({"architectures": ["GPT2LMHeadModel"]}) is GPT2Model
    assert model_class_for({"architectures": ["LlamaForCausalLM"]}) is LlamaModel
    assert model_class_for({"model_type": "llama"}) is LlamaModel
    assert model_class_for(tiny_gpt2().config) is GPT2Model
    with pytest.raises(UnsupportedModelError, match=r"FalconForCausalLM.*GPT2LMHeadModel"):
        model_class_for({"architectures": ["FalconForCausalLM"]})
    with pytest.raises(UnsupportedModelError, match="'t5'"):
        model_class_for({"model_type": "t5"})


def test_gpt2_loads_prefixed_and_unprefixed_names_alike() -> None:
    ref = tiny_gpt2()
    prefixed = dict(ref.state_dict())  # transformer.h.0..., lm_head.weight, attn buffers
    unprefixed = {
        k.removeprefix("transformer."): v for k, v in prefixed.items() if k != "lm_head.weight"
    }
    a = GPT2Model(ref.config, torch.float32, "cpu")
    a.load_weights(prefixed.items())
    b = GPT2Model(ref.config, torch.float32, "cpu")
    b.load_weights(unprefixed.items())
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    # Packed linear weights are not in the state dict: compare them as [out, in].
    for (na, la), (nb, lb) in zip(_linears(a), _linears(b), strict=True):
        assert na == nb
        torch.testing.assert_close(la.dense_weight(), lb.dense_weight(), rtol=0, atol=0)
    c_fc = ref.transformer.h[0].mlp.c_fc.weight  # Conv1D: [in, out]
    torch.testing.assert_close(a.h[0].c_fc.dense_weight(), c_fc.t(), rtol=0, atol=0)
    # The tied head holds the embedding: the Conv1D transpose and tying are both exact.
    ids = torch.tensor([3, 7, 99])
    torch.testing.assert_close(a.wte(ids), ref.transformer.wte.weight[ids], rtol=0, atol=0)


def test_missing_tensor_is_named() -> None:
    sd = {k: v for k, v in tiny_gpt2().state_dict().items() if "h.0.mlp.c_fc.bias" not in k}
    with pytest.raises(WeightLoadError, match=r"missing 1 tensor.*h\.0\.mlp\.c_fc\.bias"):
        GPT2Model(tiny_gpt2().config, torch.float32, "cpu").load_weights(sd.items())


def test_wrong_shape_names_tensor_and_both_shapes() -> None:
    ref = tiny_llama()
    sd = dict(ref.state_dict())
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight.*\(8, 32\).*\(16, 32\)"):
        LlamaModel(ref.config, torch.float32, "cpu").load_weights(sd.items())


def test_unexpected_tensor_is_rejected() -> None:
    ref = tiny_llama()
    sd = {**ref.state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.zeros(8)}
    with pytest.raises(WeightLoadError, match="q_norm"):
        LlamaModel(ref.config, torch.float32, "cpu").load_weights(sd.items())


def test_llama_untied_needs_lm_head_tied_does_not() -> None:
    untied = tiny_llama(tied=False)
    sd = {k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(WeightLoadError, match=r"lm_head\.weight"):
        LlamaModel(untied.config, torch.float32, "cpu").load_weights(sd.items())
    tied = tiny_llama(tied=True)
    sd = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    model = LlamaModel(tied.config, torch.float32, "cpu")
    model.load_weights(sd.items())
    h = torch.randn(2, 32)
    torch.testing.assert_close(model.lm_head(h), tied.lm_head(h))


def _linears(model: torch.nn.Module) -> list[tuple[str, Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("layout", ["native", "onednn", "plain"])
@pytest.mark.parametrize("tied", [True, False])
def test_packed_and_plain_weights_agree(
    layout: str, tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every weight layout loads the same checkpoint into the same function; packing is a
    pure reorder, and a tied embedding still reads the checkpoint's rows exactly."""
    if layout == "onednn" and not layers.onednn_packs(torch.float32, torch.device("cpu")):
        pytest.skip("torch built without oneDNN")
    if layout == "native" and not cpu_linear.serves(torch.float32):
        pytest.skip("no native kernels here")
    monkeypatch.setattr(layers, "weight_layout", lambda dtype, device: layout)
    packed = layout != "plain"
    ref = tiny_llama(tied=tied)
    sd = ref.state_dict()
    model = LlamaModel(ref.config, torch.float32, "cpu")
    model.load_weights(sd.items())
    for name, lin in _linears(model):
        assert lin.layout == layout and (lin.weight is None) is packed
        prefix, _, proj = name.rpartition(".")
        shards = {
            "lm_head": ["lm_head"],
            "qkv_proj": [f"model.{prefix}.self_attn.{p}_proj" for p in "qkv"],
            "o_proj": [f"model.{prefix}.self_attn.o_proj"],
            "gate_up_proj": [f"model.{prefix}.mlp.{p}_proj" for p in ("gate", "up")],
            "down_proj": [f"model.{prefix}.mlp.down_proj"],
        }[proj]
        want = torch.cat([sd[f"{shard}.weight"] for shard in shards])
        torch.testing.assert_close(lin.dense_weight(), want, rtol=0, atol=0)
    h = torch.randn(3, 32)
    torch.testing.assert_close(model.lm_head(h), ref.lm_head(h))
    ids = torch.tensor([0, 5, 99])
    emb = ref.model.embed_tokens.weight[ids]
    torch.testing.assert_close(model.embed_tokens(ids), emb, rtol=0, atol=0)


def test_packed_model_reloads() -> None:
    """Loading into a packed model unpacks, loads and packs again: the new weights win,
    tied embedding and head alike."""
    first, second = tiny_llama(tied=True), tiny_llama(tied=True)
    with torch.no_grad():
        for p in second.parameters():
            p.add_(0.5)
    model = LlamaModel(first.config, torch.float32, "cpu")
    model.load_weights(first.state_dict().items())
    model.load_weights(second.state_dict().items())
    h = torch.randn(2, 32)
    torch.testing.assert_close(model.lm_head(h), second.lm_head(h))
    ids = torch.tensor([1, 42])
    emb = second.model.embed_tokens.weight[ids]
    torch.testing.assert_close(model.embed_tokens(ids), emb, rtol=0, atol=0)
    x = torch.randn(2, 32)
    layer, want = model.layers[0], second.model.layers[0]
    torch.testing.assert_close(layer.o_proj(x), want.self_attn.o_proj(x))


def test_llama3_rope_frequencies_match_transformers() -> None:
    old_style = {  # as a config.json written before transformers 5 carries it
        "hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    }  # fmt: skip
    cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **old_style["rope_scaling"]},
    )  # fmt: skip
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")

    def inv_freq(config: object) -> torch.Tensor:
        return rope_frequencies(config, rope_parameters(config), 32).inv_freq

    torch.testing.assert_close(inv_freq(cfg), want)
    torch.testing.assert_close(inv_freq(old_style), want)
    assert not torch.allclose(inv_freq({"rope_theta": 500000.0}), want)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
        {"mscale": 1.0, "mscale_all_dim": 0.5},
        {"attention_factor": 0.9},
        {"factor": None},  # from max_position_embeddings / original
    ],
)
def test_yarn_frequencies_and_attention_scaling_match_transformers(extra: dict) -> None:
    params = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
              "original_max_position_embeddings": 64, **extra}  # fmt: skip
    cfg = LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=512,
        rope_parameters=params,
    )  # fmt: skip
    want, scaling = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got = rope_frequencies(cfg, rope_parameters(cfg), 64)
    torch.testing.assert_close(got.inv_freq, want, rtol=0, atol=0)
    assert got.attention_scaling == pytest.approx(scaling, rel=1e-12)
    assert not torch.equal(got.inv_freq, rope_frequencies({}, {"rope_type": "default",
                           "rope_theta": 50000.0}, 64).inv_freq)  # fmt: skip


def test_longrope_factors_and_attention_scaling_match_transformers() -> None:
    """Phi-3's LongRoPE with a partial rotary factor: the short factors while the served
    context is within the original one, the long ones past it (transformers' choice for a
    sequence that long), cos and sin scaled by transformers' attention factor either way."""
    rng = torch.Generator().manual_seed(0)
    cfg = Phi3Config(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=4096,
        original_max_position_embeddings=256, partial_rotary_factor=0.5,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(16, generator=rng)).tolist(),
            "long_factor": (1 + 8 * torch.rand(16, generator=rng)).tolist(),
        },
    )  # fmt: skip
    model = Phi3Model(cfg, torch.float32, "cpu")
    params = model.rope_tables(cfg)["global"]
    for context, seq_len in ((256, None), (4096, 257)):
        want, scaling = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
        got = rope_frequencies(cfg, params, 64, context)
        torch.testing.assert_close(got.inv_freq, want, rtol=0, atol=0)
        assert got.attention_scaling == pytest.approx(scaling, rel=1e-12) and scaling > 1
    # The model serves its whole context (long factors) until told to serve less.
    long_table = model.rotaries["global"].table
    model.limit_context(256)
    short = rope_frequencies(cfg, params, 64, 256).inv_freq
    assert torch.equal(model.rotaries["global"].inv_freq, short)
    assert not torch.equal(model.rotaries["global"].table[:100], long_table[:100])


def test_unsupported_rope_types_and_options_are_refused_by_name() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
            "intermediate_size": 32, "vocab_size": 16}  # fmt: skip
    dynamic = {**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic' is not supported"):
        LlamaModel(dynamic, torch.float32, "cpu")
    refused = [
        ("qwen2", {"use_sliding_window": True}, "Qwen2 with use_sliding_window=True"),
        ("gemma2", {"use_bidirectional_attention": True}, "Gemma2 with use_bidirectional"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "Gemma3 with attn_logit_softcapping"),
        ("qwen3_moe", {"use_sliding_window": True}, "Qwen3MoE with use_sliding_window=True"),
        ("olmoe", {"clip_qkv": 8.0}, "OLMoE with clip_qkv=8.0"),
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 6}, "num_experts_per_tok=6 of"),
    ]
    for model_type, options, message in refused:
        with pytest.raises(UnsupportedModelError, match=message):
            model_class_for({"model_type": model_type})({**base, **options}, torch.float32, "cpu")


def test_resolve_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_mod.native, "library", lambda: None)
    with_bf16 = tmp_path / "bf16"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n")
    with_amx = tmp_path / "amx"
    with_amx.write_text("flags\t\t: fpu amx_tile amx_bf16\n")
    plain = tmp_path / "plain"
    plain.write_text("flags\t\t: fpu sse avx2 avx512f\n")
    cfg = {"torch_dtype": "bfloat16"}
    assert dtype_mod.resolve_dtype("auto", "cpu", cfg, cpuinfo=with_bf16) == torch.bfloat16
    assert dtype_mod.resolve_dtype("auto", "cpu", cfg, cpuinfo=with_amx) == torch.bfloat16
    assert dtype_mod.resolve_dtype("auto", "cpu", cfg, cpuinfo=plain) == torch.float32
    assert dtype_mod.resolve_dtype("auto", "cpu", cfg, cpuinfo=tmp_path / "none") == torch.float32
    # the AVX2 build stands for a machine without fast bf16, even where it is forced
    monkeypatch.setattr(dtype_mod.native, "library", lambda: SimpleNamespace(isa="avx2"))
    assert dtype_mod.resolve_dtype("auto", "cpu", cfg, cpuinfo=with_bf16) == torch.float32
    monkeypatch.setattr(dtype_mod.native, "library", lambda: SimpleNamespace(isa="avx512"))
    assert dtype_mod.resolve_dtype("auto", "cpu", cfg, cpuinfo=with_bf16) == torch.bfloat16
    assert dtype_mod.resolve_dtype("float16", "cpu", cfg) == torch.float16
    assert dtype_mod.resolve_dtype("float32", "cpu", cfg) == torch.float32
    with pytest.raises(ConfigError, match="dtype"):
        dtype_mod.resolve_dtype("fp8", "cpu", cfg)


def test_kv_cache_sizing_and_allocation() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert spec.block_size == 16
    assert spec.bytes_per_block == 2 * 3 * 16 * 2 * 8 * 2
    n, caches = allocate_kv_cache(spec, "cpu", kv_cache_memory=10 * spec.bytes_per_block + 5)
    assert n == 10 and len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (10, 16, 2, 8) and k.dtype == torch.bfloat16
        assert k.data_ptr() != v.data_ptr() and not k.any()
    with pytest.raises(KVCacheError, match="raise kv_cache_memory"):
        spec.num_blocks_for(spec.bytes_per_block - 1)
    model = LlamaModel(tiny_llama().config, torch.float32, "cpu")
    assert KVCacheSpec.for_model(model, 8) == KVCacheSpec(1, 2, 8, torch.float32, 8)


def test_gpu_cache_budget_is_the_engines_own_share() -> None:
    gib = 1024**3
    # One engine alone: 0.9 of 80 GiB, less its 2 GiB model.
    assert gpu_cache_budget(78 * gib, 80 * gib, 0.9, 2 * gib) == int(80 * gib * 0.9) - 2 * gib
    # A second engine beside one holding 30 GiB names its own share, not what is left of 0.9.
    assert gpu_cache_budget(48 * gib, 80 * gib, 0.4, 2 * gib) == int(80 * gib * 0.4) - 2 * gib
    with pytest.raises(KVCacheError, match=r"gpu_memory_utilization=0.9 .* 8.00 GiB are free"):
        gpu_cache_budget(8 * gib, 80 * gib, 0.9, 2 * gib)


def test_model_bytes_counts_a_shared_weight_once() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(100, 8)
            self.head = torch.nn.Linear(8, 100, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.ones(3, dtype=torch.float64))

    assert model_bytes(Tied()) == 100 * 8 * 4 + 3 * 8


def test_gpt2_untied_head_loads_separately() -> None:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, tie_word_embeddings=False)
    ref = GPT2LMHeadModel(cfg).eval()
    sd = dict(ref.state_dict())
    model = GPT2Model(cfg, torch.float32, "cpu")
    model.load_weights(sd.items())
    h = torch.randn(2, 32)
    torch.testing.assert_close(model.lm_head(h), ref.lm_head(h))
    ids = torch.tensor([1, 50])
    torch.testing.assert_close(model.wte(ids), ref.transformer.wte.weight[ids], rtol=0, atol=0)
    del sd["lm_head.weight"]
    with pytest.raises(WeightLoadError, match=r"lm_head\.weight"):
        GPT2Model(cfg, torch.float32, "cpu").load_weights(sd.items())


def test_model_bytes_counts_a_weight_packed_by_onednn() -> None:
    """oneDNN's packed weights (the bf16 layout where native kernels do not serve bf16, as
    on AVX2 builds) have no storage to ask: their elements are counted."""
    weight = torch.randn(64, 32).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    model = torch.nn.Module()
    model.register_buffer("packed", packed)
    assert model_bytes(model) == 64 * 32 * 2
