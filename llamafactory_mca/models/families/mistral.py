"""Mistral: Llama's layout, with a sliding window on every layer where the config sets one."""

from ..registry import register
from .base import DecoderFamily, SlidingWindow


@register("mistral")
class MistralFamily(DecoderFamily):
    sliding_window = SlidingWindow()
