"""From the data plan to what one rank's model chunks eat, one optimizer step at a time.

A step is ``gradient_accumulation_steps`` micro-batches of this data-parallel rank. Each micro-batch
gets what the model and loss need: targets with the ignore index replaced (Megatron's cross entropy
indexes with them), sequence ids for per-sequence sums (DPO), the sequence lengths (FLOPs), and —
with context parallelism — only this rank's 2 of the 2·cp load-balanced chunks of every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Iterator

import torch
from megatron.core import parallel_state as ps

from ..data import MicroBatch


@dataclass
class ModelBatch:
    """A micro-batch as the forward step consumes it."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    model_labels: torch.Tensor
    loss_mask: torch.Tensor
    seq_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    max_seqlen: int
    seqlens: list[int]
    num_real_tokens: int
    num_data_tokens: int
    num_pairs: int = 0
    ref_chosen_logps: torch.Tensor | None = None
    ref_rejected_logps: torch.Tensor | None = None
    is_padding: bool = False  # a loss-free stand-in that keeps ranks in step (an epoch's last step)

    def packed_seq_params(self):
        if self.cu_seqlens is None:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               cu_seqlens_q_padded=self.cu_seqlens, cu_seqlens_kv_padded=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def to(self, device: torch.device) -> ModelBatch:
        moved = {k: v.to(device, non_blocking=True) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return replace(self, **moved)


def _seq_ids(batch: MicroBatch) -> torch.Tensor:
    """Per position, the index of its sequence; DPO pairs as 2i (chosen) and 2i+1 (rejected)."""
    if batch.cu_seqlens is not None:
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long()
        ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        return ids.view(1, -1)
    rows, length = batch.tokens.shape
    order = torch.arange(rows)
    if batch.num_pairs:
        n = batch.num_pairs
        order = torch.where(order < n, 2 * order, 2 * (order - n) + 1)
    return order.view(-1, 1).expand(rows, length).contiguous()


def prepare(batch: MicroBatch) -> ModelBatch:
    """Full-sequence ModelBatch (no context-parallel split yet)."""
    if batch.cu_seqlens is not None:
        seqlens = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    else:
        seqlens = [batch.tokens.shape[1]] * batch.tokens.shape[0]
    return ModelBatch(
        tokens=batch.tokens, position_ids=batch.position_ids, model_labels=batch.labels.clamp(min=0),
        loss_mask=batch.loss_mask, seq_ids=_seq_ids(batch), cu_seqlens=batch.cu_seqlens,
        max_seqlen=batch.max_seqlen, seqlens=seqlens, num_real_tokens=batch.num_real_tokens,
        num_data_tokens=batch.num_data_tokens,
        num_pairs=batch.num_pairs, ref_chosen_logps=batch.ref_chosen_logps,
        ref_rejected_logps=batch.ref_rejected_logps, is_padding=batch.is_padding,
    )


def pad_to_length(batch: ModelBatch, length: int) -> ModelBatch:
    """Lengthen a micro-batch with loss-free padding: packed, the last sequence grows; padded, every row."""
    extra = length - batch.tokens.shape[1]
    if extra <= 0:
        return batch

    def grow(tensor: torch.Tensor, value) -> torch.Tensor:
        tail = value if isinstance(value, torch.Tensor) else torch.full((tensor.shape[0], extra), value,
                                                                         dtype=tensor.dtype)
        return torch.cat([tensor, tail.to(tensor.dtype)], dim=1)

    last = batch.position_ids[:, -1:]
    positions = grow(batch.position_ids, last + torch.arange(1, extra + 1))
    seq_ids = grow(batch.seq_ids, batch.seq_ids[:, -1:].expand(-1, extra))
    cu_seqlens, seqlens, max_seqlen = batch.cu_seqlens, list(batch.seqlens), batch.max_seqlen
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.clone()
        cu_seqlens[-1] += extra
        seqlens[-1] += extra
        max_seqlen = max(max_seqlen, seqlens[-1])
    else:
        seqlens = [length] * len(seqlens)
        max_seqlen = length
    return replace(batch, tokens=grow(batch.tokens, 0), model_labels=grow(batch.model_labels, 0),
                   loss_mask=grow(batch.loss_mask, 0.0), position_ids=positions, seq_ids=seq_ids,
                   cu_seqlens=cu_seqlens, seqlens=seqlens, max_seqlen=max_seqlen)


def split_context_parallel(batch: ModelBatch) -> ModelBatch:
    """This CP rank's chunks of every sequence (token-level tensors only; cu_seqlens stay global)."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return batch
    from ..models.native.context_parallel import split_for_context_parallel

    keys = ("tokens", "position_ids", "model_labels", "loss_mask", "seq_ids")
    local = split_for_context_parallel({k: getattr(batch, k) for k in keys}, batch.cu_seqlens,
                                       ps.get_context_parallel_rank(), cp)
    return replace(batch, **{k: local[k] for k in keys})


class StepFeeder:
    """This rank's optimizer steps from a DataPlan, as the model chunks eat them; resumable at a consumed count.

    The plan decides which global micro-batches a step takes (the last step of an epoch takes what is left, see
    ``DataPlan.steps``); this adds what the layout needs: one length per step under pipeline parallelism, a
    micro-batch count that is a multiple of the pipeline size under the interleaved schedule, the CP split.
    """

    def __init__(self, plan: Any, layout: Any) -> None:
        self.plan = plan
        self.layout = layout
        self.multiple = layout.pp if layout.vpp else 1

    @property
    def micro_batches_per_epoch(self) -> int:
        return self.plan.num_micro_batches

    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch(self.layout.dp, self.layout.grad_accum)

    def steps(self, start: int = 0, epochs: int | None = None) -> Iterator[tuple[list[ModelBatch], int]]:
        """(this rank's micro-batches of the step, global micro-batches consumed after it)."""
        # expert parallel groups span data-parallel ranks: their all-to-alls need every rank at every micro-batch
        for step in self.plan.steps(ps.get_data_parallel_rank(), self.layout.dp, self.layout.grad_accum,
                                    self.multiple, equal_counts=self.layout.ep > 1, consumed=start, epochs=epochs):
            yield self._step(step.micro_batches), step.consumed

    def _step(self, micro_batches: list[MicroBatch]) -> list[ModelBatch]:
        batches = [prepare(b) for b in micro_batches]
        if self.layout.pp > 1:
            # One length per step under pipeline parallelism, so the schedule runs without its per-micro-batch shape
            # exchange (variable_seq_lengths off, see models/auto.py). That exchange posts a send whose receive the
            # next stage posts only after a send of its own; where sends wait for their receive (gloo), PP2 x VPP2
            # with as many micro-batches as stages deadlocked. It also costs a host sync per transfer.
            length = max(b.tokens.shape[1] for b in batches)
            batches = [pad_to_length(b, length) for b in batches]
        return [split_context_parallel(b) for b in batches]

    def eval_steps(self) -> Iterator[list[ModelBatch]]:
        """One pass over the evaluation set."""
        for batches, _ in self.steps(epochs=1):
            yield batches

    def tokens_per_step(self) -> int:
        """Average real tokens per optimizer step over an epoch."""
        return int(self.plan.stats["tokens"] / max(self.steps_per_epoch(), 1))
