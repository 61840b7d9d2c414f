"""The parallel layout: sizes checked against the world, process groups, seeds. The one place for it.

``ParallelLayout.from_args`` is the second argument check (design: args first, layout once the
world size is known); ``initialize`` builds Megatron's process groups from it. Everything else asks
``parallel_state`` or the layout, never recomputes sizes on its own.
"""

from __future__ import annotations

import atexit
import gc
import logging
import math
import os
import random
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch.distributed import distributed_c10d as c10d

from .args import expert_tp
from .compat import apply_megatron_fixes
from .cpu_mode import apply_cpu_mode, cpu_mode_needed
from .errors import UserError


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
        ep, etp = args.expert_model_parallel_size, expert_tp(args)
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            raise UserError(
                f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x context_parallel_size={cp} "
                f"= {model_parallel} does not divide the world size {world_size} ({_world_words(world_size)}). "
                f"Launch a multiple of {model_parallel} processes, or choose sizes whose product divides "
                f"{world_size}; with this pipeline and context size, tensor_model_parallel_size can be "
                f"{_listing(d for d in _divisors(world_size) if world_size % (d * pp * cp) == 0)}."
            )
        expert_parallel = ep * etp * pp
        if world_size % expert_parallel:
            raise UserError(
                f"expert_model_parallel_size={ep} x expert_tensor_parallel_size={etp} x "
                f"pipeline_model_parallel_size={pp} = {expert_parallel} does not divide the world size {world_size} "
                f"({_world_words(world_size)}): the expert layers cannot be laid out. expert_model_parallel_size "
                f"can be {_listing(d for d in _divisors(world_size) if world_size % (d * etp * pp) == 0)} here, "
                f"or launch a multiple of {expert_parallel} processes."
            )
        dp = world_size // model_parallel
        micro = getattr(args, "per_device_train_batch_size", 1)
        accum = getattr(args, "gradient_accumulation_steps", 1)
        vpp = args.virtual_pipeline_model_parallel_size
        if vpp and pp > 1 and accum % pp:
            raise UserError(
                f"gradient_accumulation_steps={accum} must be a multiple of pipeline_model_parallel_size={pp} "
                f"with the interleaved schedule (virtual_pipeline_model_parallel_size={vpp}): Megatron runs "
                f"micro-batches in groups of {pp} per virtual stage. Use gradient_accumulation_steps="
                f"{-(-accum // pp) * pp}."
            )
        return cls(world_size=world_size, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=dp,
                   expert_dp=world_size // expert_parallel, micro_batch_size=micro, grad_accum=accum,
                   seq_length=seq_length)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listing(values: Iterable[int]) -> str:
    values = list(values)
    return ", ".join(map(str, values)) if values else "none"


def _world_words(world_size: int) -> str:
    nproc, nnodes = os.environ.get("NPROC_PER_NODE"), os.environ.get("NNODES", "1")
    if nproc:
        return f"NPROC_PER_NODE={nproc} x NNODES={nnodes}"
    return "processes in this launch"


def cuda_graph_layout_needs(layout: ParallelLayout, recompute_granularity: str | None,
                            moe: bool) -> list[tuple[str, bool, str]]:
    """What per-layer CUDA graphs need of the layout, as (the keys, whether they hold, why): one graph per layer,
    and no host work inside one. The run refuses a layout failing one (``plan.check_cuda_graphs``); the planner's
    search proposes it without graphs."""
    needs = [
        ("pipeline_model_parallel_size: 1", layout.pp == 1,
         "pipeline stages keep several micro-batches in flight, each needing its own graphs"),
        ("context_parallel_size: 1", layout.cp == 1, "context parallelism plans its attention segments on the host"),
        ("recompute_granularity: selective (or unset)", recompute_granularity != "full",
         "a recomputed layer runs its forward again outside the graph"),
    ]
    if moe:
        needs.append(("expert_model_parallel_size: 1 (and expert_tensor_parallel_size: 1)",
                      layout.ep == layout.etp == 1, "Megatron's all-to-all copies the token counts to the host"))
    return needs


