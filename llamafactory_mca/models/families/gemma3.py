"""Gemma 3 (text: the 1B model, and the decoder of the 4B-27B ones): Llama's layout with q/k norms, GeGLU (tanh),
sandwich norms, Gemma's scales, and a sliding window on five of every six layers, which rotate by their own RoPE.
The 4B-27B checkpoints (``gemma3``) add LLaVA's layout: a SigLIP encoder of 896-pixel images whose patches the
projector pools to 256 tokens per image, which see each other both ways (``native/attention.py``)."""

from ..registry import register
from .base import DecoderFamily, GemmaScales, QKNorm, SandwichNorms, SlidingWindow, Vision


@register("gemma3_text")
class Gemma3TextFamily(DecoderFamily):
    qk_norm = QKNorm()
    sandwich_norms = SandwichNorms()
    gemma = GemmaScales()
    sliding_window = SlidingWindow()


@register("gemma3")
class Gemma3Family(Gemma3TextFamily):
    # transformers writes the encoder's parameters directly under vision_tower.; the hub's files under
    # vision_tower.vision_model. (transformers renames them on load)
    vision = Vision(tower_prefix="", text_prefix="language_model.model.", projector=True, image_look_ahead=True,
                    aliases=(("vision_tower.", "vision_tower.vision_model."),))
