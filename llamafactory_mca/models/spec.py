"""Which layer implementation a model is built from: Transformer Engine when importable, else native kernels.

The bridge calls, in this order::

    prepare_config(kwargs_or_config)   # turn off / refuse what this machine cannot do (one line each)
    spec = get_layer_spec(config)      # the TransformerLayer spec for GPTModel
    # or, per model chunk, get_block_spec(config, vp_stage) — also gives the final norm (needed for SP)
    describe_kernels(config)           # one line for the startup summary

Three choices, made once from the config:

- Transformer Engine importable: Megatron's own TE spec (fused attention, TE norms, TE grouped experts).
- ``attention_backend: local``: Megatron's local spec (materialises ``[b, h, s, s]`` scores, no packing, no
  CP) — kept as a reference and an escape hatch.
- otherwise the native spec: Megatron's parallel linears, ``SelfAttention``, ``MoELayer`` and dispatchers,
  with PyTorch kernels for the parts that need TE elsewhere — core attention (SDPA / ``varlen_attn``, CP by
  K/V all-gather), norms (torch RMSNorm/LayerNorm, sequence-parallel aware) and grouped experts
  (``torch._grouped_mm``). Parameter names and dist-checkpoint keys match the local and TE specs.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import replace
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe import grouped_gemm_util
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
    mtp_on_this_rank,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import L2Norm
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules, get_transformer_layer_offset

from ..args import expert_tp
from ..compat import has_transformer_engine
from ..errors import UserError
from . import native
from .mapping import NORM_ALIASES, is_linear_attention_layer, is_moe_layer
from .native import fp8, wgrad
from .native import rope as native_rope
from .native.attention import NativeDotProductAttention, check_supported
from .native.dispatch import LocalDispatchLayer, local_dispatch_applies
from .native.experts import NativeGroupedMLP, describe_experts
from .native.gated_delta import NativeGatedDeltaNet
from .native.gated_delta import describe_kernel as describe_delta_rule
from .native.kernels import cudnn_attention_device, varlen_attn_available, varlen_windows_available
from .native.logit_chunks import native_loss
from .native.moe_block import MoEBlockRouter, moe_block
from .native.norm import (
    NativeNorm,
    ProjectionRMSNorm,
    compiles_head_norms,
    compiles_zero_centred_norms,
    norms_across_heads,
)
from .native.sparse_attention import NativeSparseAttention, sparse_attention
from .native.sublayers import NativeSelfAttention, needs_sublayers


logger = logging.getLogger(__name__)

_QK_NORM = ModuleSpec(module=NativeNorm, params={"mark_sequence_parallel": False, "per_head": True})
# recipe keys of the native spec and model, set on the TransformerConfig they read
NATIVE_OPTIONS = ("moe_local_dispatch", "native_cross_entropy", "chunked_cross_entropy", "qk_norm_fusion",
                  "fp8_training")
_TE_ONLY_BACKENDS = ("flash", "fused", "unfused")


def prepare_config(config: TransformerConfig | dict[str, Any]) -> TransformerConfig | dict[str, Any]:
    """Adjust what this machine cannot honour; refuse what cannot be worked around. Edits in place, returns it.

    Takes the built ``TransformerConfig`` or, better, the keyword arguments about to build one: some
    requests fail inside ``TransformerConfig.__post_init__`` already (``apply_rope_fusion=True`` without TE
    raises there), so the bridge should pass the dict first. Each change logs one line saying why.
    """
    native.install()
    get, put = (config.get, config.__setitem__) if isinstance(config, dict) else (
        lambda k, d=None: getattr(config, k, d), lambda k, v: setattr(config, k, v))
    te = has_transformer_engine()
    backend = _backend_name(get("attention_backend"))
    if get("attention_backend") is not None:
        put("attention_backend", AttnBackend[backend])
    if not te:
        if get("apply_rope_fusion") and (get("multi_latent_attention") or get("rotary_interleaved")):
            _turn_off(put, "apply_rope_fusion", "without Transformer Engine the fused RoPE (compiled, "
                      "models/native/rope.py) does neither multi-latent attention nor interleaved rotation; RoPE runs "
                      "unfused")
        if get("gradient_accumulation_fusion") and not (_has_apex_wgrad() or wgrad.available()):
            _turn_off(put, "gradient_accumulation_fusion", "it needs a GPU (torch's addmm with out_dtype), apex or "
                      "Transformer Engine")
        if get("fp4") or (get("fp8") and not isinstance(config, dict)):
            raise UserError(f"fp8={get('fp8')!r} / fp4={get('fp4')!r} need Transformer Engine, which is not "
                             "installed. Drop the fp8 keys or install Transformer Engine.")
        if get("fp8"):  # ours on torch's scaled matmuls (native/fp8.py): Megatron's fp8 keys would ask for TE
            put("fp8_training", fp8.from_fields({key: config.pop(key) for key in fp8.FIELDS if key in config}))
        if backend in _TE_ONLY_BACKENDS:
            logger.info("attention_backend=%s selects a Transformer Engine kernel, and TE is not installed: using the "
                        "native PyTorch attention (SDPA / varlen_attn) instead.", backend)
            put("attention_backend", AttnBackend.auto)
    if get("bias_activation_fusion") and _cpu_only():
        _turn_off(put, "bias_activation_fusion", "its torch.compile kernels are for GPUs and this run is on CPU")
    if backend == "local" and not te and (get("context_parallel_size") or 1) > 1:
        raise UserError("attention_backend=local cannot do context parallelism (Megatron's local attention "
                         "refuses it). Use attention_backend: auto for the native attention.")
    return config


def get_layer_spec(config: TransformerConfig, moe: bool | None = None, linear: bool = False) -> ModuleSpec:
    """The transformer-layer spec for ``config`` (qk-norm and RMSNorm read from it). ``moe``: an MoE layer or a
    dense one (None: MoE whenever the config has experts; models mixing both take ``get_block_spec``).
    ``linear``: a gated delta-rule layer (hybrid models, always the native spec).

    With GPTModel, Megatron builds the decoder's *final* norm itself, from apex/TE or else its
    ``WrappedTorchNorm``, which refuses sequence parallelism; use ``get_block_spec`` when SP is on.
    """
    choice = _choice(config)
    _log_once(config, choice)
    experts = config.num_moe_experts if moe is not False else None
    if choice == "te":
        # here: gpt_layer_specs loads Megatron's kitchen extension, which only the te and local specs use
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
            qk_l2_norm=getattr(config, "qk_l2_norm", False),
        )
    if choice == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # here: as above

        return get_gpt_layer_local_spec(
            num_experts=experts, moe_grouped_gemm=_local_grouped_gemm(config),
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
            normalization=config.normalization, qk_l2_norm=getattr(config, "qk_l2_norm", False),
        )
    return native_layer_spec(config, experts is not None, linear)


def get_block_spec(config: TransformerConfig, vp_stage: int | None = None,
                   pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """The decoder-block spec of one model chunk: ``get_layer_spec`` for each of its layers plus a final norm
    matching the choice (for the native spec a sequence-parallel-aware torch norm). Pass it to GPTModel as
    ``transformer_layer_spec``; it is per chunk because the layer count depends on ``vp_stage``."""
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    linear = getattr(config, "linear_attention_freq", None)
    kinds = [(_is_moe_layer(config, offset + i), is_linear_attention_layer(linear, offset + i)) for i in range(count)]
    specs = {kind: get_layer_spec(config, *kind) for kind in set(kinds)}
    if _choice(config) == "te":
        final_norm = TENorm
    elif _choice(config) == "native":
        final_norm = NativeNorm
    else:
        final_norm = LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in kinds], layer_norm=final_norm)


def get_mtp_block_spec(config: TransformerConfig, vp_stage: int | None = None) -> Any:
    """The multi-token-prediction block of the chunk that holds it (the last pipeline stage), else None. Each MTP
    layer's transformer layer is of the last decoder layer's kind (``config.is_moe_layer``); its norms and
    projection come from the same choice as the decoder's."""
    if not config.mtp_num_layers or not mtp_on_this_rank(config, ignore_virtual=False, vp_stage=vp_stage):
        return None
    choice = _choice(config)
    backend = {"te": TESpecProvider, "local": LocalSpecProvider}.get(choice, _NativeBackend)
    layer = get_layer_spec(config, _is_moe_layer(config, config.num_layers))
    return MultiTokenPredictionBlockSubmodules(
        layer_specs=[get_mtp_layer_spec_for_backend(layer, backend())] * config.mtp_num_layers)


