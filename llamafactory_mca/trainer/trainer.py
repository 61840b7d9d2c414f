"""McaTrainer: the Hugging Face Trainer's lifecycle around Megatron-Core's engine.

What stays Hugging Face's: ``TrainerState``/``TrainerControl``, the callback protocol (LLaMA-Factory's
LogCallback writes ``trainer_log.jsonl`` from ``on_log``), ``DefaultFlowCallback`` deciding when to log,
save and evaluate, the LR schedulers by name, ``log_metrics``/``save_metrics``/``save_state``.
What is Megatron's: one model chunk per virtual pipeline stage, DDP per chunk, the (distributed)
optimizer, ``get_forward_backward_func`` with ``num_microbatches = gradient_accumulation_steps``.
This class only connects them; the step, loss, checkpoint and metrics live in their own modules.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
import warnings
from contextlib import nullcontext
from functools import partial
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    reduce_aux_losses_tracker_across_ranks,
)
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback
from transformers.trainer_pt_utils import log_metrics, metrics_format, save_metrics, save_state
from transformers.trainer_utils import TrainOutput

from .. import checkpoints, memory_report, watchdog
from ..checkpoints import SideFiles, checkpoint_path, is_adapter_checkpoint, resolve_resume
from ..data.loader import nothing_left
from ..errors import UserError, debug_enabled
from ..models.auto import AutoModel
from ..models.cost import flops_per_sequence_set, peak_flops
from ..models.export import export_hf
from ..models.lora.layers import set_lora_enabled
from ..models.lora.peft_io import export_adapter
from ..models.native.fp8 import casts_take_weights
from ..parallel import ParallelLayout
from . import checkpoint as ckpt
from .faults import maybe_crash, maybe_hang, nan_loss
from .feeder import StepFeeder
from .graphs import capture_seconds, eager_layers, time_capture
from .loss import PreferenceConfig, collect_pair_logps, lm_loss, preference_loss, reward_loss
from .metrics import (
    compile_records,
    compile_seconds,
    gpu_memory_gib,
    record_triton_compiles,
    triton_compiles,
    triton_records,
)
from .optim import LRSchedule, OptimizerStep, build_optimizer, wrap_ddp
from .progress import ProgressCallback, forget_logs_after
from .reporting import ReportedModel, reporting_callbacks


logger = logging.getLogger(__name__)


def _reduce_logged(outputs: list[dict], device) -> dict[str, float]:
    """Sum [value, count] pairs over micro-batches and over the world (one contributor per TP group)."""
    names = sorted({k for out in outputs for k in out if not k.startswith("_")})
    # every rank must take part with the same keys: agree on them first
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, names)
    names = sorted({k for ks in gathered for k in ks})
    totals = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    if ps.get_tensor_model_parallel_rank() == 0:
        for out in outputs:
            for i, name in enumerate(names):
                if name in out:
                    totals[i] += out[name].to(device=device, dtype=torch.float64)
    torch.distributed.all_reduce(totals)
    reduced = {name: (totals[i, 0] / totals[i, 1]).item() if totals[i, 1] > 0 else float("nan")
               for i, name in enumerate(names)}
    if "rewards/chosen" in reduced and "rewards/margins" not in reduced:  # KTO's rows are not pairs: as trl logs it
        reduced["rewards/margins"] = reduced["rewards/chosen"] - reduced["rewards/rejected"]
    return reduced


def _drop_kept_graphs(chunks: list) -> None:
    """Forget tensors with autograd history that modules (or plain objects on them) kept from the last step.

    Megatron's all-to-all MoE dispatcher keeps the last micro-batch's routing probabilities on itself, graph and all:
    a cycle through autograd nodes (the router weight's gradient hook holds DDP, DDP the dispatcher) that Python's gc
    cannot see. A trained model, its optimizer and its process groups then outlive the trainer in a process that goes
    on to build another (tests, benchmarks), each gloo group with three threads: the layouts walk slowed case by case.
    """
    for chunk in chunks:
        for module in chunk.modules():
            holders = [module] + [v for v in vars(module).values()
                                  if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor))]
            for holder in holders:
                for name, value in list(vars(holder).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(holder, name, None)


class McaTrainer:
    def __init__(self, model: Any, args: Any, layout: ParallelLayout, train_data: Any, eval_data: Any = None,
                 tokenizer: Any = None, processor: Any = None, callbacks: list | None = None,
                 preference: PreferenceConfig | None = None, reference: tuple[str, Any] | None = None,
                 side_files: SideFiles | None = None, reward: bool = False) -> None:
        """``reward``: a reward model's run (the model's value head scores each sequence, ``reward_loss``)."""
        self.model, self.args, self.layout, self.reward = model, args, layout, reward
        self.train_data, self.eval_data = train_data, eval_data
        self.train_feed = StepFeeder(train_data, layout, fixed_shapes=bool(getattr(args, "cuda_graphs", False)),
                                     prefetch=args.run_prefetch_steps())
        if args.run_cuda_graphs():
            time_capture()
        self.eval_feed = StepFeeder(eval_data, layout) if eval_data is not None else None
        self.tokenizer, self.processor = tokenizer, processor
        self.preference, self.reference = preference, reference  # DPO's ref_model: (folder, its planned config)
        self.side_files = side_files or SideFiles(model.config, layout, tokenizer=tokenizer, processor=processor)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        record_triton_compiles()  # before step 1, where our kernels compile
        tc = model.transformer_config
        self.wrapped = wrap_ddp(model.chunks, tc, args)
        self.optimizer = build_optimizer(self.wrapped, tc, args)
        self.optimizer_step = OptimizerStep(self.optimizer, self.wrapped, tc)
        if model.fp8_weights is not None:  # whether the optimizer writes every 16-bit weight again at each step
            model.fp8_weights.in_weights = casts_take_weights(
                half=bool(args.bf16 or args.fp16), param_remainders=bool(args.store_param_remainders),
                cpu_offload=bool(args.optimizer_cpu_offload),
                overlap_param_gather=bool(args.overlap_param_gather), gathering_ranks=layout.dp * layout.cp,
                graphed=args.run_cuda_graphs())
        self.max_steps, self.num_epochs = self._plan_steps()
        self.schedule = LRSchedule(self.optimizer, args, self.max_steps)
        self.state = TrainerState(is_local_process_zero=args.local_process_index == 0,
                                  is_world_process_zero=torch.distributed.get_rank() == 0)
        self.control = TrainerControl()
        # Hugging Face's order: the flow, the trackers report_to names, then LLaMA-Factory's (trainer_log.jsonl)
        handlers = [DefaultFlowCallback, ProgressCallback] + reporting_callbacks(args) + list(callbacks or [])
        self.callback_handler = CallbackHandler(handlers, ReportedModel(model), tokenizer, self.optimizer,
                                                self.schedule)
        self.peak_flops = peak_flops()
        self._inject_nan, self._nonfinite_run = False, 0
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    # ---- Hugging Face Trainer surface LLaMA-Factory's workflows use ------------------------------------------
    log_metrics = log_metrics
    metrics_format = metrics_format
    save_metrics = save_metrics
    save_state = save_state

    def tokens_per_step(self) -> int:
        return self.train_feed.tokens_per_step()

    def is_world_process_zero(self) -> bool:
        return torch.distributed.get_rank() == 0

    def add_callback(self, callback: TrainerCallback) -> None:
        self.callback_handler.add_callback(callback)

    # ---- planning ----------------------------------------------------------------------------------------------
    def _plan_steps(self) -> tuple[int, float]:
        """(max_steps, epochs): an epoch's last step takes what is left, so every epoch has ceil(n / per step)."""
        per_epoch = self.train_feed.steps_per_epoch()
        if per_epoch < 1:
            raise UserError(f"the training set has no row left to train on: {nothing_left(self.train_data.stats)}")
        if self.args.max_steps and self.args.max_steps > 0:
            return self.args.max_steps, self.args.max_steps / per_epoch
        epochs = self.args.num_train_epochs
        return max(1, math.ceil(epochs * per_epoch)), epochs

    # ---- one step -------------------------------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model_chunk, *, collect_reference: bool = False):
        watchdog.beat()
        batch = next(data_iterator)
        has_tower = getattr(getattr(model_chunk, "module", model_chunk), "vision", None) is not None
        positions, extra = batch.model_inputs(first_stage=has_tower)
        if self.model.transformer_config.mtp_num_layers:  # multi-token prediction's loss counts these targets
            extra = {**extra, "loss_mask": batch.loss_mask}
        if not self.reward:  # the output layer and the loss compute these positions alone
            extra = {**extra, "loss_rows": batch.loss_rows}
        output = model_chunk(batch.tokens, positions, None, labels=None if self.reward else batch.model_labels,
                             packed_seq_params=batch.packed_seq_params(), **extra)
        if self._inject_nan:
            output = output * float("nan")
        if collect_reference:
            return output, partial(collect_pair_logps, self.preference, batch)
        if self.preference is not None:
            return output, partial(preference_loss, self.preference, batch)
        if self.reward:
            return output, partial(reward_loss, batch)
        return output, partial(lm_loss, batch.loss_mask)

    def _run_schedule(self, micro_batches: list, forward_only: bool, chunks: list | None = None,
                      collect_reference: bool = False) -> list[dict]:
        chunks = chunks or self.wrapped
        iterators = [iter(micro_batches) for _ in chunks]
        # the whole sequence: Megatron divides by the context-parallel size itself (and by TP under SP)
        seq_length = max(b.tokens.shape[-1] for b in micro_batches) * ps.get_context_parallel_world_size()
        # graphs replay training's shapes only; the weights hold still until the optimizer step
        held = self.model.weights_held(updates=not forward_only)  # an optimizer step follows a training pass
        with eager_layers(chunks) if forward_only else nullcontext(), held:
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, collect_reference=collect_reference),
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=len(micro_batches), seq_length=seq_length,
                micro_batch_size=micro_batches[0].tokens.shape[0], forward_only=forward_only,
            ) or []

    def _grads_finite(self) -> bool:
        # A sum over each gradient buffer is NaN or inf exactly when an element is (short of an fp32 overflow
        # of finite gradients, a step nobody wants either). isfinite() made an |x| copy and boolean masks of
        # every buffer: ~7 bytes per parameter at once, the peak of our MoE benchmark (130.7 -> 102.6 GiB).
        # On the device, one host sync for all buffers.
        total = torch.zeros((), device=self.device)
        for wrapped in self.wrapped:
            for buffer in list(wrapped.buffers) + list(wrapped.expert_parallel_buffers):
                total += torch.sum(buffer.grad_data, dtype=torch.float32)
        torch.distributed.all_reduce(total)
        return bool(torch.isfinite(total).item())

    def _zero_grad(self) -> None:
        for wrapped in self.wrapped:
            wrapped.zero_grad_buffer()
        with warnings.catch_warnings():
            # megatron-core 0.16.1's distributed optimizer reads .grad of its fp32 shard views (non-leaf tensors) in
            # zero_grad, warning on every rank at every step ("throws grad-access warning", its own comment says).
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            self.optimizer.zero_grad()

    def _first_step_note(self, seconds: float) -> None:
        """Step 1 is where kernels compile and CUDA graphs are captured: say how long it took, how much of it was
        compiling, and that a later launch on this machine finds the compiled kernels in the caches."""
        if not self.is_world_process_zero():
            return
        if not torch.cuda.is_available():
            logger.info("Step 1 took %.1f s", seconds)
            return
        compiling = compile_seconds()
        triton_seconds, built, cached = triton_compiles()
        capture = f", capturing CUDA graphs {capture_seconds():.1f} s" if self.args.run_cuda_graphs() else ""
        logger.info("Step 1 took %.1f s, of it compiling kernels %.1f s (our Triton kernels %.1f s: %d compiled, %d "
                    "from Triton's cache; torch.compile %.1f s)%s; both caches keep the kernels for the next launch "
                    "on this machine", seconds, compiling + triton_seconds, triton_seconds, built, cached, compiling,
                    capture)
        records = triton_records() + compile_records() if debug_enabled() else []
        if records:
            logger.info("Compiled kernels, slowest first:\n%s", "\n".join(records))

    def train_step(self, micro_batches: list) -> dict[str, float]:
        self._zero_grad()
        self._inject_nan = nan_loss(self.state.global_step + 1)
        outputs = self._run_schedule(micro_batches, forward_only=False)
        self._inject_nan = False
        logged = _reduce_logged(outputs, self.device)
        nonfinite = self.args.check_for_nan_in_loss_and_grad and not (
            math.isfinite(logged.get("loss", 0.0)) and self._grads_finite())
        self._note_nonfinite(nonfinite)
        skipped = nonfinite
        if skipped:
            logged["grad_norm"] = float("nan")
            self._zero_grad()
        else:
            ok, grad_norm = self.optimizer_step.step()
            skipped = not ok
            if ok:
                self.schedule.step()
            logged["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        if skipped and self.model.fp8_weights is not None and self.model.fp8_weights.in_weights:
            self.optimizer_step.rewrite_weights()  # the step's FP8 casts sit in the weights: no update wrote them
        logged["skipped"] = float(skipped)
        logged.update(self._moe_metrics(len(micro_batches)))
        logged.update(self._mtp_metrics(len(micro_batches)))
        return logged

    def _note_nonfinite(self, nonfinite: bool) -> None:
        """Count steps in a row with inf/nan loss or gradients: each is skipped; too many in a row stop the run."""
        step = self.state.global_step + 1
        if not nonfinite:
            self._nonfinite_run = 0
            return
        self._nonfinite_run += 1
        limit = self.args.max_nonfinite_steps
        if self.is_world_process_zero():
            logger.warning("step %d: inf/nan loss or gradients, step skipped (%d in a row; the run stops at %d)",
                           step, self._nonfinite_run, limit)
        if self._nonfinite_run >= limit:
            first = step - self._nonfinite_run + 1
            raise UserError(f"steps {first}-{step} all had inf/nan loss or gradients (max_nonfinite_steps={limit}): "
                            "training has diverged. Lower learning_rate, check the data, or resume from an earlier "
                            "checkpoint; raise max_nonfinite_steps to tolerate longer runs of bad steps.")

    def _moe_metrics(self, num_micro_batches: int) -> dict[str, float]:
        """The routers' load-balancing (and z-) losses, unweighted, averaged over the MoE layers (the MTP layers' too)
        and micro-batches, as Megatron logs them; they reach the gradients with their coefficients, not the logged
        ``loss``, which stays the language-model loss."""
        tc = self.model.transformer_config
        if not tc.num_moe_experts:
            return {}

        tracker = get_moe_layer_wise_logging_tracker()
        names = sorted(tracker)
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, names)
        if any(g != names for g in gathered) or not names:
            clear_aux_losses_tracker()
            return {}
        reduce_aux_losses_tracker_across_ranks(names)
        config = self.model.config
        moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers + (tc.mtp_num_layers or 0)))
        metrics = {f"moe/{name}": (tracker[name]["values"].sum() / moe_layers / num_micro_batches).item()
                   for name in names}
        clear_aux_losses_tracker()
        return metrics

    def _mtp_metrics(self, num_micro_batches: int) -> dict[str, float]:
        """``mtp_loss``: each multi-token-prediction layer's loss (Megatron's per-token mean of each micro-batch,
        averaged over micro-batches and data-parallel replicas), added to the step's gradient with weight
        ``mtp_loss_scaling_factor``; the logged ``loss`` stays the next-token loss alone."""
        layers = self.model.transformer_config.mtp_num_layers
        if not layers:
            return {}

        tracker = MTPLossLoggingHelper.tracker
        values = torch.zeros(layers + 1, device=self.device)
        if "values" in tracker and ps.get_tensor_model_parallel_rank() == 0:  # the last stage's replicas
            values[:layers] = tracker["values"].to(values.device) / num_micro_batches
            values[layers] = 1
            tracker["values"].zero_()
        torch.distributed.all_reduce(values)
        losses = (values[:layers] / values[layers].clamp(min=1)).tolist()
        return {"mtp_loss" if layers == 1 else f"mtp_loss_{k + 1}": loss for k, loss in enumerate(losses)}

    # ---- the loop -------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Any = None) -> TrainOutput:
        args = self.args
        resume = resolve_resume(resume_from_checkpoint, args.output_dir, self.side_files.run)
        self._attach_reference_logps()
        consumed, step_before = 0, None
        self.state.max_steps, self.state.num_train_epochs = self.max_steps, self.num_epochs
        self.state.logging_steps, self.state.save_steps = args.logging_steps, args.save_steps
        self.state.eval_steps = args.eval_steps
        if resume:
            saved = ckpt.load_checkpoint(resume, self.model, self.optimizer, self.layout)
            self.schedule.load_state_dict(saved["scheduler"])
            consumed = saved["consumed_micro_batches"]
            loaded = TrainerState.load_from_json(os.path.join(resume, "trainer_state.json"))
            self.state.global_step, self.state.log_history = loaded.global_step, loaded.log_history
            self.state.num_input_tokens_seen = loaded.num_input_tokens_seen
            self.state.total_flos = loaded.total_flos
            # the written run's global micro-batches per step (checkpoints before it was recorded: while in the first
            # epoch, every step was whole)
            step_before = saved.get("micro_batches_per_step") or (
                consumed // loaded.global_step if loaded.global_step and consumed % loaded.global_step == 0 else None)
            if self.is_world_process_zero():
                note = self.train_feed.resume_note(saved.get("data_plan"))
                if note:
                    logger.warning("Resuming %s: %s", resume, note)
                forget_logs_after(args.output_dir, self.state.global_step)
                logger.info("Resumed from %s at step %d (%d micro-batches consumed)", resume,
                            self.state.global_step, consumed)
        self.model.train()
        start_time = time.time()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        window = _Window()
        steps = self.train_feed.steps(start=consumed, step_before=step_before)
        first_step_time = None
        while self.state.global_step < self.max_steps:
            maybe_crash("step", self.state.global_step + 1)
            maybe_hang(self.state.global_step + 1)
            watchdog.beat(step=self.state.global_step + 1)
            tick = time.perf_counter()  # the step's time includes reading and collating its micro-batches
            micro_batches, consumed = next(steps)
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            logged = self.train_step([b.to(self.device) for b in micro_batches])
            seconds = time.perf_counter() - tick
            if first_step_time is None:
                first_step_time = time.time() - start_time
                self._first_step_note(first_step_time)
            work = self._step_work(micro_batches)
            window.add(logged, seconds, work)
            self.state.num_input_tokens_seen += int(work[0])  # every step: a checkpoint between logs is exact
            self.state.total_flos += work[1]
            self.state.global_step += 1
            memory_report.maybe_write(self.state.global_step)
            self.state.epoch = consumed / self.train_feed.micro_batches_per_epoch
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_log or self.state.global_step == self.max_steps:
                self._log(window.summary(self.schedule.lr, self.layout.world_size, self.peak_flops))
                window = _Window()
                if torch.cuda.is_available():  # the next line's peak memory covers the steps since this one
                    torch.cuda.reset_peak_memory_stats()
            if self.control.should_evaluate and self.eval_data is not None:
                self.evaluate()
            if self.control.should_save:
                self._save(consumed)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if self.control.should_training_stop:
                break
        if args.save_strategy != "no" and not self._saved_at(self.state.global_step):
            self._save(consumed)
        _drop_kept_graphs(self.wrapped)
        runtime = time.time() - start_time
        metrics = {"train_runtime": round(runtime, 2),
                   "train_steps_per_second": round(self.state.global_step / runtime, 3),
                   "time_to_first_step": round(first_step_time or 0.0, 2), "epoch": self.state.epoch,
                   "total_flos": self.state.total_flos}
        train_losses = [h["loss"] for h in self.state.log_history if "loss" in h]
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_losses[-1] if train_losses else float("nan"), metrics)

    def _step_work(self, micro_batches: list) -> tuple[float, float]:
        """(the dataset's tokens trained, model FLOPs) of this step over all data-parallel ranks; stand-ins count
        for neither."""
        t = self.model.config.transformer
        vocab = self.model.config.vocab_size
        real = [b for b in micro_batches if not b.is_padding]
        local = torch.tensor([sum(b.num_data_tokens for b in real),
                              sum(flops_per_sequence_set(t, vocab, b.seqlens) for b in real)],
                             dtype=torch.float64, device=self.device)
        # one contributor per data-parallel replica: the first stage's TP/CP rank 0 (each holds its own rows)
        if not (ps.is_pipeline_first_stage() and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0):
            local.zero_()
        torch.distributed.all_reduce(local)
        return local[0].item(), local[1].item()

    def _log(self, logs: dict[str, float]) -> None:
        logs["epoch"] = round(self.state.epoch or 0.0, 4)
        if self.args.include_num_input_tokens_seen not in (False, "no", None):
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def _saved_at(self, step: int) -> bool:
        return os.path.isdir(checkpoint_path(self.args.output_dir, step))

    def _land_param_gathers(self) -> None:
        """The overlapped parameter all-gathers of the last optimizer step waited for: a checkpoint or an evaluation
        reads every parameter, LoRA's adapters (whose modules are never called) and graphed layers' included."""
        if self.args.overlap_param_gather:
            for wrapped in self.wrapped:
                wrapped.start_param_sync(force_sync=True)

    def _save(self, consumed: int) -> str:
        self._land_param_gathers()
        step = self.state.global_step
        path = ckpt.save_checkpoint(
            self.args.output_dir, step, self.model, self.optimizer,
            {"scheduler": self.schedule.state_dict(), "consumed_micro_batches": consumed, "global_step": step,
             "data_plan": self.train_feed.signature,
             "micro_batches_per_step": self.layout.dp * self.layout.grad_accum},
            self.side_files, extra=lambda folder: self.state.save_to_json(
                os.path.join(folder, checkpoints.TRAINER_STATE_NAME)))
        if self.args.save_hf_model:
            self._export(path, os.path.join(path, "hf"))
        if self.is_world_process_zero():
            checkpoints.rotate(self.args.output_dir, self.args.save_total_limit)
            logger.info("Saved %s", path)
        return path

    # ---- evaluation ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self._land_param_gathers()  # once: every evaluation step reads the weights the last optimizer step wrote
        self.model.eval()
        outputs = []
        for micro_batches in self.eval_feed.eval_steps():
            outputs += self._run_schedule([b.to(self.device) for b in micro_batches], forward_only=True)
        reduced = _reduce_logged(outputs, self.device)
        self.model.train()
        metrics = {f"eval_{k}": v for k, v in reduced.items()}
        self._log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    # ---- DPO reference log-probs ---------------------------------------------------------------------------
    def _attach_reference_logps(self) -> None:
        """DPO's reference log-probs, computed once before training (and before a resume loads later weights) by
        the initial model or ``ref_model``; kept beside each plan, which hands them to its micro-batches."""
        if self.preference is None or not self.preference.needs_reference or self.train_data.reference is not None:
            return
        reference = None
        if self.reference:
            path, config = self.reference
            reference = AutoModel.from_pretrained(path, self.args, config=config)
        elif self.model.lora is not None:  # LoRA's reference is the frozen base, as peft's disable_adapter gives it

            set_lora_enabled(self.model, False)
        for plan in (self.train_data, self.eval_data):
            if plan is not None:
                plan.set_reference(*self._reference_logps(plan, reference))
        if reference is None and self.model.lora is not None:
            set_lora_enabled(self.model, True)
        del reference

    @torch.no_grad()
    def _reference_logps(self, plan: Any, reference: Any = None) -> tuple[Any, Any]:
        """Reference (chosen, rejected) log-probs for every row of ``plan`` with the frozen current model (or
        ``reference``, another McaModel). Collective; every rank gets all."""
        feed = StepFeeder(plan, self.layout)
        chunks = reference.chunks if reference is not None else self.wrapped
        for chunk in chunks:
            chunk.eval()
        groups = plan.epoch_groups(0)
        dp_rank = ps.get_data_parallel_rank()
        found: list[tuple[int, float, float]] = []
        position = 0  # this rank's micro-batch k is global micro-batch dp_rank + k·dp
        for micro_batches in feed.eval_steps():
            outputs = self._run_schedule([b.to(self.device) for b in micro_batches], forward_only=True,
                                         chunks=chunks, collect_reference=True)
            for out in outputs:
                index = dp_rank + position * self.layout.dp
                position += 1
                if index < len(groups) and ps.get_tensor_model_parallel_rank() == 0 and \
                        ps.get_context_parallel_rank() == 0:
                    pairs = out["_pairs"].float().cpu().tolist()
                    found += [(row, c, r) for row, (c, r) in zip(groups[index], pairs)]
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, found)
        chosen = np.full(plan.table.num_rows, np.nan, dtype=np.float32)
        rejected = np.full(plan.table.num_rows, np.nan, dtype=np.float32)
        for part in gathered:
            for row, c, r in part:
                chosen[row], rejected[row] = c, r
        for chunk in self.wrapped:
            chunk.train()
        return chosen, rejected

    def _export(self, checkpoint: str, target: str) -> None:
        """Hugging Face weights, config, tokenizer and processor files from a folder just written (collective)."""
        if self.is_world_process_zero():  # a LoRA run's checkpoint exports its peft adapter
            (export_adapter if is_adapter_checkpoint(checkpoint) else export_hf)(checkpoint, target)
        torch.distributed.barrier()

    def save_model(self, output_dir: str | None = None) -> None:
        """The final model as Hugging Face safetensors + config + tokenizer in ``output_dir`` (all ranks call it),
        exported from the checkpoint of the last step; without one (save_strategy: no), from a model-only folder
        written for the purpose and removed after."""
        output_dir = output_dir or self.args.output_dir
        if self._saved_at(self.state.global_step):
            self._export(checkpoint_path(self.args.output_dir, self.state.global_step), output_dir)
        else:
            staging = os.path.join(self.args.output_dir, "export-staging")
            checkpoints.write_folder(staging, self.model.sharded_state_dict(), self.side_files)
            self._export(staging, output_dir)
            if self.is_world_process_zero():
                shutil.rmtree(staging, ignore_errors=True)
        if self.is_world_process_zero():
            logger.info("Saved the trained %s to %s", "LoRA adapter (peft)" if self.model.lora else
                        "model (Hugging Face safetensors)", output_dir)


