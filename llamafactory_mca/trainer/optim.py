"""Megatron's engine around the model chunks: DDP per chunk, the (distributed) optimizer, its step, the LR schedule.

The learning-rate schedule is any of Hugging Face's (``lr_scheduler_type`` by name, with warmup and
``lr_scheduler_kwargs``): an HF scheduler drives a one-parameter stand-in optimizer and its rate is
copied into Megatron's param groups each step (Megatron's groups carry ``lr_mult``/``wd_mult``;
biases and norms get ``wd_mult=0``), so LLaMA-Factory recipes keep their meaning.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.utils import get_pp_last_rank

from .graphs import MANAGER as _GRAPHS
from .param_remainders import MOMENT_DTYPES, megatron_builds_remainder_adam, precision_aware


def wrap_ddp(chunks: list[torch.nn.Module], tc: Any, args: Any) -> list[DistributedDataParallel]:
    """Megatron DDP per model chunk, and the sync hooks the pipeline schedule calls."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # the trainer checks, skips the step and counts (Megatron would abort)
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
    )
    wrapped = [
        DistributedDataParallel(tc, ddp_config, chunk, disable_bucketing=index > 0)  # like Megatron-LM for VPP
        for index, chunk in enumerate(chunks)
    ]
    single = len(wrapped) == 1
    tc.no_sync_func = wrapped[0].no_sync if single else [w.no_sync for w in wrapped]
    if args.overlap_grad_reduce and args.delay_grad_reduce:
        tc.grad_sync_func = wrapped[0].start_grad_sync if single else [w.start_grad_sync for w in wrapped]
    if args.overlap_param_gather:
        tc.param_sync_func = wrapped[0].start_param_sync if single else [w.start_param_sync for w in wrapped]
        for ddp in wrapped:
            _wait_for_adapters(ddp)
    tc.finalize_model_grads_func = finalize_model_grads  # OptimizerStep puts its own in its place
    return wrapped


def _wait_for_adapters(ddp: DistributedDataParallel) -> None:
    """Megatron's forward pre-hook makes a module wait for the all-gather of its own parameters (overlapped with the
    forward after each step); a LoRA layer's adapters are the parameters of its ``lora_A`` / ``lora_B`` children,
    which are never called, so the layer's own forward waits for them too. Without it a rank computed with the other
    ranks' adapter shards of the step before (and an interleaved pipeline's next step found the gather pending).

    Not inside a layer replayed as a CUDA graph: megatron-core's replay calls the DDP hook of every module in the
    layer, the adapters' included, and refuses a layer holding any other pre-hook. Such a layer runs eagerly only
    in the first step (no gather is pending yet) and in evaluations (``McaTrainer`` lands the gathers before)."""
    hook = ddp._make_forward_pre_hook()  # the one Megatron registers on every module (DDP.enable_forward_pre_hook)
    graphed = {id(m) for layer in ddp.module.modules() if _GRAPHS in layer._modules for m in layer.modules()}
    for module in ddp.module.modules():
        adapters = [child for name in ("lora_A", "lora_B")
                    if isinstance(child := module._modules.get(name), torch.nn.ParameterDict)]
        if adapters and id(module) not in graphed:
            module.register_forward_pre_hook(functools.partial(_wait_for, hook, tuple(adapters)))


def _wait_for(hook: Any, adapters: tuple[torch.nn.Module, ...], module: torch.nn.Module, args: tuple) -> None:
    for held in adapters:
        hook(held)


logger = logging.getLogger(__name__)


