"""Qwen2 / Qwen2.5: Llama's layout with biases on q, k and v."""

from __future__ import annotations

from typing import Any

from ..registry import register
from .llama import LlamaFamily


@register("qwen2")
class Qwen2Family(LlamaFamily):
    qkv_bias = True

    def sliding_window(self, hf: Any) -> int | None:
        return hf.sliding_window if getattr(hf, "use_sliding_window", False) else None
