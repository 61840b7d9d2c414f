"""run_pt / run_sft / run_dpo / run_kto / run_rm, reached through LLaMA-Factory's own dispatch under USE_MCA=1.

LLaMA-Factory does what it is good at — tokenizer, template, dataset_info.json, cutoff_len,
mask_history, train_on_prompt, val_size — and hands us tokenized rows; we plan micro-batches, build
the model in the planned layout (``plan.py``: every check that needs no process group, made once) and train with
Megatron-Core.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import torch
from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
from llamafactory.extras.ploting import plot_loss
from llamafactory.model import load_tokenizer

from . import memory_report, parallel, run_lock, start_clock, watchdog
from .checkpoints import SideFiles
from .data import BatchingConfig, DataPlan, check_trainable, empty_rows_warning, format_stats
from .data.content import template_tokens
from .data.multimodal import VisionInputs
from .data.rows import one_thread_per_worker, split_documents
from .errors import UserError, debug_enabled, user_errors
from .hub import resolve_model
from .log import setup_logging
from .models import spec, value_head
from .models.auto import AutoModel, describe_load_balancing
from .models.cost import model_parameter_count
from .models.freeze import apply_freeze, apply_multimodal_freeze
from .models.lora.peft_io import setup_lora
from .models.native import logit_chunks, tower_attention
from .plan import RunPlan, plan_run
from .planner.check import training_of
from .planner.memory import estimate
from .quiet import quiet_transformers
from .trainer.metrics import count_parameters, startup_summary
from .trainer.trainer import McaTrainer


logger = logging.getLogger(__name__)

def run_pt(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _run("pt", model_args, data_args, training_args, finetuning_args, callbacks)


def run_sft(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _run("sft", model_args, data_args, training_args, finetuning_args, callbacks)


def run_dpo(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _run("dpo", model_args, data_args, training_args, finetuning_args, callbacks)


def run_kto(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _run("kto", model_args, data_args, training_args, finetuning_args, callbacks)


def run_rm(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _run("rm", model_args, data_args, training_args, finetuning_args, callbacks)


def _at(model_args: Any, path: str) -> Any:
    """``model_args`` naming the resolved folder (a copy: the parsed arguments stay as the recipe wrote them)."""
    resolved = copy.copy(model_args)
    resolved.model_name_or_path = path
    return resolved


def _data_plans(plan: RunPlan, template: Any, tokenizer_module: dict, model_args: Any, data_args: Any,
                training_args: Any) -> tuple[DataPlan, DataPlan | None]:
    """LLaMA-Factory's tokenized rows as micro-batches, training and evaluation; refuses data that would teach
    nothing and warns of empty rows."""
    tokenizer, processor = tokenizer_module["tokenizer"], tokenizer_module.get("processor")
    dataset_module = _load_rows(plan.stage, template, model_args, data_args, training_args, tokenizer_module,
                                plan.cutoff_len)
    frame = template_tokens(plan.stage, template, tokenizer, processor, data_args)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batching = dict(cutoff_len=plan.cutoff_len, packing=plan.packing, padding_free=plan.padding_free,
                    pad_multiple=plan.layout.pad_multiple, pad_token_id=pad_id)
    vision = VisionInputs(template.mm_plugin, processor, plan.config.hf_config, video_span=plan.video_span,
                          projector=plan.tower.projector) if plan.vision else None
    reward = plan.stage == "rm"
    train_plan = DataPlan(dataset_module["train_dataset"],
                          BatchingConfig.from_args(training_args, micro_batch_size=plan.layout.micro_batch_size,
                                                   **batching),
                          log=False, vision=vision, template_tokens=frame, reward=reward)
    check_trainable(train_plan.stats, dataset=",".join(data_args.dataset or []))
    warning = empty_rows_warning(train_plan.stats, dataset=",".join(data_args.dataset or []))
    if warning and torch.distributed.get_rank() == 0:
        logger.warning(warning)
    eval_dataset = dataset_module.get("eval_dataset")
    if isinstance(eval_dataset, dict):
        raise UserError("several eval datasets (eval_dataset with a dict) are not supported with USE_MCA=1.")
    eval_plan = None if eval_dataset is None else DataPlan(
        eval_dataset, BatchingConfig.from_args(training_args, for_eval=True, **batching), log=False, vision=vision,
        template_tokens=frame, reward=reward)
    return train_plan, eval_plan


def _describe_mtp(tc: Any) -> str:
    layers = tc.mtp_num_layers or 0
    return f" with {layers} multi-token-prediction layer(s), loss weight {tc.mtp_loss_scaling_factor:g}" if layers \
        else ""


def _describe_loss(plan: RunPlan, transformer_config: Any) -> str:
    if plan.stage == "rm":  # no logits: the value head scores each sequence's last token
        return "loss: -logsigmoid(chosen - rejected) over the value head's scores (no logits)"
    layout = plan.layout
    return logit_chunks.describe(plan.cutoff_len * layout.micro_batch_size // layout.cp,
                                 plan.config.padded_vocab_size(layout.tp) // layout.tp,
                                 logit_chunks.native_loss(transformer_config),
                                 getattr(transformer_config, "chunked_cross_entropy", None))


def _summary(plan: RunPlan, model: Any, trainer: McaTrainer, train_plan: DataPlan, training_args: Any,
             finetuning_args: Any, startup: str) -> str:
    """The startup summary (rank 0)."""
    on_rank = count_parameters(model.chunks)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = plan.config
    return startup_summary(
        layout=plan.layout, args=training_args, packed=plan.packing, padding_free=plan.padding_free,
        model_type=config.hf_model_type + _describe_mtp(model.transformer_config),
        params_total=model_parameter_count(config), params_on_rank=on_rank,
        kernels=spec.describe_kernels(model.transformer_config)
        + (f"; {tower_attention.describe(plan.tower.projector)}" if plan.vision else "") + "; " + _describe_loss(
            plan, model.transformer_config),
        tokens_per_step=trainer.tokens_per_step(),
        steps=trainer.max_steps, data_stats=format_stats(train_plan.stats),
        planned=estimate(config, plan.layout, training_of(plan, training_args, finetuning_args)),
        tuning=f"{model.lora.describe()}: {trainable / 1e6:,.2f}M trainable parameters on this rank "
               f"({100 * trainable / max(on_rank, 1):.2f}%)" if model.lora else None,
        moe=describe_load_balancing(model.transformer_config, config.hf_model_type, plan.balancing)
        if config.num_experts else None, startup=startup, merge=plan.merge.why)


def _load_rows(stage: str, template: Any, model_args: Any, data_args: Any, training_args: Any,
               tokenizer_module: dict, cutoff_len: int) -> dict:
    """LLaMA-Factory's tokenized rows, one sequence per row, shifted later inside each sequence.

    sft/dpo/kto: LLaMA-Factory truncates each row (its own way: mask_history, train_on_prompt) to cutoff_len + 1
    tokens, so that the shift loses nothing; rm: to cutoff_len, as its rm stage does (nothing is shifted). pt: whole
    documents, split here into cutoff_len pieces
    (``split_documents``), or, with ``pt_blocks: concatenated``, LLaMA-Factory's own cutoff_len blocks.
    """
    documents = stage == "pt" and training_args.pt_blocks == "documents"
    concatenated = stage == "pt" and not documents
    saved = data_args.cutoff_len, data_args.packing, data_args.neat_packing
    data_args.cutoff_len = 2**31 - 1 if documents else cutoff_len if concatenated or stage == "rm" else cutoff_len + 1
    data_args.packing, data_args.neat_packing = concatenated, False
    workers = data_args.preprocessing_num_workers
    try:
        with one_thread_per_worker(workers):
            module = get_dataset(template, model_args, data_args, training_args,
                                 stage="rm" if stage in ("dpo", "rm") else stage, **tokenizer_module)
    except ValueError as err:  # LLaMA-Factory's word for data it cannot use (format, columns, no valid samples)
        raise UserError(f"LLaMA-Factory could not prepare dataset={','.join(data_args.dataset or [])}: {err}") from err
    finally:
        data_args.cutoff_len, data_args.packing, data_args.neat_packing = saved
    if documents:
        with training_args.main_process_first(desc="splitting documents"):  # one rank writes the cache
            for key in ("train_dataset", "eval_dataset"):
                if module.get(key) is not None and not isinstance(module[key], dict):
                    module[key] = split_documents(module[key], cutoff_len, workers)
    return module


LOST_PEER_GRACE_S = 3.0
PLOTTED = {"dpo": ["rewards/accuracies"], "rm": ["rewards/accuracies"], "kto": ["rewards/chosen"]}  # LLaMA-Factory's


def _run(stage: str, model_args, data_args, training_args, finetuning_args, callbacks=None) -> None:
    """A worker's run: a user error is one message (see errors.py), Ctrl-C a quiet exit."""
    parallel.interrupt_once()
    try:
        with user_errors():
            _train(stage, model_args, data_args, training_args, finetuning_args, callbacks)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except RuntimeError as err:
        if not parallel.lost_peer(err) or debug_enabled():
            raise
        # another rank died (killed, out of memory, crashed): its failure is the news, which the launcher reports;
        # this rank's traceback from inside a collective would only bury it. Ranks forked by our torchrun are
        # reported one failure at a time, the first the agent sees: leave it the time to see the dead rank first.
        time.sleep(LOST_PEER_GRACE_S)
        raise SystemExit(1) from None
    finally:
        run_lock.release_held()  # torchrun started by hand: rank 0 took the lock (see _train)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker; an in-process caller keeps its interpreter
        parallel.end_worker()
    parallel.destroy()


