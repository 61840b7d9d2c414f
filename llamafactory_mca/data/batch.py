"""``MicroBatch``: what one forward/backward pass of the Megatron schedule receives, from collation to the model.

The data side builds it (``packing.py``), lengthens it to a step's common length (``padded_to``) and cuts it
to one context-parallel rank's tokens (``context_parallel.py``); the trainer moves it to the device and feeds
it to the model and the loss as it is. Two layouts share one type so the trainer has a single code path:

- packed (THD): ``b == 1``; the sequences lie end to end and ``cu_seqlens`` marks their boundaries. Each
  sequence is padded up to the pad multiple on its own; the padding sits at the end of its sequence, so with
  causal attention no real token ever attends to it, and the boundaries may count it (``cu_seqlens`` and
  ``cu_seqlens_padded`` are the same tensor).
- padded (BSHD): ``b`` rows, right-padded to one length; ``cu_seqlens`` is None.

For DPO both layouts say where the pair's sequences are: packed, sequences ``2i`` and ``2i + 1`` are the
chosen and rejected answers of pair ``i``; padded, rows ``[0, n)`` are chosen and ``[n, 2n)`` rejected. A KTO row
is laid out as a pair: its answer in the chosen place, its KL sample in the rejected one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch


if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


IGNORE_INDEX = -100  # LLaMA-Factory's IGNORE_INDEX (llamafactory.extras.constants); kept here to import nothing heavy


@dataclass
class MicroBatch:
    """One micro-batch on CPU (``to(device)`` moves it). Labels are already shifted inside every sequence."""

    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64, IGNORE_INDEX where no loss
    loss_mask: torch.Tensor  # [b, s] float32, 1.0 where a target counts
    position_ids: torch.Tensor  # [b, s] int64, restarting at 0 in every packed sequence
    seq_ids: torch.Tensor  # [b, s] int64, per position its sequence (DPO pair i: 2i chosen, 2i + 1 rejected)
    cu_seqlens: torch.Tensor | None  # [n + 1] int32, packed only: padded boundaries of the n sequences
    max_seqlen: int  # longest (padded) sequence
    seqlens: list[int]  # every sequence's (padded) length over the whole context-parallel group (FLOPs)
    num_tokens: int  # all positions, padding included
    num_real_tokens: int  # positions holding a real token
    num_loss_tokens: int  # positions whose target counts
    num_data_tokens: int  # the dataset's tokens trained: positions + each sequence's last token, once per document
    num_pairs: int = 0  # DPO: pairs in this micro-batch; 0 otherwise
    ref_chosen_logps: torch.Tensor | None = None  # [num_pairs] float32, when the dataset carries them
    ref_rejected_logps: torch.Tensor | None = None
    desirable: torch.Tensor | None = None  # [num_pairs] bool: KTO's tags (the pair: a row's answer, its KL sample)
    is_padding: bool = False  # a stand-in that keeps ranks in step (an epoch's last step); it adds to no loss
    rope_positions: torch.Tensor | None = None  # [b, s, 3] vision-language models' 3-D positions (mrope)
    vision: dict[str, torch.Tensor] | None = None  # pixel_values, image_grid_thw, ... (data/multimodal.py)
    # [n] int64: the positions whose target counts, sequence-major (as the model's [s, b] hidden states flatten):
    # the only rows the output layer and the loss compute. ``to`` finds them on the host, where the mask is.
    loss_rows: torch.Tensor | None = None

    def model_inputs(self, first_stage: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        """(positions, extra keyword arguments) for the model chunk: 3-D positions [3, b, s] for multimodal RoPE, the
        pixels only where the vision tower is (the first stage), and to every stage whether the micro-batch holds
        images (known here on the host: the attention's image mask then costs no device-to-host read)."""
        positions = self.position_ids if self.rope_positions is None else self.rope_positions.permute(2, 0, 1)
        if not self.vision:
            return positions, {}
        return positions, {**(self.vision if first_stage else {}), "images": "pixel_values" in self.vision}

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1 if self.packed else self.tokens.shape[0]

    @property
    def model_labels(self) -> torch.Tensor:
        """Targets as Megatron's cross entropy takes them: it indexes with every one, so no ignore index."""
        return self.labels.clamp(min=0)

    def packed_seq_params(self) -> PackedSeqParams | None:
        """Megatron's THD description of this micro-batch, or None for a padded one."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams  # here: data/ loads without Megatron

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens,
            cu_seqlens_kv_padded=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def to(self, device: str | torch.device, non_blocking: bool = True) -> MicroBatch:
        """A copy whose tensors live on ``device`` (pinned-memory copies may overlap with compute), ``loss_rows``
        found first where the mask is still on the host (on the device, finding them would wait for the GPU)."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        if self.loss_rows is None and not self.loss_mask.is_cuda:
            moved["loss_rows"] = self._loss_rows().to(device, non_blocking=non_blocking)
        if self.vision:
            moved["vision"] = {k: v.to(device, non_blocking=non_blocking) for k, v in self.vision.items()}
        return replace(self, **moved)

    def _loss_rows(self) -> torch.Tensor:
        """At least one row: a micro-batch with no target (a stand-in, ``without_loss``) computes position 0, whose
        loss its mask zeroes, rather than GEMMs of no rows."""
        rows = self.loss_mask.t().reshape(-1).nonzero().squeeze(1)
        return rows if rows.numel() else torch.zeros(1, dtype=torch.int64)

    def padded_to(self, length: int) -> MicroBatch:
        """Lengthened with loss-free padding to ``length`` positions: packed, the last sequence grows; padded, every
        row. (Every micro-batch of a pipeline-parallel step has one length.)"""
        extra = length - self.tokens.shape[1]
        if extra <= 0:
            return self

        def grow(tensor: torch.Tensor, tail: torch.Tensor | float) -> torch.Tensor:
            if not isinstance(tail, torch.Tensor):
                tail = torch.full((tensor.shape[0], extra), tail)
            return torch.cat([tensor, tail.to(tensor.dtype)], dim=1)

        positions = grow(self.position_ids, self.position_ids[:, -1:] + torch.arange(1, extra + 1))
        rope = self.rope_positions
        if rope is not None:
            rope = torch.cat([rope, rope[:, -1:] + torch.arange(1, extra + 1).view(1, -1, 1)], dim=1)
        seq_ids = grow(self.seq_ids, self.seq_ids[:, -1:].expand(-1, extra))
        cu_seqlens, seqlens, max_seqlen = self.cu_seqlens, list(self.seqlens), self.max_seqlen
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.clone()
            cu_seqlens[-1] += extra
            seqlens[-1] += extra
            max_seqlen = max(max_seqlen, seqlens[-1])
        else:
            seqlens, max_seqlen = [length] * len(seqlens), length
        return replace(self, tokens=grow(self.tokens, 0), labels=grow(self.labels, IGNORE_INDEX),
                       loss_mask=grow(self.loss_mask, 0.0), position_ids=positions, seq_ids=seq_ids,
                       rope_positions=rope,
                       cu_seqlens=cu_seqlens, seqlens=seqlens, max_seqlen=max_seqlen,
                       num_tokens=self.num_tokens + extra * self.tokens.shape[0])

    def with_slots(self, slots: int) -> MicroBatch:
        """A packed micro-batch described by shapes that never change, for a CUDA graph to replay: ``cu_seqlens``
        lengthened to ``slots`` sequences by repeating its end (empty sequences, which attention and RoPE skip), and
        ``max_seqlen`` one past the pack's length. (Megatron sizes the rotary table by ``max_seqlen``, and a table
        exactly as long as the pack would mean positions counted across the pack, as multimodal RoPE's are.)"""
        if not self.packed or self.num_sequences > slots:
            raise ValueError(f"with_slots({slots}) needs a packed micro-batch of at most {slots} sequences "
                             f"(got {'a padded one' if not self.packed else self.num_sequences})")
        tail = self.cu_seqlens[-1:].expand(slots - self.num_sequences)
        return replace(self, cu_seqlens=torch.cat([self.cu_seqlens, tail]), max_seqlen=self.tokens.shape[1] + 1)

    def without_loss(self) -> MicroBatch:
        """The same shapes with every target masked: a stand-in micro-batch for ranks that ran out of data."""
        return replace(
            self,
            labels=torch.full_like(self.labels, IGNORE_INDEX),
            loss_mask=torch.zeros_like(self.loss_mask),
            num_real_tokens=0,
            num_loss_tokens=0,
            num_data_tokens=0,
            is_padding=True,
        )
