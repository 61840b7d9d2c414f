"""Gemma 4's MoE block (the 26B-A4B's ``enable_moe_block``): a dense MLP and routed experts side by side in every
layer, each branch with its own norms, their sum normalised once more before the residual add.

transformers' layer, with ``r`` the residual stream after attention::

    dense   = post_1(mlp(pre(r)))
    experts = post_2(experts(pre_2(r), router(r)))
    out     = r + post(dense + experts)

The router sees ``r`` itself: a weightless RMSNorm, times a learned ``scale`` and 1/sqrt(hidden), then the
projection; softmax over the experts, top-k, renormalised (Megatron's softmax over the top-k logits), each chosen
weight times its expert's ``per_expert_scale``.

Built on Megatron's MoELayer so the experts keep its grouped GEMMs, dispatchers and expert parallelism: the dense MLP
is Megatron's shared expert (``moe_shared_expert_intermediate_size``), the router ``MoEBlockRouter``, and the layer's
own pre-MLP norm an identity (the spec's), so the block receives ``r`` and normalises each branch's input itself.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from .norm import NativeNorm


def moe_block(config: Any) -> bool:
    """Whether the model's MoE layers are Gemma 4's block (``moe_block``: a ``MODEL_OPTIONS`` key)."""
    return bool(getattr(config, "moe_block", False))


class MoEBlockRouter(TopKRouter):
    """Megatron's top-k router behind Gemma 4's input scaling, its choices weighted per expert."""

    def __init__(self, config: Any, pg_collection: Any = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        device = self.weight.device
        self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, device=device, dtype=config.params_dtype))
        self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, device=device,
                                                              dtype=config.params_dtype))
        for param in (self.scale, self.per_expert_scale):  # replicated over TP like the weight: summed under SP
            setattr(param, "sequence_parallel", config.sequence_parallel)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        normed = torch.nn.functional.rms_norm(input.float(), (input.size(-1),), eps=self.config.layernorm_epsilon)
        return super().gating(normed.to(input.dtype) * self.scale * input.size(-1) ** -0.5)

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        probs, routing_map = super().forward(input, padding_mask)
        return probs * self.per_expert_scale.to(probs.dtype), routing_map


class MoEBlock(MoELayer):
    """Gemma 4's block on Megatron's MoELayer (see the module's doc): ``shared_experts`` is the dense MLP. Built as a
    MoELayer and turned into this one (``attach``): TransformerLayer hands its process groups only to an MLP it knows
    by class."""

    @classmethod
    def attach(cls, layer: MoELayer) -> None:
        if layer.shared_experts is None or layer.shared_expert_overlap or not isinstance(layer.router, MoEBlockRouter):
            raise ValueError("Gemma 4's MoE block needs its router, and its dense MLP as the shared expert, not "
                             "overlapped.")
        layer.__class__ = cls
        config = layer.config

        def norm() -> NativeNorm:
            return NativeNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

        layer.pre_dense_norm, layer.dense_post_norm = norm(), norm()  # HF: pre_feedforward_layernorm, ..._1
        layer.pre_experts_norm, layer.experts_post_norm = norm(), norm()  # HF: pre_feedforward_layernorm_2, ..._2
        layer.post_layernorm = norm()  # HF: post_feedforward_layernorm

    def shared_experts_compute(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dense_post_norm(super().shared_experts_compute(self.pre_dense_norm(hidden_states)))

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        return super().preprocess(self.pre_experts_norm(hidden_states), probs, routing_map)

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None) -> torch.Tensor:
        output = self.experts_post_norm(self.token_dispatcher.combine_postprocess(output))
        return self.post_layernorm(output + shared_expert_output)