def build_optimizer(wrapped: list[DistributedDataParallel], tc: Any, args: Any):
    offload = args.optimizer_cpu_offload and torch.cuda.is_available()
    if args.optimizer_cpu_offload and not offload:  # Megatron's hybrid optimizer maps GPU params to CPU copies
        logger.info("optimizer_cpu_offload=True turned off: this run is on the CPU, where the optimizer states "
                    "already are.")
    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.learning_rate,
        min_lr=0.0,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_epsilon,
        clip_grad=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else 0.0,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=tc.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=1.0 if offload else 0.0,
    )
    if args.store_param_remainders:
        precision_aware(config, *(MOMENT_DTYPES[getattr(args, key)] for key in ("exp_avg_dtype", "exp_avg_sq_dtype")))
        with megatron_builds_remainder_adam():
            optimizer = get_megatron_optimizer(config, wrapped)
    else:
        optimizer = get_megatron_optimizer(config, wrapped)
    use_fused_adam(optimizer)
    if args.fp16:
        tc.grad_scale_func = optimizer.scale_loss
    return optimizer


class OptimizerStep:
    """Megatron's optimizer step, with the per-token loss's division and the gradient clipping done inside Adam.

    With ``calculate_per_token_loss`` Megatron's ``finalize_model_grads`` multiplies every gradient by 1 / (the
    step's loss tokens), and clipping multiplies them again by the clip coefficient: two passes over all gradients
    in fp32 (28 ms of a 656 ms step on the 8-layer MoE benchmark). torch's fused AdamW divides each gradient by its
    ``grad_scale`` as it reads it (the hook AMP's GradScaler uses; it also writes the divided gradient back, which
    makes Adam's pass 8 ms longer there), so both factors become one scalar: the norm is taken of the unscaled
    gradients and scaled (a norm is homogeneous), the coefficient follows from it as Megatron computes it, and Adam
    reads ``g / (tokens / coeff)``.
    Where an inner optimizer is not torch's fused AdamW (the remainders' Adam, the CPU-offloading one) the
    gradients are scaled first and Megatron's own step runs, as before.
    """

    def __init__(self, optimizer: Any, wrapped: list[DistributedDataParallel], tc: Any) -> None:
        self.optimizer = optimizer
        self.wrapped = wrapped
        # the config keeps only the counter: a method of this object there would tie the model (through the config)
        # to the optimizer and DDP in a cycle that only the garbage collector breaks, holding a finished layout's
        # process groups for longer
        self.tokens = _StepTokens()
        tc.finalize_model_grads_func = self.tokens.finalize_model_grads

    def step(self) -> tuple[bool, float | None]:
        """(whether the parameters were updated, the gradient norm as Megatron reports it)."""
        tokens, self.tokens.count = self.tokens.count, None
        count = float(tokens) if tokens is not None else 0.0  # Megatron's `if num_tokens > 0` syncs here too
        scale = 1.0 / count if count > 0 else 1.0
        adams = _fused_adams(self.optimizer)
        if adams is None:
            if scale != 1.0:
                for chunk in self.wrapped:
                    chunk.scale_gradients(scale)
            ok, grad_norm, _ = self.optimizer.step()
            return ok, grad_norm
        if self.optimizer.prepare_grads():  # fp16's inf/nan check
            return False, None
        grad_norm = float(self.optimizer.get_grad_norm()) * scale
        clip = self.optimizer.config.clip_grad
        coeff = min(1.0, clip / (grad_norm + 1.0e-6)) if clip > 0 else 1.0  # clip_grad_by_total_norm_fp32's
        divisor = torch.tensor(1.0 / (scale * coeff), dtype=torch.float32)
        for adam in adams:
            adam.grad_scale = divisor
        try:
            ok = self.optimizer.step_with_ready_grads()
        finally:
            for adam in adams:
                adam.grad_scale = None
        return ok, grad_norm

    def rewrite_weights(self) -> None:
        """The 16-bit weights written again from the fp32 main weights, as an update writes them, without one: after
        a step that did not update, where FP8 lent those weights' memory to its casts (``fp8.casts_take_weights``)."""
        for inner in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            inner._copy_main_params_to_model_params()  # megatron-core's, as its step_with_ready_grads calls it
        for chunk in self.wrapped:  # the other data-parallel ranks' shards
            if chunk.ddp_config.use_distributed_optimizer:
                chunk.start_param_sync(force_sync=True)