def check_layout(config: Any, layout: ParallelLayout, custom_pipeline_layout: bool = False,
                 sequence_parallel: bool | None = None) -> None:
    """The model against the layout (``config``: a models.McaConfig), before any process group exists;
    ``sequence_parallel``: the recipe's, where it is known.

    Each problem names the size, the model dimension it must divide, and the sizes that fit the model, so the
    fix is one edit (the world size is checked in ``ParallelLayout.from_args``).
    """
    t = config.transformer
    tp, pp, vpp, ep, etp = layout.tp, layout.pp, layout.vpp or 1, layout.ep, layout.etp
    heads, groups, _ = config.attention
    # the dense MLP's width, where some layer has one (DeepSeek-V3 and GLM-4.5 start with dense layers)
    has_dense = not all(config.is_moe_layer(i) for i in range(t["num_layers"]))
    dense_ffn = t["ffn_hidden_size"] if has_dense else None

    # Gemma 4's full-attention layers have key/value heads of their own
    full_groups = config.global_attention_shape.num_query_groups if t.get("global_attention") else groups

    def tp_fits(d: int) -> bool:
        return (heads % d == 0 and groups % d == 0 and full_groups % d == 0
                and (dense_ffn is None or dense_ffn % d == 0))

    problems = []
    tp_hint = f" (sizes that fit this model: {_listing(d for d in _divisors(heads) if tp_fits(d))})"
    if heads % tp:
        problems.append(f"tensor_model_parallel_size={tp} does not divide num_attention_heads={heads}" + tp_hint)
    elif groups % tp:
        problems.append(f"tensor_model_parallel_size={tp} does not divide the key/value heads "
                        f"(num_key_value_heads={groups})" + tp_hint)
    elif full_groups % tp:
        problems.append(f"tensor_model_parallel_size={tp} does not divide the full-attention layers' key/value heads "
                        f"(num_global_key_value_heads={full_groups})" + tp_hint)
    elif dense_ffn is not None and dense_ffn % tp:
        problems.append(f"tensor_model_parallel_size={tp} does not divide ffn_hidden_size={dense_ffn}" + tp_hint)
    if config.is_hybrid:  # gated delta-rule layers: TP splits their key and value heads; no CP for them yet
        for field in ("linear_num_key_heads", "linear_num_value_heads"):
            if t[field] % tp:
                problems.append(f"tensor_model_parallel_size={tp} does not divide {field}={t[field]} (the gated "
                                f"delta-rule layers' heads; sizes that fit: {_listing(_divisors(t[field]))})")
        if layout.cp > 1:
            problems.append(f"context_parallel_size={layout.cp}: the gated delta-rule layers cannot split a sequence "
                            "(their recurrent state runs through it; context_parallel_size must be 1 — for long "
                            "sequences use tensor parallelism and recompute)")
    if t.get("experimental_attention_variant") == "dsa" and layout.cp > 1:
        problems.append(f"context_parallel_size={layout.cp}: DeepSeek sparse attention's indexer ranks every earlier "
                        "key of a query's sequence, which context parallelism spreads over ranks (context_parallel_"
                        "size must be 1 — for long sequences use tensor parallelism and recompute)")
    if config.num_experts:
        experts, moe_ffn = config.num_experts, t["moe_ffn_hidden_size"]
        if experts % ep:
            problems.append(f"expert_model_parallel_size={ep} does not divide num_experts={experts} "
                            f"(sizes that fit this model: {_listing(_divisors(experts))})")
        if moe_ffn % etp:
            problems.append(f"expert_tensor_parallel_size={etp} does not divide moe_ffn_hidden_size={moe_ffn} "
                            f"(sizes that fit: {_listing(d for d in _divisors(moe_ffn) if d <= 64)})")
        if etp > 1 and t.get("add_bias_linear"):
            problems.append(f"expert_tensor_parallel_size={etp}: the experts' biases need each expert whole on its "
                            "rank (set expert_tensor_parallel_size: 1; expert_model_parallel_size spreads them)")
        if tp > 1 and sequence_parallel is False:
            problems.append(f"tensor_model_parallel_size={tp} on a model with experts needs sequence_parallel: true "
                            "(Megatron-Core refuses MoE layers under tensor parallelism without it)")
    elif ep > 1 or etp > 1:
        what = f"expert_model_parallel_size={ep}" if ep > 1 else f"expert_tensor_parallel_size={etp}"
        problems.append(f"{what} on a dense model: it has no experts to spread (set expert_model_parallel_size: 1 "
                        "and expert_tensor_parallel_size: 1; tensor_model_parallel_size or "
                        "pipeline_model_parallel_size split a dense model)")
    layers, stages = t["num_layers"], pp * vpp
    if stages > 1 and config.on_one_stage:
        problems.append(f"pipeline_model_parallel_size={pp}" + (f" x virtual_pipeline_model_parallel_size={vpp}"
                                                                  if vpp > 1 else "")
                        + ": the per-layer inputs and shared keys and values of this model go from layer to layer "
                        "beside the hidden states, which are all a pipeline stage hands on (pipeline_model_parallel_"
                        "size must be 1; data and tensor parallelism split these models)")
    if not custom_pipeline_layout and (stages > layers or layers % stages):
        pp_fits = _listing(d // vpp for d in _divisors(layers) if d % vpp == 0)
        what = f"pipeline_model_parallel_size={pp}" + (f" x virtual_pipeline_model_parallel_size={vpp}" if vpp > 1
                                                        else "")
        if stages > layers:
            problems.append(f"{what} = {stages} stages is more than num_layers={layers} (pipeline_model_parallel_"
                            f"size can be {pp_fits})")
        else:
            problems.append(f"num_layers={layers} does not split evenly into {what} = {stages} stages "
                            f"(pipeline_model_parallel_size can be {pp_fits}; or give pipeline_model_parallel_layout "
                            "for an uneven split)")
    if problems:
        raise UserError(f"{config.hf_model_type}: " + "; ".join(problems) + ".")


def min_world_size(args: Any) -> int:
    """The fewest processes the recipe's layout (``args``: its parsed arguments) fits in: dense layers need tp·pp·cp,
    expert layers ep·etp·pp."""
    pp = args.pipeline_model_parallel_size
    return math.lcm(args.tensor_model_parallel_size * pp * args.context_parallel_size,
                    args.expert_model_parallel_size * expert_tp(args) * pp)


def init_distributed(timeout_s: float = 1800) -> None:
    """Join the process group torchrun (or a test's spawn) describes; gloo without GPUs, NCCL with.

    ``timeout_s`` is ``ddp_timeout``; the group's own timeout is a minute longer, so that the watchdog's message
    (rank, step, operation) comes before the backend's.
    """
    if cpu_mode_needed():
        apply_cpu_mode()
    apply_megatron_fixes()
    if torch.distributed.is_initialized():
        return
    device = {}
    if torch.cuda.is_available():
        # a bound device: NCCL neither guesses it from the rank nor warns at every barrier
        device["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device["device_id"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    torch.distributed.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo",
        rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")),
        timeout=timedelta(seconds=timeout_s + 60), **device,
    )


# What a collective raises on the survivors when another rank's process died (gloo; NCCL's watchdog aborts itself).
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def lost_peer(err: BaseException) -> bool:
    """A collective failed because another rank's process is gone, not because of this rank."""
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _PEER_GONE)


