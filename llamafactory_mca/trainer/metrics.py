"""Numbers for people: the startup summary and the GPU's memory peaks (FLOPs and parameter counts: ``models/cost.py``;
the memory estimate: ``planner/memory.py``)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch._dynamo.utils import calculate_time_spent, get_compilation_metrics  # private: torch's only count

from ..parallel import ParallelLayout


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


def gpu_memory_gib() -> tuple[float, float]:
    """(peak allocated, peak reserved) since the last reset, in GiB; zeros on CPU."""
    if not torch.cuda.is_available():
        return 0.0, 0.0
    return torch.cuda.max_memory_allocated() / 1024**3, torch.cuda.max_memory_reserved() / 1024**3


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (forward and backward graphs): what a cold compile
    cache adds to step 1."""
    return calculate_time_spent().get("total_wall_time", 0.0)


def compile_records() -> list[str]:
    """One line per graph torch.compile built in this process (forward and backward), slowest first: which kernels a
    cold compile cache costs (shown with LLAMAFACTORY_MCA_DEBUG=1)."""
    lines = []
    for m in get_compilation_metrics():
        us = m.backward_cumulative_compile_time_us if m.is_forward is False else None
        seconds = us / 1e6 if us is not None else (m.entire_frame_compile_time_s or 0.0)
        if seconds >= 0.005:  # (torch also records cache hits and runtime events, at no cost)
            where = f"{m.co_name} ({os.path.basename(m.co_filename or '?')})" if m.co_name else "(a backward graph)"
            lines.append((seconds, f"{seconds:6.2f} s  {where}"))
    return [line for _, line in sorted(lines, reverse=True)]


_TRITON_COMPILES: list[tuple[float, str, bool]] = []  # (seconds, kernel, loaded from Triton's cache)


def record_triton_compiles() -> None:
    """From here on, note each of our Triton kernels this process compiles (or finds in Triton's cache): on a fresh
    machine they are most of what step 1 compiles (torch.compile's own graphs are counted by torch)."""
    try:
        from triton import knobs  # lazy: torch's CPU wheels come without Triton
    except ImportError:
        return

    def listen(*, src: Any, times: Any, cache_hit: bool, **_: Any) -> None:
        module = getattr(getattr(src, "fn", None), "module", "") or ""
        if module.startswith("llamafactory_mca."):
            name = f"{module.rsplit('.', 1)[-1]}.{getattr(src, 'name', '?')}"
            _TRITON_COMPILES.append((getattr(times, "total", 0) / 1e6, name, cache_hit))

    knobs.compilation.listener = listen


def triton_compiles() -> tuple[float, int, int]:
    """(seconds compiling, kernels compiled, kernels found in Triton's cache) of ours so far."""
    built = [seconds for seconds, _, hit in _TRITON_COMPILES if not hit]
    return sum(built), len(built), len(_TRITON_COMPILES) - len(built)


def triton_records() -> list[str]:
    """One line per Triton kernel of ours compiled or loaded, slowest first (shown with LLAMAFACTORY_MCA_DEBUG=1)."""
    return [f"{seconds:6.2f} s  {name}" + (" (Triton's cache)" if hit else "")
            for seconds, name, hit in sorted(_TRITON_COMPILES, reverse=True)]


def startup_summary(*, layout: ParallelLayout, args: Any, packed: bool, padding_free: bool, model_type: str,
                    params_total: int, params_on_rank: int, kernels: str, tokens_per_step: int | None, steps: int,
                    data_stats: str, planned: dict[str, float], tuning: str | None = None, moe: str | None = None,
                    startup: str | None = None, merge: str = "") -> str:
    """``planned``: the planner's estimate (``planner.memory.estimate``), the one place memory is priced; ``merge``:
    why the micro-batch is larger than the recipe's (``planner.micro_batches``)."""
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
        + (" (packed)" if packed else " (rows without padding)" if padding_free
           else " (padded to the longest row)") + (f"; {merge}" if merge else ""),
        f"  steps       {steps}; lr {args.learning_rate:g} ({schedule}), warmup "
        f"{args.get_warmup_steps(steps)}, weight decay {args.weight_decay:g}, max grad norm {args.max_grad_norm:g}",
        f"  kernels     {kernels}",
        *([f"  MoE         {moe}"] if moe else []),
        *([f"  tuning      {tuning}"] if tuning else []),
        f"  optimizer   {args.optimizer}{' (distributed)' if args.use_distributed_optimizer else ''}"
        f"{', overlap grad reduce' if args.overlap_grad_reduce else ''}"
        f"{', overlap param gather' if args.overlap_param_gather else ''}"
        f"{', CPU offload' if args.optimizer_cpu_offload else ''}"
        f"{', fp32 masters as bf16 + 16-bit remainders' if getattr(args, 'store_param_remainders', False) else ''}"
        f"{_moments(args)}",
        f"  recompute   {args.recompute_granularity or 'off'}"
        + (f" ({args.recompute_method}, {args.recompute_num_layers} layers)" if args.recompute_granularity == "full"
           else f" ({', '.join(args.recompute_modules or ['core_attn'])})" if args.recompute_granularity else ""),
        f"  parameters  {params_on_rank / 1e6:,.1f}M on this rank",
        f"  memory      predicted peak per GPU {planned['peak']:.2f} GiB (largest stage: weights "
        f"{planned['weights']:.2f}, grads {planned['grads']:.2f}, optimizer {planned['optimizer']:.2f}, activations "
        f"{planned['activations']:.2f}, logits {planned['logits']:.2f}; {planned['needs']:.2f} GiB with the "
        "allocator's headroom; `llamafactory-mca plan` has the breakdown)",
        f"  {data_stats}",
        *([f"  startup     {startup}"] if startup else []),
        "=" * 100,
    ]
    return "\n".join(lines)


def _moments(args: Any) -> str:
    kept = {key: getattr(args, f"{key}_dtype", "fp32") for key in ("exp_avg", "exp_avg_sq")}
    narrow = [f"{key} {dtype}" for key, dtype in kept.items() if dtype != "fp32"]
    return f", moments {' and '.join(narrow)} (one-pass step)" if narrow else ""
