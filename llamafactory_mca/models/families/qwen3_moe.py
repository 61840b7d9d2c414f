"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3 attention (qk-norm), every layer sparse, no shared expert."""

from ..registry import register
from .base import DecoderFamily, MoE, QKNorm, SlidingWindow


@register("qwen3_moe")
class Qwen3MoeFamily(DecoderFamily):
    qk_norm = QKNorm()
    moe = MoE()
    sliding_window = SlidingWindow(switch="use_sliding_window")
