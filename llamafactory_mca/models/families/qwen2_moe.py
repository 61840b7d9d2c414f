"""Qwen2-MoE / Qwen1.5-MoE: every layer sparse, top-k routing, one shared expert behind a sigmoid gate."""

from ..registry import register
from .base import DecoderFamily, MoE, SharedExpert


@register("qwen2_moe")
class Qwen2MoeFamily(DecoderFamily):
    qkv_bias = True
    moe = MoE(shared_expert=SharedExpert(gate=True))
