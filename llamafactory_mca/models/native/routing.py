"""The router: DeepSeek-V3's group-limited routing, with a group scored as transformers scores it; and the gating
GEMM's backward without the weight gradient of a frozen router.

Group-limited routing: both choose the ``group_topk`` best of ``num_groups`` expert groups and then the top-k
experts inside them. They differ in a group's score: transformers (DeepSeek-V3, Kimi-K2, GLM-4.5: the checkpoints' own
modeling code) sums each group's two best expert scores; megatron-core 0.16 sums its best ``topk // group_topk``. The
two agree where topk is 2 x group_topk (DeepSeek-V3's 8 and 4); elsewhere megatron-core would send tokens to other
experts than the model was trained with. ``install`` puts both functions in megatron-core's place.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils


MEGATRON_GROUP_LIMITED_TOPK = moe_utils.group_limited_topk  # what ``install`` replaces
MEGATRON_GATING = moe_utils.router_gating_linear  # what ``install`` replaces in megatron-core's router module
GROUP_SCORE_EXPERTS = 2  # transformers: a group's score is the sum of its two best experts' scores


def group_limited_topk(scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's ``moe_utils.group_limited_topk`` (same arguments and results) with transformers' group score."""
    per_group = num_experts // num_groups
    group_scores = scores.view(num_tokens, num_groups, per_group).topk(min(GROUP_SCORE_EXPERTS, per_group),
                                                                       dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, per_group).reshape(num_tokens, -1)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)


class _Gating(torch.autograd.Function):
    """megatron-core 0.16's ``RouterGatingLinearFunction`` (logits in the router's dtype from the bf16 input and
    weight, keeping those only), whose backward computes the weight's gradient whether or not the weight trains: for
    LoRA's frozen router that is an fp32 [experts, tokens] x [tokens, hidden] GEMM per MoE layer and micro-batch for
    nothing (about 9 ms of a one-second MiniMax-M2 LoRA step on an H100, one of the router's three fp32 GEMMs in its
    profiled kernels). Here it is computed only where asked for; where the weight trains this is megatron-core's."""

    @staticmethod
    def forward(ctx, inp, weight, bias, router_dtype):
        return moe_utils.RouterGatingLinearFunction.forward(ctx, inp, weight, bias, router_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.needs_input_grad[1]:
            return moe_utils.RouterGatingLinearFunction.backward(ctx, grad_output)
        inp, weight, bias = ctx.saved_tensors
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = torch.mm(grad, weight.to(ctx.router_dtype)).to(ctx.input_dtype).view(inp.shape) \
            if ctx.needs_input_grad[0] else None
        grad_bias = grad.sum(dim=0).to(ctx.weight_dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_input, None, grad_bias, None


def router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         router_dtype: torch.dtype) -> torch.Tensor:
    """megatron-core's ``moe_utils.router_gating_linear`` (same arguments and result)."""
    return _Gating.apply(inp, weight, bias, router_dtype)
