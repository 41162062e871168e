"""Our models against transformers on the same random weights, fp32: a step that mixes
prefills with decodes, chunked prefill after a cached prefix, shared prefix blocks, and
decoding across block boundaries all give the logits of computing from scratch. Sliding
windows are shorter than the sequences, so every sequence attends past one."""

from __future__ import annotations

import random

import pytest
import torch
from model_test_utils import Blocks, PagedSeq, reference_logits, schedule
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from flowllm import kernels
from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.registry import model_class_for
from flowllm.models.runner import ModelRunner

BLOCK = 16
VOCAB = 512


def gpt2_reference() -> torch.nn.Module:
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=256,
        initializer_range=0.15, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def llama_reference(variant: str) -> torch.nn.Module:
    kw: dict[str, object] = dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=VOCAB,
        max_position_embeddings=256, initializer_range=0.15, bos_token_id=0, eos_token_id=0,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    if variant == "gqa_untied":
        kw.update(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    elif variant == "mha_tied_bias":
        kw.update(
            num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
            attention_bias=True, mlp_bias=True,
        )  # fmt: skip
    elif variant == "llama3_rope":
        kw.update(
            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )  # fmt: skip
    torch.manual_seed(1)
    ref = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    if kw.get("attention_bias"):
        with torch.no_grad():  # transformers zero-inits biases; make them matter
            for name, p in ref.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.1)
    return ref


def qwen_reference(version: int) -> torch.nn.Module:
    """A small random Qwen2 (q/k/v biases) or Qwen3 (q/k head norms, head_dim apart from
    hidden / heads), GQA, with biases and norm weights randomized so they matter."""
    kw: dict[str, object] = dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=VOCAB,
        max_position_embeddings=256, initializer_range=0.15, bos_token_id=0, eos_token_id=0,
        rms_norm_eps=1e-6, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=version == 2, rope_theta=1000000.0,
    )  # fmt: skip
    torch.manual_seed(2 + version)
    if version == 2:
        ref = Qwen2ForCausalLM(Qwen2Config(**kw)).eval()
    else:
        ref = Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=32)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return ref


SMALL: dict[str, object] = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=VOCAB,
    max_position_embeddings=256, initializer_range=0.15, bos_token_id=0, eos_token_id=0,
    rms_norm_eps=1e-6, num_attention_heads=4, num_key_value_heads=2, pad_token_id=None,
)  # fmt: skip


def mistral_reference(window: int | None) -> torch.nn.Module:
    """A random Mistral whose window (13) starts inside a cache block, or none (null)."""
    torch.manual_seed(5)
    cfg = MistralConfig(**SMALL, sliding_window=window, tie_word_embeddings=False)
    return MistralForCausalLM(cfg).eval()


def smollm3_reference(sliding: bool) -> torch.nn.Module:
    """A random SmolLM3 of 4 layers, every second without RoPE (no_rope_layer_interval 2),
    optionally with a window (11) on those, as transformers lays them out."""
    torch.manual_seed(6)
    cfg = SmolLM3Config(
        **{**SMALL, "num_hidden_layers": 4}, no_rope_layer_interval=2,
        use_sliding_window=sliding, sliding_window=11 if sliding else None,
    )  # fmt: skip
    ref = SmolLM3ForCausalLM(cfg).eval()
    assert ref.config.no_rope_layers == [1, 0, 1, 0]
    return ref


def phi3_reference(variant: str) -> torch.nn.Module:
    """A random Phi-3: fused projections, a partial rotary factor (0.75: 12 of 16 dims),
    LongRoPE with random factors. "short": the original context (128) holds every test
    sequence, so transformers rotates all of them by the short factors, as we do serving
    up to 128 positions; "long": the sequences pass the original context (32), both sides
    rotate by the long factors, and a window of 20."""
    original = 128 if variant == "short" else 32
    rng = torch.Generator().manual_seed(7)
    kw = {**SMALL, "max_position_embeddings": 128 if variant == "short" else 256}
    cfg = Phi3Config(
        **kw, original_max_position_embeddings=original, partial_rotary_factor=0.75,
        sliding_window=20 if variant == "long" else None, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(6, generator=rng)).tolist(),
            "long_factor": (1 + 3 * torch.rand(6, generator=rng)).tolist(),
        },
    )  # fmt: skip
    torch.manual_seed(7)
    return Phi3ForCausalLM(cfg).eval()