def _startup(rank_start: float, before_run: float, started: float, data_ready: float, model_ready: float) -> str:
    """The summary's ``startup`` line: the launcher's phases (``start_clock``), rank 0's, what step 1 does."""
    launcher = start_clock.launcher_phases(rank_start)
    rank = (f"{'arguments and process group' if start_clock.forked() else 'imports, arguments and process group'} "
            f"{before_run:.1f} s, data {data_ready - started:.1f} s (read, tokenized, planned), model "
            f"{model_ready - data_ready:.1f} s (built, loaded), optimizer {time.monotonic() - model_ready:.1f} s")
    step = ("step 1 compiles and captures what it needs" if torch.cuda.is_available()
            else "nothing is compiled on CPUs (eager kernels)")
    if launcher is None:  # a bare torchrun: this rank's own clock only
        return f"rank 0: {rank}; {step}"
    total = time.time() - (rank_start - launcher[0])
    return (f"{total:.1f} s from the command to training: launcher {launcher[0]:.1f} s ({launcher[1]}); "
            f"rank 0: {rank}; {step}")


def _resolve_once_per_node(name: str, model_args: Any, field: str) -> str:
    """A hub id as a local folder: the launcher resolved it (LLAMAFACTORY_MCA_RESOLVED); under a bare torchrun the
    first rank of each node downloads while the others wait, then all read the same snapshot."""
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    path = resolve_model(name, model_args, field=field) if first else None
    torch.distributed.barrier()
    return path or resolve_model(name, model_args, field=field)


