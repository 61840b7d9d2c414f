"""The data half of context parallelism: which tokens of a micro-batch go to which context-parallel rank.

Megatron's load-balanced layout: every sequence of global length ``L`` (a multiple of ``2·cp``) is cut into
``2·cp`` chunks of ``c = L / (2·cp)`` tokens; CP rank ``r`` holds chunks ``r`` and ``2·cp-1-r``, in that order, so
early (cheap) and late (expensive) causal rows are spread evenly — what Megatron's ``get_batch_on_this_cp_rank``
does for padded batches and what its THD RoPE assumes. The attention half (K/V all-gather, segment plans) is
``models/native/context_parallel.py``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .batch import MicroBatch


_TOKEN_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "seq_ids", "rope_positions")


def for_context_parallel_rank(batch: MicroBatch, cp_rank: int, cp_size: int) -> MicroBatch:
    """This rank's chunks of every sequence: the token tensors are cut, ``cu_seqlens``, ``max_seqlen`` and
    ``seqlens`` stay global (Megatron's THD RoPE and our attention divide them by ``cp`` themselves)."""
    if cp_size == 1:
        return batch
    local = split_for_context_parallel({k: getattr(batch, k) for k in _TOKEN_FIELDS}, batch.cu_seqlens, cp_rank,
                                       cp_size)
    return replace(batch, **local)


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
    lengths = checked_lengths(cu_seqlens, cp_size)
    chunk = lengths // (2 * cp_size)
    starts = cu_seqlens[:-1]
    first = starts + cp_rank * chunk
    second = starts + (2 * cp_size - 1 - cp_rank) * chunk
    return concat_ranges(torch.stack([first, second], 1).flatten(), torch.stack([chunk, chunk], 1).flatten())


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


def checked_lengths(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    if cp_size > 1 and bool((lengths % (2 * cp_size)).any()):
        bad = [int(n) for n in lengths if n % (2 * cp_size)][:5]
        raise ValueError(f"context parallelism needs every packed sequence length to be a multiple of 2 x "
                         f"context_parallel_size = {2 * cp_size}; got lengths {bad}. Pad each sequence to it.")
    return lengths


def concat_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    total = int(lengths.sum())
    out_starts = torch.cumsum(lengths, 0) - lengths
    shift = torch.repeat_interleave(starts - out_starts, lengths, output_size=total)
    return torch.arange(total, dtype=torch.int64) + shift
