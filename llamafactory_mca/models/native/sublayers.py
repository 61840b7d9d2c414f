"""Attention and MLP sublayers with two things megatron-core 0.16's lack, both Gemma's.

- A norm on the sublayer's output before the residual add (``post_layer_norms``: Gemma's "sandwich" norms, HF's
  ``post_attention_layernorm`` and ``post_feedforward_layernorm``). It sits outside the output projection, so LoRA's
  delta on ``linear_proj`` / ``linear_fc2`` is normalised with the base's output, as in HF. Under sequence parallelism
  it sees this rank's tokens with the whole hidden size, its weight marked for the gradient sum like every SP norm.
- A RoPE table per kind of layer (``window_rotary_base``: Gemma 3 rotates its sliding-window layers with base 10,000
  and its global ones with 1,000,000, scaled; ``global_attention``: Gemma 4's full-attention layers rotate their
  wider heads by their own, proportional RoPE). ``LanguageModel`` computes both frequency tables once per micro-batch
  and hands the decoder the two side by side, the model's first; each attention layer takes its own (the other
  kind's table is the last ``kv_channels`` of it) and gives Megatron's attention one table, as it always has.

And Gemma 4's attention: an RMSNorm without weight on each value head (``value_norm``), and in its full-attention
layers keys that are also the values (``keys_are_values``): linear_qkv holds q and k only, and the values are the
keys before their norm and RoPE. In the E2B/E4B the last layers compute no keys or values (``kv_source``: linear_qkv
holds q only, no k norm): each attends with those of the last earlier layer of its kind, which that layer leaves in
the model's ``shared_kv`` (normed, before RoPE: RoPE is the same for both) while the forward runs. Autograd carries
their gradients back to that layer; a recomputed layer would hand on keys without them, so these models refuse full
recomputation (``plan.check_model_fits``).
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
    return any(getattr(config, name, None) for name in ("post_layer_norms", "window_rotary_base", "global_attention",
                                                        "value_norm", "kv_sharing"))


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
        # which of the two tables side by side (LanguageModel._preprocess) rotates this layer: None the model's only
        self.other_rope = None
        if getattr(config, "window_rotary_base", None):
            self.other_rope = windowed
        elif getattr(config, "global_attention", None):
            self.other_rope = not windowed
        self.post_layernorm = _post_norm(config)
        self.value_norm = bool(getattr(config, "value_norm", False))
        # the layer number whose keys and values this layer attends with (None: its own); the model's store of them
        self.kv_source: int | None = getattr(config, "kv_source", None)
        self.shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        if self.kv_source is not None:
            self.linear_qkv_out_dim = self.query_projection_size  # q only
            self.linear_qkv = submodules.linear_qkv(
                config.hidden_size, self.linear_qkv_out_dim, config=config, init_method=config.init_method,
                gather_output=False, bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False,
                is_expert=False, tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)
            self.k_layernorm = None
        elif getattr(config, "keys_are_values", False):
            if config.num_query_groups < self.world_size:
                raise ValueError(f"keys that are the values in {config.num_query_groups} key/value heads cannot be "
                                 f"split over {self.world_size} tensor-parallel ranks")
            # q and k only (Megatron's sized it for q, k and v)
            self.linear_qkv_out_dim = self.query_projection_size + self.kv_projection_size
            self.linear_qkv = submodules.linear_qkv(
                config.hidden_size, self.linear_qkv_out_dim, config=config, init_method=config.init_method,
                gather_output=False, bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False,
                is_expert=False, tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)

    def forward(self, hidden_states: torch.Tensor, *args: Any, rotary_pos_emb: Any = None, **kwargs: Any):
        if self.other_rope is not None and rotary_pos_emb is not None:
            width = self.config.kv_channels
            rotary_pos_emb = (rotary_pos_emb[..., -width:] if self.other_rope else rotary_pos_emb[..., :width])
            rotary_pos_emb = rotary_pos_emb.contiguous()
        output, bias = super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        return (self.post_layernorm(output) if self.post_layernorm is not None else output), bias

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states: Any = None,
                                    output_gate: bool = False, split_qkv: bool = True):
        if self.kv_source is not None:
            if output_gate or not split_qkv:
                raise ValueError("a layer attending with another layer's keys: no output gate, and q split here")
            query, _ = self.linear_qkv(hidden_states)
            query = query.view(*query.shape[:-1], self.num_attention_heads_per_partition,
                               self.hidden_size_per_attention_head)
            if self.q_layernorm is not None:
                query = self.q_layernorm(query)
            return (query, *self.shared_kv[self.kv_source])
        query, key, value = self._own_query_key_value(hidden_states, key_value_states, output_gate, split_qkv)
        if self.shared_kv is not None:
            self.shared_kv[self.layer_number] = key, value
        return query, key, value

    def _own_query_key_value(self, hidden_states: torch.Tensor, key_value_states: Any, output_gate: bool,
                             split_qkv: bool):
        if not getattr(self.config, "keys_are_values", False):
            out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
            if not self.value_norm:
                return out
            query, key, value = out
            return query, key, _rms(value, self.config.layernorm_epsilon)
        if output_gate or not split_qkv:
            raise ValueError("keys that are the values: no output gate, and q, k, v split here")
        mixed, _ = self.linear_qkv(hidden_states)
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        d = self.hidden_size_per_attention_head
        mixed = mixed.view(*mixed.shape[:-1], groups, (per_group + 1) * d)
        query, key = torch.split(mixed, [per_group * d, d], dim=-1)
        query = query.reshape(*query.shape[:-2], -1, d)
        value = _rms(key, self.config.layernorm_epsilon) if self.value_norm else key
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in fp32 (Gemma 4's values). CUDA's fused kernel sums in fp32 and rounds once, so a
    half-precision input goes in as it is: one launch each way, not a cast, the norm and a cast back (and no Triton
    call, whose host time the narrow models that have these norms would wait on: ``auto._engine_fields``)."""
    if x.is_cuda:
        return torch.nn.functional.rms_norm(x, (x.size(-1),), eps=eps)
    return torch.nn.functional.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)


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
