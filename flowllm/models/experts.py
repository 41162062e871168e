"""A mixture-of-experts MLP: a router picks each token's top-k experts, and each expert's
SwiGLU MLP runs over the rows routed to it, as one grouped product per expert the step
uses, never one per token.

Routing is transformers' (Qwen3-MoE, OLMoE, Mixtral): router logits by a linear layer in
the model's dtype, softmax in float32, the top k probabilities, renormalized to sum to 1
where `norm_topk_prob` says so, then (Qwen3-MoE, OLMoE) rounded to the model's dtype or
(Mixtral) kept in float32 for the scaling. Each expert's output is scaled by its weight
and added into the token's row in ascending expert order, starting from zeros: the order
transformers adds them in, so a bf16 model rounds its sums where transformers does.

Batch invariance: the router and the experts are `Linear` layers, whose products give a
row the same result at any number of rows (the native kernels' fixed summation order,
quantized or not); an expert's activation gives every value one formula at any number of
rows (`layers.ACTIVATIONS`); softmax and top-k work row by row; the sum over a token's
experts has a fixed order. So a token's output depends on its own row only, never on which
other tokens share its experts in the step. A step reads the weights of the experts its
tokens use and no others.

Weights: every expert is its own pair of Linear layers (gate/up fused, down), so it packs
for the native kernels or keeps a GGUF file's quantized blocks (each expert's slice of
the file's 3-D tensor as its own quantized weight) like any dense layer. The router stays
in float under `--quantization int8`, as vLLM keeps it: a rounding there would change
which experts a token gets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flowllm.models.errors import UnsupportedModelError
from flowllm.models.layers import GatedActivation, Linear


@dataclass(frozen=True)
class ExpertOptions:
    """A layer of experts: how many, how many each token uses, their MLP's width, and how
    the router's top-k probabilities become weights (see the module docstring)."""

    num_experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool
    weights_in_model_dtype: bool = True  # Mixtral: False, the weights stay float32

    def check(self, model: str) -> None:
        """UnsupportedModelError naming the config's fields when they cannot route."""
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"{model} with num_experts_per_tok={self.top_k} of "
                f"num_experts={self.num_experts} cannot route"
            )


class Expert(nn.Module):
    """One expert's SwiGLU MLP: act(x gate^T) * (x up^T), then down."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        dtype: torch.dtype,
        device: torch.device,
        model: str,
    ) -> None:
        super().__init__()
        self.intermediate = intermediate
        # gate_up rows: [gate (I) | up (I)]
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, dtype, device)
        self.down_proj = Linear(intermediate, hidden, False, dtype, device)
        self.act_and_mul = GatedActivation(act, model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [m, hidden] -> [m, hidden]
        out: torch.Tensor = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return out


class SparseMoE(nn.Module):
    """The router (`gate`) and the experts of one layer (see the module docstring)."""

    def __init__(
        self,
        hidden: int,
        options: ExpertOptions,
        act: str,
        dtype: torch.dtype,
        device: torch.device,
        model: str,
    ) -> None:
        super().__init__()
        options.check(model)
        self.options = options
        self.gate = Linear(hidden, options.num_experts, False, dtype, device, quantizable=False)
        self.experts = nn.ModuleList(
            Expert(hidden, options.intermediate, act, dtype, device, model)
            for _ in range(options.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's k experts [n, k] int64, their weights [n, k]), as transformers
        computes them."""
        o = self.options
        logits = self.gate(x)  # [n, E] in the model's dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, o.top_k, dim=-1)
        if o.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if o.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> [n, hidden]
        chosen, weights = self.route(x)
        k = self.options.top_k
        flat = chosen.flatten()  # [n * k]: row r's choices at r * k ...
        # the (row, choice) slots grouped by expert, in ascending expert order
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.options.num_experts).tolist()
        rows = order.div(k, rounding_mode="floor")
        scales = weights.flatten().index_select(0, order).unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if not count:
                continue
            group = rows[start : start + count]
            y = expert(x.index_select(0, group))  # one product over the expert's rows
            out.index_add_(0, group, (y * scales[start : start + count]).to(out.dtype))
            start += count
        return out
