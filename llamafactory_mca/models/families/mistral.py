"""Mistral: Llama's layout; a sliding window is honoured only where every sequence fits inside it."""

from __future__ import annotations

from typing import Any

from ..registry import register
from .llama import LlamaFamily


@register("mistral")
class MistralFamily(LlamaFamily):
    def sliding_window(self, hf: Any) -> int | None:
        return getattr(hf, "sliding_window", None)
