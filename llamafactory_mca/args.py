"""Our recipe keys and their checks.

``DistributingParallelArguments`` holds what goes into Megatron's ``TransformerConfig``;
``MegatronArguments`` adds the engine knobs (DDP, optimizer, packing). ``training_args.py`` mixes them into
Hugging Face's ``TrainingArguments``, so one YAML recipe carries LLaMA-Factory, Trainer and Megatron keys.
Every cross-field check runs in ``__post_init__``, before any process group or GPU exists, and raises a
``UserError`` that names the fields, their values and the fix. This module imports nothing heavy, so
``llamafactory-mca train --help`` can list the keys in a moment.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import UserError


logger = logging.getLogger(__name__)

DISPATCHERS = ("allgather", "alltoall")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "rowwise", "delayed", "mxfp8", "blockwise", "custom")  # rowwise: ours (torchao's)
FP8_NATIVE_RECIPES = ("tensorwise", "rowwise", "delayed")  # what runs without TE (models/native/fp8.py)
FP8_AMAX_ALGOS = ("most_recent", "max")
ROUTER_DTYPES = ("fp32", "fp64")
DROP_POLICIES = ("probs", "position")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
OPTIMIZERS = ("adam", "sgd")
MOMENT_DTYPES = ("fp32", "bf16")  # exp_avg_dtype / exp_avg_sq_dtype (Megatron's also take fp16 and fp8)
PT_BLOCKS = ("documents", "concatenated")
MOE_BALANCING = ("llamafactory", "checkpoint")
# The sizes that make a layout: each of ``parallel.ParallelLayout``'s sizes and the recipe key that sets it, the one
# place these names are written (here, not in parallel.py: this module stays light). Written into every checkpoint
# (mca_layout.json) in this order, accepted by merge and convert.
LAYOUT_KEY = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
              "vpp": "virtual_pipeline_model_parallel_size", "ep": "expert_model_parallel_size",
              "etp": "expert_tensor_parallel_size", "cp": "context_parallel_size"}
LAYOUT_KEYS = tuple(LAYOUT_KEY.values())


def expert_tp(args: Any) -> int:
    """``expert_tensor_parallel_size`` as the layout takes it (``args``: the recipe's arguments, or a
    TransformerConfig): unset is 1, each expert whole on its rank; megatron-core's own default would be the
    tensor-parallel size."""
    return args.expert_tensor_parallel_size or 1


def _split_csv(value: Any) -> Any:
    """Accept ``"a,b"`` from a command line and ``[a, b]`` from YAML alike."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)


def _merge_request(value: Any) -> str | int:
    """``merge_micro_batches`` as "auto" or a positive integer (YAML gives an int, the command line a string)."""
    if str(value).strip().lower() == "auto":
        return "auto"
    if str(value).strip().isdigit() and int(value) >= 1:
        return int(value)
    raise UserError(f"merge_micro_batches={value!r}: give auto, 1 (never merge) or a positive integer that divides "
                    "gradient_accumulation_steps.")


def _one_of(name: str, value: Any, choices: tuple) -> None:
    _require(value is None or value in choices, f"{name}={value!r} is not one of {', '.join(choices)}.")


