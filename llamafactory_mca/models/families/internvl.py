"""InternVL 3.5 (``internvl``, the 1B-38B models): Qwen3's decoder under LLaVA's layout (``models/multimodal.py``)
with the InternViT encoder, whose 448-pixel tiles (LLaMA-Factory's plugin cuts an image into up to 12 and a
thumbnail) become 256 tokens each: the projector drops the class token and folds 2 x 2 patches into one. Image
tokens attend causally, under plain RoPE."""

from ..registry import register
from .base import Vision
from .qwen3 import Qwen3Family


@register("internvl")
class InternVLFamily(Qwen3Family):
    # written as transformers' save_pretrained writes it (LLaVA's legacy prefixes); read also under its in-memory names
    vision = Vision(tower_prefix="", text_prefix="language_model.model.", projector=True, decoders=("qwen3",),
                    aliases=(("language_model.model.", "model.language_model."),
                             ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
                             ("multi_modal_projector.", "model.multi_modal_projector.")))
