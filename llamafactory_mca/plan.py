"""The run, planned once per process: what a run decides before it touches a process group, a GPU or the data.

``plan_run`` turns the parsed recipe into decisions — the world and the layout, packing and the cutoff, the model
folder and its config (multi-token prediction and the load-balancing weight resolved), the LoRA adapters, the DPO
reference — and makes each check once. The launcher's preflight is this plan plus the dataset and resume checks; each
worker builds its run from the same plan. Nothing here changes the parsed arguments: a decision is a field of the
plan, and what a decision leaves out is a note the worker says once.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
from collections.abc import Callable
from typing import Any

from llamafactory.data.template import TEMPLATES
from llamafactory.hparams.parser import read_args

from .checkpoints import is_ours, run_record, verify_checkpoint
from .checkpoints.hf_io import check_safetensors_files
from .errors import UserError
from .hub import resolve_model
from .models.auto import AutoConfig, mtp_apart_from_features, resolve_load_balancing, resolve_mtp
from .models.config import McaConfig
from .models.families import get_family
from .models.lora.peft_io import plan_lora
from .models.lora.targets import LoraPlan, check_lora_request
from .models.multimodal import check_vision_layout
from .parallel import ParallelLayout, check_layout, cuda_graph_layout_needs
from .planner.check import memory_to_plan_for, training_of
from .planner.micro_batches import Merge, merged, plan_merge
from .stages import PREFERENCE_STAGES, check_no_generation, check_stage
from .trainer.loss import PreferenceConfig


SUPPORTED_FINETUNING = ("full", "freeze", "lora")


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Everything decided about a run before it starts; made by ``plan_run`` only."""

    stage: str
    finetuning_type: str
    layout: ParallelLayout
    packing: bool
    padding_free: bool  # unpacked rows run as THD sequences without their padding (the same rows and loss)
    cutoff_len: int  # the user's: positions per row
    model_path: str  # a local folder (hub ids resolved)
    config: McaConfig  # multi-token prediction and the load-balancing weight as this run trains them
    balancing: str  # where the load-balancing weight came from (the summary says)
    custom_pipeline_layout: bool
    adapters: tuple[str, ...] = ()  # LoRA: adapter folders to merge or continue, in order
    reference: tuple[str, McaConfig] | None = None  # DPO's and KTO's ref_model: its folder and config
    preference: PreferenceConfig | None = None  # DPO's or KTO's loss and its settings
    lora: LoraPlan | None = None  # the adapter a LoRA run trains: its settings and targets
    merge: Merge = Merge(1, "")  # the recipe's micro-batches run k as one (``layout`` is the merged one)
    notes: tuple[str, ...] = ()  # what the plan left out and why, said once by rank 0

    @property
    def record(self) -> dict[str, Any]:
        """What its checkpoints record of the run, and what a resume must match."""
        return run_record(self.stage, self.finetuning_type, self.config)

    @property
    def vision(self) -> bool:
        return self.config.vision_language

    @property
    def tower(self) -> Any:
        """The family's vision tower (``families.base.Vision``), None for a text model."""
        return get_family(self.config).vision if self.vision else None

    @property
    def video_span(self) -> tuple[int, int] | None:
        """The ids around a video written as its frames' image tokens (``families.base.Vision.video_span``)."""
        return self.tower.video_span(self.config.hf_config) if self.vision else None


Resolver = Callable[..., str]  # hub.resolve_model's signature: (name, model_args, field=...) -> a local folder