@dataclass
class DistributingParallelArguments:
    """What Megatron's TransformerConfig receives: parallel layout, recompute, fusions, MoE, fp8.

    Layout sizes default to 1. The model-side knobs default to None: a checkpoint's own
    ``mca_config.json`` holds them too, and a None here never overrides it.
    """

    tensor_model_parallel_size: int = field(default=1, metadata={"help": "Tensor parallel size (TP)."})
    pipeline_model_parallel_size: int = field(default=1, metadata={"help": "Pipeline parallel size (PP)."})
    virtual_pipeline_model_parallel_size: int | None = field(
        default=None, metadata={"help": "Model chunks per pipeline stage (VPP, interleaved schedule)."}
    )
    context_parallel_size: int = field(default=1, metadata={"help": "Context parallel size (CP)."})
    expert_model_parallel_size: int = field(default=1, metadata={"help": "Expert parallel size (EP)."})
    expert_tensor_parallel_size: int | None = field(
        default=None, metadata={"help": "Tensor parallel size inside expert layers (ETP); default 1."}
    )
    sequence_parallel: bool = field(default=False, metadata={"help": "Sequence parallelism (needs TP > 1)."})
    pipeline_model_parallel_layout: str | None = field(
        default=None,
        metadata={"help": "Megatron layout string, e.g. 'Et*3|t*3L'; its stage count sets the virtual size."},
    )
    recompute_granularity: str | None = field(default=None, metadata={"help": "full or selective."})
    recompute_method: str | None = field(default=None, metadata={"help": "uniform or block (full only)."})
    recompute_num_layers: int | None = field(default=None, metadata={"help": "Layers per recompute unit."})
    recompute_modules: str | None = field(
        default=None, metadata={"help": f"Selective recompute modules, list or comma-separated: {RECOMPUTE_MODULES}."}
    )
    moe_layer_recompute: bool | None = field(default=None, metadata={"help": "Recompute whole MoE layers."})
    bias_activation_fusion: bool | None = field(default=None, metadata={"help": "Fuse bias + activation."})
    gradient_accumulation_fusion: bool | None = field(
        default=None, metadata={"help": "GEMM each weight gradient straight into the fp32 main_grad (apex, TE, or on "
                                        "GPUs torch's addmm with out_dtype); default on on GPUs unless only LoRA "
                                        "adapters train."}
    )
    apply_rope_fusion: bool | None = field(
        default=None, metadata={"help": "Fused RoPE: Transformer Engine's, or without it the same rotation as a "
                                        "Triton kernel (models/native/rope.py); default on on GPUs unless only LoRA "
                                        "adapters train."}
    )
    moe_token_dispatcher_type: str | None = field(default=None, metadata={"help": "allgather or alltoall."})
    moe_router_load_balancing_type: str | None = field(default=None, metadata={"help": f"{LOAD_BALANCING}."})
    moe_aux_loss_coeff: float | None = field(default=None, metadata={"help": "Load-balancing loss weight."})
    moe_z_loss_coeff: float | None = field(default=None, metadata={"help": "Router z-loss weight."})
    moe_grouped_gemm: bool | None = field(default=None, metadata={"help": "Run local experts as one grouped GEMM."})
    moe_expert_capacity_factor: float | None = field(default=None, metadata={"help": "Token drop capacity."})
    moe_token_drop_policy: str | None = field(default=None, metadata={"help": "probs or position."})
    moe_pad_expert_input_to_capacity: bool | None = field(default=None, metadata={"help": "Pad to capacity."})
    moe_shared_expert_overlap: bool | None = field(default=None, metadata={"help": "Overlap shared experts."})
    moe_router_dtype: str | None = field(default=None, metadata={"help": "fp32 or fp64 router math."})
    moe_local_dispatch: bool | None = field(
        default=None, metadata={"help": "Route MoE tokens on the device, without host syncs, where every expert is on "
                                        "the rank (ep = etp = 1, no token dropping); default on. false: Megatron's "
                                        "dispatcher."}
    )
    qk_norm_fusion: bool | None = field(
        default=None, metadata={"help": "The per-head q/k RMSNorms, and every (1 + weight) norm (Gemma 3, Qwen3-Next, "
                                        "Qwen3.5), as Triton kernels on GPUs (models/native/norm.py); default on "
                                        "unless only LoRA adapters train."}
    )
    native_cross_entropy: bool | None = field(
        default=None, metadata={"help": "The language-model loss from the bf16 logits without Megatron's fp32 copy of "
                                        "them (models/native/cross_entropy.py); default on. false: Megatron's."}
    )
    chunked_cross_entropy: bool | None = field(
        default=None, metadata={"help": "The output layer and the loss a chunk of 4,096 tokens at a time, never the "
                                        "whole logits (forward and backward; TP and PP too): default on where a "
                                        "micro-batch's bf16 logits would pass 4 GiB per GPU (long rows), as Liger's "
                                        "fused linear cross-entropy. false: the logits at once (faster when they "
                                        "fit)."}
    )
    mtp_num_layers: int | None = field(
        default=None, metadata={"help": "Multi-token-prediction layers (DeepSeek-V3, GLM-4.5): unset trains the "
                                        "checkpoint's (full pt, sft); 0 leaves them out (LoRA, freeze and dpo runs "
                                        "do)."}
    )
    mtp_loss_scaling_factor: float | None = field(
        default=None, metadata={"help": "Weight of the multi-token-prediction loss in the gradient (Megatron's "
                                        "default 0.1)."}
    )
    calculate_per_token_loss: bool | None = field(default=None, metadata={"help": "Per-token loss scaling."})
    variable_seq_lengths: bool | None = field(
        default=None, metadata={"help": "Micro-batches of different lengths (set automatically when needed)."}
    )
    fp8: str | None = field(
        default=None, metadata={"help": "FP8 GEMMs: e4m3, or hybrid (gradients in e5m2); true, as LLaMA-Factory "
                                        "writes it, is e4m3 rowwise (its torchao default)."}
    )
    fp8_recipe: str | None = field(
        default=None, metadata={"help": f"FP8 scaling, {FP8_RECIPES}: without Transformer Engine tensorwise (the "
                                        "default) or rowwise."}
    )
    fp8_param: bool | None = field(default=None, metadata={"help": "Keep parameters in fp8 (Transformer Engine)."})
    fp8_wgrad: bool | None = field(
        default=None, metadata={"help": "The weight gradients' GEMMs in FP8 too (default true); false: in bf16."}
    )
    first_last_layers_bf16: bool | None = field(
        default=None, metadata={"help": "Keep the first and last layers in bf16 under fp8 (default true)."}
    )
    num_layers_at_start_in_bf16: int | None = field(
        default=None, metadata={"help": "Layers kept in bf16 at the start under first_last_layers_bf16 (default 1)."}
    )
    num_layers_at_end_in_bf16: int | None = field(
        default=None, metadata={"help": "Layers kept in bf16 at the end under first_last_layers_bf16 (default 1)."}
    )
    fp8_amax_history_len: int | None = field(
        default=None, metadata={"help": "fp8_recipe delayed: steps of absolute maxima kept (default 1)."}
    )
    fp8_amax_compute_algo: str | None = field(
        default=None, metadata={"help": f"fp8_recipe delayed, {FP8_AMAX_ALGOS}: the scale from the last step's "
                                        "maximum (default) or the largest in the history."}
    )
    fp8_margin: int | None = field(
        default=None, metadata={"help": "fp8_recipe delayed: scales 2^margin below the FP8 range (default 0)."}
    )
    attention_backend: str | None = field(
        default=None, metadata={"help": f"{ATTENTION_BACKENDS}; auto picks TE or the native kernels."}
    )
    additional_configs: str | None = field(
        default=None, metadata={"help": "Extra TransformerConfig fields: a dict, a JSON string or a JSON file path."}
    )

    def __post_init__(self) -> None:
        self.recompute_modules = _split_csv(self.recompute_modules)
        self.additional_configs = self._load_additional_configs(self.additional_configs)
        self._check_parallel_arguments()

    @staticmethod
    def _load_additional_configs(value: Any) -> dict | None:
        if value is None or isinstance(value, dict):
            return value
        if isinstance(value, str) and value.strip().startswith("{"):
            return json.loads(value)
        if isinstance(value, str) and os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                return json.load(f)
        raise UserError(f"additional_configs={value!r} is neither a dict, a JSON string nor an existing JSON file.")

    def _check_parallel_arguments(self) -> None:
        for name in LAYOUT_KEYS:
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and value >= 1),
                     f"{name}={value!r} must be a positive integer.")
        _one_of("moe_token_dispatcher_type", self.moe_token_dispatcher_type, DISPATCHERS)
        _one_of("recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        _one_of("recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        self._read_fp8_spelling()
        _one_of("fp8", self.fp8, FP8_FORMATS)
        _one_of("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        _one_of("fp8_amax_compute_algo", self.fp8_amax_compute_algo, FP8_AMAX_ALGOS)
        _one_of("moe_router_dtype", self.moe_router_dtype, ROUTER_DTYPES)
        _one_of("moe_token_drop_policy", self.moe_token_drop_policy, DROP_POLICIES)
        _one_of("moe_router_load_balancing_type", self.moe_router_load_balancing_type, LOAD_BALANCING)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)

        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if self.sequence_parallel and tp == 1:
            raise UserError(
                "sequence_parallel=True needs tensor_model_parallel_size > 1 (got 1): sequence parallelism splits "
                "activations across the TP group. Set tensor_model_parallel_size >= 2 or sequence_parallel: false."
            )
        if self.expert_model_parallel_size > 1 and tp > 1 and not self.sequence_parallel:
            logger.warning(
                "expert_model_parallel_size=%d with tensor_model_parallel_size=%d: turning sequence_parallel on, "
                "as Megatron's MoE layers require it.", self.expert_model_parallel_size, tp,
            )
            self.sequence_parallel = True

        if self.pipeline_model_parallel_layout is not None:
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

            stages = PipelineParallelLayerLayout.get_num_stages_from_str(self.pipeline_model_parallel_layout)
            _require(stages % pp == 0,
                     f"pipeline_model_parallel_layout={self.pipeline_model_parallel_layout!r} has {stages} stages, "
                     f"not a multiple of pipeline_model_parallel_size={pp}. Give pp x vpp stages separated by '|'.")
            vpp = stages // pp
            _require(self.virtual_pipeline_model_parallel_size in (None, vpp) or vpp == 1,
                     f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size} contradicts "
                     f"pipeline_model_parallel_layout ({stages} stages / pp {pp} = {vpp}). Drop one of them.")
            self.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
        if self.virtual_pipeline_model_parallel_size is not None and self.virtual_pipeline_model_parallel_size > 1:
            _require(pp > 1,
                     f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size} needs "
                     "pipeline_model_parallel_size > 1 (got 1). Raise pipeline_model_parallel_size or drop the "
                     "VPP size.")
        if self.virtual_pipeline_model_parallel_size == 1:
            self.virtual_pipeline_model_parallel_size = None

        self._check_recompute()
        self._check_moe()
        self._check_fp8()

    def _check_recompute(self) -> None:
        granularity = self.recompute_granularity
        if granularity is None:
            for name in ("recompute_method", "recompute_num_layers", "recompute_modules"):
                _require(getattr(self, name) is None,
                         f"{name}={getattr(self, name)!r} has no effect without recompute_granularity. "
                         "Set recompute_granularity: full (with recompute_method) or selective (with "
                         "recompute_modules).")
            return
        if granularity == "full":
            _require(self.recompute_modules is None,
                     f"recompute_modules={self.recompute_modules} applies to recompute_granularity=selective, "
                     "not full. "
                     "Drop recompute_modules or use recompute_granularity: selective.")
            # Megatron needs both; the guide's recipes give only the granularity: recompute every layer.
            if self.recompute_method is None and self.recompute_num_layers is None:
                self.recompute_method, self.recompute_num_layers = "uniform", 1
            _require(self.recompute_method is not None,
                     f"recompute_num_layers={self.recompute_num_layers} needs recompute_method (uniform or block).")
            _require(self.recompute_num_layers is not None and self.recompute_num_layers >= 1,
                     f"recompute_method={self.recompute_method!r} needs recompute_num_layers >= 1 "
                     f"(got {self.recompute_num_layers}).")
        else:
            for name in ("recompute_method", "recompute_num_layers"):
                _require(getattr(self, name) is None,
                         f"{name}={getattr(self, name)!r} applies to recompute_granularity=full, not selective. "
                         f"Drop {name} or use recompute_granularity: full.")
            unknown = sorted(set(self.recompute_modules or ()) - set(RECOMPUTE_MODULES))
            _require(not unknown, f"recompute_modules has unknown entries {unknown}; choose from {RECOMPUTE_MODULES}.")

    def _check_moe(self) -> None:
        if self.moe_pad_expert_input_to_capacity:
            _require(self.moe_expert_capacity_factor is not None,
                     "moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor (e.g. 1.0).")
        if self.moe_shared_expert_overlap:
            _require(self.moe_token_dispatcher_type in (None, "alltoall"),
                     f"moe_shared_expert_overlap=True needs moe_token_dispatcher_type=alltoall "
                     f"(got {self.moe_token_dispatcher_type}).")
        if self.variable_seq_lengths and self.moe_token_dispatcher_type == "allgather":
            raise UserError(
                "variable_seq_lengths=True is refused with moe_token_dispatcher_type=allgather: that dispatcher "
                "needs one sequence length for all micro-batches. Use moe_token_dispatcher_type: alltoall."
            )
        if self.mtp_num_layers is not None:
            _require(self.mtp_num_layers >= 0, f"mtp_num_layers={self.mtp_num_layers} must be >= 0.")
        if self.mtp_loss_scaling_factor is not None:
            _require(self.mtp_loss_scaling_factor >= 0,
                     f"mtp_loss_scaling_factor={self.mtp_loss_scaling_factor} must be >= 0.")

    def _read_fp8_spelling(self) -> None:
        """LLaMA-Factory's ``fp8: true`` (a bool, or a string from the command line) is its torchao default: E4M3
        with rowwise scaling; false is off."""
        spelled = str(self.fp8).lower() if self.fp8 is not None else None
        if spelled in ("true", "false"):
            self.fp8 = "e4m3" if spelled == "true" else None
            if self.fp8 and self.fp8_recipe is None:
                self.fp8_recipe = "rowwise"

    def _check_fp8(self) -> None:
        keys = ("fp8_recipe", "fp8_param", "fp8_wgrad", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
                "num_layers_at_end_in_bf16", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin")
        if self.fp8 is None:
            for name in keys:
                _require(getattr(self, name) is None or getattr(self, name) is False,
                         f"{name}={getattr(self, name)!r} needs fp8 set to e4m3 or hybrid (got fp8=None).")
            return
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp8_margin"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and value >= 0), f"{name}={value!r} must be >= 0.")
        _require(self.fp8_amax_history_len is None or self.fp8_amax_history_len >= 1,
                 f"fp8_amax_history_len={self.fp8_amax_history_len!r} must be >= 1.")
        from .compat import fp8_unsupported, has_transformer_engine

        if has_transformer_engine():
            _require(self.fp8_recipe != "rowwise",
                     "fp8_recipe='rowwise' is the recipe of our FP8 without Transformer Engine, which is installed "
                     "here and runs Megatron's own recipes. Use fp8_recipe: tensorwise, delayed or blockwise.")
            return
        self.fp8_recipe = self.fp8_recipe or "tensorwise"
        _require(self.fp8_recipe in FP8_NATIVE_RECIPES,
                 f"fp8_recipe={self.fp8_recipe!r} needs Transformer Engine, which is not installed; without it FP8 "
                 f"runs on torch's scaled matmuls. Set fp8_recipe: tensorwise, delayed or rowwise.")
        for name in ("fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin"):
            _require(getattr(self, name) is None or self.fp8_recipe == "delayed",
                     f"{name}={getattr(self, name)!r} sets delayed scaling, but fp8_recipe={self.fp8_recipe!r}. Set "
                     f"fp8_recipe: delayed, or drop {name}.")
        _require(not self.fp8_param,
                 "fp8_param=True keeps the weights in Transformer Engine's FP8 tensors, which is not installed. Drop "
                 "fp8_param: without it the weights stay bf16 and each GEMM casts its own FP8 copy.")
        reason = fp8_unsupported()
        _require(reason is None,
                 f"fp8={self.fp8!r} needs GPUs with FP8 tensor cores (NVIDIA compute capability 8.9 or newer: "
                 f"Ada, Hopper, Blackwell), and {reason}. Drop fp8 (and the fp8_* keys) on this machine.")

    def get_config_dict(self) -> dict[str, Any]:
        """The TransformerConfig overrides: every set field, with additional_configs merged on top."""
        names = [f.name for f in fields(DistributingParallelArguments) if f.name != "additional_configs"]
        config = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        config[LAYOUT_KEY["etp"]] = expert_tp(self)  # set: megatron-core's default is not the layout's
        config.update(self.additional_configs or {})
        return config


@dataclass
class MegatronArguments(DistributingParallelArguments):
    """Engine knobs: Megatron DDP, the optimizer, and how batches are built."""

    accumulate_allreduce_grads_in_fp32: bool = field(
        default=False, metadata={"help": "Accumulate and all-reduce gradients in fp32 (on by default with bf16)."}
    )
    use_distributed_optimizer: bool = field(default=False, metadata={"help": "Shard optimizer states over DP."})
    overlap_grad_reduce: bool = field(default=False, metadata={"help": "Overlap gradient reduce with backward."})
    delay_grad_reduce: bool = field(default=True, metadata={"help": "Delay grad reduce to the last micro-batch."})
    overlap_param_gather: bool = field(default=False, metadata={"help": "Overlap parameter all-gather (dist opt)."})
    ddp_bucket_size: int | None = field(default=None, metadata={"help": "DDP bucket size in elements."})
    ddp_average_in_collective: bool = field(default=False, metadata={"help": "Average in the collective."})
    check_for_nan_in_loss_and_grad: bool = field(
        default=True, metadata={"help": "Skip a step whose loss or gradients are inf/nan (counted and logged); "
                                        "stop after max_nonfinite_steps such steps in a row."}
    )
    max_nonfinite_steps: int = field(
        default=10, metadata={"help": "Stop with a message after this many skipped inf/nan steps in a row."}
    )
    optimizer: str = field(default="adam", metadata={"help": "adam or sgd."})
    optimizer_cpu_offload: bool = field(default=False, metadata={"help": "Keep optimizer states on CPU."})
    store_param_remainders: bool = field(
        default=False, metadata={"help": "Keep each fp32 master weight as its bf16 weight plus a 16-bit remainder "
                                         "(as Transformer Engine's FusedAdam does, here without it): 16 bytes per "
                                         "trained parameter instead of 18, the same fp32 Adam update. Needs bf16, "
                                         "the distributed optimizer and adam, without optimizer_cpu_offload."}
    )
    exp_avg_dtype: str = field(
        default="fp32", metadata={"help": "Adam's first moment: fp32 or bf16 (Megatron's key). bf16 moments (both "
                                          "keys) with store_param_remainders keep 12 bytes per trained parameter "
                                          "instead of 16, as DeepSeek-V3 trained, and their step is one pass."}
    )
    exp_avg_sq_dtype: str = field(default="fp32", metadata={"help": "Adam's second moment: fp32 or bf16."})
    save_hf_model: bool = field(default=False, metadata={"help": "Also write HF safetensors in each checkpoint."})
    sequence_packing: bool = field(default=False, metadata={"help": "Pack rows into THD micro-batches."})
    cuda_graphs: bool = field(
        default=False, metadata={"help": "Capture each transformer layer's forward and backward once as CUDA graphs "
                                         "and replay them (megatron-core's local graphs, no Transformer Engine): "
                                         "fewer kernel launches per step. Packed sft/pt of text models, full, "
                                         "freeze or LoRA tuning (LoRA without dropout), on one pipeline stage; "
                                         "packs get one size. On CPUs only the fixed shapes apply."}
    )
    prefetch_steps: int | None = field(
        default=None, metadata={"help": "Optimizer steps whose micro-batches are collated ahead on a background "
                                        "thread (a vision-language model's pixels and 3-D positions included) while "
                                        "the GPU runs the step before; 0: each step collates its own. Default: 1 on "
                                        "GPUs, 0 on CPUs (where the thread competes with the training for cores)."}
    )
    padding_free: bool | None = field(
        default=None, metadata={"help": "Without sequence_packing: each micro-batch's rows run as variable-length "
                                        "sequences (THD) instead of right-padded rows; the same rows, the same "
                                        "loss, no compute spent on padding. Default: on GPUs (on CPUs the padded "
                                        "kernels are the faster ones). false: padded rows (BSHD)."})
    pt_blocks: str = field(
        default="documents",
        metadata={"help": "pt only. documents: every document split into cutoff_len pieces, each its own sequence "
                          "(no attention across documents, nothing dropped). concatenated: LLaMA-Factory's default "
                          "path, documents joined and cut into cutoff_len blocks (attention crosses documents; each "
                          "tokenizer batch's remainder is dropped)."},
    )
    merge_micro_batches: str = field(
        default="auto",
        metadata={"help": "Packed pt/sft: run k of the recipe's micro-batches as one, accumulating k times fewer: "
                          "the same global batch and tokens per step, one gradient pass over the weights per k "
                          "micro-batches. auto: on one pipeline stage without graphs, MoE models merge until each "
                          "expert's GEMM gets 512 rows (below that its GEMMs, its launches and, for trained experts, "
                          "the fp32 weight-gradient pass per micro-batch cost more), dense ones up to 4,096 tokens x "
                          "4,096 wide, where the planner predicts the larger micro-batch fits the GPU; 1: never; k: "
                          "that many (k divides gradient_accumulation_steps)."},
    )
    moe_balancing: str = field(
        default="llamafactory",
        metadata={"help": "MoE only. llamafactory: as LLaMA-Factory's default path, a load-balancing loss only where "
                          "moe_aux_loss_coef sets its weight, and a sigmoid router's expert bias used as loaded, "
                          "never updated. checkpoint: Megatron's practice, the checkpoint's router_aux_loss_coef "
                          "trains and the expert bias follows each step's loads."},
    )

    def __post_init__(self) -> None:
        DistributingParallelArguments.__post_init__(self)
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("pt_blocks", self.pt_blocks, PT_BLOCKS)
        _one_of("moe_balancing", self.moe_balancing, MOE_BALANCING)
        self.merge_micro_batches = _merge_request(self.merge_micro_batches)
        if self.overlap_param_gather:
            _require(self.use_distributed_optimizer and self.overlap_grad_reduce,
                     f"overlap_param_gather=True needs use_distributed_optimizer=True and overlap_grad_reduce=True "
                     f"(got {self.use_distributed_optimizer} and {self.overlap_grad_reduce}). Set both, or drop "
                     "overlap_param_gather.")
        if self.optimizer_cpu_offload:
            _require(self.use_distributed_optimizer,
                     "optimizer_cpu_offload=True needs use_distributed_optimizer=True (Megatron's hybrid CPU "
                     "optimizer).")
        if self.store_param_remainders:
            _require(self.use_distributed_optimizer and self.optimizer == "adam" and not self.optimizer_cpu_offload,
                     f"store_param_remainders=True needs use_distributed_optimizer=True and optimizer=adam without "
                     f"optimizer_cpu_offload (got {self.use_distributed_optimizer}, {self.optimizer!r} and "
                     f"{self.optimizer_cpu_offload}). Set use_distributed_optimizer: true, or drop "
                     "store_param_remainders.")
        for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            value = getattr(self, key)
            _require(value in MOMENT_DTYPES, f"{key}={value!r} is not one of {', '.join(MOMENT_DTYPES)}. Use "
                                             f"{key}: bf16 (with store_param_remainders: true) or drop it.")
            _require(value == "fp32" or self.store_param_remainders,
                     f"{key}={value} keeps Adam's moments in the precision-aware Adam of store_param_remainders, "
                     "which is off. Set store_param_remainders: true, or drop the key.")
        _require(self.max_nonfinite_steps >= 1, f"max_nonfinite_steps={self.max_nonfinite_steps} must be >= 1.")
        if self.prefetch_steps is not None:
            _require(self.prefetch_steps >= 0, f"prefetch_steps={self.prefetch_steps} must be >= 0 (0: no prefetch).")
        if self.ddp_bucket_size is not None:
            _require(self.ddp_bucket_size > 0, f"ddp_bucket_size={self.ddp_bucket_size} must be positive.")

    @classmethod
    def from_json_file(cls, path: str) -> MegatronArguments:
        """Rebuild the arguments a run saved with ``to_json_file`` (unknown keys are ignored)."""
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        names = {f.name for f in fields(cls) if f.init}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_json_file(self, path: str) -> None:
        names = [f.name for f in fields(MegatronArguments)]
        data = {name: getattr(self, name) for name in names}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)

    def run_padding_free(self) -> bool:
        """Whether unpacked micro-batches can run as THD rows: asked for (by default on GPUs), micro-batches may
        differ in length, and the attention kernels take THD (auto: the native ones or TE; not Megatron's local spec).
        The plan decides with packing (``RunPlan.padding_free``)."""
        from .cpu_mode import cpu_mode_needed

        wanted = not cpu_mode_needed() if self.padding_free is None else self.padding_free
        return wanted and self.allow_variable_seq_lengths() and self.attention_backend in (None, "auto")

    def run_prefetch_steps(self) -> int:
        """Steps collated ahead: the recipe's, else one on GPUs and none on CPUs."""
        from .cpu_mode import cpu_mode_needed

        if self.prefetch_steps is not None:
            return self.prefetch_steps
        return 0 if cpu_mode_needed() else 1

    def run_cuda_graphs(self) -> bool:
        """Whether layers run as CUDA graphs: asked for and on GPUs (on CPUs only the fixed shapes apply)."""
        from .cpu_mode import cpu_mode_needed

        return self.cuda_graphs and not cpu_mode_needed()

    def allow_variable_seq_lengths(self) -> bool:
        """Whether micro-batches may differ in length: the MoE allgather dispatcher forbids it, padding
        every batch to one length instead; everything else takes the longest row of each micro-batch."""
        if self.cuda_graphs:  # a graph replays one shape
            return False
        if self.variable_seq_lengths is not None:
            return self.variable_seq_lengths
        return self.moe_token_dispatcher_type != "allgather"


