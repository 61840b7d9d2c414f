"""The Hugging Face vision towers' attention as one variable-length call per block.

transformers' vision attention for Qwen2-VL, Qwen2.5-VL and Qwen3-VL cuts the packed patches into images (or
Qwen2.5-VL's 112-pixel windows) on the host and runs one SDPA call per piece, unless the attention implementation's
name contains "flash": then it hands the packed q/k/v and ``cu_seqlens`` to a single call. Without the flash-attn
package no such implementation exists here, so the tower of the Qwen2.5-VL-7B benchmark made about 2,000 small
attention calls per micro-batch, each with its host work. ``ATTENTION`` is ours under such a name: torch's
``varlen_attn`` (the flash kernel our decoder runs, not causal here) on GPUs; elsewhere the per-piece SDPA that
transformers runs itself, so CPU runs keep the tower's numerics exactly.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kernels import bidirectional_varlen, varlen_attn_available, varlen_usable


ATTENTION = "mca_varlen_flash"  # "flash" in the name is what the towers test (is_flash_attention_requested)


def tower_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, scaling: float | None = None, dropout: float = 0.0,
                    cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                    max_length_q: torch.Tensor | int | None = None, max_length_k: torch.Tensor | int | None = None,
                    is_causal: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """``[1, heads, tokens, dim]`` in, ``[1, tokens, heads, dim]`` out, as transformers' flash functions."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal)
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    if varlen_usable(q) and attention_mask is None and not is_causal and not dropout:
        # the towers pass the same tensors for queries and keys: convert (and read on the host) once
        cu_q, max_q = cu_seq_lens_q.to(torch.int32), int(max_length_q)
        cu_k = cu_q if cu_seq_lens_k is cu_seq_lens_q else cu_seq_lens_k.to(torch.int32)
        max_k = max_q if max_length_k is max_length_q else int(max_length_k)
        return bidirectional_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling).unsqueeze(0), None
    # transformers' own path for implementations without "flash" in their name: one SDPA call per piece
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    outs = [sdpa_attention_forward(module, q_, k_, v_, attention_mask, dropout=dropout, scaling=scaling,
                                   is_causal=is_causal)[0]
            for q_, k_, v_ in zip(*(torch.split(t, lengths, dim=2) for t in (query, key, value)))]
    return torch.cat(outs, dim=1), None


def describe(projector: bool = False) -> str:
    """The towers' attention in words, for the startup summary's kernel line. ``projector``: LLaVA's layout, whose
    images come whole and of one size (``models/multimodal.TowerWithProjector``)."""
    if projector:
        return "vision tower: SDPA over a micro-batch's images"
    if torch.cuda.is_available() and varlen_attn_available():
        return "vision tower: one varlen_attn call per block"
    return "vision tower: SDPA per image or window"


AttentionInterface.register(ATTENTION, tower_attention)
