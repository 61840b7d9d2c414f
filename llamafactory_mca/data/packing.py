"""Grouping rows into micro-batches, and collating a group into a ``MicroBatch``.

Packed (THD): first-fit-decreasing inside a bounded window of consecutive rows, so a pack only mixes rows
that lie near each other in the (shuffled) order and the stream stays close to the dataset's order. Every
sequence is padded up to ``pad_multiple`` (2·cp·tp-style, ``ParallelLayout.pad_multiple``): context parallel
cuts each sequence into 2·cp load-balanced chunks, and sequence parallel splits tokens over TP. A pack's length then
rounds up to a multiple of ``TILE`` (within its capacity), the last sequence's padding taking the difference.

Padded (BSHD): consecutive rows, padded to the longest row of the micro-batch rounded up to
lcm(pad_multiple, 8), never to cutoff_len, unless one fixed length is required (MoE allgather dispatcher).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .batch import IGNORE_INDEX, MicroBatch
from .rows import Sample


# The weight gradients' GEMMs reduce over a micro-batch's tokens; cuBLAS runs them fastest when that count is a
# multiple of its 64-deep tiles (on an H100, Gemma 4 31B's fc2 weight gradient at 4,006 tokens takes 1.59 ms, at
# 4,032 1.28 ms), far more than the padding costs.
TILE = 64


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def round_up_array(values: np.ndarray, multiple: int) -> np.ndarray:
    return -(-values // multiple) * multiple


def pack_length(tokens: int, pad_multiple: int, capacity: int) -> int:
    """A pack's length: its sequences' ``tokens`` (each padded to ``pad_multiple``) rounded up to a multiple of
    ``TILE``, never past its ``capacity``."""
    return max(min(round_up(tokens, math.lcm(pad_multiple, TILE)), capacity), tokens)


def padded_multiple(pad_multiple: int) -> int:
    """Rows of a padded batch round up to this: the parallel layout's multiple, and 8 for tensor cores."""
    return math.lcm(pad_multiple, 8)


def pack_window_ffd(sizes: np.ndarray, order: Sequence[int], capacity: int, window: int) -> list[tuple[int, ...]]:
    """Pack ``order`` (indices into ``sizes``) into bins of at most ``capacity``, window by window.

    Inside each window of ``window`` consecutive indices: first-fit-decreasing (largest first, ties in
    order). A pack never spans two windows. Members of a pack keep their order, and packs are sorted by
    their first member, so the stream follows the input order up to one window.
    """
    if window < 1:
        raise ValueError(f"window={window} must be >= 1.")
    packs: list[tuple[int, ...]] = []
    for start in range(0, len(order), window):
        rows = [int(i) for i in order[start : start + window]]
        rank = {index: position for position, index in enumerate(rows)}
        bins: list[list[int]] = []
        free: list[int] = []
        open_bins: list[int] = []  # bins that can still take the smallest item of this window
        smallest = min(int(sizes[i]) for i in rows)
        for index in sorted(rows, key=lambda i: (-int(sizes[i]), rank[i])):
            size = int(sizes[index])
            if size > capacity:
                raise ValueError(f"Row {index} needs {size} tokens, more than the pack capacity {capacity}.")
            target = next((b for b in open_bins if free[b] >= size), None)
            if target is None:
                target = len(bins)
                bins.append([])
                free.append(capacity)
                open_bins.append(target)
            bins[target].append(index)
            free[target] -= size
            if free[target] < smallest:
                open_bins.remove(target)
        packs.extend(tuple(sorted(b, key=rank.__getitem__)) for b in sorted(bins, key=lambda b: min(map(rank.get, b))))
    return packs


