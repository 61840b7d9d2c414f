"""InternVL 3.5 (``internvl``): the InternViT encoder under LLaVA's layout (``models/multimodal.py``), whose 448-pixel
tiles (LLaMA-Factory's plugin cuts an image into up to 12 and a thumbnail) become 256 tokens each: the projector drops
the class token and folds 2 x 2 patches into one. Image tokens attend causally, under plain RoPE.

transformers builds the language model from ``text_config`` whatever its type, so the hub's models differ in their
decoder: Qwen3's (1B-38B) or gpt-oss's (GPT-OSS-20B-A4B). Each is its decoder's family with this tower, registered
under that decoder (``families.get_family`` picks by ``text_config.model_type``; others, such as the 30B-A3B's
qwen3_moe, are refused in one line naming these)."""

from ..registry import register
from .base import Vision
from .gpt_oss import GptOssFamily
from .qwen3 import Qwen3Family


# written as transformers' save_pretrained writes it (LLaVA's legacy prefixes); read also under its in-memory names
INTERNVL_VISION = Vision(tower_prefix="", text_prefix="language_model.model.", projector=True,
                         aliases=(("language_model.model.", "model.language_model."),
                                  ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
                                  ("multi_modal_projector.", "model.multi_modal_projector.")))


@register("internvl", decoder="qwen3")
class InternVLFamily(Qwen3Family):
    vision = INTERNVL_VISION


@register("internvl", decoder="gpt_oss")
class InternVLGptOssFamily(GptOssFamily):
    vision = INTERNVL_VISION
