"""Qwen2-VL and Qwen2.5-VL: Qwen2's decoder (q/k/v biases) under multimodal RoPE, and their HF vision towers
(Qwen2.5-VL's with windowed attention and a SwiGLU merger; ``models/multimodal.py``)."""

from ..registry import register
from .base import DecoderFamily, Vision


@register("qwen2_vl")
class Qwen2VLFamily(DecoderFamily):
    qkv_bias = True
    vision = Vision()


@register("qwen2_5_vl")
class Qwen25VLFamily(Qwen2VLFamily):
    pass
