"""AutoConfig / AutoModel: a Hugging Face checkpoint (or one of ours) in, this rank's model chunks out.

``AutoModel.from_pretrained(path, args)`` builds only the chunks this rank owns (its pipeline stage,
one chunk per virtual stage) in the layout ``args`` asks for, and reads only its slices of the HF
safetensors. A folder of ours (``checkpoints.is_ours``: training or ``llamafactory-mca convert``) has its dist
checkpoint loaded instead, resharded to the current layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import shutil
import time
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from transformers import AutoConfig as HfAutoConfig

from .. import checkpoints
from ..checkpoints.dist_reader import DistCheckpointReader, named_load_errors
from ..checkpoints.hf_io import SafetensorsSource
from ..compat import has_transformer_engine
from ..cpu_mode import cpu_mode_needed
from ..errors import UserError
from . import spec
from . import value_head as vhead
from .config import McaConfig, rope_inv_freq
from .export import export_hf
from .families import get_family
from .loading import dims_for, load_hf_weights
from .lora.layers import adapter_state
from .native.cross_entropy import DeferredLogits
from .native.fp8 import WeightCasts, use_fp8


logger = logging.getLogger(__name__)

class AutoConfig:
    @staticmethod
    def from_pretrained(path: str, args: Any = None, trust_remote_code: bool = False) -> McaConfig:
        """McaConfig of one of our folders, or from a HF ``config.json``."""
        if checkpoints.is_adapter_checkpoint(path):
            raise UserError(f"{path} is a checkpoint of a LoRA run: it holds the adapter, not the model. Keep "
                            "model_name_or_path on the base model and set adapter_name_or_path to its exported "
                            "adapter "
                            f"({os.path.join(path, 'hf')} with save_hf_model, or llamafactory-mca merge "
                            f"--checkpoint_path {path} --output_path ADAPTER_DIR).")
        if checkpoints.is_ours(path):
            config = McaConfig.from_json_file(checkpoints.config_file(path))
            get_family(config)  # fails clearly for an unknown type
            return config
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path} is neither a Hugging Face model folder (no config.json) nor a "
                             f"llamafactory_mca checkpoint (no {checkpoints.MCA_CONFIG_NAME}).")

        hf = HfAutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        return _drop_missing_mtp(get_family(hf).config_from_hf(hf), path)


def _drop_missing_mtp(config: McaConfig, path: str) -> McaConfig:
    """A config declaring multi-token-prediction layers whose safetensors files hold none (transformers'
    save_pretrained drops them, so a model fine-tuned by LLaMA-Factory's default path has none) trains without them,
    as that path does; said once."""
    if not config.mtp_num_layers:
        return config
    try:
        names = SafetensorsSource(path).keys()
    except Exception:  # no weights here (a config-only folder): loading says what is missing
        return config
    _, (eh_proj,) = get_family(config).weight_table(config).lookup(
        f"decoder.layers.{config.num_layers}.mtp.eh_proj.weight")
    if eh_proj in names:
        return config
    said = torch.distributed.is_initialized() and torch.distributed.get_rank() == 0 and path not in _SAID_NO_MTP
    if said:  # the launcher's preflight stays quiet; rank 0 says it once
        _SAID_NO_MTP.add(path)
        logger.warning("%s: config.json declares %d multi-token-prediction layer(s), "
                       "but %s holds no weights for them (transformers' save_pretrained drops them): training "
                       "without them.", config.hf_model_type, config.mtp_num_layers, path)
    return config.without_mtp()


_SAID_NO_MTP: set[str] = set()


def mtp_apart_from_features(config: McaConfig, pipeline: int) -> str | None:
    """Why a vision-language model's multi-token-prediction layer cannot train in this layout, or None: it takes the
    image features (``multimodal.VisionLanguageModel._shifted_inputs``), which stay on the first pipeline stage, and
    sits on the last."""
    if config.mtp_num_layers and pipeline > 1 and config.vision_language:
        return (f"{config.hf_model_type}: the multi-token-prediction layer takes the image features, which stay on "
                f"the first pipeline stage, but sits on the last (pipeline_model_parallel_size={pipeline})")
    return None


def resolve_mtp(config: McaConfig, asked: int | None, pipeline: int = 1) -> McaConfig:
    """The model's multi-token-prediction layers as asked (``mtp_num_layers``; None: the model's, unless the layout
    cannot train them; 0: leave them out)."""
    apart = mtp_apart_from_features(config, pipeline)
    if apart and asked:
        raise UserError(f"{apart}. Set pipeline_model_parallel_size: 1 to train it, or mtp_num_layers: 0.")
    if apart:
        return config.without_mtp()
    if asked is None or asked == config.mtp_num_layers:
        return config
    if asked == 0:
        return config.without_mtp()
    raise UserError(f"mtp_num_layers={asked}: {config.hf_model_type} has {config.mtp_num_layers} multi-token-"
                     "prediction layer(s) in its checkpoint. Leave mtp_num_layers unset to train them, or set 0 to "
                     "leave them out.")


# The families of ours whose HF modeling LLaMA-Factory's default path hands moe_aux_loss_coef to (its configure_moe);
# it trains the others without a load-balancing loss whatever the recipe says.
LLAMAFACTORY_AUX_LOSS_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_TRACKED_AS = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
               "global_aux_loss": "global_load_balancing_loss"}


def resolve_load_balancing(config: McaConfig, args: Any, moe_aux_loss_coef: float | None) -> tuple[McaConfig, str]:
    """The router's load balancing for this run, and where its weight came from (for the summary).

    LLaMA-Factory's default path trains no load-balancing loss unless ``moe_aux_loss_coef`` is set (transformers
    adds the term only with ``output_router_logits``, which only that key turns on), and never updates a sigmoid
    router's correction bias (a buffer to transformers). That is the default here too, so both paths train the same
    model from the same recipe. ``moe_balancing: checkpoint`` keeps Megatron's practice instead: the checkpoint's
    ``router_aux_loss_coef`` and the expert bias updated towards balanced loads. ``moe_aux_loss_coef`` (or Megatron's
    ``moe_aux_loss_coeff``; set both, they must agree) sets the weight either way. Sigmoid routing (DeepSeek-V3,
    GLM-4.5) has no auxiliary loss of its own: a weight asked for there adds DeepSeek-V3's sequence-wise one
    (``seq_aux_loss``) unless ``moe_router_load_balancing_type`` says otherwise.
    """
    if not config.num_experts:
        return config, ""
    theirs, ours = moe_aux_loss_coef, getattr(args, "moe_aux_loss_coeff", None)
    if theirs is not None and ours is not None and float(theirs) != float(ours):
        raise UserError(f"moe_aux_loss_coef={theirs} (LLaMA-Factory's key) and moe_aux_loss_coeff={ours} (Megatron's) "
                        "disagree on the load-balancing loss weight: set one of them.")
    from_checkpoint = getattr(args, "moe_balancing", "llamafactory") == "checkpoint"
    transformer = dict(config.transformer)
    if transformer.get("moe_router_enable_expert_bias") and not from_checkpoint:
        transformer["moe_router_bias_update_rate"] = 0.0
    if theirs is None and ours is None:
        if from_checkpoint:
            return dataclasses.replace(config, transformer=transformer), "the checkpoint's router_aux_loss_coef"
        transformer["moe_aux_loss_coeff"] = 0.0
        return dataclasses.replace(config, transformer=transformer), "LLaMA-Factory's default"
    transformer["moe_aux_loss_coeff"] = float(theirs if theirs is not None else ours)
    if (transformer["moe_aux_loss_coeff"] and transformer.get("moe_router_load_balancing_type") == "none"
            and getattr(args, "moe_router_load_balancing_type", None) is None):
        transformer["moe_router_load_balancing_type"] = "seq_aux_loss"
    source = "moe_aux_loss_coef" if theirs is not None else "moe_aux_loss_coeff"
    return dataclasses.replace(config, transformer=transformer), source


def describe_load_balancing(tc: Any, model_type: str, source: str) -> str:
    """The summary's MoE line: which load balancing trains, its weight and where that came from, how it is logged,
    where it differs from LLaMA-Factory's default path, and the key that changes it."""
    kind, coeff = tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff
    weight = f"{coeff:g}" if isinstance(coeff, (int, float)) else str(coeff)
    parts = []
    if tc.moe_router_enable_expert_bias:
        parts.append("routing balanced by the expert bias, updated each step (aux-loss-free)"
                     if tc.moe_router_bias_update_rate else
                     "routing with the checkpoint's expert bias, held as loaded (LLaMA-Factory's default path; "
                     "moe_balancing: checkpoint updates it)")
    if source == "LLaMA-Factory's default":
        parts.append("no load-balancing loss, as in LLaMA-Factory's default path (moe_aux_loss_coef sets a weight; "
                     "moe_balancing: checkpoint trains the checkpoint's router_aux_loss_coef)")
    elif kind == "none" or not coeff:
        why = "" if source.startswith("the checkpoint") else f" ({source}: 0)" if not coeff else \
            " (moe_router_load_balancing_type: none)"
        parts.append(f"no load-balancing loss{why}" + ("" if coeff else ", as in LLaMA-Factory's default path"))
    else:
        parts.append(f"load-balancing loss {kind} x {weight} ({source}), logged apart as "
                     f"{_TRACKED_AS.get(str(kind), str(kind))}: loss is the language-model loss")
        if source.startswith("the checkpoint"):
            parts.append(f"LLaMA-Factory's default path trains {model_type} without it (moe_balancing: llamafactory)")
        elif model_type not in LLAMAFACTORY_AUX_LOSS_TYPES:
            parts.append(f"LLaMA-Factory's default path ignores moe_aux_loss_coef for {model_type}")
    if tc.moe_z_loss_coeff:
        parts.append(f"router z-loss x {tc.moe_z_loss_coeff:g}")
    return "; ".join(parts)


