"""Qwen2-MoE / Qwen1.5-MoE: every layer sparse, top-k routing, one shared expert behind a sigmoid gate."""

from __future__ import annotations

from typing import Any

from ..config import McaConfig
from ..mapping import Op, Rename, dense_layer, embeddings, gated_mlp
from ..registry import register
from .llama import LlamaFamily, _refuse


def moe_transformer(hf: Any, norm_topk_prob: bool) -> dict[str, Any]:
    """The MoE fields every family here shares."""
    return dict(
        num_moe_experts=getattr(hf, "num_experts", None) or hf.num_local_experts,
        moe_ffn_hidden_size=getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size,
        moe_router_topk=hf.num_experts_per_tok,
        # HF: softmax over all experts, top-k, renormalise if norm_topk_prob = Megatron's softmax over the top-k.
        moe_router_pre_softmax=not norm_topk_prob,
        moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
        moe_router_load_balancing_type="aux_loss",
    )


def check_all_layers_sparse(model_type: str, hf: Any) -> None:
    if getattr(hf, "decoder_sparse_step", 1) != 1 or getattr(hf, "mlp_only_layers", None):
        _refuse(model_type, f"dense layers between MoE layers (decoder_sparse_step={hf.decoder_sparse_step}, "
                f"mlp_only_layers={hf.mlp_only_layers})", "Supported: every layer an MoE layer.")


ROUTER = Rename("decoder.layers.*.mlp.router.weight", ("model.layers.*.mlp.gate.weight",))
EXPERTS = gated_mlp("decoder.layers.*.mlp.experts.local_experts.*", "model.layers.*.mlp.experts.*")


@register("qwen2_moe")
class Qwen2MoeFamily(LlamaFamily):
    qkv_bias = True

    def check(self, hf: Any) -> None:
        super().check(hf)
        check_all_layers_sparse(self.model_type, hf)

    def transformer(self, hf: Any) -> dict[str, Any]:
        return {**super().transformer(hf), **moe_transformer(hf, hf.norm_topk_prob),
                "moe_shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
                "moe_shared_expert_gate": True}

    def weights(self, config: McaConfig) -> list[Op]:
        return (embeddings(config.tie_word_embeddings) + dense_layer(mlp="", qkv_bias=True) + [ROUTER] + EXPERTS
                + gated_mlp("decoder.layers.*.mlp.shared_experts", "model.layers.*.mlp.shared_expert")
                + [Rename("decoder.layers.*.mlp.shared_experts.gate_weight",
                          ("model.layers.*.mlp.shared_expert_gate.weight",))])
