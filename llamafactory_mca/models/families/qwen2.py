"""Qwen2 / Qwen2.5: Llama's layout with biases on q, k and v."""

from ..registry import register
from .base import DecoderFamily, SlidingWindow


@register("qwen2")
class Qwen2Family(DecoderFamily):
    qkv_bias = True
    sliding_window = SlidingWindow(switch="use_sliding_window")