def _is_moe_layer(config: TransformerConfig, layer: int) -> bool:
    return is_moe_layer(config.num_moe_experts, config.moe_layer_freq, layer)


def native_layer_spec(config: TransformerConfig, moe: bool = True, linear: bool = False) -> ModuleSpec:
    """Megatron's local layer layout with the native core attention, norms and grouped experts (``moe``: the MLP is
    the experts, where the config has them; ``linear``: the gated delta rule in the attention's place)."""
    check_supported(config)
    qk_norm = L2Norm if getattr(config, "qk_l2_norm", False) else _QK_NORM if config.qk_layernorm else IdentityOp
    q_norm = k_norm = qk_norm
    if norms_across_heads(config):
        q_norm, k_norm = (ModuleSpec(module=ProjectionRMSNorm, params={"kind": kind}) for kind in ("query", "key"))
    pre_mlp_norm = NativeNorm
    if config.num_moe_experts and moe:
        mlp = get_moe_module_spec_for_backend(_NativeBackend(), num_experts=config.num_moe_experts,
                                              moe_grouped_gemm=config.moe_grouped_gemm)
        if moe_block(config):  # Gemma 4's (LocalDispatchLayer makes it a MoEBlock): it normalises its inputs itself
            mlp = replace(mlp, submodules=replace(mlp.submodules, router=MoEBlockRouter))
            pre_mlp_norm = IdentityOp
    else:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                              linear_fc2=RowParallelLinear))
    if linear:
        attention = ModuleSpec(module=NativeGatedDeltaNet)
    elif config.multi_latent_attention:
        attention = _mla_spec(config)
    else:
        attention = ModuleSpec(module=NativeSelfAttention if needs_sublayers(config) else SelfAttention,
                               params={"attn_mask_type": AttnMaskType.causal},
                               submodules=SelfAttentionSubmodules(
                                   linear_qkv=ColumnParallelLinear, core_attention=NativeDotProductAttention,
                                   linear_proj=RowParallelLinear, q_layernorm=q_norm, k_layernorm=k_norm))
    return ModuleSpec(
        module=LocalDispatchLayer,  # TransformerLayer; its MoE routes without host syncs where it can
        submodules=TransformerLayerSubmodules(
            input_layernorm=NativeNorm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=dict(NORM_ALIASES),  # dist-checkpoint keys as the TE spec's
        ),
    )


