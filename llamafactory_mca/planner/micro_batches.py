"""How many of the recipe's packed micro-batches run as one (``merge_micro_batches``).

A packed micro-batch is a token budget, so k of them as one pack of k times the tokens, accumulated k times fewer,
train the same global batch. What changes is the work per micro-batch: a MoE layer's experts add their weight gradients
to the fp32 main_grad once per micro-batch, a read and a write of every expert weight in fp32 whatever the micro-batch
holds, and every layer's kernels are launched once per micro-batch. At 256 rows per expert (Qwen3-30B-A3B's 4,096-token
packs: 128 experts, top 8) that traffic takes longer than the GEMM it follows; at 512 the two are even (one H200, 8
layers, the same 8 packs per step: 0.75 s as 1 x 8, 0.50 s as 2 x 4 with half the launches). Dense layers gain only
where they are narrow enough for the host to be the limit: Gemma 4 E2B's 1536-wide layers on 4,096-token packs kept
the GPU busy 61% of the step, and as 2 x 4 93%, at 1.55x the tokens/s (one H200). LoRA's frozen experts have no
weight gradients to pay for, but their grouped GEMMs run below the GEMM's rate at a few hundred rows per expert and
their layers launch per micro-batch all the same: Qwen3-30B-A3B with LoRA, the recipe's 1 x 8 as 2 x 4, ran 1.3-2.1x
as fast in three calls (one H200). Graphs replay the recipe's shapes (and take the host's part away), so ``auto``
merges MoE models up to 512 rows per expert, and dense ones whose micro-batch is under ``DENSE_WORK`` tokens x hidden
up to it, each only as far as the planner's memory estimate fits the GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import UserError
from ..parallel import ParallelLayout
from .memory import Training, estimate


EXPERT_ROWS = 512  # rows per expert and micro-batch from which a MoE layer's GEMMs (and weight-gradient pass) pay
DENSE_WORK = 4096 * 4096  # tokens x hidden of a dense micro-batch from which its layers keep the GPU busy
MERGES = (2, 4, 8)
MERGING_STAGES = ("pt", "sft")  # the preference stages pair their rows inside a micro-batch; rm scores rows


@dataclasses.dataclass(frozen=True)
class Merge:
    factor: int  # 1: the recipe's micro-batches as they are
    why: str  # for the startup summary


def rows_per_expert(config: Any, layout: ParallelLayout, tokens: int) -> float:
    """Rows each of one rank's experts gets per micro-batch: expert parallelism gathers its ranks' tokens."""
    t = config.transformer
    per_rank = tokens * layout.micro_batch_size / layout.cp
    return per_rank * (t.get("moe_router_topk") or 1) * layout.ep / (t.get("num_moe_experts") or 1)


def merged(layout: ParallelLayout, factor: int) -> ParallelLayout:
    return dataclasses.replace(layout, micro_batch_size=layout.micro_batch_size * factor,
                               grad_accum=layout.grad_accum // factor)


def plan_merge(request: str | int, config: Any, layout: ParallelLayout, training: Training, stage: str, packing: bool,
               cuda_graphs: bool, gpu_memory_gib: Callable[[], float | None]) -> Merge:
    """The factor for ``merge_micro_batches`` (``request``: "auto" or an integer): an explicit one is checked, auto
    decides from the experts' rows and the memory estimate against ``gpu_memory_gib()`` (asked only here; None where
    no GPU is visible or the estimate is not trusted: nothing merges)."""
    if request == 1:
        return Merge(1, "")
    if request != "auto":
        return Merge(request, _check_explicit(request, layout, stage, packing))
    experts = bool(config.transformer.get("num_moe_experts"))
    if not (packing and stage in MERGING_STAGES and layout.pp == 1 and not cuda_graphs):
        return Merge(1, "")
    budget = gpu_memory_gib()
    if budget is None:
        return Merge(1, "")
    hidden = config.transformer["hidden_size"]

    def work(candidate: ParallelLayout) -> tuple[float, str]:
        """(how far the micro-batch is from keeping the GPU busy, 1 = there; what to say of it)"""
        if experts:
            rows = rows_per_expert(config, candidate, training.tokens)
            return rows / EXPERT_ROWS, f"{rows:,.0f} rows per expert"
        tokens = training.tokens * candidate.micro_batch_size / candidate.cp
        return tokens * hidden / DENSE_WORK, f"{tokens:,.0f} tokens of {hidden} per micro-batch"

    best = Merge(1, "")
    for factor in MERGES:
        if layout.grad_accum % factor or work(merged(layout, best.factor))[0] >= 1 or \
                (not experts and work(merged(layout, factor))[0] > 1):
            break
        bigger = merged(layout, factor)
        if estimate(config, bigger, training)["needs"] > budget:
            break
        best = Merge(factor, f"merge_micro_batches: auto merged the recipe's micro-batches by {factor} "
                             f"({work(bigger)[1]}; 1 keeps them)")
    return best


def _check_explicit(factor: int, layout: ParallelLayout, stage: str, packing: bool) -> str:
    problem = (f"gradient_accumulation_steps={layout.grad_accum} is not a multiple of it" if layout.grad_accum % factor
               else "the rows are not packed (sequence_packing: true packs them)" if not packing
               else f"stage {stage} keeps its rows' pairs or scores per micro-batch" if stage not in MERGING_STAGES
               else "pipeline stages need their micro-batches (the fewer, the longer the bubble)" if layout.pp > 1
               else "")
    if problem:
        raise UserError(f"merge_micro_batches={factor}: {problem}. Use merge_micro_batches: 1, or auto (which "
                        "merges where it can).")
    return f"merge_micro_batches: {factor} merged the recipe's micro-batches"