def plan_run(stage: str, model_args: Any, data_args: Any, training_args: Any, finetuning_args: Any, world_size: int,
             recipe: dict | list | None = None, resolve: Resolver = resolve_model) -> RunPlan:
    """The plan, with every check that needs no process group, in the order a user would fix them. ``recipe``: as
    LLaMA-Factory's ``read_args`` returns it (None: the command line); ``resolve``: how a hub id becomes a folder
    (the launcher downloads; a bare torchrun's ranks take turns per node). The request itself (``check_request``) was
    checked as it was parsed: every process parses through LLaMA-Factory's ``get_train_args``, which the activation
    hook wraps (``launch/plugin.py``), so it runs once per process, first."""
    packing, cutoff_len = packing_request(data_args, training_args, recipe)
    layout = training_args.resolve_layout(world_size, seq_length=cutoff_len)
    model_path = resolve(model_args.model_name_or_path, model_args, field="model_name_or_path")
    tuning = finetuning_args.finetuning_type
    config, mtp_note = plan_mtp(AutoConfig.from_pretrained(model_path, training_args, model_args.trust_remote_code),
                                stage, tuning, training_args)
    config, balancing = resolve_load_balancing(config, training_args, model_args.moe_aux_loss_coef)
    custom = training_args.pipeline_model_parallel_layout is not None
    check_layout(config, layout, custom, training_args.sequence_parallel)
    check_model_fits(config, stage, layout, custom, training_args.recompute_granularity)
    if config.num_experts and training_args.moe_grouped_gemm is False and config.transformer.get("moe_grouped_gemm"):
        raise UserError(f"{config.hf_model_type}: moe_grouped_gemm=False, but this model's experts have biases, "
                        "which only the grouped experts hold. Remove moe_grouped_gemm or set it to true.")
    rebuilt = list(training_args.recompute_modules or ["core_attn"])
    if config.transformer.get("experimental_attention_variant") == "dsa" and "core_attn" in rebuilt and \
            training_args.recompute_granularity == "selective":
        raise UserError(f"{config.hf_model_type}: recompute_modules={rebuilt} with recompute_granularity=selective: "
                        "Megatron recomputes core_attn without what DeepSeek sparse attention's indexer reads (its "
                        "long sequences' scores are recomputed anyway). List other modules (e.g. recompute_modules: "
                        "mla_up_proj,moe_act) or use recompute_granularity: full.")
    reference = None
    if stage in ("dpo", "kto") and getattr(finetuning_args, "ref_model", None):
        ref_path = resolve(finetuning_args.ref_model, model_args, field="ref_model")
        ref_config, _ = plan_mtp(AutoConfig.from_pretrained(ref_path, training_args, model_args.trust_remote_code),
                                 stage, tuning, training_args)
        reference = (ref_path, ref_config)
    notes = (mtp_note,) if mtp_note else ()
    if getattr(training_args, "cuda_graphs", False):
        check_cuda_graphs(stage, finetuning_args, packing, config, layout, training_args)
        if not training_args.run_cuda_graphs():
            notes += ("cuda_graphs: true on CPUs: the layers run eagerly, on the fixed shapes a graph would replay.",)
    adapters: tuple[str, ...] = ()
    lora = None
    if tuning == "lora":
        for path in model_args.adapter_name_or_path or []:
            if os.path.isabs(os.path.expanduser(path)) and not os.path.isdir(os.path.expanduser(path)):
                raise UserError(f"adapter_name_or_path={path!r} is not a peft adapter folder (it does not exist).")
            adapters += (resolve(path, model_args, field="adapter_name_or_path"),)
        lora = plan_lora(config, finetuning_args, list(adapters), layout.etp, layout.tp, training_args.seed)
    preference = preference_config(stage, finetuning_args)
    plan = RunPlan(stage=stage, finetuning_type=tuning, layout=layout, packing=packing,
                   padding_free=not packing and training_args.run_padding_free(), cutoff_len=cutoff_len,
                   model_path=model_path, config=config, balancing=balancing, custom_pipeline_layout=custom,
                   adapters=adapters, reference=reference, preference=preference, lora=lora, notes=notes)
    # last: the memory estimate it checks reads the rest of the plan
    merge = plan_merge(training_args.merge_micro_batches, config, layout, training_of(plan, training_args,
                       finetuning_args), stage, packing, bool(training_args.cuda_graphs), memory_to_plan_for)
    return dataclasses.replace(plan, layout=merged(layout, merge.factor), merge=merge) if merge.factor > 1 else plan


def preference_config(stage: str, finetuning_args: Any) -> PreferenceConfig | None:
    """DPO's loss as pref_loss names it, KTO's with its weights; None for the other stages."""
    if stage == "kto":
        return PreferenceConfig(loss="kto", beta=finetuning_args.pref_beta, ftx=finetuning_args.pref_ftx,
                                desirable_weight=finetuning_args.kto_chosen_weight,
                                undesirable_weight=finetuning_args.kto_rejected_weight)
    if stage == "dpo":
        return PreferenceConfig(loss=finetuning_args.pref_loss, beta=finetuning_args.pref_beta,
                                label_smoothing=finetuning_args.dpo_label_smoothing, ftx=finetuning_args.pref_ftx,
                                simpo_gamma=finetuning_args.simpo_gamma)
    return None


