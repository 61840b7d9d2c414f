"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3's multi-latent attention and sigmoid-routed MoE (the layers
``mlp_layer_types`` marks ``dense`` first, a shared expert, a multi-token-prediction layer) with DeepSeek's sparse
attention: in each layer a lightning indexer picks ``index_topk`` keys per query (``native/sparse_attention.py``).

transformers rotates GLM-5's RoPE dims in halves, where DeepSeek-V3's checkpoints are interleaved: Megatron's MLA
de-interleaves, so q_b_proj's and kv_a_proj_with_mqa's RoPE rows are held interleaved (``mapping.RopeRows``)."""

from typing import Any

from ..config import McaConfig, rope_settings
from ..mapping import HF_LAYER, LAYER, Op, Rename, RopeRows
from ..registry import register
from .base import refuse
from .deepseek_v3 import DeepseekV3Family


_INDEXER = (("linear_wq_b.weight", "wq_b.weight"), ("linear_wk.weight", "wk.weight"),
            ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
            ("linear_weights_proj.weight", "weights_proj.weight"))


@register("glm_moe_dsa")
class GlmMoeDsaFamily(DeepseekV3Family):
    no_gradient = ("wq_b", "wk", "weights_proj")

    def check(self, hf: Any) -> None:
        super().check(hf)
        if "shared" in (hf.indexer_types or []):
            refuse(self.model_type, f"indexer_types={hf.indexer_types} (layers reusing the previous layer's keys)",
                   "Supported: an indexer of its own in every layer (GLM-5's).")
        kinds = list(hf.mlp_layer_types)
        dense = kinds.index("sparse") if "sparse" in kinds else len(kinds)
        if kinds[dense:] != ["sparse"] * (len(kinds) - dense):
            refuse(self.model_type, f"mlp_layer_types={kinds}", "Supported: the dense layers first, then MoE ones.")

    def check_rope(self, hf: Any) -> None:
        """The indexer rotates with plain RoPE (GLM-5's)."""
        rope = rope_settings(hf)[1]
        if rope:
            refuse(self.model_type, f"rope scaling {rope}", "Supported: plain RoPE (GLM-5's).")

    def transformer(self, hf: Any) -> dict[str, Any]:
        fields = super().transformer(hf)
        dense = list(hf.mlp_layer_types).count("dense")
        fields.pop("moe_layer_freq", None)
        if dense:
            fields["moe_layer_freq"] = [0] * dense + [1] * (hf.num_hidden_layers - dense)
        return fields | dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=hf.index_n_heads,
                             dsa_indexer_head_dim=hf.index_head_dim, dsa_indexer_topk=hf.index_topk)

    def layer_ops(self, config: McaConfig, dense_mlp: bool) -> list[Op]:
        t = config.transformer
        rope = t["qk_pos_emb_head_dim"]
        rows = {f"{LAYER}self_attention.linear_q_up_proj.weight": t["qk_head_dim"] + rope,
                f"{LAYER}self_attention.linear_q_proj.weight": t["qk_head_dim"] + rope,
                f"{LAYER}self_attention.linear_kv_down_proj.weight": None}
        ops = [RopeRows(op.mca, op.hf, rope=rope, block=rows[op.mca]) if op.mca in rows else op
               for op in super().layer_ops(config, dense_mlp)]
        ours, theirs = f"{LAYER}self_attention.core_attention.indexer.", f"{HF_LAYER}self_attn.indexer."
        return ops + [Rename(f"{ours}{mine}", (f"{theirs}{hf}",)) for mine, hf in _INDEXER]

