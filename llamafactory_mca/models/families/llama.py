"""Llama 2 / 3 / 3.1 / 3.2 (llama3 rope scaling, tied embeddings): the generic decoder, nothing added."""

from ..registry import register
from .base import DecoderFamily


@register("llama")
class LlamaFamily(DecoderFamily):
    pass
