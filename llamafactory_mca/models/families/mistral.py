"""Mistral: Llama's layout; a sliding window is honoured only where every sequence fits inside it."""

from ..registry import register
from .base import DecoderFamily, SlidingWindow


@register("mistral")
class MistralFamily(DecoderFamily):
    sliding_window = SlidingWindow()
