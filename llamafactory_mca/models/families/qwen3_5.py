"""Qwen3.5: a vision-language model whose text half is Qwen3-Next's hybrid decoder (gated delta-rule layers among
gated full-attention ones, zero-centred norms) with dense MLPs, its delta-rule projections stored flat
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), under Qwen3-VL's interleaved mrope and tower (no
deepstack), and Qwen3-Next's multi-token-prediction layer under ``mtp.`` (the hub's configs declare one; it sees the
image features at the placeholders, ``multimodal.VisionLanguageModel``). Qwen3.5-MoE: the same with every MLP an MoE
layer."""

from ..registry import register
from .base import DecoderFamily, GatedDeltaNet, MoE, QKNorm, SharedExpert
from .qwen3_next import QWEN_MTP
from .qwen3_vl import QWEN3_VL


@register("qwen3_5")
class Qwen3_5Family(DecoderFamily):
    qk_norm = QKNorm()
    linear_attention = GatedDeltaNet(fused=False)
    mtp = QWEN_MTP
    vision = QWEN3_VL


@register("qwen3_5_moe")
class Qwen3_5MoeFamily(DecoderFamily):
    """Every layer MoE with a gated shared expert; the router always renormalises the top-k; the experts stacked per
    layer as transformers holds them ([E, out, in])."""

    qk_norm = QKNorm()
    linear_attention = GatedDeltaNet(fused=False)
    moe = MoE(norm_topk=True, shared_expert=SharedExpert(gate=True), stacked=True, stacked_out_in=True)
    mtp = QWEN_MTP
    vision = QWEN3_VL
