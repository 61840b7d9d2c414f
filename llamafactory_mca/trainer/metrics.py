"""Numbers for people: memory estimates and the startup summary (FLOPs and parameter counts: ``models/cost.py``)."""

from __future__ import annotations

from typing import Any

import torch

from ..parallel import ParallelLayout


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


def memory_estimate_gib(params_on_rank: int, args: Any, dp: int, trainable: int | None = None) -> dict[str, float]:
    """Weights + gradients + optimizer states per GPU (activations come on top and depend on the data). Frozen
    parameters (``trainable`` of them train) have neither gradients nor optimizer states."""
    trainable = params_on_rank if trainable is None else trainable
    weight_bytes = 2 if (args.bf16 or args.fp16) else 4
    grad_bytes = 4 if (args.accumulate_allreduce_grads_in_fp32 or weight_bytes == 4) else weight_bytes
    states = 12 if args.optimizer == "adam" else 8  # fp32 main params + moments (sgd: + momentum)
    if weight_bytes == 4:
        states -= 4  # fp32 training has no separate main copy
    elif getattr(args, "store_param_remainders", False):
        states -= 2  # the main copy's lower half only
    if args.use_distributed_optimizer:
        states /= dp
    gib = 1024**3
    result = {"weights": params_on_rank * weight_bytes / gib, "grads": trainable * grad_bytes / gib,
              "optimizer": trainable * states / gib}
    if args.optimizer_cpu_offload:
        result["optimizer"] = 0.0
    result["total"] = sum(result.values())
    return result


def gpu_memory_gib() -> tuple[float, float]:
    """(peak allocated, peak reserved) since the last reset, in GiB; zeros on CPU."""
    if not torch.cuda.is_available():
        return 0.0, 0.0
    return torch.cuda.max_memory_allocated() / 1024**3, torch.cuda.max_memory_reserved() / 1024**3


def startup_summary(*, layout: ParallelLayout, args: Any, packed: bool, model_type: str, params_total: int,
                    params_on_rank: int, kernels: str, tokens_per_step: int | None, steps: int, data_stats: str,
                    memory: dict[str, float], planned: dict[str, float] | None = None, tuning: str | None = None,
                    moe: str | None = None, startup: str | None = None) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    lines = [
        "=" * 100,
        f"llamafactory_mca: training {model_type} ({params_total / 1e6:,.1f}M parameters) on {layout.world_size} x "
        f"{device}, {precision}",
        f"  layout      {layout.describe()}" + (", sequence parallel" if args.sequence_parallel else ""),
        f"  batch       global {layout.global_batch_size} = dp {layout.dp} x micro batch {layout.micro_batch_size}"
        f" x grad accumulation {layout.grad_accum}"
        + (f"; ~{tokens_per_step:,} tokens per step" if tokens_per_step else "")
        + (" (packed)" if packed else " (rows without padding)" if args.run_padding_free()
           else " (padded to the longest row)"),
        f"  steps       {steps}; lr {args.learning_rate:g} ({schedule}), warmup "
        f"{args.get_warmup_steps(steps)}, weight decay {args.weight_decay:g}, max grad norm {args.max_grad_norm:g}",
        f"  kernels     {kernels}",
        *([f"  MoE         {moe}"] if moe else []),
        *([f"  tuning      {tuning}"] if tuning else []),
        f"  optimizer   {args.optimizer}{' (distributed)' if args.use_distributed_optimizer else ''}"
        f"{', overlap grad reduce' if args.overlap_grad_reduce else ''}"
        f"{', overlap param gather' if args.overlap_param_gather else ''}"
        f"{', CPU offload' if args.optimizer_cpu_offload else ''}"
        f"{', fp32 masters as bf16 + 16-bit remainders' if getattr(args, 'store_param_remainders', False) else ''}",
        f"  recompute   {args.recompute_granularity or 'off'}"
        + (f" ({args.recompute_method}, {args.recompute_num_layers} layers)" if args.recompute_granularity == "full"
           else f" ({', '.join(args.recompute_modules or ['core_attn'])})" if args.recompute_granularity else ""),
        f"  parameters  {params_on_rank / 1e6:,.1f}M on this rank: weights {memory['weights']:.2f}, grads "
        f"{memory['grads']:.2f}, optimizer {memory['optimizer']:.2f} GiB",
        *([f"  memory      predicted peak per GPU {planned['peak']:.2f} GiB (largest stage: activations "
           f"{planned['activations']:.2f}, logits {planned['logits']:.2f}; {planned['needs']:.2f} GiB with the "
           "allocator's headroom; `llamafactory-mca plan` has the breakdown)"] if planned else []),
        f"  {data_stats}",
        *([f"  startup     {startup}"] if startup else []),
        "=" * 100,
    ]
    return "\n".join(lines)
