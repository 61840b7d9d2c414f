"""Qwen3: Llama's layout with RMSNorm on queries and keys (qk-norm) and an explicit head_dim."""

from ..registry import register
from .base import DecoderFamily, QKNorm, SlidingWindow


@register("qwen3")
class Qwen3Family(DecoderFamily):
    qk_norm = QKNorm()
    sliding_window = SlidingWindow(switch="use_sliding_window")
