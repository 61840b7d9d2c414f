"""Qwen3.5: a vision-language model whose text half is Qwen3-Next's hybrid decoder (gated delta-rule layers among
gated full-attention ones, zero-centred norms) with dense MLPs, its delta-rule projections stored flat
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), under Qwen3-VL's interleaved mrope and tower (no
deepstack)."""

from ..registry import register
from .base import DecoderFamily, GatedDeltaNet, QKNorm
from .qwen3_vl import QWEN3_VL


@register("qwen3_5")
class Qwen3_5Family(DecoderFamily):
    qk_norm = QKNorm()
    linear_attention = GatedDeltaNet(fused=False)
    vision = QWEN3_VL