class _Window:
    """Averages over the steps between two log lines."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = 0
        self.seconds = 0.0
        self.tokens = 0.0
        self.flops = 0.0
        self.skipped = 0

    def add(self, logged: dict[str, float], seconds: float, work: tuple[float, float]) -> None:
        self.steps += 1
        self.seconds += seconds
        self.tokens += work[0]
        self.flops += work[1]
        self.skipped += int(logged.get("skipped", 0))
        for key, value in logged.items():
            if key != "skipped" and math.isfinite(value):
                self.sums[key] = self.sums.get(key, 0.0) + value

    def summary(self, lr: float, world_size: int, peak: float | None) -> dict[str, float]:
        good = max(self.steps - self.skipped, 1)
        logs = {k: v / good for k, v in self.sums.items()}
        logs["learning_rate"] = lr
        logs["tokens_per_second_per_gpu"] = round(self.tokens / max(self.seconds, 1e-9) / world_size, 1)
        if peak:
            logs["mfu"] = round(self.flops / max(self.seconds, 1e-9) / world_size / peak, 4)
        peak_alloc, _ = gpu_memory_gib()
        if peak_alloc:
            logs["peak_memory_gib"] = round(peak_alloc, 2)
        if self.skipped:
            logs["skipped_steps"] = self.skipped
        return logs
