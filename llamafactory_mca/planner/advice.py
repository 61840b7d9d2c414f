"""When a recipe does not fit: the cheapest changes that would, each with what it costs.

Asked by ``llamafactory-mca plan`` and by the launcher's memory check. The changes keep the model and the global
batch; they are tried cheapest first: the 16-bit remainders of the fp32 weights cost a few percent of speed and nothing
else, Adam's moments in bf16 no speed but the moments' precision (one H200, the MoE benchmark: 2-3% faster), recompute
about a fifth of the speed, the optimizer on the CPU host memory and more speed (and the two before it), LoRA changes
what trains; then the smallest number of GPUs on which the layout search finds a layout that fits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..parallel import ParallelLayout
from .memory import Training, estimate
from .search import search


GPU_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256)
LORA_RANK = 16  # LLaMA-Factory's examples' rank


def _changes(training: Training, config: Any) -> list[tuple[str, dict[str, Any]]]:
    """(the recipe keys to set, the Training fields they change), cheapest first; each adds to the ones before it
    that still apply (``_together``), so the last is all of them that can go together; full recompute only where it
    trains the model right."""
    steps = []
    fp32_states = {"param_remainders": False, "moment_bytes": 8}  # what the CPU-offloaded and LoRA optimizers keep
    if training.half and not training.param_remainders and training.lora_rank is None:
        steps.append(("store_param_remainders: true", {"param_remainders": True}))
    if training.half and training.moment_bytes > 4 and training.lora_rank is None:
        steps.append(("store_param_remainders: true, exp_avg_dtype: bf16, exp_avg_sq_dtype: bf16",
                      {"param_remainders": True, "moment_bytes": 4}))
    if training.recompute != "full" and config.recomputes_whole_layers:
        steps.append(("recompute_granularity: full", {"recompute": "full"}))
    if not training.cpu_offload and training.lora_rank is None:
        steps.append(("optimizer_cpu_offload: true", {"cpu_offload": True, **fp32_states}))
    if training.lora_rank is None:
        steps.append((f"finetuning_type: lora (lora_rank: {LORA_RANK})",
                      {"lora_rank": LORA_RANK, "cpu_offload": False, **fp32_states}))
    return steps


def _together(steps: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """The steps taken together: the later ones' fields win, and a step whose fields a later one undid is not named
    (the remainders under the CPU-offloaded optimizer, say)."""
    fields: dict[str, Any] = {}
    for _, changed in steps:
        fields.update(changed)
    names = [name for name, changed in steps if all(fields[k] == v for k, v in changed.items())]
    names = [name for i, name in enumerate(names) if not any(name in later for later in names[i + 1:])]
    return " + ".join(names), fields


def cheapest_changes(config: Any, layout: ParallelLayout, training: Training, budget: float,
                     peak_flops: float) -> list[str]:
    """What would fit ``budget`` GiB per GPU: the first change (alone, then together with the cheaper ones) that
    fits in this layout, and the fewest GPUs on which some layout of the same global batch fits as the recipe is."""
    found: list[str] = []
    steps = _changes(training, config)
    for i, (name, fields) in enumerate(steps):
        alone = estimate(config, layout, dataclasses.replace(training, **fields))
        names, together = _together(steps[:i + 1])
        combined = estimate(config, layout, dataclasses.replace(training, **together))
        if alone["needs"] <= budget:
            found.append(f"{name} ({alone['needs']:.1f} GiB)")
            break
        if combined["needs"] <= budget:
            found.append(f"{names} ({combined['needs']:.1f} GiB)")
            break
    for gpus in (n for n in GPU_COUNTS if n > layout.world_size):
        fits, _ = search(config, gpus, layout.global_batch_size, training, budget, peak_flops)
        if fits:
            keys = ", ".join(f"{k}: {v}" for k, v in fits[0].keys.items())
            found.append(f"{gpus} GPUs with {keys} ({fits[0].memory['needs']:.1f} GiB)")
            break
    return found


def change_for_gpus(config: Any, gpus: int, global_batch: int, training: Training, budget: float,
                    peak_flops: float) -> str | None:
    """When no layout of the recipe fits ``gpus`` GPUs: the cheapest change (with the ones before it) under which
    the search finds one, and that layout."""
    steps = _changes(training, config)
    for i in range(len(steps)):
        names, together = _together(steps[:i + 1])
        fits, _ = search(config, gpus, global_batch, dataclasses.replace(training, **together), budget, peak_flops)
        if fits:
            keys = ", ".join(f"{k}: {v}" for k, v in fits[0].keys.items())
            return f"{names} with {keys} ({fits[0].memory['needs']:.1f} GiB)"
    return None