def check_finetuning_type(tuning: str) -> None:
    """Also before LLaMA-Factory's parser, which refuses an unknown value with a bare AssertionError."""
    if tuning not in SUPPORTED_FINETUNING:
        qlora = (" (QLoRA is finetuning_type: lora with quantization_bit, which the Megatron path does not "
                 "support: train LoRA on the bf16 weights)" if "qlora" in str(tuning).lower() else "")
        raise UserError(f"finetuning_type={tuning!r} is not supported with USE_MCA=1; supported: "
                        f"{', '.join(SUPPORTED_FINETUNING)}{qlora}. Use one of those, or unset USE_MCA for OFT with "
                        "LLaMA-Factory's default trainer.")


def check_request(stage: str, model_args: Any, data_args: Any, training_args: Any, finetuning_args: Any) -> None:
    """Refuse what the Megatron path does not do, naming the key and the fix. Its one caller is the guard on
    LLaMA-Factory's ``get_train_args`` (``launch/plugin.py``), where the launcher's preflight, the plan command,
    LlamaBoard's checks and every worker parse the recipe; ``plan_run`` relies on it."""
    check_stage(stage)
    check_no_generation(training_args)
    check_finetuning_type(finetuning_args.finetuning_type)
    if finetuning_args.finetuning_type == "lora":
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
        if data_args.template not in TEMPLATES:
            close = difflib.get_close_matches(data_args.template, list(TEMPLATES), n=3)
            raise UserError(f"template={data_args.template!r} is not one of LLaMA-Factory's templates"
                            + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else "")
                            + "; see llamafactory/data/template.py for the list.")
    if data_args.streaming:
        raise UserError("streaming=True is not supported with USE_MCA=1: micro-batches are planned over the whole "
                         "tokenized dataset (deterministic, resumable packing). Set streaming: false.")
    if stage == "dpo" and finetuning_args.pref_loss not in PreferenceConfig.SUPPORTED:
        raise UserError(f"pref_loss={finetuning_args.pref_loss!r} is not supported with USE_MCA=1; supported: "
                         f"{', '.join(PreferenceConfig.SUPPORTED)}.")
    if stage == "dpo" and getattr(finetuning_args, "ld_alpha", None):
        raise UserError("ld_alpha is not supported with USE_MCA=1.")
    _check_output_dir(training_args.output_dir)



def grouped_experts(config: McaConfig, args: Any) -> bool | None:
    """Whether the experts run as one grouped GEMM: the recipe's ``moe_grouped_gemm``, else the model's (biased
    experts run grouped only: ``families/base.LinearBiases``)."""
    return config.transformer.get("moe_grouped_gemm") if args.moe_grouped_gemm is None else args.moe_grouped_gemm


def check_cuda_graphs(stage: str, finetuning_args: Any, packing: bool, config: McaConfig, layout: ParallelLayout,
                      args: Any) -> None:
    """What per-layer CUDA graphs need: one graph per layer, replaying one pack size, with nothing read on the host
    inside a layer."""
    needs = cuda_graph_layout_needs(layout, args.recompute_granularity, bool(config.num_experts)) + [
        # (what it needs, holds, why)
        ("variable_seq_lengths unset", not args.variable_seq_lengths, "a graph replays one length"),
        ("packing: true", packing, "packs are what get one size per micro-batch"),
        ("stage: sft or pt", stage in ("sft", "pt"), "DPO's reference pass and pairs run other shapes"),
        ("lora_dropout: 0", finetuning_args.finetuning_type != "lora" or not finetuning_args.lora_dropout,
         "LoRA's dropout inside a replayed graph is not verified yet"),
        ("a text model", not config.vision_language,
         "a vision-language model's 3-D positions or image blocks cover the whole pack"),
        ("a model without linear-attention layers", not config.transformer.get("linear_attention_freq"),
         "the gated delta rule plans its chunks on the host"),
        ("a model without per-layer inputs or shared keys and values", not config.on_one_stage,
         "they go from layer to layer outside each layer's graph"),
    ]
    if config.num_experts:
        needs += [
            ("moe_grouped_gemm: true", bool(grouped_experts(config, args)),
             "the sequential experts read each expert's token count on the host"),
            ("moe_local_dispatch unset, without moe_expert_capacity_factor",
             args.moe_local_dispatch is not False and args.moe_expert_capacity_factor is None,
             "only the on-device routing has no host copy"),
        ]
    for key, holds, why in needs:
        if not holds:
            raise UserError(f"cuda_graphs=True needs {key} ({why}). Set cuda_graphs: false.")