class _StepTokens:
    """The step's loss tokens, from Megatron's finalize to the optimizer step."""

    def __init__(self) -> None:
        self.count: torch.Tensor | None = None

    def finalize_model_grads(self, model: list, num_tokens: torch.Tensor | None = None, pg_collection: Any = None,
                             force_all_reduce: bool = False) -> None:
        """Megatron's, but the step's token count is kept for the step instead of applied to the gradients (the
        count summed as Megatron sums it: from the last pipeline stage, over data and context parallel ranks)."""
        finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        self.count = None
        if num_tokens is not None:
            pp = pg_collection.pp if pg_collection is not None else parallel_state.get_pipeline_model_parallel_group()
            dp_cp = (pg_collection.dp_cp if pg_collection is not None
                     else parallel_state.get_data_parallel_group(with_context_parallel=True))
            torch.distributed.broadcast(num_tokens, src=get_pp_last_rank(pp), group=pp)
            torch.distributed.all_reduce(num_tokens, group=dp_cp)
            self.count = num_tokens


def _fused_adams(optimizer: Any) -> list[torch.optim.AdamW] | None:
    """The inner optimizers when each one with parameters is torch's AdamW with every group fused, else None."""
    adams = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        inner = getattr(opt, "optimizer", None)
        if type(inner) is not torch.optim.AdamW or not all(g.get("fused") for g in inner.param_groups):
            return None
        adams.append(inner)
    return adams or None


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (chained) optimizer wrappers."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer)]


def use_fused_adam(optimizer: Any) -> None:
    """Run torch's AdamW as its fused kernel where Megatron fell back to the default implementation.

    Without Transformer Engine or apex, megatron-core builds ``torch.optim.AdamW`` with torch's default
    ``foreach`` implementation, which allocates full-size temporaries over all parameters at once in every
    step (at least the fp32 square root of the second moments: 4 bytes per parameter, 21 GiB for the 5.6B
    parameters of our MoE benchmark, on top of the 18 bytes per parameter of the state itself) and makes
    several passes over memory. The fused kernel updates in place in one pass, and takes the gradients'
    scale (``OptimizerStep``). torch has it for CUDA and CPU tensors, so CPU runs take the same path. Also
    called after a checkpoint load (a loaded param group brings the flags it was saved with), and moves step
    counters to where the chosen implementation keeps them.
    """
    for inner in inner_optimizers(optimizer):
        if type(inner) is not torch.optim.AdamW:
            continue
        for group in inner.param_groups:
            fusable = all(p.device.type in ("cuda", "cpu") and p.dtype in (torch.float32, torch.bfloat16,
                                                                              torch.float16)
                          for p in group["params"])
            group.update(fused=True if fusable else None, foreach=False if fusable else None)
            for param in group["params"]:
                state = inner.state.get(param)
                if state and "step" in state:
                    state["step"] = step_counter(group, float(state["step"]))


def step_counter(group: dict, value: float) -> torch.Tensor:
    """Adam's step counter as torch's AdamW keeps it: a device tensor for the fused kernel, else a CPU scalar."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(value), dtype=torch.float32, device=group["params"][0].device)
    return torch.tensor(float(value))


class LRSchedule:
    """A Hugging Face scheduler by name, applied to Megatron's param groups."""

    def __init__(self, optimizer: Any, args: Any, num_training_steps: int) -> None:
        from transformers import get_scheduler  # here: transformers takes seconds to import

        self.optimizer = optimizer
        self.base_lr = args.learning_rate
        self.weight_decay = args.weight_decay
        self._stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self.base_lr)
        self.scheduler = get_scheduler(
            args.lr_scheduler_type, self._stand_in,
            num_warmup_steps=args.get_warmup_steps(num_training_steps),
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs or {}),
        )
        self.apply()

    @property
    def lr(self) -> float:
        return self._stand_in.param_groups[0]["lr"]

    def apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def step(self) -> None:
        self._stand_in.step()  # a no-op (no gradients) that keeps torch's "scheduler before optimizer" check quiet
        self.scheduler.step()
        self.apply()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        self._stand_in.param_groups[0]["lr"] = self.scheduler.get_last_lr()[0]
        self.apply()
