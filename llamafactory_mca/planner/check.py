"""The launcher's memory check: a recipe predicted not to fit the GPUs it is about to start on is refused before any
worker starts, naming the biggest term and the first change of the layout search that fits.

The GPUs' size comes from ``nvidia-smi`` (the launcher must not open a CUDA context) or from
``LLAMAFACTORY_MCA_GPU_MEMORY`` (GiB; also how CPU tests exercise it); ``LLAMAFACTORY_MCA_SKIP_MEMORY_CHECK=1`` trusts
the recipe instead, for the cases the estimate does not know (far more image tokens than it assumes, very uneven
packs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Protocol

from ..compat import has_transformer_engine
from ..errors import UserError
from ..models.config import McaConfig
from ..models.native.fp8 import FIELDS, Fp8Training, from_fields
from ..parallel import ParallelLayout
from .advice import cheapest_changes
from .memory import Training, estimate, moment_bytes
from .search import DEFAULT_PEAK, search


MEMORY_ENV = "LLAMAFACTORY_MCA_GPU_MEMORY"
SKIP_ENV = "LLAMAFACTORY_MCA_SKIP_MEMORY_CHECK"
TERMS = ("weights", "grads", "optimizer", "activations", "logits")


class Planned(Protocol):
    """What the fit check reads of a run's plan (``plan.RunPlan``, which asks this module: named by its fields)."""

    finetuning_type: str
    cutoff_len: int
    config: McaConfig
    layout: ParallelLayout


_ADVICE = {"weights": "more tensor or pipeline parallelism (or expert parallelism for the experts)",
           "grads": "more tensor or pipeline parallelism, or LoRA",
           "optimizer": "more GPUs under use_distributed_optimizer, or optimizer_cpu_offload: true",
           "activations": "recompute_granularity: full, a shorter cutoff_len, or context parallelism",
           "logits": "a shorter cutoff_len or tensor parallelism (the vocabulary is split over TP)"}


def training_of(plan: Planned, training_args: Any, finetuning_args: Any) -> Training:
    """What of the recipe, beside the layout, sizes the memory."""
    lora = plan.finetuning_type == "lora"
    target = ",".join(getattr(finetuning_args, "lora_target", None) or [])
    return Training(tokens=plan.cutoff_len, recompute=training_args.recompute_granularity,
                    recompute_modules=tuple(training_args.recompute_modules or ("core_attn",)),
                    sequence_parallel=bool(training_args.sequence_parallel),
                    distributed_optimizer=bool(training_args.use_distributed_optimizer),
                    cpu_offload=bool(training_args.optimizer_cpu_offload),
                    lora_rank=finetuning_args.lora_rank if lora else None, lora_experts=lora and "experts" in target,
                    native_cross_entropy=training_args.native_cross_entropy is not False,
                    chunked_cross_entropy=training_args.chunked_cross_entropy,
                    half=bool(training_args.bf16 or training_args.fp16),
                    param_remainders=bool(training_args.store_param_remainders),
                    overlap_param_gather=bool(training_args.overlap_param_gather),
                    moment_bytes=moment_bytes(training_args.exp_avg_dtype, training_args.exp_avg_sq_dtype),
                    cuda_graphs=bool(training_args.cuda_graphs),  # the recipe's, also planned on a CPU
                    freeze_vision_tower=bool(finetuning_args.freeze_vision_tower),
                    freeze_projector=bool(finetuning_args.freeze_multi_modal_projector),
                    fp8=fp8_of(training_args))


def fp8_of(training_args: Any) -> Fp8Training | None:
    """The run's FP8 settings from its keys, as the model build reads them (``native.fp8.from_fields``)."""
    if not getattr(training_args, "fp8", None) or has_transformer_engine():
        return None
    return from_fields({key: getattr(training_args, key) for key in FIELDS if getattr(training_args, key, None)
                        is not None})


def visible_gpu_memory_gib() -> float | None:
    """The smallest GPU's memory (GiB) on this node, or None where there is no GPU (or no nvidia-smi). The one reader
    of a GPU's size: the launcher's check, the plan command and LlamaBoard's summary all weigh a recipe against it."""
    if os.environ.get(MEMORY_ENV):
        return float(os.environ[MEMORY_ENV])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
        sizes = [float(line) for line in out.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) / 1024 if sizes else None


def memory_to_plan_for() -> float | None:
    """The GPUs' size where the estimate is to be trusted: None without GPUs or under ``SKIP_ENV``."""
    return None if os.environ.get(SKIP_ENV, "0") == "1" else visible_gpu_memory_gib()


def check_fits(plan: Planned, training_args: Any, finetuning_args: Any) -> dict[str, float] | None:
    """The estimate for this run; raises UserError when it does not fit the visible GPUs."""
    budget = memory_to_plan_for()
    if budget is None:
        return None
    training = training_of(plan, training_args, finetuning_args)
    memory = estimate(plan.config, plan.layout, training)
    if memory["needs"] <= budget:
        return memory
    biggest = max(TERMS, key=lambda k: memory[k])
    layout = plan.layout
    found, _ = search(plan.config, layout.world_size, layout.global_batch_size, training, budget, DEFAULT_PEAK)
    if found:
        keys = ", ".join(f"{k}: {v}" for k, v in found[0].keys.items())
        fix = f"On these {layout.world_size} GPU(s) this fits: {keys} (`llamafactory-mca plan` lists more)."
    else:
        changes = cheapest_changes(plan.config, layout, training, budget, DEFAULT_PEAK)
        fix = f"No layout of global batch {layout.global_batch_size} fits {layout.world_size} GPU(s); " + (
            f"this would: {'; or '.join(changes)}." if changes else
            f"{_ADVICE[biggest]}, or more GPUs (`llamafactory-mca plan RECIPE --gpus N`).")
    raise UserError(
        f"this run is predicted to need {memory['needs']:.1f} GiB per GPU and the GPUs have {budget:.0f} GiB "
        f"(the biggest term: {biggest} {memory[biggest]:.1f} GiB; " + ", ".join(
            f"{k} {memory[k]:.1f}" for k in TERMS if k != biggest) + f"). {fix} Set {SKIP_ENV}=1 to start anyway.")