def plan_mtp(config: McaConfig, stage: str, finetuning_type: str, args: Any) -> tuple[McaConfig, str | None]:
    """The model's multi-token-prediction layers for this run, and a note when they are left out unasked: trained in
    full pt and sft; left out in LoRA runs (a peft adapter has no place for them, and the base model keeps its own),
    freeze runs (they train chosen decoder layers only) and dpo, kto and rm runs (an MTP layer's loss is next-token
    prediction, not a preference), unless the recipe sets ``mtp_num_layers``. A vision-language model's MTP layer
    needs the image features, which live on the first pipeline stage, and sits on the last: under pipelining it is
    left out (``resolve_mtp``)."""
    asked = getattr(args, "mtp_num_layers", None)
    pipeline = getattr(args, "pipeline_model_parallel_size", 1) or 1
    apart = mtp_apart_from_features(config, pipeline)
    if apart and asked is None:
        return resolve_mtp(config, asked, pipeline), (
            f"{apart}: it is not trained in this run, and the exported model has none, like LLaMA-Factory's default "
            "path's. pipeline_model_parallel_size: 1 trains it.")
    if config.mtp_num_layers and asked is None and (stage in PREFERENCE_STAGES or finetuning_type != "full"):
        why = stage if stage in PREFERENCE_STAGES and finetuning_type == "full" else \
            "LoRA" if finetuning_type == "lora" else finetuning_type
        exported = ("the base model keeps them" if why == "LoRA" else
                    "the exported model has none, like LLaMA-Factory's default path's")
        return resolve_mtp(config, 0, pipeline), (
            f"{config.hf_model_type}: the checkpoint's {config.mtp_num_layers} multi-token-prediction layer(s) are "
            f"not trained in a {why} run ({exported}).")
    return resolve_mtp(config, asked, pipeline), None


def _check_output_dir(output_dir: str) -> None:
    """Try a write where the folder will be created (permission bits alone say nothing for root)."""
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


def check_model_fits(config: Any, stage: str, layout: Any, custom_pipeline_layout: bool = False,
                     recompute_granularity: str | None = None) -> None:
    """Refuse a model this run would train wrongly.
    ``custom_pipeline_layout``: a pipeline_model_parallel_layout places the layers, not the even split (the model
    build then checks where the deepstack layers went); ``recompute_granularity``: the recipe's."""
    if recompute_granularity == "full" and not config.recomputes_whole_layers:
        raise UserError(f"{config.hf_model_type}: recompute_granularity=full with layers that attend with an earlier "
                        "layer's keys and values: a recomputed layer would hand them on without their gradients. Use "
                        "recompute_granularity: selective (or leave it unset).")
    if config.vision_language:
        if stage == "rm":
            raise UserError(f"{config.hf_model_type}: stage rm on vision-language models is not supported with "
                            "USE_MCA=1 yet; sft, pt, dpo and kto are. Unset USE_MCA to run it with LLaMA-Factory's "
                            "default trainer.")
        check_vision_layout(config, layout, custom_pipeline_layout)


def packing_request(data_args: Any, training_args: Any, recipe: dict | list | None = None) -> tuple[bool, int]:
    """(pack?, the user's cutoff_len).

    LLaMA-Factory's DataArguments lowers cutoff_len by one in ``__post_init__`` when the recipe sets packing or
    neat_packing; for pt its parser turns packing on later without lowering it. Which one happened is read
    from the recipe itself (``recipe``: as ``read_args`` returns it; None reads the command line).
    """
    packing = bool(training_args.sequence_packing or data_args.packing or data_args.neat_packing)
    try:
        if recipe is None:
            recipe = read_args()
        if isinstance(recipe, dict):
            lowered = bool(recipe.get("packing") or recipe.get("neat_packing"))
        else:
            lowered = any(a.split("=")[0] in ("--packing", "--neat_packing") for a in recipe) and \
                bool(data_args.packing)
    except Exception:  # called without a recipe on the command line
        lowered = bool(data_args.neat_packing)
    return packing, data_args.cutoff_len + (1 if lowered else 0)


def check_model_files(path: str) -> None:
    """The model's files as far as that is cheap: a checkpoint of ours verifies (its metadata against its data
    files); a Hugging Face folder's safetensors headers parse and match their files' lengths."""
    if is_ours(path):
        verify_checkpoint(path)
    else:
        check_safetensors_files(path)
