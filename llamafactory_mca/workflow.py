"""run_pt / run_sft / run_dpo, reached through LLaMA-Factory's own dispatch under USE_MCA=1.

LLaMA-Factory does what it is good at — tokenizer, template, dataset_info.json, cutoff_len,
mask_history, train_on_prompt, val_size — and hands us tokenized rows; we plan micro-batches, build
the model in the requested layout and train with Megatron-Core. Every check that can fail runs
before process groups, GPUs or data are touched.
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Any

import torch

from .errors import UserError


logger = logging.getLogger("llamafactory_mca")

SUPPORTED_STAGES = ("pt", "sft", "dpo")
SUPPORTED_FINETUNING = ("full", "freeze", "lora")


def run_pt(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _run("pt", model_args, data_args, training_args, finetuning_args, callbacks)


def run_sft(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _run("sft", model_args, data_args, training_args, finetuning_args, callbacks)


def run_dpo(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _run("dpo", model_args, data_args, training_args, finetuning_args, callbacks)


def check_request(stage: str, model_args: Any, data_args: Any, training_args: Any, finetuning_args: Any) -> None:
    """Refuse what the Megatron path does not do, naming the key and the fix."""
    if stage not in SUPPORTED_STAGES:
        raise UserError(f"stage={stage!r} is not supported with USE_MCA=1; supported: {', '.join(SUPPORTED_STAGES)}. "
                         "Unset USE_MCA to run it with LLaMA-Factory's default trainer.")
    if finetuning_args.finetuning_type not in SUPPORTED_FINETUNING:
        raise UserError(f"finetuning_type={finetuning_args.finetuning_type!r} is not supported with USE_MCA=1; "
                         f"supported: {', '.join(SUPPORTED_FINETUNING)}. Use one of those, or unset USE_MCA for "
                         "OFT with LLaMA-Factory's default trainer.")
    if finetuning_args.finetuning_type == "lora":
        from .models.lora import check_lora_request

        check_lora_request(finetuning_args)
    elif getattr(model_args, "adapter_name_or_path", None):
        raise UserError(f"adapter_name_or_path is set but finetuning_type={finetuning_args.finetuning_type!r}: "
                         "continue an adapter with finetuning_type: lora, or merge it first (llamafactory-cli export) "
                         "and train the merged model.")
    if getattr(model_args, "quantization_bit", None):
        raise UserError(f"quantization_bit={model_args.quantization_bit} is not supported with USE_MCA=1.")
    if data_args.cutoff_len is not None and data_args.cutoff_len < 1:
        raise UserError(f"cutoff_len={data_args.cutoff_len} must be a positive number of tokens.")
    if data_args.template is not None:
        from llamafactory.data.template import TEMPLATES

        if data_args.template not in TEMPLATES:
            close = difflib.get_close_matches(data_args.template, list(TEMPLATES), n=3)
            raise UserError(f"template={data_args.template!r} is not one of LLaMA-Factory's templates"
                            + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else "")
                            + "; see llamafactory/data/template.py for the list.")
    if data_args.streaming:
        raise UserError("streaming=True is not supported with USE_MCA=1: micro-batches are planned over the whole "
                         "tokenized dataset (deterministic, resumable packing). Set streaming: false.")
    if stage == "dpo" and finetuning_args.pref_loss not in ("sigmoid", "hinge", "ipo", "orpo", "simpo"):
        raise UserError(f"pref_loss={finetuning_args.pref_loss!r} is not supported with USE_MCA=1; supported: "
                         "sigmoid, hinge, ipo, orpo, simpo.")
    if stage == "dpo" and getattr(finetuning_args, "ld_alpha", None):
        raise UserError("ld_alpha is not supported with USE_MCA=1.")
    _check_output_dir(training_args.output_dir)


def plan_mtp(config: Any, stage: str, finetuning_args: Any, training_args: Any, say: bool = False) -> Any:
    """The model's multi-token-prediction layers for this run: trained in full pt and sft; left out in LoRA runs (a
    peft adapter has no place for them, and the base model keeps its own), freeze runs (they train chosen decoder
    layers only) and dpo runs (their loss is next-token prediction, not a preference), unless the recipe sets
    ``mtp_num_layers``. A vision-language model's MTP layer needs the image features, which live on the first
    pipeline stage, and sits on the last: under pipelining it is left out (``resolve_mtp``)."""
    from .models.auto import mtp_apart_from_features, resolve_mtp

    apart = mtp_apart_from_features(config, training_args)
    if apart and training_args.mtp_num_layers is None:
        if say:
            logger.warning("%s: it is not trained in this run, and the exported model has none, like "
                           "LLaMA-Factory's default path's. pipeline_model_parallel_size: 1 trains it.", apart)
        return resolve_mtp(config, training_args)
    tuning = finetuning_args.finetuning_type
    if config.mtp_num_layers and training_args.mtp_num_layers is None and (stage == "dpo" or tuning != "full"):
        training_args.mtp_num_layers = 0
        if say:
            why = "dpo" if stage == "dpo" and tuning == "full" else "LoRA" if tuning == "lora" else tuning
            exported = ("the base model keeps them" if why == "LoRA" else
                        "the exported model has none, like LLaMA-Factory's default path's")
            logger.warning("%s: the checkpoint's %d multi-token-prediction layer(s) are not trained in a %s run "
                           "(%s).", config.hf_model_type, config.mtp_num_layers, why, exported)
    return resolve_mtp(config, training_args)


def _describe_mtp(tc: Any) -> str:
    layers = tc.mtp_num_layers or 0
    return f" with {layers} multi-token-prediction layer(s), loss weight {tc.mtp_loss_scaling_factor:g}" if layers \
        else ""


def _check_output_dir(output_dir: str) -> None:
    """Try a write where the folder will be created (permission bits alone say nothing for root)."""
    import tempfile

    probe = os.path.abspath(output_dir)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        if not os.path.isdir(probe):
            raise NotADirectoryError(f"{probe} is a file")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise UserError(f"output_dir={output_dir!r} is not writable ({err}). Choose a folder you can write "
                         "to.") from err


def check_model_fits(config: Any, cutoff_len: int, stage: str, layout: Any, custom_pipeline_layout: bool = False
                     ) -> None:
    """Refuse a model this run would train wrongly (before any worker starts: the preflight calls it too).
    ``custom_pipeline_layout``: a pipeline_model_parallel_layout places the layers, not the even split (the model
    build then checks where the deepstack layers went)."""
    if config.transformer.get("mrope_section"):
        if stage == "dpo":
            raise UserError(f"{config.hf_model_type}: DPO on vision-language models is not supported with USE_MCA=1 "
                            "yet; sft and pt are. Unset USE_MCA to run it with LLaMA-Factory's default trainer.")
        if layout.cp > 1:
            raise UserError(f"context_parallel_size={layout.cp} is not supported for the vision-language model "
                            f"{config.hf_model_type} yet (its image features would have to follow the token split); "
                            "use context_parallel_size: 1.")
        from .models.multimodal import deepstack_layers

        deepstack, stages = deepstack_layers(config.hf_config), layout.pp * (layout.vpp or 1)
        first_chunk = config.num_layers // stages
        if deepstack > first_chunk and not custom_pipeline_layout:
            raise UserError(f"{config.hf_model_type}: the first {deepstack} decoder layers take the vision tower's "
                            f"deepstack features and must share its pipeline stage, but pipeline_model_parallel_size="
                            f"{layout.pp}" + (f" x virtual_pipeline_model_parallel_size={layout.vpp}" if layout.vpp
                                              else "") + f" puts {first_chunk} layers there. Use fewer stages (at "
                            f"most {config.num_layers // deepstack}) or a pipeline_model_parallel_layout whose first "
                            f"stage holds {deepstack} layers.")
    if config.sliding_window is not None and cutoff_len > config.sliding_window:
        raise UserError(f"{config.hf_model_type}: the model uses sliding-window attention (window "
                         f"{config.sliding_window}), which llamafactory_mca does not implement; it matches full "
                         f"attention only when sequences fit in the window. Set cutoff_len <= "
                         f"{config.sliding_window}.")


def packing_request(data_args: Any, training_args: Any, recipe: dict | list | None = None) -> tuple[bool, int]:
    """(pack?, the user's cutoff_len).

    LLaMA-Factory's DataArguments lowers cutoff_len by one in ``__post_init__`` when the recipe sets packing or
    neat_packing; for pt its parser turns packing on later without lowering it. Which one happened is read
    from the recipe itself (``recipe``: as ``read_args`` returns it; None reads the command line).
    """
    packing = bool(training_args.sequence_packing or data_args.packing or data_args.neat_packing)
    try:
        if recipe is None:
            from llamafactory.hparams.parser import read_args

            recipe = read_args()
        if isinstance(recipe, dict):
            lowered = bool(recipe.get("packing") or recipe.get("neat_packing"))
        else:
            lowered = any(a.split("=")[0] in ("--packing", "--neat_packing") for a in recipe) and \
                bool(data_args.packing)
    except Exception:  # called without a recipe on the command line
        lowered = bool(data_args.neat_packing)
    return packing, data_args.cutoff_len + (1 if lowered else 0)


def _load_rows(stage: str, template: Any, model_args: Any, data_args: Any, training_args: Any,
               tokenizer_module: dict, cutoff_len: int) -> dict:
    """LLaMA-Factory's tokenized rows, one sequence per row, shifted later inside each sequence.

    sft/dpo: LLaMA-Factory truncates each row (its own way: mask_history, train_on_prompt) to cutoff_len + 1
    tokens, so that the shift loses nothing. pt: whole documents, split here into cutoff_len pieces
    (``split_documents``), or, with ``pt_blocks: concatenated``, LLaMA-Factory's own cutoff_len blocks.
    """
    from llamafactory.data import get_dataset

    from .data.rows import split_documents

    documents = stage == "pt" and training_args.pt_blocks == "documents"
    concatenated = stage == "pt" and not documents
    saved = data_args.cutoff_len, data_args.packing, data_args.neat_packing
    data_args.cutoff_len = 2**31 - 1 if documents else cutoff_len if concatenated else cutoff_len + 1
    data_args.packing, data_args.neat_packing = concatenated, False
    try:
        module = get_dataset(template, model_args, data_args, training_args, stage="rm" if stage == "dpo" else stage,
                             **tokenizer_module)
    except ValueError as err:  # LLaMA-Factory's word for data it cannot use (format, columns, no valid samples)
        raise UserError(f"LLaMA-Factory could not prepare dataset={','.join(data_args.dataset or [])}: {err}") from err
    finally:
        data_args.cutoff_len, data_args.packing, data_args.neat_packing = saved
    if documents:
        with training_args.main_process_first(desc="splitting documents"):  # one rank writes the cache
            for key in ("train_dataset", "eval_dataset"):
                if module.get(key) is not None and not isinstance(module[key], dict):
                    module[key] = split_documents(module[key], cutoff_len, data_args.preprocessing_num_workers)
    return module


def _run(stage: str, model_args, data_args, training_args, finetuning_args, callbacks=None) -> None:
    """A worker's run: a user error is one message (see errors.py), Ctrl-C a quiet exit."""
    from . import run_lock
    from .errors import debug_enabled, user_errors
    from .parallel import end_worker, lost_peer

    try:
        with user_errors():
            _train(stage, model_args, data_args, training_args, finetuning_args, callbacks)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except RuntimeError as err:
        if not lost_peer(err) or debug_enabled():
            raise
        # another rank died (killed, out of memory, crashed): its failure is the news, which the launcher reports;
        # this rank's traceback from inside a collective would only bury it
        raise SystemExit(1) from None
    finally:
        run_lock.release_held()  # torchrun started by hand: rank 0 took the lock (see _train)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker; an in-process caller keeps its interpreter
        end_worker()


def _resolve_model_once_per_node(model_args: Any, finetuning_args: Any) -> None:
    """Hub ids to local folders: the launcher did it (LLAMAFACTORY_MCA_RESOLVED); under a bare torchrun the
    first rank of each node downloads while the others wait, then all read the same snapshot."""
    from .hub import resolve_model

    first = os.environ.get("LOCAL_RANK", "0") == "0"
    for turn in (True, False):
        if turn == first:
            model_args.model_name_or_path = resolve_model(model_args.model_name_or_path, model_args)
            if getattr(finetuning_args, "ref_model", None):
                finetuning_args.ref_model = resolve_model(finetuning_args.ref_model, model_args)
            if getattr(model_args, "adapter_name_or_path", None):
                model_args.adapter_name_or_path = [resolve_model(p, model_args)
                                                   for p in model_args.adapter_name_or_path]
        torch.distributed.barrier()


def _train(stage: str, model_args, data_args, training_args, finetuning_args, callbacks=None) -> None:
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.extras.ploting import plot_loss
    from llamafactory.model import load_tokenizer

    from . import memory_report, parallel, run_lock, watchdog
    from .checkpoints import SideFiles, run_record
    from .data import BatchingConfig, DataPlan, check_trainable, empty_rows_warning, format_stats
    from .data.content import template_tokens
    from .log import setup_logging
    from .models import spec
    from .models.auto import AutoConfig, AutoModel, describe_load_balancing, resolve_load_balancing
    from .models.freeze import apply_freeze, apply_multimodal_freeze
    from .parallel import check_layout
    from .quiet import quiet_transformers
    from .trainer.loss import PreferenceConfig
    from .trainer.metrics import count_parameters, memory_estimate_gib, model_parameter_count, startup_summary
    from .trainer.trainer import McaTrainer

    setup_logging()
    quiet_transformers()
    check_request(stage, model_args, data_args, training_args, finetuning_args)
    packing, cutoff_len = packing_request(data_args, training_args)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    layout = training_args.resolve_layout(world_size, seq_length=cutoff_len)
    parallel.init_distributed(training_args.ddp_timeout)
    watchdog.start(training_args.ddp_timeout, torch.distributed.get_rank())
    if not os.environ.get(run_lock.HELD_ENV) and torch.distributed.get_rank() == 0:  # torchrun started by hand
        run_lock.acquire(training_args.output_dir)  # released by _run, however the run ends
    _resolve_model_once_per_node(model_args, finetuning_args)
    config = AutoConfig.from_pretrained(model_args.model_name_or_path, training_args, model_args.trust_remote_code)
    config = plan_mtp(config, stage, finetuning_args, training_args, say=torch.distributed.get_rank() == 0)
    config, balancing = resolve_load_balancing(config, training_args, model_args.moe_aux_loss_coef)
    custom = training_args.pipeline_model_parallel_layout is not None
    check_layout(config, layout, custom, training_args.sequence_parallel)
    check_model_fits(config, cutoff_len, stage, layout, custom)

    watchdog.beat(phase="loading data and model")
    parallel.initialize(layout, training_args.seed)
    memory_report.start()
    tokenizer_module = load_tokenizer(model_args)
    tokenizer = tokenizer_module["tokenizer"]
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{config.vocab_size}: "
                         "resizing embeddings is not supported with USE_MCA=1. Use a tokenizer that fits the model "
                         "(or resize and save the model with transformers first).")
    dataset_module = _load_rows(stage, template, model_args, data_args, training_args, tokenizer_module, cutoff_len)
    frame = template_tokens(stage, template, tokenizer, tokenizer_module.get("processor"), data_args)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batching = dict(cutoff_len=cutoff_len, packing=packing, pad_multiple=layout.pad_multiple, pad_token_id=pad_id)
    vision = None
    if config.transformer.get("mrope_section"):
        from .data.multimodal import VisionInputs

        vision = VisionInputs(template.mm_plugin, tokenizer_module.get("processor"), config.hf_config)
    train_plan = DataPlan(dataset_module["train_dataset"], BatchingConfig.from_args(training_args, **batching),
                          log=False, vision=vision, template_tokens=frame)
    check_trainable(train_plan.stats, dataset=",".join(data_args.dataset or []))
    warning = empty_rows_warning(train_plan.stats, dataset=",".join(data_args.dataset or []))
    if warning and torch.distributed.get_rank() == 0:
        logger.warning(warning)
    eval_dataset = dataset_module.get("eval_dataset")
    if isinstance(eval_dataset, dict):
        raise UserError("several eval datasets (eval_dataset with a dict) are not supported with USE_MCA=1.")
    eval_plan = None if eval_dataset is None else DataPlan(
        eval_dataset, BatchingConfig.from_args(training_args, for_eval=True, **batching), log=False, vision=vision,
        template_tokens=frame)

    model = AutoModel.from_pretrained(model_args.model_name_or_path, training_args, model_args.trust_remote_code,
                                      config=config)
    adapter_config = None
    if finetuning_args.finetuning_type == "lora":
        from .models.lora_io import setup_lora

        adapter_config = setup_lora(model, finetuning_args, list(model_args.adapter_name_or_path or []),
                                    model_args.model_name_or_path, training_args.seed,
                                    finetuning_args.freeze_vision_tower)
    else:
        if finetuning_args.finetuning_type == "freeze":
            apply_freeze(model, finetuning_args)
        apply_multimodal_freeze(model, finetuning_args)

    preference = None
    if stage == "dpo":
        preference = PreferenceConfig(loss=finetuning_args.pref_loss, beta=finetuning_args.pref_beta,
                                      label_smoothing=finetuning_args.dpo_label_smoothing,
                                      ftx=finetuning_args.pref_ftx, simpo_gamma=finetuning_args.simpo_gamma)

    grouped = getattr(model.transformer_config, "moe_grouped_gemm", None) if config.num_experts else None
    processor = tokenizer_module.get("processor")
    trainer = McaTrainer(
        model=model, args=training_args, layout=layout, train_data=train_plan, eval_data=eval_plan,
        tokenizer=tokenizer, processor=processor, callbacks=callbacks, preference=preference,
        reference_model=finetuning_args.ref_model if stage == "dpo" else None,
        side_files=SideFiles(config, layout, grouped, tokenizer, processor, adapter_config=adapter_config,
                             run=run_record(stage, finetuning_args.finetuning_type, config)),
    )

    if torch.distributed.get_rank() == 0:
        on_rank = count_parameters(model.chunks)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info("\n" + startup_summary(
            layout=layout, args=training_args,
            model_type=config.hf_model_type + _describe_mtp(model.transformer_config),
            params_total=model_parameter_count(config), params_on_rank=on_rank,
            kernels=spec.describe_kernels(model.transformer_config), tokens_per_step=trainer.tokens_per_step(),
            steps=trainer.max_steps, data_stats=format_stats(train_plan.stats),
            memory=memory_estimate_gib(on_rank, training_args, layout.dp, trainable),
            tuning=f"{model.lora.describe()}: {trainable / 1e6:,.2f}M trainable parameters on this rank "
                   f"({100 * trainable / max(on_rank, 1):.2f}%)" if model.lora else None,
            moe=describe_load_balancing(model.transformer_config, config.hf_model_type, balancing)
            if config.num_experts else None))

    result = trainer.train(training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    if trainer.is_world_process_zero() and finetuning_args.plot_loss:
        keys = ["loss"] + (["eval_loss"] if eval_plan is not None else [])
        plot_loss(training_args.output_dir, keys=keys + (["rewards/accuracies"] if stage == "dpo" else []))
    parallel.destroy()
