"""Qwen3-VL and Qwen3-VL-MoE: Qwen3's decoder (qk-norm; Qwen3-MoE's experts, stacked per layer in the checkpoint)
under interleaved multimodal RoPE, and their HF vision tower, whose deepstack features are added after the first
decoder layers (``models/multimodal.py``)."""

from ..registry import register
from .base import DecoderFamily, MoE, QKNorm, Vision


QWEN3_VL = Vision(tower_prefix="model.visual.", text_prefix="model.language_model.", interleaved_mrope=True)


@register("qwen3_vl")
class Qwen3VLFamily(DecoderFamily):
    qk_norm = QKNorm()
    vision = QWEN3_VL


@register("qwen3_vl_moe")
class Qwen3VLMoeFamily(DecoderFamily):
    qk_norm = QKNorm()
    moe = MoE(norm_topk=True, stacked=True)
    vision = QWEN3_VL
