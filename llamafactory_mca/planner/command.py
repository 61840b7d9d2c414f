"""``llamafactory-mca plan RECIPE.yaml [key=value ...] [--gpus N] [--gpu-memory GIB] [--json]``.

The recipe is read as training reads it (LLaMA-Factory's parser with our keys, hub ids resolved, the same plan and
checks), but only the model's config.json is opened: no weights, no GPU, no process group.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..errors import UserError, user_errors
from .check import TERMS, training_of
from .memory import estimate
from .search import DEFAULT_PEAK, predicted_tokens_per_s, search

USAGE = """usage: llamafactory-mca plan RECIPE.yaml [key=value ...] [--gpus N] [--gpu-memory GIB] [--json]

What the recipe needs per GPU (weights, gradients, optimizer states, activations, logits) in its own layout, and
whether it fits --gpu-memory (default: the visible GPU's). With --gpus N: the layouts of the same global batch that
fit N GPUs, best first, with the keys to paste. --json: one JSON object as the last line.
"""


def _options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="llamafactory-mca plan", usage=USAGE.split("\n")[0].removeprefix("usage: "),
                                     add_help=False)
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument("--gpu-memory", type=float, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--top", type=int, default=5)
    options, rest = parser.parse_known_args(argv)
    if options.gpus is not None and options.gpus < 1:
        raise UserError(f"--gpus {options.gpus}: give the number of GPUs to plan for, 1 or more.")
    if options.gpu_memory is not None and options.gpu_memory <= 0:
        raise UserError(f"--gpu-memory {options.gpu_memory:g}: give each GPU's memory in GiB, e.g. --gpu-memory 80.")
    return options, rest


def _gpu() -> tuple[float | None, float, str]:
    """(memory GiB of the visible GPU or None, bf16 peak FLOP/s, its name): an H100's peak without one."""
    import torch

    from ..trainer.metrics import peak_flops

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / 1024**3, peak_flops() or DEFAULT_PEAK, props.name
    return None, DEFAULT_PEAK, "no GPU visible (speed as on an H100)"


def plan_command(argv: list[str]) -> dict[str, Any]:
    """The estimate (and the search) as a dict; prints the human-readable lines."""
    # LLaMA-Factory's parser, through the launcher's own recipe reading so that a plan reads exactly what training
    # would: imported only now, after main() has installed our hook (its argument classes are chosen at import)
    from ..launch.preflight import check_keys, parse, read_recipe
    from ..plan import plan_run
    from ..parallel import min_world_size

    options, rest = _options(argv)
    recipe = read_recipe(rest)
    check_keys(recipe, rest[0])
    model_args, data_args, training_args, finetuning_args, _ = parse(recipe)
    world = options.gpus or min_world_size(
        training_args.tensor_model_parallel_size, training_args.pipeline_model_parallel_size,
        training_args.context_parallel_size, training_args.expert_model_parallel_size,
        training_args.expert_tensor_parallel_size or 1)
    plan = plan_run(finetuning_args.stage, model_args, data_args, training_args, finetuning_args, world, recipe)
    training = training_of(plan, training_args, finetuning_args)
    memory = estimate(plan.config, plan.layout, training)
    visible, peak, gpu_name = _gpu()
    budget = options.gpu_memory or visible
    fits = None if budget is None else memory["needs"] <= budget
    layout = plan.layout
    speed = predicted_tokens_per_s(plan.config, layout, training, peak)
    result: dict[str, Any] = {
        "layout": layout.describe(), "global_batch": layout.global_batch_size, "tokens_per_row": training.tokens,
        "peak_gib": memory["peak"], "needs_gib": memory["needs"], "gpu_memory_gib": budget, "fits": fits,
        "breakdown": {k: memory[k] for k in TERMS}, "tokens_per_s_per_gpu": round(speed), "gpu": gpu_name}
    print(f"{rest[0]}: {plan.config.hf_model_type}, {layout.describe()}, global batch {layout.global_batch_size} "
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
    return result


def main(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    os.environ["USE_MCA"] = "1"
    from ..launch.plugin import install
    from ..quiet import quiet_third_party

    install()
    quiet_third_party()
    with user_errors(also=(ValueError,)):
        result = plan_command(argv)
    if "--json" in argv:
        sys.stdout.flush()
        print(json.dumps(result))
    return 0
