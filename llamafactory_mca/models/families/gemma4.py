"""Gemma 4 (``gemma4_text``: the decoder of the dense models): Gemma 3's layer (q/k norms, GeGLU, sandwich norms, a
window on most layers) with plain RMSNorm weights, q·k unscaled (the q/k norms set the scale), an RMSNorm without
weight on the values, each layer's output times a stored scalar, and soft-capped logits. The full-attention layers
have wider heads (``global_head_dim``), their own number of key/value heads and, where ``attention_k_eq_v``, keys
that are also the values (``config.layer_configs``, ``native/sublayers.py``); they rotate by proportional RoPE (a
share of each head's frequencies, the rest unrotated), the windowed layers by plain RoPE, the model's table.

The hub's checkpoints (``gemma4``) hold this decoder under ``model.language_model.`` beside a vision tower and its
``embed_vision`` (LLaVA's layout, ``multimodal.TowerWithProjector``): images of their own sizes come as patches with
their (x, y) (``image_position_ids``), each pooled to as many tokens as its valid patches make; with
``use_bidirectional_attention: vision`` (the hub's) an image's tokens see one another on the windowed layers only.

The 26B-A4B's layers have a dense MLP and routed experts side by side (``enable_moe_block``: ``native/moe_block.py``):
Megatron's MoE layer with the dense MLP as its shared expert, each branch under its own norms.

The E2B/E4B give every layer a small input vector of its own per token (``hidden_size_per_layer_input``:
``native/per_layer_inputs.py``), and their last layers (``num_kv_shared_layers``) compute no keys or values: each
attends with those of the last earlier layer of its kind, its MLP twice as wide (``use_double_wide_mlp``). Both go
from layer to layer beside the hidden states, so these models train on one pipeline stage. Their audio tower is
carried through training and export untouched; audio inputs, videos and bidirectional attention between all tokens
(``use_bidirectional_attention: all``) are refused in one line."""

from dataclasses import replace
from typing import Any

from ..config import McaConfig
from ..mapping import LAYER, FusedQK, FusedQKV, Op, PerLayer, Rename, Reshaped
from ..registry import register
from .base import DecoderFamily, Gemma4Layers, QKNorm, SandwichNorms, SlidingWindow, Vision, typed_rope


@register("gemma4_text")
class Gemma4TextFamily(DecoderFamily):
    qk_norm = QKNorm()
    sandwich_norms = SandwichNorms()
    sliding_window = SlidingWindow()
    gemma4 = Gemma4Layers()

    def check_rope(self, hf: Any) -> None:
        """Per kind of layer (``Gemma4Layers.check``)."""

    def config_from_hf(self, hf: Any) -> McaConfig:
        """The model's RoPE table is the windowed layers' (plain); the full-attention layers' is their own."""
        config = super().config_from_hf(hf)
        window = typed_rope(hf.get_text_config() if hasattr(hf, "get_text_config") else hf, "sliding_attention")
        return replace(config, rotary_base=float(window.get("rope_theta", 10000.0)), rope_parameters=None,
                       rotary_percent=1.0)

    def layer_ops(self, config: McaConfig, dense_mlp: bool) -> list[Op]:
        """linear_qkv per layer: the full-attention layers' heads are their own, their q and k alone where the keys
        are the values; q alone in a layer attending with an earlier layer's keys and values."""
        ops = super().layer_ops(config, dense_mlp)
        qkv = next(op for op in ops if op.mca.endswith("linear_qkv.weight"))
        shape = config.global_attention_shape
        full = Reshaped(qkv.mca, qkv.hf[:2], inner=FusedQK(qkv.mca, qkv.hf[:2]), shape=shape) \
            if config.transformer["global_attention"]["keys_are_values"] \
            else Reshaped(qkv.mca, qkv.hf, inner=FusedQKV(qkv.mca, qkv.hf), shape=shape)
        own = [qkv if config.windowed(i) else full for i in range(config.num_layers)]
        q_only = Rename(qkv.mca, qkv.hf[:1])  # a layer attending with an earlier layer's keys and values
        layers = tuple(q_only if config.kv_source(i) is not None else op for i, op in enumerate(own))
        ops = [PerLayer(op.mca, op.hf, layers=layers) if op is qkv else op for op in ops]
        if config.transformer.get("moe_block"):  # the block normalises its dense MLP's input itself
            ops = [Rename(f"{LAYER}mlp.pre_dense_norm.weight", op.hf) if op.mca.endswith(".pre_mlp_layernorm.weight")
                   else op for op in ops]
        return ops


@register("gemma4")
class Gemma4Family(Gemma4TextFamily):
    vision = Vision(tower_prefix="model.", text_prefix="model.language_model.", projector=True)

    def config_from_hf(self, hf: Any) -> McaConfig:
        """``use_bidirectional_attention: vision`` (the hub's): an image's tokens see one another on the windowed
        layers (transformers ORs its image groups into the sliding masks only)."""
        config = super().config_from_hf(hf)
        if getattr(hf.get_text_config(), "use_bidirectional_attention", None) == "vision":
            config = replace(config, transformer={**config.transformer, "image_look_ahead": "windowed"})
        return config
