"""Qwen3-Next (e.g. Qwen3-Next-80B-A3B): three gated delta-rule layers to one gated full-attention layer, every layer
MoE with one gated shared expert, zero-centred RMSNorms, RoPE on a quarter of each head, one
multi-token-prediction layer stored under ``mtp.`` (docs/qwen3-next-notes.md)."""

from ..registry import register
from .base import DecoderFamily, GatedDeltaNet, MoE, MultiTokenPrediction, QKNorm, SharedExpert


# one layer under ``mtp.``, sharing the model's embedding and output layer (Qwen3.5 too)
QWEN_MTP = MultiTokenPrediction(count="mtp_num_hidden_layers", under_mtp=True)


@register("qwen3_next")
class Qwen3NextFamily(DecoderFamily):
    qk_norm = QKNorm()
    linear_attention = GatedDeltaNet(fused=True)
    moe = MoE(shared_expert=SharedExpert(gate=True))
    mtp = QWEN_MTP
