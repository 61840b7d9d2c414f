"""``llamafactory-mca plan RECIPE.yaml [key=value ...] [--gpus N] [--gpu-memory GIB] [--json]``.

The recipe is read as training reads it (LLaMA-Factory's parser with our keys, hub ids resolved, the same plan and
checks), but only the model's config.json is opened: no weights, no GPU, no process group.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

import torch

from ..errors import UserError, user_errors
from ..models.cost import peak_flops
from ..parallel import min_world_size
from ..planner.advice import GPU_COUNTS, change_for_gpus, cheapest_changes
from ..planner.check import TERMS, training_of, visible_gpu_memory_gib
from ..planner.memory import estimate
from ..planner.search import DEFAULT_PEAK, predicted_tokens_per_s, search
from ..quiet import quiet_third_party
from ..tools import flags
from .plugin import install


def _options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    options, rest = flags.plan().parse_known_args(argv)
    if options.gpus is not None and options.gpus < 1:
        raise UserError(f"--gpus {options.gpus}: give the number of GPUs to plan for, 1 or more.")
    if options.gpu_memory is not None and options.gpu_memory <= 0:
        raise UserError(f"--gpu-memory {options.gpu_memory:g}: give each GPU's memory in GiB, e.g. --gpu-memory 80.")
    return options, rest


def _gpu() -> tuple[float | None, float, str, int]:
    """(memory GiB of the smallest GPU or None, bf16 peak FLOP/s, its name, how many): an H100's peak without one.
    The memory is the launcher's reading (``planner.check.visible_gpu_memory_gib``), so a plan and the launcher's
    check weigh a recipe against the same size."""
    if torch.cuda.is_available():
        return (visible_gpu_memory_gib(), peak_flops() or DEFAULT_PEAK, torch.cuda.get_device_name(0),
                torch.cuda.device_count())
    return None, DEFAULT_PEAK, "no GPU visible (speed as on an H100)", 0


_HARDWARE = re.compile(r"#\s*Hardware:.*?(\d+)\s*x\s*(?:\w+\s*\()?(\d+)\s*GB", re.IGNORECASE)


def recipe_hardware(path: str) -> tuple[int, float] | None:
    """(GPUs, GiB each) from a recipe's ``# Hardware: ... N x M GB`` header line, as our recipes state it."""
    try:
        with open(path, encoding="utf-8") as f:
            head = "".join(line for line in f if line.startswith("#"))
    except OSError:
        return None
    match = _HARDWARE.search(head)
    return (int(match.group(1)), float(match.group(2))) if match else None


def own_world(smallest: int, gpus_asked: int | None, gpus_visible: int,
              hardware: tuple[int, float] | None) -> tuple[int, str]:
    """The world the recipe's own layout is planned for, and why: --gpus where the layout takes it (else --gpus is
    only searched, with the global batch of the recipe's own world), the launch's NPROC_PER_NODE x NNODES, the
    visible GPUs, the recipe's Hardware line, or the smallest world its layout takes."""
    launch = 0
    if os.environ.get("NPROC_PER_NODE", "").isdigit():
        launch = int(os.environ["NPROC_PER_NODE"]) * int(os.environ.get("NNODES", "1") or 1)
    for count, whose in ((gpus_asked, "--gpus"), (launch, "NPROC_PER_NODE x NNODES"),
                         (gpus_visible, "the visible GPUs"),
                         (hardware[0] if hardware else 0, "the recipe's Hardware line")):
        if count and count % smallest == 0:
            return count, whose
    return smallest, "the smallest world its layout takes"