def chunk(order: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """Consecutive groups of ``size`` (the last may be shorter)."""
    return [tuple(int(i) for i in order[start : start + size]) for start in range(0, len(order), size)]


def _ref_logps(samples: list[Sample]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not samples or any(s.ref_logps is None for s in samples):
        return None, None
    chosen, rejected = zip(*(s.ref_logps for s in samples))
    return torch.tensor(chosen, dtype=torch.float32), torch.tensor(rejected, dtype=torch.float32)


def _data_tokens(samples: list[Sample]) -> int:
    """The dataset tokens these samples train: each sequence's positions plus its last token (a target only),
    which a piece continuing a document shares with the piece before it."""
    return sum(len(tokens) + (0 if sample.continues or sample.unshifted else 1) for sample in samples
               if not sample.filler
               for tokens, _ in sample.sequences)


def _finish(tokens: np.ndarray, labels: np.ndarray, positions: np.ndarray, num_real: int, samples: list[Sample],
            pairwise: bool, cu_seqlens: np.ndarray | None, max_seqlen: int) -> MicroBatch:
    loss_mask = labels != IGNORE_INDEX
    chosen, rejected = _ref_logps(samples) if pairwise else (None, None)
    rows, length = tokens.shape
    if cu_seqlens is not None:  # packed: a pair's sequences are adjacent, so sequence i is already 2i / 2i + 1
        seqlens = np.diff(cu_seqlens)
        seq_ids = np.repeat(np.arange(len(seqlens)), seqlens)[None]
    else:  # padded: rows [0, n) chosen, [n, 2n) rejected
        seqlens = np.full(rows, length)
        order = np.arange(rows)
        if pairwise:
            n = len(samples)
            order = np.where(order < n, 2 * order, 2 * (order - n) + 1)
        seq_ids = np.broadcast_to(order[:, None], (rows, length))
    return MicroBatch(
        tokens=torch.from_numpy(tokens),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(loss_mask.astype(np.float32)),
        position_ids=torch.from_numpy(positions),
        seq_ids=torch.from_numpy(np.ascontiguousarray(seq_ids, dtype=np.int64)),
        cu_seqlens=None if cu_seqlens is None else torch.from_numpy(cu_seqlens.astype(np.int32)),
        max_seqlen=int(max_seqlen),
        seqlens=[int(n) for n in seqlens],
        num_tokens=int(tokens.size),
        num_real_tokens=int(num_real),
        num_loss_tokens=int(loss_mask.sum()),
        num_data_tokens=_data_tokens(samples),
        num_pairs=len(samples) if pairwise else 0,
        ref_chosen_logps=chosen,
        ref_rejected_logps=rejected,
        desirable=torch.tensor([s.desirable for s in samples], dtype=torch.bool) if pairwise else None,
    )


def collate_packed(samples: list[Sample], pad_multiple: int, pad_token_id: int, pairwise: bool = False,
                   total_length: int | None = None, capacity: int | None = None) -> MicroBatch:
    """One THD row: every sequence padded to ``pad_multiple``, a pair's two sequences adjacent.

    ``total_length`` (fixed-length mode) lengthens the last sequence's padding so every pack has one size; else
    ``capacity`` (the pack's most tokens) lets it round the pack up to a multiple of ``TILE``. Causal attention keeps
    the real tokens of that sequence blind to the padding after them.
    """
    sequences = [seq for sample in samples for seq in sample.sequences]
    real = [len(tokens) for tokens, _ in sequences]
    padded = [round_up(n, pad_multiple) for n in real]
    if total_length is None and capacity is not None:
        total_length = pack_length(sum(padded), pad_multiple, capacity)
    if total_length is not None and padded:
        if sum(padded) > total_length:
            raise ValueError(f"Pack of {sum(padded)} tokens exceeds the fixed length {total_length}.")
        padded[-1] += total_length - sum(padded)
    cu_seqlens = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    total = int(cu_seqlens[-1])
    tokens = np.full(total, pad_token_id, dtype=np.int64)
    labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    for (seq_tokens, seq_targets), start, n, width in zip(sequences, cu_seqlens, real, padded):
        tokens[start : start + n] = seq_tokens
        labels[start : start + n] = seq_targets
        positions[start : start + width] = np.arange(width)
    return _finish(tokens[None], labels[None], positions[None], sum(real), samples, pairwise, cu_seqlens,
                   max(padded, default=0))


def collate_padded(samples: list[Sample], pad_multiple: int, pad_token_id: int, pairwise: bool = False,
                   fixed_length: int | None = None, rows: int | None = None) -> MicroBatch:
    """``b`` rows (DPO: all chosen, then all rejected), right-padded to the longest (rounded) or a fixed length.

    ``rows``: as many samples as that, loss-free fillers making up a short group (an epoch's last rows), where every
    micro-batch must have one shape (pipeline transfers, the allgather dispatcher).
    """
    width = len(samples[0].sequences) if samples else 1
    real = [len(tokens) for sample in samples for tokens, _ in sample.sequences]
    if rows is not None and len(samples) < rows:
        filler = Sample([(np.array([pad_token_id]), np.array([IGNORE_INDEX]))] * width, (0.0, 0.0) if pairwise
                        else None, filler=True)
        samples = samples + [filler] * (rows - len(samples))
    sequences = [sample.sequences[k] for k in range(width) for sample in samples]
    length = fixed_length or round_up(max(real, default=1), padded_multiple(pad_multiple))
    if max(real, default=0) > length:
        raise ValueError(f"A row of {max(real)} tokens exceeds the fixed length {length}.")
    tokens = np.full((len(sequences), length), pad_token_id, dtype=np.int64)
    labels = np.full((len(sequences), length), IGNORE_INDEX, dtype=np.int64)
    for row, (seq_tokens, seq_targets) in enumerate(sequences):
        tokens[row, :len(seq_tokens)] = seq_tokens
        labels[row, :len(seq_tokens)] = seq_targets
    positions = np.broadcast_to(np.arange(length, dtype=np.int64), tokens.shape).copy()
    return _finish(tokens, labels, positions, sum(real), samples, pairwise, None, length)