def _mla_spec(config: TransformerConfig) -> ModuleSpec:
    """Multi-latent attention (DeepSeek-V3) as Megatron's local spec lays it out, with the native core attention
    (with DeepSeek's sparse attention, GLM-5's, the native sparse one).

    The latent q/kv norms are always built here rather than through ``qk_layernorm``: with that flag Megatron's
    finalize_model_grads sums every ``q_layernorm`` gradient over tensor-parallel ranks by name, but MLA normalises the
    gathered latent, so that gradient is already whole on each rank (it would come out tp times too large). Under
    sequence parallelism the latent is scattered again and the norms are marked for the sum like any SP norm."""
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear, linear_proj=RowParallelLinear, q_layernorm=NativeNorm,
            kv_layernorm=NativeNorm, core_attention=NativeSparseAttention if sparse_attention(config)
            else NativeDotProductAttention,
        ),
    )


def describe_kernels(config: TransformerConfig) -> str:
    """One line for the startup summary naming the attention and MoE kernels chosen."""
    choice = _choice(config)
    if choice == "te":
        attention, experts = "Transformer Engine", "TE grouped GEMM" if config.moe_grouped_gemm else "TE sequential"
    elif choice == "local":
        attention = "Megatron local (materialised scores, no packing/CP)"
        experts = "grouped_gemm" if _local_grouped_gemm(config) else "sequential loop"
    else:
        packed = "varlen_attn" if varlen_attn_available() else "per-sequence SDPA"
        attention = f"native (SDPA padded, {packed} packed"
        if cudnn_attention_device() and getattr(config, "cuda_graph_impl", "none") != "local":
            attention += ", cuDNN for causal rows and one-sequence packs"  # graphed layers keep flash
        attention += f", CP{config.context_parallel_size} K/V all-gather)" if config.context_parallel_size > 1 else ")"
        experts = describe_experts() if config.moe_grouped_gemm else "sequential loop"
        local = local_dispatch_applies(config, *_expert_parallel_sizes(config))
        experts += ", routing on the device (no host sync)" if local else ", Megatron's alltoall routing"
    absent = "" if choice == "te" else " (Transformer Engine and apex absent: PyTorch kernels)"
    if _native_only(config) and has_transformer_engine():
        absent = f" ({_native_only(config)} has no TE spec)"
    line = f"layer spec: {choice}{absent}; attention: {attention}"
    if config.window_size is not None:
        pattern = config.window_attn_skip_freq
        layers = f"{sum(pattern)} of {len(pattern)} layers" if isinstance(pattern, list) else "every layer"
        how = "varlen_attn window_size" if choice == "native" and varlen_windows_available() else "a band mask"
        line += f"; sliding window {config.window_size[0] + 1} tokens on {layers} ({how})"
        if getattr(config, "window_rotary_base", None):
            line += f", RoPE base {config.window_rotary_base:g} there"
    full = getattr(config, "global_attention", None)
    if full:
        line += (f"; full-attention layers: heads of {full['kv_channels']}, {full['num_query_groups']} key/value heads"
                 + (" (the keys are the values)" if full.get("keys_are_values") else "")
                 + f", RoPE on {full['rope_fraction']:.0%} of each head (base {full['rotary_base']:g})")
    per_layer, sharing = getattr(config, "per_layer_inputs", None), getattr(config, "kv_sharing", None)
    if per_layer:
        line += f"; per-layer inputs of {per_layer['width']} per layer (the decoder's context)"
    if sharing:
        shared = config.num_layers - sharing["first"]
        line += (f"; the last {shared} layers attend with earlier layers' keys and values"
                 + (", their MLP twice as wide" if sharing.get("double_wide_mlp") else ""))
    if getattr(config, "final_logit_softcapping", None):
        line += f"; logits soft-capped at {config.final_logit_softcapping:g}" + (
            " inside the loss's passes, in fp32" if native_loss(config) else "")
    if getattr(config, "image_look_ahead", False):
        where = " on the windowed layers" if config.image_look_ahead == "windowed" else ""
        line += f"; image tokens see their whole image{where}: one SDPA call under a mask"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        how = ("varlen_attn, its output and log-sum-exp corrected for the sink"
               if choice == "native" and varlen_attn_available() and not _cpu_only() else "fp32 scores per sequence")
        line += f"; attention sinks ({config.softmax_type}): {how}"
    if getattr(config, "linear_attention_freq", None):
        line += f"; gated delta rule: {describe_delta_rule()}"
    if sparse_attention(config):
        line += (f"; DeepSeek sparse attention: the lightning indexer's top {config.dsa_indexer_topk} keys per query "
                 "(frozen, as transformers runs it), SDPA under their mask")
    if norms_across_heads(config):
        line += "; q/k norms across all heads (statistics summed over TP ranks)"
    line += f"; MoE experts: {experts}" if config.num_moe_experts else ""
    if getattr(config, "fp8_training", None):
        line += "; " + config.fp8_training.describe(config.num_layers, bool(config.num_moe_experts),
                                                     config.hidden_size)
    if moe_block(config):
        line += (f" beside a dense MLP of {config.moe_shared_expert_intermediate_size} in every layer, each under its "
                 "own norms (Gemma 4's MoE block)")
    rope = getattr(config, "apply_rope_fusion", False) and native_rope.compiled_in_use()
    # q/k norms across heads fuse only where a rank holds every head (ProjectionRMSNorm: no statistics to sum)
    qk_norms = (choice == "native" and getattr(config, "qk_layernorm", False) and compiles_head_norms(config)
                and not getattr(config, "qk_l2_norm", False)
                and not (norms_across_heads(config) and config.tensor_model_parallel_size > 1))
    zero_centred = choice == "native" and compiles_zero_centred_norms(config)
    fused = [name for name, on in (("RoPE", rope), ("q/k norms", qk_norms), ("(1 + w) norms", zero_centred)) if on]
    line += f"; Triton: {' and '.join(fused)}" if fused else ""
    return line + ("; every layer a CUDA graph (forward and backward, captured in step 1)"
                   if getattr(config, "cuda_graph_impl", "none") == "local" else "")


