"""Mixtral: Mistral attention, sparse MoE FFN in every layer (w1 = gate, w3 = up, w2 = down)."""

from ..registry import register
from .base import DecoderFamily, MoE, SlidingWindow


@register("mixtral")
class MixtralFamily(DecoderFamily):
    sliding_window = SlidingWindow()
    # Mixtral takes the softmax over the selected experts only: normalised top-k.
    moe = MoE(norm_topk=True, hf_module="block_sparse_moe", projections=("w1", "w3", "w2"))
