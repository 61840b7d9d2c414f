"""Qwen3: Llama's layout with RMSNorm on queries and keys (qk-norm) and an explicit head_dim."""

from __future__ import annotations

from typing import Any

from ..config import McaConfig
from ..mapping import Op, Rename
from ..registry import register
from .llama import LlamaFamily


def qk_norm_ops() -> list[Op]:
    return [
        Rename("decoder.layers.*.self_attention.q_layernorm.weight", ("model.layers.*.self_attn.q_norm.weight",)),
        Rename("decoder.layers.*.self_attention.k_layernorm.weight", ("model.layers.*.self_attn.k_norm.weight",)),
    ]


@register("qwen3")
class Qwen3Family(LlamaFamily):
    def transformer(self, hf: Any) -> dict[str, Any]:
        return {**super().transformer(hf), "qk_layernorm": True}

    def sliding_window(self, hf: Any) -> int | None:
        return hf.sliding_window if getattr(hf, "use_sliding_window", False) else None

    def weights(self, config: McaConfig) -> list[Op]:
        return super().weights(config) + qk_norm_ops()
