"""Mixtral: Mistral attention, sparse MoE FFN in every layer (w1 = gate, w3 = up, w2 = down)."""

from __future__ import annotations

from typing import Any

from ..config import McaConfig
from ..mapping import Op, Rename, dense_layer, embeddings, gated_mlp
from ..registry import register
from .mistral import MistralFamily
from .qwen2_moe import moe_transformer


@register("mixtral")
class MixtralFamily(MistralFamily):
    def transformer(self, hf: Any) -> dict[str, Any]:
        # Mixtral takes the softmax over the selected experts only: normalised top-k.
        return {**super().transformer(hf), **moe_transformer(hf, norm_topk_prob=True)}

    def weights(self, config: McaConfig) -> list[Op]:
        moe = "model.layers.*.block_sparse_moe."
        return (embeddings(config.tie_word_embeddings) + dense_layer(mlp="")
                + [Rename("decoder.layers.*.mlp.router.weight", (moe + "gate.weight",))]
                + gated_mlp("decoder.layers.*.mlp.experts.local_experts.*", moe + "experts.*", "w1", "w3", "w2"))
