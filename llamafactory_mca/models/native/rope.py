"""RoPE for packed (THD) batches without a host synchronisation.

megatron-core 0.16's unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``, what runs without Transformer
Engine) splits the packed tensor per sequence with ``cu_seqlens.tolist()`` and compares a tensor in a Python ``if``:
two device-to-host copies for q and two for k in every layer of every micro-batch, each waiting for the GPU to
drain (perf-notes: ~900 per step on a 28-layer model). Here every token's rotary position is computed on the device
(which sequence it is in by ``searchsorted``, its offset inside it, the context-parallel chunk it belongs to) and the
frequencies are gathered once: the same rotation, no sync. Megatron-LM's main branch has the same idea.

``apply_rope_fusion`` without Transformer Engine: megatron-core calls TE's fused RoPE through two slots of
``rope_utils`` that stay empty without TE; ``install()`` fills them with the same math as one Triton kernel per
direction on GPUs (``rope_triton.py``: gather of the frequencies, cos/sin, rotation and cast; eager on CPU). Eagerly
the rotation of q or k is about ten kernels over the whole tensor, in fp32 where the frequencies are; under CUDA
graphs, where the host cost of a call is gone, that memory traffic is what is left of RoPE.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

from . import rope_triton


MEGATRON_THD_ROPE = rope_utils._apply_rotary_pos_emb_thd  # what native.install() replaces (tests compare)


def thd_positions(cu_seqlens: torch.Tensor, local_tokens: int, cp_size: int, cp_rank: int,
                  absolute: bool) -> torch.Tensor:
    """The rotary position of each of this rank's ``local_tokens`` packed tokens.

    ``cu_seqlens`` holds the global (padded) sequence boundaries; under context parallelism each sequence of length
    L is held as two chunks of L / (2·cp): positions ``rank·c + j`` and ``L - (rank+1)·c + j``. ``absolute`` adds the
    sequence's start, for frequencies given per packed position (multimodal RoPE) rather than per offset.
    """
    cu = cu_seqlens.to(torch.int64)
    local_cu = cu // cp_size
    index = torch.arange(local_tokens, device=cu.device)
    seq = torch.searchsorted(local_cu[1:].contiguous(), index, right=True)
    offset = index - local_cu[seq]
    if cp_size > 1:
        chunk = (local_cu[seq + 1] - local_cu[seq]) // 2
        length = cu[seq + 1] - cu[seq]
        offset = torch.where(offset < chunk, cp_rank * chunk + offset, length - (cp_rank + 2) * chunk + offset)
    return offset + cu[seq] if absolute else offset


_LAST: list = [None, None]  # [(cu_seqlens, sizes), positions] of the last call


def _positions_of(cu_seqlens: torch.Tensor, local_tokens: int, cp_size: int, cp_rank: int,
                  absolute: bool) -> torch.Tensor:
    """``thd_positions``, computed once per micro-batch: q and k of every layer pass the same ``cu_seqlens`` object
    (held here, so its identity cannot be reused), and each computation is ~10 small kernel launches."""
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        # Inside a CUDA graph each layer computes its own: a tensor kept from another graph's capture would live in
        # memory that graph owns.
        return thd_positions(cu_seqlens, local_tokens, cp_size, cp_rank, absolute)
    key = (local_tokens, cp_size, cp_rank, absolute)
    if _LAST[0] is None or _LAST[0][0] is not cu_seqlens or _LAST[0][1] != key:
        _LAST[:] = [(cu_seqlens, key), thd_positions(cu_seqlens, local_tokens, cp_size, cp_rank, absolute)]
    return _LAST[1]


def _packed_positions(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int,
                      cp_rank: int) -> torch.Tensor:
    """The row of ``freqs`` for each of this rank's packed tokens in ``t``. Megatron's test
    ``freqs.size(0) == cu_seqlens[-1]`` (frequencies per packed position, as multimodal RoPE gives them) is answered
    from shapes: the packed tensor holds cu_seqlens[-1] / cp tokens on this rank."""
    absolute = freqs.size(0) == t.size(0) * cp_size
    return _positions_of(cu_seqlens, t.size(0), cp_size, cp_rank, absolute)


def apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                             rotary_interleaved: bool = False, multi_latent_attention: bool = False,
                             mscale: float = 1.0, cp_group: torch.distributed.ProcessGroup = None) -> torch.Tensor:
    """Drop-in for ``rope_utils._apply_rotary_pos_emb_thd`` (same arguments and result, no host sync)."""
    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    positions = _packed_positions(t, cu_seqlens, freqs, cp_group.size(), cp_group.rank())
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions],
                                                 rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)


def _rotate(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor | None, interleaved: bool) -> torch.Tensor:
    """Megatron's rotation of ``t`` [s, b, h, d] by ``freqs`` (gathered at ``positions`` first where given)."""
    if positions is not None:
        t, freqs = t.unsqueeze(1), freqs[positions]
    out = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    return out.squeeze(1) if positions is not None else out


def _fused(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor | None, interleaved: bool) -> torch.Tensor:
    if t.is_cuda and not interleaved:  # (the spec turns the fusion off for interleaved rotary)
        return rope_triton.rotate(t, freqs, positions)
    return _rotate(t, freqs, positions, interleaved)


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> torch.Tensor:
    """The padded-batch slot (TE's ``fused_apply_rotary_pos_emb``, same arguments)."""
    return _fused(t, freqs, None, interleaved)


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                                   cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """The packed-batch slot (TE's ``fused_apply_rotary_pos_emb_thd``, same arguments and positions as
    ``apply_rotary_pos_emb_thd``)."""
    return _fused(t, freqs, _packed_positions(t, cu_seqlens, freqs, cp_size, cp_rank), False)


def compiled_in_use() -> bool:
    """Whether ``apply_rope_fusion`` reaches the fused rotation here (without TE, once ``install()`` ran)."""
    return rope_utils.fused_apply_rotary_pos_emb_thd is fused_apply_rotary_pos_emb_thd
