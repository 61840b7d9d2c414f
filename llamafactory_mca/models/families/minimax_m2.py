"""MiniMax-M2 (``minimax_m2``): grouped-query attention whose q/k norms each normalise all heads of a token at once
(q_proj's and k_proj's whole output), RoPE on part of each head (``partial_rotary_factor`` in ``rope_parameters``),
and in every layer Mixtral's expert layout (``block_sparse_moe.experts.*.w1/w3/w2``) routed as DeepSeek-V3 routes:
sigmoid scores, experts chosen by score + a correction bias kept on the MoE block, the chosen scores renormalised;
no expert groups, no shared expert, no scaling factor."""

from ..registry import register
from .base import DecoderFamily, MoE, QKNorm


@register("minimax_m2")
class MiniMaxM2Family(DecoderFamily):
    qk_norm = QKNorm(across_heads=True)
    moe = MoE(norm_topk=True, hf_module="block_sparse_moe", projections=("w1", "w3", "w2"), sigmoid=True,
              expert_bias="e_score_correction_bias")
