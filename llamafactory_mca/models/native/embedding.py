"""Embedding lookups whose backward adds the looked-up rows' gradients straight into DDP's ``main_grad``.

torch's embedding backward makes a dense gradient as large as the table, zeroed and then scattered into, for the
few thousand rows a micro-batch reads; DDP's hook then adds all of it into the fp32 ``main_grad`` (torch's
mixed-dtype add, which does not vectorise). At Gemma 4 E2B's per-layer table (262,144 x 8,960) that is a 4.7 GB
gradient made and 9.4 GB of fp32 read and written every micro-batch, for 8,192 tokens' rows (with this and three
smaller changes E2B went from 2.8x to 3.4x LLaMA-Factory's tokens/s on an H200, and 128 to 121 GiB:
``benchmarks/results/h200_gemma4_e2b/``). Here the rows go into ``main_grad`` with one ``index_add_`` in its dtype
and the weight gets the placeholder Megatron's fused linears give (``wgrad.placeholder_grad``), so DDP's hook adds
nothing.

A table the output layer also multiplies by (tied embeddings on one stage) gets its gradient from that layer's
backward too, where it fuses gradient accumulation as a placeholder that Megatron zeroes (``zero_out_wgrad``) so that
DDP's hook can add a dense embedding gradient beside it. Autograd sums a leaf's gradients before the hook reads them,
so at Gemma 4 31B's 262,144 x 5,376 every micro-batch paid two table-sized fills, a bf16 add of the two placeholders
and the hook's fp32 add of their zeros. The output layer marks the table it used (``used_by_output_layer``), the
lookup's backward then adds its rows alone and hands autograd nothing, and the zeroing is off
(``RowGradEmbedding.own_rows_only``).

Where there is no ``main_grad`` (no DDP: a reference model, a frozen table) or Megatron's ``deterministic_mode`` is on
(``index_add_`` adds a repeated token's rows in no fixed order), the lookup is torch's, dense gradient and all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from .wgrad import placeholder_grad


def into_main_grad(weight: torch.Tensor) -> bool:
    """Whether DDP gave ``weight`` a ``main_grad`` and marks what is added there (``grad_added_to_main_grad``)."""
    return weight.requires_grad and hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad")


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids, weight)
        ctx.padding_idx = padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        ids, weight = ctx.saved_tensors
        ids = ids.reshape(-1)
        rows = grad.reshape(ids.numel(), -1).to(weight.main_grad.dtype)
        if ctx.padding_idx is not None:  # the row torch does not train
            rows = rows.masked_fill((ids == ctx.padding_idx).unsqueeze(-1), 0)
        weight.main_grad.index_add_(0, ids, rows)
        if getattr(weight, "used_by_output_layer", False):  # its backward hands autograd the table's gradient
            return None, None, None
        return None, placeholder_grad(weight, grad.dtype), None


def mark_output_use(weight: torch.Tensor) -> None:
    """Called by an output layer multiplying by ``weight`` in a forward that trains it: a tied table's lookup then
    leaves the gradient autograd hands on to that layer (see the module docstring)."""
    if torch.is_grad_enabled() and weight.requires_grad:
        weight.used_by_output_layer = True


def lookup(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None,
           deterministic: bool = False) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)``, its gradient added into ``weight.main_grad`` where DDP gave one."""
    if deterministic or not (torch.is_grad_enabled() and into_main_grad(weight)):
        return F.embedding(ids, weight, padding_idx)
    return _Lookup.apply(ids, weight, padding_idx)


class RowGradEmbedding(VocabParallelEmbedding):
    """Megatron's vocabulary-parallel embedding (same parameter, keys and tensor parallelism) looking up through
    ``lookup``; the model gives its word embeddings this class (``cross_entropy.LanguageModel``)."""

    @staticmethod
    def own_rows_only(table: VocabParallelEmbedding) -> None:
        """Megatron zeroes the placeholder gradient of a table tied to the output layer on the same stage
        (``zero_out_wgrad``) so that DDP's hook can add the embedding's dense gradient beside it; this lookup adds
        its rows itself and hands autograd nothing, so the zeros (a table-sized fill) and the hook's fp32 add are
        left out: the add alone took 6 ms of every micro-batch at Gemma 4 31B's 262,144 x 5,376 on an H100. Torch's
        lookup (``deterministic_mode``) keeps them."""
        if not table.deterministic_mode:
            table.weight.zero_out_wgrad = False

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        tp = self.tp_group.size()
        ids, outside = input_, None
        if tp > 1:  # other ranks' rows: looked up as row 0 and zeroed, as Megatron's
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        out = lookup(ids, self.weight, deterministic=self.deterministic_mode)
        if outside is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:  # [b, s, h] -> [s, b, h], scattered over the sequence
            return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(), group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
