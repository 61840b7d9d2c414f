"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3 attention (qk-norm), every layer sparse, no shared expert."""

from __future__ import annotations

from typing import Any

from ..config import McaConfig
from ..mapping import Op, dense_layer, embeddings
from ..registry import register
from .qwen2_moe import EXPERTS, ROUTER, check_all_layers_sparse, moe_transformer
from .qwen3 import Qwen3Family, qk_norm_ops


@register("qwen3_moe")
class Qwen3MoeFamily(Qwen3Family):
    def check(self, hf: Any) -> None:
        super().check(hf)
        check_all_layers_sparse(self.model_type, hf)

    def transformer(self, hf: Any) -> dict[str, Any]:
        return {**super().transformer(hf), **moe_transformer(hf, hf.norm_topk_prob)}

    def weights(self, config: McaConfig) -> list[Op]:
        return embeddings(config.tie_word_embeddings) + dense_layer(mlp="") + qk_norm_ops() + [ROUTER] + EXPERTS