def _train(stage: str, model_args, data_args, training_args, finetuning_args, callbacks=None) -> None:
    """A worker's run, built from the plan: data, model, trainer, then LLaMA-Factory's bookkeeping."""
    started, rank_start = time.monotonic(), start_clock.process_started()
    before_run = time.time() - rank_start  # from this process's start: its imports (spawned), the arguments, the group
    setup_logging()
    quiet_transformers()
    # before joining the group: a launcher killed now takes the rendezvous store with it, and the join would wait
    rank = int(os.environ.get("RANK", "0"))
    watchdog.start(training_args.ddp_timeout, rank)
    parallel.init_distributed(training_args.ddp_timeout)
    if not os.environ.get(run_lock.HELD_ENV) and rank == 0:  # torchrun started by hand
        run_lock.acquire(training_args.output_dir)  # released by _run, however the run ends
    plan = plan_run(stage, model_args, data_args, training_args, finetuning_args,
                    int(os.environ.get("WORLD_SIZE", "1")), resolve=_resolve_once_per_node)
    for note in plan.notes if rank == 0 else ():
        logger.warning(note)

    watchdog.beat(phase="loading data and model")
    parallel.initialize(plan.layout, training_args.seed, cuda_graphs=training_args.run_cuda_graphs())
    memory_report.start()
    tokenizer_module = load_tokenizer(_at(model_args, plan.model_path))
    tokenizer, processor = tokenizer_module["tokenizer"], tokenizer_module.get("processor")
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    if len(tokenizer) > plan.config.vocab_size:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{plan.config.vocab_size}: resizing embeddings is not supported with USE_MCA=1. Use a "
                         "tokenizer that fits the model (or resize and save the model with transformers first).")
    train_plan, eval_plan = _data_plans(plan, template, tokenizer_module, model_args, data_args, training_args)
    data_ready = time.monotonic()

    model = AutoModel.from_pretrained(plan.model_path, training_args, model_args.trust_remote_code, config=plan.config,
                                      frozen_base=plan.finetuning_type == "lora", value_head=stage == "rm")
    adapter_config = None
    if plan.finetuning_type == "lora":
        adapter_config = setup_lora(model, plan.lora, list(plan.adapters), plan.model_path, training_args.seed)
    else:
        if plan.finetuning_type == "freeze":
            apply_freeze(model, finetuning_args)
        apply_multimodal_freeze(model, finetuning_args)
    if stage == "rm":
        value_head.train_whole(model.chunks, plan.adapters)

    model_ready = time.monotonic()
    grouped = getattr(model.transformer_config, "moe_grouped_gemm", None) if plan.config.num_experts else None
    trainer = McaTrainer(
        model=model, args=training_args, layout=plan.layout, train_data=train_plan, eval_data=eval_plan,
        tokenizer=tokenizer, processor=processor, callbacks=callbacks, preference=plan.preference,
        reference=plan.reference,
        side_files=SideFiles(plan.config, plan.layout, grouped, tokenizer, processor, adapter_config=adapter_config,
                             run=plan.record),
        reward=stage == "rm",
    )
    if rank == 0:
        startup = _startup(rank_start, before_run, started, data_ready, model_ready)
        logger.info("\n" + _summary(plan, model, trainer, train_plan, training_args, finetuning_args, startup))

    result = trainer.train(training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    if trainer.is_world_process_zero() and finetuning_args.plot_loss:
        keys = ["loss"] + (["eval_loss"] if eval_plan is not None else [])
        plot_loss(training_args.output_dir, keys=keys + PLOTTED.get(stage, []))