def batch_p2p_safe(pp: int, vpp: int | None) -> bool:
    """Whether the pipeline's sends and receives may go out as one batch: on GPUs, unless a rank's two neighbours
    are one rank that a call both sends to twice (PP2 with the interleaved schedule)."""
    return not cpu_mode_needed() and not (pp == 2 and (vpp or 1) > 1)


def _engine_fields(config: McaConfig, args: Any, frozen_base: bool = False) -> dict[str, Any]:
    """TransformerConfig fields that depend on the run, not the model. ``frozen_base``: only adapters train (LoRA)."""
    bf16, fp16 = bool(getattr(args, "bf16", False)), bool(getattr(args, "fp16", False))
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    graphs = getattr(args, "run_cuda_graphs", lambda: False)()
    # Fusions without TE: each weight gradient GEMMed into main_grad (torch's addmm with out_dtype, native/wgrad.py),
    # RoPE and the q/k norms fused (Triton: native/rope_triton.py, native/norm_triton.py). On one H200, dense graphed
    # +15%, MoE eager +8% (+16% since the experts' gradients go into main_grad too; benchmarks/results/h200_fusions);
    # dense eager -7% there while RoPE and the norms were torch.compile'd graphs, whose calls cost host time, and
    # +12.8% with them as Triton kernels (one H100, the Qwen3-8B shape: h100_fp8/call9; launches a step 7.0k -> 4.1k,
    # the 536 mixed-dtype adds of bf16 weight gradients into main_grad gone). Off where only adapters train eagerly:
    # the frozen base computes no weight gradients, and LoRA MoE measured -8% (h200_expert_grads/lora_moe).
    # Multi-latent attention and multimodal RoPE keep the unfused rotation by default; a recipe may set each key.
    fused = not cpu_mode_needed() and (graphs or not frozen_base)
    fields: dict[str, Any] = dict(
        bf16=bf16, fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=cpu_mode_needed(),
        gradient_accumulation_fusion=fused,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=has_transformer_engine(),
        # the fused SwiGLU (no TE; our Triton kernel in Megatron's place, native/swiglu_triton.py): half the
        # activation's GPU time (perf-notes); on CPU spec.prepare_config turns a recipe's request off.
        bias_activation_fusion=not cpu_mode_needed(),
        deallocate_pipeline_outputs=True,
        # Our losses return (sum, count): the step's loss is a per-token mean over the whole global batch.
        calculate_per_token_loss=True,
        # Under pipeline parallelism every micro-batch of a step has one length (trainer/feeder.py), passed to the
        # schedule; without it Megatron exchanges shapes before each transfer (see StepFeeder._step for why not).
        variable_seq_lengths=(args.allow_variable_seq_lengths() if hasattr(args, "allow_variable_seq_lengths")
                              else True) and getattr(args, "pipeline_model_parallel_size", 1) == 1,
        # Batched sends and receives are paired per peer in the order they are posted. At PP2 under the interleaved
        # schedule a rank's previous and next stage are the same rank, and one call sends to both: rank 0's gradient
        # (to its previous stage) met rank 1's receive of an activation (from its previous stage), the two swapped.
        # On four H200s PP2 x VPP2 x DP2 trained on garbage that way (grad norm 1e9 from step 1); gloo on CPU did the
        # same. Megatron's unbatched path puts the two directions on two process groups.
        batch_p2p_comm=batch_p2p_safe(getattr(args, "pipeline_model_parallel_size", 1),
                                      getattr(args, "virtual_pipeline_model_parallel_size", None)),
        apply_rope_fusion=fused and not config.transformer.get("multi_latent_attention")
        and not config.transformer.get("mrope_section"),
        qk_norm_fusion=fused,
        cuda_graph_scope=[],  # megatron-core 0.16.1's default "full" warns that it is deprecated, in every process
        # Whole layers, forward and backward, through megatron-core's CudaGraphManager (no TE needed): recorded in
        # the first step, captured at its end, replayed after (trainer/graphs.py).
        cuda_graph_impl="local" if graphs else "none",
    )
    # alltoall is the fast dispatcher, and the only one Megatron allows with variable sequence lengths
    # (it checks even for dense models).
    fields["moe_token_dispatcher_type"] = "alltoall"
    if config.num_experts:
        fields["moe_router_dtype"] = "fp32"
    return fields


