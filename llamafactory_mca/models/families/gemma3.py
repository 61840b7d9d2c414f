"""Gemma 3 (text: the 1B model, and the decoder of the 4B-27B ones): Llama's layout with q/k norms, GeGLU (tanh),
sandwich norms, Gemma's scales, and a sliding window on five of every six layers, which rotate by their own RoPE."""

from ..registry import register
from .base import DecoderFamily, GemmaScales, QKNorm, SandwichNorms, SlidingWindow


@register("gemma3_text")
class Gemma3TextFamily(DecoderFamily):
    qk_norm = QKNorm()
    sandwich_norms = SandwichNorms()
    gemma = GemmaScales()
    sliding_window = SlidingWindow()