def initialize(layout: ParallelLayout, seed: int = 42, cuda_graphs: bool = False) -> None:
    """Create Megatron's process groups for ``layout`` (idempotent) and seed every RNG. ``cuda_graphs``: the run's
    layers will be CUDA graphs, whose random numbers must come from a graph-safe generator."""
    # here: the launcher imports this module (min_world_size, init_distributed's hook); Megatron loads in a rank
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if cuda_graphs:  # NCCL buffer registration under graph capture faults with expandable segments (Megatron asserts)
        os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
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

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs, force_reset_rng=cuda_graphs)


def destroy() -> None:
    destroy_layout()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def destroy_layout() -> None:
    """Megatron's process groups gone, the default group kept, so that ``initialize`` can build another layout in
    the same processes (tests, benchmarks).

    A gloo group keeps three threads until the last reference to it goes, some of them spinning: a 4-process test
    walking 60 layouts piled up ~1,200 threads per process and its cases slowed from 5 s to 37 s each. So every
    holder is let go: megatron-core's ``destroy_model_parallel`` forgets most of its globals but not all (0.16.1:
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo twin), the MoE and MTP loss trackers keep the groups
    their losses were reduced over, and the rotary embeddings' class-level ``lru_cache`` on ``forward`` keeps the
    last modules (``self``) and, through the DDP hooks on them, the whole finished model with its optimizer. (The
    trainer drops the autograd graphs its modules keep: ``trainer._drop_kept_graphs``.)"""
    from megatron.core import parallel_state  # here: as in init_distributed
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    for rotary in (RotaryEmbedding, YarnRotaryEmbedding):
        rotary.forward.cache_clear()
    get_moe_layer_wise_logging_tracker().clear()
    MTPLossLoggingHelper.tracker.clear()
    # The finished model's reference cycles (modules and their hooks) hold groups too: collected now, once the caches
    # above no longer keep it, and until a pass frees nothing (finalizers run in one pass let go of more for the
    # next); otherwise it lingers as garbage, with its groups' threads, until Python's next automatic collection.
    while gc.collect():
        pass
    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and _holds_group(value):
            setattr(parallel_state, name, None)
    if torch.distributed.is_initialized():
        world = c10d._get_default_group()
        for group in [g for g in list(c10d._world.pg_map) if g is not world]:
            torch.distributed.destroy_process_group(group)


