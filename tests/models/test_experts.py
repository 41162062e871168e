"""A layer of experts (flowllm.models.experts) against transformers' own sparse blocks on
the same random weights: the router's choices and weights (their dtype included) and the
block's output; one grouped product per expert a step uses; and a token's output the
same bits whichever tokens share its experts, on every product path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from flowllm.kernels import cpu_linear
from flowllm.models.experts import Expert, ExpertOptions, SparseMoE
from flowllm.models.layers import pack_linears
from flowllm.models.registry import model_class_for

HIDDEN, EXPERTS = 64, 8
COMMON: dict[str, Any] = dict(hidden_size=HIDDEN, num_attention_heads=4, vocab_size=64)

FAMILIES: dict[str, tuple[Any, Any, ExpertOptions]] = {
    "qwen3_moe": (
        Qwen3MoeSparseMoeBlock,
        Qwen3MoeConfig(**COMMON, moe_intermediate_size=48, num_experts=EXPERTS,
                       num_experts_per_tok=2, norm_topk_prob=True),
        ExpertOptions(EXPERTS, 2, 48, norm_topk_prob=True),
    ),
    "olmoe": (
        OlmoeSparseMoeBlock,
        OlmoeConfig(**COMMON, intermediate_size=80, num_experts=EXPERTS, num_experts_per_tok=3,
                    pad_token_id=0, eos_token_id=1),
        ExpertOptions(EXPERTS, 3, 80, norm_topk_prob=False),
    ),
    "mixtral": (
        MixtralSparseMoeBlock,
        MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=EXPERTS,
                      num_experts_per_tok=2),
        ExpertOptions(EXPERTS, 2, 32, norm_topk_prob=True, weights_in_model_dtype=False),
    ),
}  # fmt: skip


def reference_block(family: str, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' sparse block of `family`, random weights, its eager experts loop."""
    block_class, config, _ = FAMILIES[family]
    config._experts_implementation = "eager"
    torch.manual_seed(40)
    block = block_class(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.15)
    return block.to(dtype).eval()


def ours(family: str, ref: torch.nn.Module, dtype: torch.dtype, quantize: str | None = None):
    """flowllm's layer of experts on `ref`'s weights, packed as a model's are."""
    options = FAMILIES[family][2]
    moe = SparseMoE(HIDDEN, options, "silu", dtype, torch.device("cpu"), family)
    moe.gate.load_weight("gate", ref.gate.weight.detach())
    inter = options.intermediate
    for e, expert in enumerate(moe.experts):
        gate_up, down = ref.experts.gate_up_proj[e].detach(), ref.experts.down_proj[e].detach()
        expert.gate_up_proj.load_weight("gate", gate_up[:inter], rows=inter)
        expert.gate_up_proj.load_weight("up", gate_up[inter:], start=inter)
        expert.down_proj.load_weight("down", down)
    pack_linears(moe, quantize)
    return moe


def dtypes() -> list[torch.dtype]:
    return [torch.float32] + ([torch.bfloat16] if cpu_linear.serves(torch.bfloat16) else [])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", dtypes())
def test_routing_and_output_are_transformers(family: str, dtype: torch.dtype) -> None:
    ref = reference_block(family, dtype)
    moe = ours(family, ref, dtype)
    x = torch.randn(48, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        _, want_weights, want_chosen = ref.gate(x)
        want = ref(x.unsqueeze(0)).squeeze(0)
        chosen, weights = moe.route(x)
        got = moe(x)
    assert torch.equal(chosen, want_chosen)
    # Qwen3-MoE and OLMoE round the weights to the model's dtype; Mixtral keeps float32.
    assert weights.dtype == want_weights.dtype
    assert weights.dtype == (torch.float32 if family == "mixtral" else dtype)
    exact = dtype == torch.float32
    torch.testing.assert_close(weights, want_weights, rtol=1e-5 if exact else 1e-2, atol=0)
    tol = {"rtol": 1e-5, "atol": 1e-6} if exact else {"rtol": 2e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    # Every expert is used somewhere, so every product above was checked.
    assert set(chosen.flatten().tolist()) == set(range(EXPERTS))


def test_one_grouped_product_per_expert_the_step_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = ours("qwen3_moe", reference_block("qwen3_moe", torch.float32), torch.float32)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    calls: list[tuple[int, int]] = []
    forward = Expert.forward

    def spy(self: Expert, rows: torch.Tensor) -> torch.Tensor:
        calls.append((list(moe.experts).index(self), rows.shape[0]))
        return forward(self, rows)

    monkeypatch.setattr(Expert, "forward", spy)
    with torch.no_grad():
        chosen, _ = moe.route(x)
        moe(x)
    used = torch.bincount(chosen.flatten(), minlength=EXPERTS)
    # in ascending expert order, each over all of its rows, none for an expert unused
    assert calls == [(e, int(n)) for e, n in enumerate(used) if n]
    assert len(calls) < EXPERTS


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("dtype", dtypes())
def test_a_row_does_not_depend_on_the_rows_beside_it(
    family: str, quantize: str | None, dtype: torch.dtype, kernel_build: str
) -> None:
    """The same rows alone, in pairs and among 63 others give the same bits, on each kernel
    build: each expert's product runs over groups of 1 to dozens of rows."""
    moe = ours(family, reference_block(family, dtype), dtype, quantize)
    if quantize:
        assert moe.gate.quantized is None  # the router stays float
        assert all(e.gate_up_proj.quantized is not None for e in moe.experts)
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        crowded = moe(x)
        for i in range(0, 64, 7):
            assert torch.equal(moe(x[i : i + 1]), crowded[i : i + 1])
            assert torch.equal(moe(x[i : i + 2]), crowded[i : i + 2])


def test_sparse_and_dense_layers_as_the_config_sets() -> None:
    base: dict[str, Any] = dict(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=6, intermediate_size=64,
        vocab_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    cases = [
        ({}, [True] * 6),
        ({"decoder_sparse_step": 2}, [False, True] * 3),
        ({"decoder_sparse_step": 3, "mlp_only_layers": [5]}, [False, False, True] + [False] * 3),
        ({"mlp_only_layers": [0, 4]}, [False, True, True, True, False, True]),
        ({"num_experts": 0}, [False] * 6),
    ]
    for extra, sparse in cases:
        cfg = {"model_type": "qwen3_moe", **base, **extra}
        model = model_class_for(cfg)(cfg, torch.float32, "cpu")
        assert [hasattr(layer, "moe") for layer in model.layers] == sparse, extra
        for layer in model.layers:
            experts = getattr(layer, "moe", None)
            if experts is None:
                assert layer.gate_up_proj.out_features == 2 * 64
            else:
                assert experts.experts[0].gate_up_proj.out_features == 2 * 16
