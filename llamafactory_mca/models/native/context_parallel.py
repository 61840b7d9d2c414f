"""Context parallelism without Transformer Engine: load-balanced chunks, K/V all-gather, segment plans.

The layout is Megatron's. Every sequence of global length ``L`` (a multiple of ``2·cp``) is cut into
``2·cp`` chunks of ``c = L / (2·cp)`` tokens; CP rank ``r`` holds chunks ``r`` and ``2·cp-1-r``, in that
order, so early (cheap) and late (expensive) causal rows are spread evenly. That is what Megatron's
``get_batch_on_this_cp_rank`` does for padded batches, what its THD RoPE assumes
(``_get_thd_freqs_on_this_cp_rank``: local length ``L/cp`` per sequence, positions ``[r·c, (r+1)·c)`` and
``[(2cp-1-r)·c, (2cp-r)·c)``), and what ``RotaryEmbedding`` slices for padded batches
(``get_pos_emb_on_this_cp_rank``).

Attention: each rank all-gathers K and V over the CP group (Megatron's sequence-parallel gather: the
backward reduce-scatters the gradients back to their owners), reorders the gathered rows into, per
sequence, the key prefix each local chunk may see — ``(r+1)·c`` keys for chunk ``r``, ``(2cp-r)·c`` for
chunk ``2cp-1-r`` — and runs one causal varlen call with bottom-right alignment over the resulting
``2·n_seq`` segments. The key buffer holds ``L + c`` rows per sequence; nothing quadratic is built.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from .kernels import SegmentPlan, make_plan


def split_for_context_parallel(tensors: dict[str, torch.Tensor | None], cu_seqlens: torch.Tensor | None,
                               cp_rank: int, cp_size: int) -> dict[str, torch.Tensor | None]:
    """This CP rank's part of a micro-batch: chunks ``cp_rank`` and ``2·cp_size-1-cp_rank`` of every sequence.

    Args:
        tensors: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ... with the sequence on dim 1:
            ``[b, s, ...]`` for padded batches, ``[1, t, ...]`` for packed (THD) ones. ``None`` passes through.
        cu_seqlens: ``None`` for padded batches; for packed ones the *global* cumulative sequence lengths
            (``[n+1]``, the padded variant if the data pads each sequence), ending at ``t``.
        cp_rank, cp_size: this rank in the context-parallel group and the group size.

    Returns:
        A new dict with the same keys, each tensor cut to ``s / cp`` (padded) or ``t / cp`` (packed) tokens.

    Every sequence length (``s``, or each ``cu_seqlens`` difference) must be a multiple of ``2·cp_size``
    (``ParallelLayout.pad_multiple``). The ``PackedSeqParams`` handed to the model keep the *global*
    ``cu_seqlens`` and ``max_seqlen`` (the longest global sequence): Megatron's THD RoPE divides the
    lengths by ``cp`` itself, and the native attention plans its chunks from them. ``max_seqlen`` must be a
    sequence length, not the packed total — if it equals ``cu_seqlens[-1]``, Megatron's RoPE switches to
    offsetting positions by each sequence's start.
    """
    if cp_size == 1:
        return dict(tensors)
    if cu_seqlens is None:
        return {name: _split_padded(name, t, cp_rank, cp_size) for name, t in tensors.items()}
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    index = local_token_index(cu, cp_rank, cp_size)
    out = {}
    for name, t in tensors.items():
        if t is not None:
            if t.size(1) != int(cu[-1]):
                raise ValueError(f"{name} holds {t.size(1)} tokens on dim 1 but cu_seqlens ends at {int(cu[-1])}")
            t = t.index_select(1, index.to(t.device))
        out[name] = t
    return out


def local_token_index(cu_seqlens: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Positions (in the global packed batch) of this rank's tokens, in local order."""
    lengths = _checked_lengths(cu_seqlens, cp_size)
    chunk = lengths // (2 * cp_size)
    starts = cu_seqlens[:-1]
    first = starts + cp_rank * chunk
    second = starts + (2 * cp_size - 1 - cp_rank) * chunk
    return _concat_ranges(torch.stack([first, second], 1).flatten(), torch.stack([chunk, chunk], 1).flatten())


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
    lengths = _checked_lengths(cu, cp_size)
    if cp_size == 1:
        lens = lengths.tolist()
        return make_plan(lens, lens, device)
    chunk = lengths // (2 * cp_size)
    r = cp_rank
    q_lens = torch.stack([chunk, chunk], 1).flatten()
    k_lens = torch.stack([(r + 1) * chunk, (2 * cp_size - r) * chunk], 1).flatten()
    seq = torch.repeat_interleave(torch.arange(len(lengths)).repeat_interleave(2), k_lens)
    pos = _concat_ranges(torch.zeros_like(k_lens), k_lens)  # position inside its sequence
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


def _split_padded(name: str, t: torch.Tensor | None, cp_rank: int, cp_size: int) -> torch.Tensor | None:
    if t is None:
        return None
    seq = t.size(1)
    if seq % (2 * cp_size):
        raise ValueError(f"{name} has sequence length {seq}, not a multiple of 2 x context_parallel_size = "
                         f"{2 * cp_size}; pad batches to a multiple of it.")
    index = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=t.device)
    chunks = t.view(t.size(0), 2 * cp_size, seq // (2 * cp_size), *t.shape[2:])
    return chunks.index_select(1, index).reshape(t.size(0), -1, *t.shape[2:])


def _checked_lengths(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    if cp_size > 1 and bool((lengths % (2 * cp_size)).any()):
        bad = [int(n) for n in lengths if n % (2 * cp_size)][:5]
        raise ValueError(f"context parallelism needs every packed sequence length to be a multiple of 2 x "
                         f"context_parallel_size = {2 * cp_size}; got lengths {bad}. Pad each sequence to it.")
    return lengths


def _concat_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    total = int(lengths.sum())
    out_starts = torch.cumsum(lengths, 0) - lengths
    shift = torch.repeat_interleave(starts - out_starts, lengths, output_size=total)
    return torch.arange(total, dtype=torch.int64) + shift