def _holds_group(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_group(v) for v in value)
    return isinstance(value, torch.distributed.ProcessGroup)


_LEAVE_BY_RETURNING = False


def interrupt_once() -> None:
    """Ctrl-C reaches a worker twice: from the terminal, then passed on by torchrun's agent. The second would land
    in the middle of dropping an unfinished checkpoint, or in the exit's finalizers, with a traceback: the first
    raises KeyboardInterrupt, later ones are ignored (the agent still ends a worker that does not leave)."""
    def interrupted(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)


def leave_by_returning() -> None:
    """This worker was forked by our torchrun (launch/torchrun.py): torch's agent waits for its entry function to
    return, so ``end_worker`` ends with SystemExit(0), which the agent's wrapper turns into a return; the process
    then leaves through multiprocessing's os._exit, never finalizing either."""
    global _LEAVE_BY_RETURNING
    _LEAVE_BY_RETURNING = True


def end_worker() -> None:
    """End a torchrun worker whose work is done, before the interpreter tears itself down.

    Objects that outlive training in reference cycles (modules with hooks, communication handles, their tensors)
    would otherwise be freed during interpreter finalization, where a gloo/NCCL thread that still touches one takes
    the GIL of a dying interpreter and the process aborts ("terminate called without an active exception", SIGABRT):
    a finished run then reports a failure (seen on a loaded CI machine, one rank in eight; pytorch PR 179291
    describes the mechanism). So the worker never finalizes: the process groups go, the exit handlers run (logging,
    experiment trackers), the streams are flushed, and it leaves with exit code 0; the operating system takes back
    the rest. Nothing is garbage-collected first (``destroy_layout``'s collections are for a process that goes on to
    another layout): a full collection of a process holding torch, transformers and LLaMA-Factory takes a third of a
    second, and the loop took 2-3 s of every rank's exit. For worker processes only: it does not return."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if _LEAVE_BY_RETURNING:
        raise SystemExit(0)
    os._exit(0)