class _NativeBackend(LocalSpecProvider):
    """Megatron's local providers with the native norm, attention and grouped experts."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> Any:
        return _QK_NORM if for_qk else NativeNorm

    def core_attention(self) -> type:
        return NativeDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        if moe_use_grouped_gemm:
            return NativeGroupedMLP, None
        return SequentialMLP, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def _expert_parallel_sizes(config: TransformerConfig) -> tuple[int, int]:
    """(ep, etp) the experts run with: the process groups' sizes once built (TransformerConfig fills an unset
    expert_tensor_parallel_size with the tensor-parallel size, but the layout's default is 1), else the config's."""
    if ps.model_parallel_is_initialized():
        return ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    return config.expert_model_parallel_size, expert_tp(config)


def _native_only(config: TransformerConfig) -> str | None:
    """What of the model only the native spec builds (None: nothing)."""
    if getattr(config, "linear_attention_freq", None):
        return "hybrid linear-attention model: our gated delta-rule layer"
    if sparse_attention(config):
        return "DeepSeek sparse attention: our indexer and attention"
    if needs_sublayers(config):
        return "post-sublayer norms / a RoPE base per layer kind: our attention and MLP sublayers"
    if moe_block(config):
        return "Gemma 4's MoE block: our block around Megatron's MoE layer"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        return "attention sinks on packed sequences: our attention"
    if norms_across_heads(config):
        return "q/k norms across all heads: our ProjectionRMSNorm"
    if config.num_moe_experts and getattr(config, "add_bias_linear", False) and config.moe_grouped_gemm:
        return "biased grouped experts: our grouped GEMM"
    return None


def _choice(config: TransformerConfig) -> str:
    if _native_only(config):
        return "native"
    if has_transformer_engine():
        return "te"
    if _backend_name(config.attention_backend) == "local":
        return "local"
    return "native"


def _backend_name(value: Any) -> str:
    if value is None:
        return "auto"
    return value.name if isinstance(value, AttnBackend) else str(value)


def _local_grouped_gemm(config: TransformerConfig) -> bool:
    """Megatron's local grouped experts need the ``grouped_gemm`` package; without it use SequentialMLP."""
    if config.moe_grouped_gemm and not grouped_gemm_util.grouped_gemm_is_available():
        logger.info("moe_grouped_gemm with attention_backend=local needs the grouped_gemm package: using "
                    "SequentialMLP experts (attention_backend: auto gives torch._grouped_mm experts).")
        return False
    return bool(config.moe_grouped_gemm)


def _turn_off(put, name: str, why: str) -> None:
    put(name, False)
    logger.info("%s=True turned off: %s.", name, why)


def _has_apex_wgrad() -> bool:
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def _cpu_only() -> bool:
    return not torch.cuda.is_available()


_LOGGED: set[tuple] = set()


def _log_once(config: TransformerConfig, choice: str) -> None:
    key = (choice, bool(config.num_moe_experts), bool(config.moe_grouped_gemm), config.context_parallel_size)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.debug(describe_kernels(config))  # the startup summary prints it
