"""GLM-4.5V (``glm4v_moe``): GLM-4.5-Air's decoder (``glm4_moe.py``: q/k/v biases, RoPE on the first half of each
head, the first layers dense, sigmoid routing with a shared expert) without qk-norm, under multimodal RoPE in three
blocks (T 8, H 12, W 12 of the rotary half's 32 frequencies, Qwen2-VL's layout), and its HF vision tower
(``models/multimodal.py``). The checkpoint keeps Qwen3-VL's prefixes. A video's frames are image tokens between
``<|begin_of_video|>`` and ``<|end_of_video|>``, one frame per tower row (``data/multimodal.py``)."""

from ..registry import register
from .base import Vision
from .glm4_moe import Glm4MoeFamily


@register("glm4v_moe")
class Glm4vMoeFamily(Glm4MoeFamily):
    vision = Vision(tower_prefix="model.visual.", text_prefix="model.language_model.", default_mrope=(8, 12, 12),
                    video_frames_as_images=True)