def build_transformer_config(config: McaConfig, args: Any = None, frozen_base: bool = False):
    """Architecture (config) + engine defaults + the run's explicit overrides (args), in that order."""
    overrides = args.get_config_dict() if args is not None else {}
    overrides.pop("mtp_num_layers", None)  # the config's, after resolve_mtp
    engine = {k: v for k, v in _engine_fields(config, args, frozen_base).items() if k not in overrides}
    if not config.num_experts:  # MoE knobs in a recipe shared between dense and MoE models
        overrides = {k: v for k, v in overrides.items() if not k.startswith("moe_")}
    return config.to_transformer_config(overrides, **engine)


class McaModel:
    """This rank's model chunks (one GPTModel per virtual pipeline stage) and the config they came from."""

    def __init__(self, config: McaConfig, transformer_config, chunks: list[torch.nn.Module],
                 fp8_weights: WeightCasts | None = None) -> None:
        self.config = config
        self.transformer_config = transformer_config
        self.chunks = chunks
        self.lora = None  # a lora.LoraRun once apply_lora put adapters on the chunks
        self.fp8_weights = fp8_weights

    def weights_held(self, updates: bool) -> contextlib.AbstractContextManager:
        """Where the weights do not change (one step's forward and backward, or an evaluation's forward): FP8 casts
        each weight once. ``updates``: an optimizer step follows."""
        return self.fp8_weights.holding(updates) if self.fp8_weights is not None else contextlib.nullcontext()

    def parameters(self):
        for chunk in self.chunks:
            yield from chunk.parameters()

    def named_parameters(self):
        for i, chunk in enumerate(self.chunks):
            for name, param in chunk.named_parameters():
                yield (f"chunk{i}.{name}" if len(self.chunks) > 1 else name), param

    def train(self, mode: bool = True) -> McaModel:
        for chunk in self.chunks:
            chunk.train(mode)
        return self

    def eval(self) -> McaModel:
        return self.train(False)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Megatron's sharded state dict for dist checkpointing (keys are global: any layout reloads it). With LoRA
        only the adapters (and ``additional_target`` modules): the frozen base comes from ``model_name_or_path``."""
        # GPTModel needs the data-parallel group where a later stage holds a copy of the embedding (multi-token
        # prediction's); megatron-core's other modules fill it in themselves
        states = [chunk.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None)) for chunk in self.chunks]
        if self.lora is not None:
            states = [adapter_state(state, self.lora.settings.additional) for state in states]
        if len(states) == 1:
            return {"model": states[0]}
        return {f"model{i}": state for i, state in enumerate(states)}

    def load_hf_weights(self, path: str) -> SafetensorsSource:
        family = get_family(self.config)
        src = SafetensorsSource(path, family.source_aliases)
        table = family.weight_table(self.config)
        dims = dims_for(self.config, ps.get_tensor_model_parallel_world_size())
        load_hf_weights(self.chunks, src, table, dims, self.config.num_experts)
        return src

    def load_dist_checkpoint(self, directory: str, strict: bool = True) -> None:
        wanted = self.sharded_state_dict()
        if vhead.heads(self.chunks) and vhead.WEIGHT_KEY not in DistCheckpointReader(directory):
            # a reward model from a checkpoint of another stage: its value head starts new
            wanted = {k: {n: v for n, v in part.items() if not n.startswith(vhead.PREFIX)}
                      for k, part in wanted.items()}
        with named_load_errors(directory):
            state = dist_checkpointing.load(wanted, directory,
                                            strict=StrictHandling.ASSUME_OK_UNEXPECTED if not strict
                                            else StrictHandling.RAISE_UNEXPECTED)
        for i, chunk in enumerate(self.chunks):
            chunk.load_state_dict(state["model" if len(self.chunks) == 1 else f"model{i}"], strict=False)
        check_finite(self.chunks, directory)

    def save_pretrained(self, directory: str, dtype: torch.dtype | None = None) -> None:
        """Hugging Face safetensors + config.json, gathered from every rank (all ranks must call it).

        Writes a folder of ours beside the target and merges it on rank 0 — the same streaming path as
        ``llamafactory-mca merge``, so both exports cannot disagree.
        """
        staging = directory.rstrip("/") + ".dist_tmp"
        checkpoints.write_folder(staging, self.sharded_state_dict(), checkpoints.SideFiles(self.config))
        if torch.distributed.get_rank() == 0:
            export_hf(staging, directory, dtype=dtype)
            shutil.rmtree(staging)
        torch.distributed.barrier()


@torch.no_grad()
def check_finite(chunks: list[torch.nn.Module], source: str) -> None:
    """A UserError naming every parameter loaded from ``source`` that holds NaN or inf (one host sync)."""
    named = [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]
    if not named:
        return
    finite = torch.stack([torch.isfinite(p).all() for _, p in named]).cpu()
    bad = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
    if bad:
        raise UserError(f"{source} holds NaN or inf values in {', '.join(bad[:5])}"
                        + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                        + ": the checkpoint is corrupt or training diverged before it was saved.")


def _mask_vocab_padding(chunk: torch.nn.Module, vocab_size: int) -> None:
    """Logits of the padded vocabulary rows are -inf, so softmax and loss see exactly the model's vocabulary.

    Megatron pads the vocabulary to a multiple of tp × 128; zero rows would still add exp(0) to every softmax
    denominator, making the loss depend on the TP size and differ from Hugging Face's.
    """
    local = chunk.output_layer.weight.shape[0] if chunk.output_layer.weight is not None else \
        chunk.shared_embedding_or_output_weight().shape[0]
    first_padded = vocab_size - ps.get_tensor_model_parallel_rank() * local
    if first_padded >= local:
        return
    start = max(first_padded, 0)

    def hook(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        if isinstance(logits, DeferredLogits):  # fused with the loss, which leaves the padding out
            logits.valid = start
        else:
            logits[..., start:] = float("-inf")  # in place: the linear layer saved nothing that depends on it
        return output

    chunk.output_layer.register_forward_hook(hook)


def _experts_reduced_over_their_data_parallel_group(chunks: list[torch.nn.Module]) -> None:
    """megatron-core reduces an expert's gradient over the expert-data-parallel group only under expert parallelism
    (the ``allreduce`` attribute it sets: ``expert_model_parallel_size > 1``), else over the dense one. Those groups
    differ wherever the experts' tensor-parallel size is not the attention's: under TP2 with whole experts
    (expert_tensor_parallel_size 1, the layout's default) each TP rank runs its own sequence-parallel tokens through
    its copy of every expert, and only the expert-data-parallel group sums the two halves of the gradient."""
    if (ps.get_expert_model_parallel_world_size() > 1
            or ps.get_expert_tensor_parallel_world_size() == ps.get_tensor_model_parallel_world_size()):
        return
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.experts." in name:
                param.allreduce = False


class AutoModel:
    @staticmethod
    def from_config(config: McaConfig, args: Any = None, frozen_base: bool = False) -> McaModel:
        """Build this rank's chunks with random weights (process groups must exist, in a layout the model fits:
        ``parallel.check_layout``, which the run's plan and convert make). ``config`` as the run trains it (its
        multi-token prediction resolved: ``plan.plan_mtp``, or ``resolve_mtp``); ``frozen_base``: only adapters
        will train (LoRA), which changes the speed defaults."""
        tc = build_transformer_config(config, args, frozen_base)
        tp = ps.get_tensor_model_parallel_world_size()
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        inv_freq = rope_inv_freq(config, tc.kv_channels)
        family = get_family(config)
        chunks = []
        for stage in range(vpp or 1):
            vp_stage = stage if vpp else None
            chunk = family.build_chunk(
                mca=config, config=tc, transformer_layer_spec=spec.get_block_spec(tc, vp_stage),
                vocab_size=config.padded_vocab_size(tp),
                max_sequence_length=config.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=config.tie_word_embeddings,
                position_embedding_type="mrope" if config.transformer.get("mrope_section") else "rope",
                rotary_base=config.rotary_base, rotary_percent=config.rotary_percent, vp_stage=vp_stage,
                mtp_block_spec=spec.get_mtp_block_spec(tc, vp_stage),
            )
            if inv_freq is not None:
                chunk.rotary_pos_emb.inv_freq = inv_freq.to(chunk.rotary_pos_emb.inv_freq.device)
            if chunk.post_process:
                _mask_vocab_padding(chunk, config.vocab_size)
            if torch.cuda.is_available():
                chunk.cuda()
            chunks.append(chunk)
        _experts_reduced_over_their_data_parallel_group(chunks)
        fp8_weights = use_fp8(chunks, tc.fp8_training, tc.num_layers) if getattr(tc, "fp8_training", None) else None
        return McaModel(config, tc, chunks, fp8_weights)

    @staticmethod
    def from_pretrained(path: str, args: Any = None, trust_remote_code: bool = False,
                        config: McaConfig | None = None, frozen_base: bool = False, value_head: bool = False
                        ) -> McaModel:
        """``config``: the run's plan of the model at ``path`` (``plan.RunPlan.config``), if made already; otherwise
        read from ``path`` with the multi-token prediction ``args`` asks for. ``value_head``: a reward model's, on the
        last stage (``value_head.py``)."""
        start = time.perf_counter()
        if config is None:
            config = resolve_mtp(AutoConfig.from_pretrained(path, args, trust_remote_code),
                                 getattr(args, "mtp_num_layers", None),
                                 getattr(args, "pipeline_model_parallel_size", 1) or 1)
        model = AutoModel.from_config(config, args, frozen_base)
        built = time.perf_counter()
        attach = (lambda: vhead.attach(model.chunks, config.hf_config, model.transformer_config,
                                       getattr(args, "seed", 42))) if value_head else (lambda: None)
        dist = checkpoints.dist_checkpoint_dir(path) if checkpoints.is_ours(path) else None
        if dist is not None:
            attach()  # a checkpoint of ours holds the head with the rest
            model.load_dist_checkpoint(dist, strict=False)
            what = f"dist checkpoint {dist}"
        else:
            src = model.load_hf_weights(path)
            attach()  # beside the HF weights, in value_head.safetensors (or new)
            what = f"{len(src.files_opened)} safetensors file(s), {src.bytes_read / 2**20:.1f} MiB read on this rank"
            if value_head and vhead.load_file_into(model.chunks, path):
                what += f", {vhead.V_HEAD_SAFE_WEIGHTS_NAME}"
        if torch.distributed.get_rank() == 0:
            peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux
            logger.info("Loaded %s (%s) in %.1f s (built %.1f s, weights %.1f s) from %s; peak host memory of rank 0 "
                        "so far %.2f GiB", config.hf_model_type, what, time.perf_counter() - start, built - start,
                        time.perf_counter() - built, path, peak_rss)
        return model
