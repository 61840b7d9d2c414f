"""Gemma 4 (``gemma4_text``: the decoder of the dense models): Gemma 3's layer (q/k norms, GeGLU, sandwich norms, a
window on most layers) with plain RMSNorm weights, q·k unscaled (the q/k norms set the scale), an RMSNorm without
weight on the values, each layer's output times a stored scalar, and soft-capped logits. The full-attention layers
have wider heads (``global_head_dim``), their own number of key/value heads and, where ``attention_k_eq_v``, keys
that are also the values (``config.global_layer_configs``, ``native/sublayers.py``); they rotate by proportional RoPE
(a share of each head's frequencies, the rest unrotated), the windowed layers by plain RoPE, the model's table.

Refused, one line each: the per-layer input embeddings and key/value-sharing layers of the small models
(``hidden_size_per_layer_input``, ``num_kv_shared_layers``), the MoE block (``enable_moe_block``), bidirectional
attention."""

from dataclasses import dataclass, replace
from typing import Any

from ..config import McaConfig, layer_typed_rope
from ..mapping import HF_LAYER, LAYER, FusedQK, FusedQKV, Op, PerLayer, Rename, Reshaped
from ..registry import register
from .base import DecoderFamily, Part, QKNorm, SandwichNorms, SlidingWindow, refuse


def _rope(hf: Any, kind: str) -> dict[str, Any]:
    return dict((hf.rope_parameters or {}).get(kind) or {}) if layer_typed_rope(hf.rope_parameters) else {}


@dataclass(frozen=True)
class Gemma4Layers(Part):
    """What Gemma 4's layers add to Gemma 3's (see the module's doc)."""

    def check(self, model_type: str, hf: Any) -> None:
        refusals = (("hidden_size_per_layer_input", "per-layer input embeddings (Gemma 4's E2B/E4B)"),
                    ("num_kv_shared_layers", "layers sharing another layer's keys and values (Gemma 4's E2B/E4B)"),
                    ("enable_moe_block", "the MoE block beside the MLP (Gemma 4's 26B-A4B)"),
                    ("use_bidirectional_attention", "bidirectional attention"))
        for key, what in refusals:
            if getattr(hf, key, None):
                refuse(model_type, f"{key}={getattr(hf, key)!r} ({what})", "Supported: Gemma 4's dense decoder "
                       "(the 31B's layout).")
        if not layer_typed_rope(hf.rope_parameters):
            refuse(model_type, f"rope_parameters={hf.rope_parameters}", "Supported: RoPE per kind of layer.")
        window, full = _rope(hf, "sliding_attention"), _rope(hf, "full_attention")
        if window.get("rope_type", "default") != "default" or window.get("partial_rotary_factor", 1.0) != 1.0:
            refuse(model_type, f"RoPE {window} on the sliding-window layers", "Supported: plain RoPE on whole heads.")
        if full.get("rope_type", "default") not in ("default", "proportional") or full.get("factor", 1.0) != 1.0:
            refuse(model_type, f"RoPE {full} on the full-attention layers",
                   "Supported: plain or proportional RoPE, unscaled (Gemma 4's).")

    def transformer(self, hf: Any) -> dict[str, Any]:
        full = _rope(hf, "full_attention")
        keys_are_values = bool(hf.attention_k_eq_v)
        groups = (hf.num_global_key_value_heads if keys_are_values and hf.num_global_key_value_heads
                  else hf.num_key_value_heads)
        fraction = full.get("partial_rotary_factor", 1.0) if full.get("rope_type") == "proportional" else 1.0
        return dict(embedding_multiplier=hf.hidden_size ** 0.5, softmax_scale=1.0, value_norm=True,
                    layer_scalars=True, final_logit_softcapping=hf.final_logit_softcapping or None,
                    global_attention=dict(kv_channels=hf.global_head_dim or hf.head_dim, num_query_groups=groups,
                                          keys_are_values=keys_are_values,
                                          rotary_base=float(full.get("rope_theta", 1e6)), rope_fraction=fraction))

    def weights(self, config: McaConfig) -> list[Op]:
        return [Rename(f"{LAYER}layer_scalar", (f"{HF_LAYER}layer_scalar",))]


@register("gemma4_text")
class Gemma4TextFamily(DecoderFamily):
    qk_norm = QKNorm()
    sandwich_norms = SandwichNorms()
    sliding_window = SlidingWindow()
    gemma4 = Gemma4Layers()

    def parts(self) -> list[Part]:
        return super().parts() + [self.gemma4]

    def check_rope(self, hf: Any) -> None:
        """Per kind of layer (``Gemma4Layers.check``)."""

    def config_from_hf(self, hf: Any) -> McaConfig:
        """The model's RoPE table is the windowed layers' (plain); the full-attention layers' is their own."""
        config = super().config_from_hf(hf)
        window = _rope(hf.get_text_config() if hasattr(hf, "get_text_config") else hf, "sliding_attention")
        return replace(config, rotary_base=float(window.get("rope_theta", 10000.0)), rope_parameters=None,
                       rotary_percent=1.0)

    def layer_ops(self, config: McaConfig, dense_mlp: bool) -> list[Op]:
        """linear_qkv per layer: the full-attention layers' heads are their own, their q and k alone where the keys
        are the values."""
        ops = super().layer_ops(config, dense_mlp)
        qkv = next(op for op in ops if op.mca.endswith("linear_qkv.weight"))
        shape = config.global_attention_shape
        full = Reshaped(qkv.mca, qkv.hf[:2], inner=FusedQK(qkv.mca, qkv.hf[:2]), shape=shape) \
            if config.transformer["global_attention"]["keys_are_values"] \
            else Reshaped(qkv.mca, qkv.hf, inner=FusedQKV(qkv.mca, qkv.hf), shape=shape)
        layers = tuple(qkv if config.windowed(i) else full for i in range(config.num_layers))
        return [PerLayer(op.mca, op.hf, layers=layers) if op is qkv else op for op in ops]
