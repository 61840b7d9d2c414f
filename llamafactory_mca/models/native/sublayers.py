"""Attention and MLP sublayers with two things megatron-core 0.16's lack, both Gemma's.

- A norm on the sublayer's output before the residual add (``post_layer_norms``: Gemma's "sandwich" norms, HF's
  ``post_attention_layernorm`` and ``post_feedforward_layernorm``). It sits outside the output projection, so LoRA's
  delta on ``linear_proj`` / ``linear_fc2`` is normalised with the base's output, as in HF. Under sequence parallelism
  it sees this rank's tokens with the whole hidden size, its weight marked for the gradient sum like every SP norm.
- A RoPE base per kind of layer (``window_rotary_base``: Gemma 3 rotates its sliding-window layers with base 10,000
  and its global ones with 1,000,000, scaled). ``LanguageModel`` computes both frequency tables once per micro-batch
  and hands the decoder the two stacked; each attention layer takes its own and gives Megatron's attention one table,
  as it always has.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.utils import is_layer_window_attention, sharded_state_dict_default

from .norm import NativeNorm


def needs_sublayers(config: Any) -> bool:
    """Whether a model's layers need these sublayers rather than Megatron's."""
    return bool(getattr(config, "post_layer_norms", False) or getattr(config, "window_rotary_base", None))


def _post_norm(config: Any) -> torch.nn.Module | None:
    if not getattr(config, "post_layer_norms", False):
        return None
    if config.add_bias_linear:  # the bias would be added after the norm by Megatron's bias-dropout-add
        raise ValueError("post_layer_norms with add_bias_linear: the output projections' biases would skip the norm.")
    return NativeNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


class NativeSelfAttention(SelfAttention):
    """Megatron's SelfAttention; its output normalised where the model has post norms, its RoPE table the one of its
    kind of layer where windowed layers have their own base."""

    def __init__(self, config: Any, submodules: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        # index into the stacked tables (LanguageModel._preprocess): 0 the model's RoPE, 1 the windowed layers'
        self.rope_table = int(windowed) if getattr(config, "window_rotary_base", None) else None
        self.post_layernorm = _post_norm(config)

    def forward(self, hidden_states: torch.Tensor, *args: Any, rotary_pos_emb: Any = None, **kwargs: Any):
        if self.rope_table is not None and rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[self.rope_table]
        output, bias = super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        return (self.post_layernorm(output) if self.post_layernorm is not None else output), bias


class PostNormMLP(MLP):
    """Megatron's MLP, its output normalised (``post_layer_norms``). Built as an MLP and turned into this one
    (``attach``): TransformerLayer hands its tensor-parallel group only to an MLP it knows by class."""

    @classmethod
    def attach(cls, mlp: MLP) -> None:
        mlp.__class__ = cls
        mlp.post_layernorm = _post_norm(mlp.config)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        output, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_layernorm(output), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """MLP's, plus the norm's weight (replicated). MLP's own asks every child for a sharded state dict, which a
        torch norm has not: the norm steps aside while it runs."""
        norm = self._modules.pop("post_layernorm")
        try:
            state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self._modules["post_layernorm"] = norm
        return state | sharded_state_dict_default(norm, f"{prefix}post_layernorm.", sharded_offsets, metadata,
                                                  tp_group=self.tp_group)
