"""The parallel layout: sizes checked against the world, process groups, seeds. The one place for it.

``ParallelLayout.from_args`` is the second argument check (design: args first, layout once the
world size is known); ``initialize`` builds Megatron's process groups from it. Everything else asks
``parallel_state`` or the layout, never recomputes sizes on its own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    dp: int
    expert_dp: int
    micro_batch_size: int
    grad_accum: int
    seq_length: int | None = None

    @property
    def global_batch_size(self) -> int:
        """Rows (or packed micro-batches) per optimizer step: dp × micro batch × grad accumulation."""
        return self.dp * self.micro_batch_size * self.grad_accum

    @property
    def tokens_per_step(self) -> int | None:
        return None if self.seq_length is None else self.global_batch_size * self.seq_length

    @property
    def pad_multiple(self) -> int:
        """Each sequence's length must divide into 2·cp chunks of a TP-divisible size (CP load balance, SP)."""
        multiple = self.tp if self.tp > 1 else 1
        return multiple * 2 * self.cp if self.cp > 1 else multiple

    def describe(self) -> str:
        vpp = f" vpp={self.vpp}" if self.vpp else ""
        return (f"world={self.world_size} tp={self.tp} pp={self.pp}{vpp} cp={self.cp} ep={self.ep} etp={self.etp} "
                f"dp={self.dp} (expert dp={self.expert_dp})")

    @classmethod
    def from_args(cls, args: Any, world_size: int | None = None, seq_length: int | None = None
                  ) -> ParallelLayout:
        world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
        ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or 1
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            raise ValueError(
                f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x context_parallel_size={cp} "
                f"= {model_parallel} does not divide the world size {world_size}. Choose sizes whose product divides "
                f"the number of processes (NPROC_PER_NODE x NNODES), or launch a multiple of {model_parallel} "
                "processes."
            )
        expert_parallel = ep * etp * pp
        if world_size % expert_parallel:
            raise ValueError(
                f"expert_model_parallel_size={ep} x expert_tensor_parallel_size={etp} x "
                f"pipeline_model_parallel_size={pp}"
                f" = {expert_parallel} does not divide the world size {world_size}; the expert layers cannot be laid "
                "out. Lower expert_model_parallel_size or launch more processes."
            )
        dp = world_size // model_parallel
        micro = getattr(args, "per_device_train_batch_size", 1)
        accum = getattr(args, "gradient_accumulation_steps", 1)
        vpp = args.virtual_pipeline_model_parallel_size
        if vpp and pp > 1 and accum % pp:
            raise ValueError(
                f"gradient_accumulation_steps={accum} must be a multiple of pipeline_model_parallel_size={pp} "
                "with the "
                f"interleaved schedule (virtual_pipeline_model_parallel_size={vpp}). Use gradient_accumulation_steps="
                f"{-(-accum // pp) * pp}."
            )
        return cls(world_size=world_size, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=dp,
                   expert_dp=world_size // expert_parallel, micro_batch_size=micro, grad_accum=accum,
                   seq_length=seq_length)


def min_world_size(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1) -> int:
    """The fewest processes a layout fits in: dense layers need tp·pp·cp, expert layers ep·etp·pp."""
    import math

    return math.lcm(tp * pp * cp, ep * etp * pp)


def init_distributed(timeout_minutes: int = 30) -> None:
    """Join the process group torchrun (or a test's spawn) describes; gloo without GPUs, NCCL with."""
    from .compat import apply_megatron_fixes
    from .cpu_mode import apply_cpu_mode, cpu_mode_needed

    if cpu_mode_needed():
        apply_cpu_mode()
    apply_megatron_fixes()
    if torch.distributed.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    from datetime import timedelta

    torch.distributed.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo",
        rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")),
        timeout=timedelta(minutes=timeout_minutes),
    )


def initialize(layout: ParallelLayout, seed: int = 42) -> None:
    """Create Megatron's process groups for ``layout`` (idempotent) and seed every RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    init_distributed()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        )
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