@dataclass
class _HostCompatArguments:
    """Keys LLaMA-Factory recipes carry that transformers 5 dropped or that live in LLaMA-Factory's own
    TrainingArguments subclass, which is bypassed under USE_MCA. Without them a common recipe fails with
    "Some keys are not used"."""

    overwrite_output_dir: bool = field(default=False, metadata={"help": "Deprecated; accepted for old recipes."})
    enable_torch_profiler: bool = field(default=False, metadata={"help": "Collect torch profiler traces."})
    profiler_output_dir: str | None = field(default=None, metadata={"help": "Where profiler traces go."})
    profiler_wait_steps: int = field(default=1, metadata={"help": "Profiler wait steps."})
    profiler_warmup_steps: int = field(default=1, metadata={"help": "Profiler warm-up steps."})
    profiler_active_steps: int = field(default=1, metadata={"help": "Profiler active steps."})
    profiler_repeat: int = field(default=1, metadata={"help": "Profiler cycles."})
    profiler_record_shapes: bool = field(default=True, metadata={"help": "Record shapes."})
    profiler_profile_memory: bool = field(default=True, metadata={"help": "Profile memory."})
    profiler_with_stack: bool = field(default=True, metadata={"help": "Record stacks."})
    profile_modules: str | None = field(default=None, metadata={"help": "Module patterns to time."})
    fp8_enable_fsdp_float8_all_gather: bool = field(default=False, metadata={"help": "Unused under MCA."})
    fp8_backend: str = field(
        default="auto", metadata={"help": "LLaMA-Factory's FP8 backend. Under MCA, FP8 runs on Transformer Engine "
                                          "where it is installed and on torch's scaled matmuls elsewhere."}
    )