def _randomize_norms(ref: torch.nn.Module) -> torch.nn.Module:
    """Gemma's norms scale by 1 + w with w initialized to 0: make w matter."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    return ref


def gemma_reference(version: int) -> torch.nn.Module:
    """A random Gemma 2 or Gemma 3 of 4 layers: head_dim apart from hidden / heads, a
    query_pre_attn_scalar apart from head_dim, sliding layers (window 13) among global ones,
    caps small enough to bind (Gemma 2's attention cap and both final caps), Gemma 3's
    layer types from sliding_window_pattern 3 and its global layers rotated by linear
    scaling of their own theta."""
    kw = {**SMALL, "num_hidden_layers": 4, "head_dim": 32, "query_pre_attn_scalar": 24,
          "sliding_window": 13, "pad_token_id": 0}  # fmt: skip
    torch.manual_seed(8 + version)
    if version == 2:
        cfg = Gemma2Config(**kw, attn_logit_softcapping=1.5, final_logit_softcapping=3.0)
        ref = Gemma2ForCausalLM(cfg)
    else:
        cfg = Gemma3TextConfig(
            **kw, final_logit_softcapping=4.0, sliding_window_pattern=3,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )  # fmt: skip
        ref = Gemma3ForCausalLM(cfg)
        assert cfg.layer_types == ["sliding_attention"] * 2 + ["full_attention"] + [
            "sliding_attention"
        ]
    return _randomize_norms(ref.eval())


def moe_reference(family: str) -> torch.nn.Module:
    """A random mixture-of-experts model of 4 layers, transformers' experts run by its
    eager loop (the reference implementation). "qwen3_moe": 8 experts of width 48, top 2
    renormalized, layer 2 dense (`mlp_only_layers`); "qwen3_moe_raw": top 3 of 6, the
    weights not renormalized, layers 0 and 2 dense (`decoder_sparse_step` 2); "olmoe":
    q/k norms across all heads, top 3 of 8; "mixtral": top 2 of 6, a window of 13."""
    torch.manual_seed(30)
    kw = {**SMALL, "num_hidden_layers": 4}
    if family == "qwen3_moe":
        cfg: object = Qwen3MoeConfig(
            **kw, head_dim=32, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2],
        )  # fmt: skip
        ref = Qwen3MoeForCausalLM(cfg)
    elif family == "qwen3_moe_raw":
        cfg = Qwen3MoeConfig(
            **kw, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=3,
            norm_topk_prob=False, decoder_sparse_step=2,
        )  # fmt: skip
        ref = Qwen3MoeForCausalLM(cfg)
    elif family == "olmoe":
        ref = OlmoeForCausalLM(OlmoeConfig(**kw, num_experts=8, num_experts_per_tok=3))
    else:
        cfg = MixtralConfig(**kw, num_local_experts=6, num_experts_per_tok=2, sliding_window=13)
        ref = MixtralForCausalLM(cfg)
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return ref.eval()


REFERENCES = {
    "gpt2": (gpt2_reference, 1e-4),
    "llama_gqa_untied": (lambda: llama_reference("gqa_untied"), 1e-4),
    "llama_mha_tied_bias": (lambda: llama_reference("mha_tied_bias"), 1e-4),
    "llama_llama3_rope": (lambda: llama_reference("llama3_rope"), 1e-4),
    "qwen2": (lambda: qwen_reference(2), 1e-4),
    "qwen3": (lambda: qwen_reference(3), 1e-4),
    "mistral_window": (lambda: mistral_reference(13), 1e-4),
    "mistral_no_window": (lambda: mistral_reference(None), 1e-4),
    "smollm3": (lambda: smollm3_reference(False), 1e-4),
    "smollm3_sliding": (lambda: smollm3_reference(True), 1e-4),
    "phi3_longrope_short": (lambda: phi3_reference("short"), 1e-4),
    "phi3_longrope_long_window": (lambda: phi3_reference("long"), 1e-4),
    "gemma2": (lambda: gemma_reference(2), 1e-4),
    "gemma3": (lambda: gemma_reference(3), 1e-4),
    "qwen3_moe": (lambda: moe_reference("qwen3_moe"), 1e-4),
    "qwen3_moe_raw": (lambda: moe_reference("qwen3_moe_raw"), 1e-4),
    "olmoe": (lambda: moe_reference("olmoe"), 1e-4),
    "mixtral": (lambda: moe_reference("mixtral"), 1e-4),
}


def ours_from(ref: torch.nn.Module) -> tuple[torch.nn.Module, list]:
    model = model_class_for(ref.config)(ref.config, torch.float32, "cpu")
    model.load_weights(ref.state_dict().items())
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(96, "cpu")
    return model, kv


@pytest.mark.parametrize("name", list(REFERENCES))
def test_mixed_steps_match_transformers(name: str) -> None:
    build, tol = REFERENCES[name]
    ref = build()
    model, kv = ours_from(ref)
    runner = ModelRunner(model, kv, BLOCK, "cpu")
    rng = random.Random(7)
    lengths = [23, 40, 7, 16, 33, 50]
    seqs = [
        PagedSeq(i, [rng.randrange(VOCAB) for _ in range(n + 40)]) for i, n in enumerate(lengths)
    ]
    # Seq 5 shares seq 1's first 32 tokens and, as a prefix-cache hit, its first two blocks.
    seqs[5].tokens[:32] = seqs[1].tokens[:32]
    blocks = Blocks(96)
    oracle = {s.seq_id: reference_logits(ref, s.tokens) for s in seqs}
    got_rows: dict[int, list[tuple[int, torch.Tensor]]] = {s.seq_id: [] for s in seqs}

    def step(plan: list[tuple[int, int]], prompt_ids: set[int]) -> None:
        scheduled = [schedule(seqs[i], n, blocks, BLOCK) for i, n in plan]
        logits, prompt = runner.run(scheduled, prompt_ids)
        assert logits.shape == (len(plan), VOCAB) and logits.dtype == torch.float32
        for (i, n), row in zip(plan, logits, strict=True):
            seqs[i].num_computed += n
            got_rows[i].append((seqs[i].num_computed - 1, row))
        for i, rows in prompt.items():
            n = dict(plan)[i]
            assert rows.shape == (n, VOCAB)
            start = seqs[i].num_computed - n
            got_rows[i].extend((start + k, rows[k]) for k in range(n))

    # Step 1: three prompts prefilled at once (seq 1 fully, two of them with prompt logits).
    step([(0, 23), (1, 40), (2, 7)], {0, 2})
    # Step 2: decodes of 0 and 1 beside a block-sized prefill (3), a chunk of 2 after its
    # cached prefix, and the first chunk of 4.
    step([(0, 1), (3, 16), (1, 1), (2, 12), (4, 20)], {2})
    # Seq 5 reuses seq 1's two full blocks: only its remaining tokens are computed.
    seqs[5].blocks = seqs[1].blocks[:2]
    seqs[5].num_computed = 32
    step([(5, 18), (4, 13), (3, 1), (0, 1)], {5})
    # Decodes across block boundaries (seq 0 passes 32, seq 3 passes 32, seq 5 passes 64).
    for _ in range(16):
        step([(i, 1) for i in (0, 1, 2, 3, 4, 5)], set())

    for i, rows in got_rows.items():
        for pos, row in rows:
            diff = (row - oracle[i][pos]).abs().max().item()
            assert diff <= tol, f"seq {i} position {pos}: max |diff| {diff:.2e} > {tol}"
    # The comparison means something: logits vary well beyond the tolerance.
    assert oracle[0].std().item() > 0.1


@pytest.mark.parametrize("name", ["llama_gqa_untied", "gemma2", "gemma3"])
def test_bfloat16_close_to_transformers_fp32(name: str) -> None:
    ref = REFERENCES[name][0]()
    model = model_class_for(ref.config)(ref.config, torch.bfloat16, "cpu")
    model.load_weights(ref.state_dict().items())
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(8, "cpu")
    assert kv[0][0].dtype == torch.bfloat16
    runner = ModelRunner(model, kv, BLOCK, "cpu")
    seq = PagedSeq(0, list(range(3, 40)))
    _, prompt = runner.run([schedule(seq, 37, Blocks(8), BLOCK)], {0})
    want = reference_logits(ref, seq.tokens)
    assert (prompt[0] - want).abs().max().item() < 0.1 * want.abs().max().item()


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa_untied", "mistral_window", "gemma2"])
def test_model_on_triton_kernels_matches_transformers(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's CUDA path (the Triton kernels), run by the interpreter on CPU tensors."""
    triton_attention = pytest.importorskip("flowllm.kernels.triton_attention")
    if not triton_attention.interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 before flowllm is imported (the Makefile sets it)")
    monkeypatch.setattr(kernels, "implementation_for", lambda device: triton_attention)
    build, tol = REFERENCES[name]
    ref = build()
    model, kv = ours_from(ref)
    runner = ModelRunner(model, kv, BLOCK, "cpu")
    rng = random.Random(3)
    seqs = [PagedSeq(i, [rng.randrange(VOCAB) for _ in range(n)]) for i, n in enumerate((20, 9))]
    blocks = Blocks(96)
    _, first = runner.run([schedule(seqs[0], 17, blocks, BLOCK)], {0})
    seqs[0].num_computed = 17
    # A decode after a block boundary beside a fresh prefill.
    logits, prompt = runner.run(
        [schedule(seqs[0], 1, blocks, BLOCK), schedule(seqs[1], 9, blocks, BLOCK)], {1}
    )
    want0, want1 = (reference_logits(ref, s.tokens) for s in seqs)
    assert (first[0] - want0[:17]).abs().max().item() <= tol
    assert (logits[0] - want0[17]).abs().max().item() <= tol
    assert (prompt[1] - want1).abs().max().item() <= tol
