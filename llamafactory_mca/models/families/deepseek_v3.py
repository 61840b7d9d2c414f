"""DeepSeek-V3 / R1 and models of its architecture (Moonlight, Kimi-K2): multi-latent attention (low-rank q and kv
projections with their norms, a RoPE part of each head shared by all heads for the keys, value heads narrower than
query/key heads, YaRN), the first ``first_k_dense_replace`` layers dense, then sigmoid-routed MoE with a correction
bias, grouped routing and shared experts; multi-token-prediction layers (``num_nextn_predict_layers``).

Megatron's MLA de-interleaves the RoPE dims itself, exactly as transformers does for ``rope_interleave=True`` (every
released checkpoint), so the weights map one to one (docs/deepseek-glm-notes.md). YaRN runs in Megatron's MLA (its
own rotary embedding and softmax scale), not through the HF inverse frequencies the other families replay."""

from dataclasses import replace
from typing import Any

from ..config import McaConfig, rope_settings
from ..mapping import HF_LAYER, LAYER, Op, Rename, gated_mlp
from ..registry import register
from .base import DecoderFamily, MoE, MultiTokenPrediction, SharedExpert, refuse


_ATTENTION = "self_attn."


@register("deepseek_v3")
class DeepseekV3Family(DecoderFamily):
    moe = MoE(shared_expert=SharedExpert(gate=False, hf_name="shared_experts"), sigmoid=True)
    mtp = MultiTokenPrediction()

    def check(self, hf: Any) -> None:
        super().check(hf)  # hidden_act, attention_bias (MLA has no biases), RoPE below, the routing
        if not getattr(hf, "rope_interleave", True):
            refuse(self.model_type, "rope_interleave=False", "Supported: the released checkpoints' interleaved RoPE.")
        if getattr(hf, "quantization_config", None):
            refuse(self.model_type, f"a quantized checkpoint ({hf.quantization_config.get('quant_method', '?')})",
                   "Convert it to bf16 first (DeepSeek's fp8_cast_bf16.py), then point model_name_or_path there.")

    def check_rope(self, hf: Any) -> None:
        """YaRN is Megatron's MLA's own (not replayed from HF's inverse frequencies), so it is allowed here."""
        rope = rope_settings(hf)[1] or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn") or rope.get("attention_factor") or rope.get("truncate") is False:
            refuse(self.model_type, f"rope scaling {rope}", "Supported: none, or YaRN with mscale / mscale_all_dim.")

    def rope_attention(self, hf: Any, fields: dict[str, Any]) -> dict[str, Any]:
        """Megatron's MLA applies YaRN's mscale to its softmax scale itself."""
        return {}

    def transformer(self, hf: Any) -> dict[str, Any]:
        fields = super().transformer(hf)
        theta, rope = rope_settings(hf)
        fields.update(
            multi_latent_attention=True, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
            qk_head_dim=hf.qk_nope_head_dim, qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
            num_query_groups=hf.num_attention_heads, kv_channels=hf.v_head_dim, add_qkv_bias=False,
            rotary_base=theta,
        )
        if rope:  # YaRN
            fields.update(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                          original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                          beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                          mscale=float(rope.get("mscale") or 1.0),
                          mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
        else:  # plain RoPE: Megatron's MLA scales the softmax by yarn's mscale(factor, mscale_all_dim) regardless
            fields.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        return fields

    def config_from_hf(self, hf: Any) -> McaConfig:
        return replace(super().config_from_hf(hf), rope_parameters=None)  # YaRN lives in the MLA fields above

    def layer_ops(self, config: McaConfig, dense_mlp: bool) -> list[Op]:
        ops = _mla_layer(config.transformer["q_lora_rank"] is not None)
        return ops + (gated_mlp(f"{LAYER}mlp", f"{HF_LAYER}mlp") if dense_mlp else [])


def _mla_layer(q_lora: bool) -> list[Op]:
    """One layer's norms and multi-latent attention (every name maps one to one; docs/deepseek-glm-notes.md §4)."""
    ours, theirs = f"{LAYER}self_attention.", f"{HF_LAYER}{_ATTENTION}"
    pairs = [("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
             ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj")]
    pairs += ([("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"), ("linear_q_up_proj", "q_b_proj")]
              if q_lora else [("linear_q_proj", "q_proj")])
    return [Rename(f"{LAYER}input_layernorm.weight", (f"{HF_LAYER}input_layernorm.weight",)),
            Rename(f"{LAYER}pre_mlp_layernorm.weight", (f"{HF_LAYER}post_attention_layernorm.weight",))] + [
        Rename(f"{ours}{mine}.weight", (f"{theirs}{hf}.weight",)) for mine, hf in pairs]
