"""Context parallelism without Transformer Engine: the attention half (K/V all-gather, segment plans).

Which tokens each CP rank holds is the data's business (``data/context_parallel.py``: Megatron's load-balanced
chunks ``r`` and ``2·cp-1-r`` of ``c = L / (2·cp)`` tokens per sequence, what its THD RoPE assumes).

Attention: each rank all-gathers K and V over the CP group (Megatron's sequence-parallel gather: the
backward reduce-scatters the gradients back to their owners), reorders the gathered rows into, per
sequence, the key prefix each local chunk may see — ``(r+1)·c`` keys for chunk ``r``, ``(2cp-r)·c`` for
chunk ``2cp-1-r`` — and runs one causal varlen call with bottom-right alignment over the resulting
``2·n_seq`` segments. The key buffer holds ``L + c`` rows per sequence; nothing quadratic is built.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from ...data.context_parallel import checked_lengths, concat_ranges
from .kernels import SegmentPlan, make_plan


def packed_plan(cu_seqlens: torch.Tensor, cp_rank: int, cp_size: int, num_local_tokens: int,
                device: torch.device) -> SegmentPlan:
    """The segment plan of a packed batch for this rank; ``cu_seqlens`` are global (host or device)."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    total = int(cu[-1])
    if num_local_tokens * cp_size != total:
        raise ValueError(
            f"the packed batch holds {num_local_tokens} tokens on this rank but cu_seqlens ends at {total} "
            f"(context_parallel_size={cp_size}): cu_seqlens must cover every token (pad with a last dummy "
            "sequence) and stay global under context parallelism."
        )
    lengths = checked_lengths(cu, cp_size)
    if cp_size == 1:
        lens = lengths.tolist()
        return make_plan(lens, lens, device)
    chunk = lengths // (2 * cp_size)
    r = cp_rank
    q_lens = torch.stack([chunk, chunk], 1).flatten()
    k_lens = torch.stack([(r + 1) * chunk, (2 * cp_size - r) * chunk], 1).flatten()
    seq = torch.repeat_interleave(torch.arange(len(lengths)).repeat_interleave(2), k_lens)
    pos = concat_ranges(torch.zeros_like(k_lens), k_lens)  # position inside its sequence
    c = chunk[seq].clamp(min=1)
    j, w = pos // c, pos % c  # which global chunk, where inside it
    late = j >= cp_size
    owner = torch.where(late, 2 * cp_size - 1 - j, j)
    local = cu[:-1][seq] // cp_size + torch.where(late, c, 0) + w
    kv_index = (owner * num_local_tokens + local).to(device, non_blocking=True)
    return make_plan(q_lens.tolist(), k_lens.tolist(), device, kv_index=kv_index)


def padded_cu_seqlens(batch: int, local_seq: int, cp_size: int) -> torch.Tensor:
    """A padded CP batch seen as ``batch`` packed sequences of the global length."""
    return torch.arange(batch + 1, dtype=torch.int64) * (local_seq * cp_size)


def gather_kv(tensor: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 over ``group``; the backward reduce-scatters the gradients (sums them)."""
    return gather_from_sequence_parallel_region(tensor.contiguous(), True, group=group)