def plan_command(argv: list[str]) -> dict[str, Any]:
    """The estimate (and the search) as a dict; prints the human-readable lines."""
    # LLaMA-Factory's parser, through the launcher's own recipe reading so that a plan reads exactly what training
    # would: imported only now, after main() has installed our hook (its argument classes are chosen at import)
    from ..plan import plan_run
    from .preflight import check_keys, parse, read_recipe

    options, rest = _options(argv)
    recipe = read_recipe(rest)
    check_keys(recipe, rest[0])
    model_args, data_args, training_args, finetuning_args, _ = parse(recipe)
    smallest = min_world_size(training_args)
    visible, peak, gpu_name, gpus_visible = _gpu()
    hardware = recipe_hardware(rest[0])
    world, whose = own_world(smallest, options.gpus, gpus_visible, hardware)
    plan = plan_run(finetuning_args.stage, model_args, data_args, training_args, finetuning_args, world, recipe)
    training = training_of(plan, training_args, finetuning_args)
    memory = estimate(plan.config, plan.layout, training)
    budget = options.gpu_memory or visible or (hardware[1] if hardware else None)
    fits = None if budget is None else memory["needs"] <= budget
    layout = plan.layout
    speed = predicted_tokens_per_s(plan.config, layout, training, peak)
    result: dict[str, Any] = {
        "layout": layout.describe(), "global_batch": layout.global_batch_size, "tokens_per_row": training.tokens,
        "peak_gib": memory["peak"], "needs_gib": memory["needs"], "gpu_memory_gib": budget, "fits": fits,
        "breakdown": {k: memory[k] for k in TERMS}, "tokens_per_s_per_gpu": round(speed), "gpu": gpu_name}
    print(f"{rest[0]}: {plan.config.hf_model_type} on {world} GPU(s) ({whose}), {layout.describe()}, global batch "
          f"{layout.global_batch_size} "
          f"= dp {layout.dp} x micro-batch {layout.micro_batch_size} x accumulation {layout.grad_accum}, "
          f"{training.tokens} tokens per row{', recompute ' + training.recompute if training.recompute else ''}")
    print("per GPU (the largest pipeline stage): " + ", ".join(f"{k} {memory[k]:.2f}" for k in TERMS)
          + f" GiB; peak {memory['peak']:.2f} GiB allocated, {memory['needs']:.2f} GiB with the allocator's headroom "
          "and the CUDA context")
    if fits is None:
        print("fits: unknown (no GPU visible; pass --gpu-memory GIB)")
    else:
        biggest = max(TERMS, key=lambda k: memory[k])
        print(f"fits {budget:g} GiB: {'yes' if fits else 'no'}" + ("" if fits else f" (the biggest term: {biggest})")
              + f"; predicted {speed:,.0f} tokens/s/GPU on {gpu_name}")
        if not fits:
            result["changes"] = cheapest_changes(plan.config, layout, training, budget, peak)
            for change in result["changes"] or [f"nothing found up to {GPU_COUNTS[-1]} GPUs"]:
                print(f"  would fit: {change}")
    if options.gpus:
        if budget is None:
            raise UserError("--gpus searches the layouts that fit, and no GPU is visible: pass --gpu-memory GIB too.")
        found, refused = search(plan.config, options.gpus, layout.global_batch_size, training, budget, peak)
        result["layouts"] = [{"keys": c.keys, "peak_gib": c.memory["peak"], "needs_gib": c.memory["needs"],
                              "tokens_per_s_per_gpu": round(c.tokens_per_s)} for c in found[:options.top]]
        result["refused"] = refused
        print(f"\nlayouts of global batch {layout.global_batch_size} on {options.gpus} GPU(s) of {budget:g} GiB that "
              f"fit ({len(found)}), best first:")
        for c in found[:options.top]:
            keys = ", ".join(f"{k}: {v}" for k, v in c.keys.items())
            print(f"  {c.tokens_per_s:>9,.0f} tokens/s/GPU  {c.memory['needs']:5.1f} GiB  {keys}")
        for reason, count in refused.items():
            print(f"  not proposed ({count}): {reason}")
        if not found:
            result["change"] = change_for_gpus(plan.config, options.gpus, layout.global_batch_size, training, budget,
                                               peak)
            print(f"  would fit: {result['change'] or 'no change tried (recompute, remainders, CPU offload, LoRA)'}")
    return result


def main(argv: list[str]) -> int:
    if not argv:
        print(flags.plan().format_help())
        return 0
    os.environ["USE_MCA"] = "1"
    install()
    quiet_third_party()
    with user_errors(also=(ValueError,)):
        result = plan_command(argv)
    if "--json" in argv:
        sys.stdout.flush()
        print(json.dumps(result))
    return 0
