"""The native core attention: a drop-in for Megatron's ``core_attention`` submodule without TE.

Megatron's ``SelfAttention`` does the projections, the qk-norm and RoPE (per packed sequence from
``cu_seqlens`` for THD, in pure torch when ``apply_rope_fusion`` is off), squeezes the batch dimension of
THD tensors to ``[t, h, d]``, then calls this module with ``(query, key, value, attention_mask,
attn_mask_type, attention_bias, packed_seq_params)`` and reshapes what comes back to ``[t, 1, h·d]``
(THD) or expects ``[s, b, h·d]`` (padded). Head counts are read off the tensors, so GQA, and TP with
fewer K/V heads than ranks, need nothing special.

Which kernel runs (see ``kernels.py``):

================  ===========================================  ===========================================
batch             context_parallel_size = 1                    context_parallel_size > 1
================  ===========================================  ===========================================
padded [s,b,h,d]  SDPA, causal, ``enable_gqa``, dropout        K/V all-gather + causal segments (varlen)
packed [t,h,d]    causal varlen_attn over ``cu_seqlens``       K/V all-gather + causal segments (varlen)
================  ===========================================  ===========================================

Sliding windows (Megatron's ``window_size`` on the layers ``window_attn_skip_freq`` names) narrow every row:
varlen_attn's own ``window_size`` on the GPU, a band mask in the SDPA calls elsewhere.

On CPU the varlen calls become a loop of SDPA calls with the same math. ``apply_query_key_layer_scaling``
needs no code here: Megatron divides the softmax scale by the layer number and multiplies the scores back
before the softmax, an fp16 range trick whose net scale is 1 (SDPA and flash accumulate in fp32).
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)

from ...errors import UserError
from . import context_parallel as cp_utils
from .kernels import (
    SegmentPlan,
    image_look_ahead_mask,
    masked_attention,
    one_sequence,
    padded_attention,
    sbhd_to_thd,
    segment_attention,
    varlen_usable,
)


_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


class NativeDotProductAttention(MegatronModule):
    """Causal self-attention on PyTorch kernels: padded (SDPA) and packed THD (varlen_attn), with CP."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,  # multi-latent attention passes its q/k and v head dims: read off the tensors
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        check_supported(config)
        if attention_type != "self":
            raise ValueError(f"the native attention does self-attention only (got attention_type={attention_type!r})")
        self.layer_number = max(1, layer_number)
        # a sliding window's left reach on the layers Megatron's pattern names (HF's sliding_window W: W - 1)
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
        self.window = config.window_size[0] if windowed else None
        self.attn_mask_type = attn_mask_type
        # the model's image look-ahead: on every layer (Gemma 3), or on the windowed ones only ("windowed": Gemma 4);
        # where it is off, the image blocks the VL model passes as the mask are not this layer's
        look_ahead = getattr(config, "image_look_ahead", False)
        self.image_blocks = bool(look_ahead)
        self.image_look_ahead = bool(look_ahead) and (look_ahead != "windowed" or self.window is not None)
        self._init_sink(config, pg_collection)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group(
            check_initialized=False)
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        self.cp_rank = self.cp_group.rank() if self.cp_group is not None else 0
        if self.cp_size > 1 and self.dropout_p > 0:
            raise UserError(f"attention_dropout={self.dropout_p} with context_parallel_size={self.cp_size}: the "
                             "native context-parallel attention has no dropout. Set attention_dropout: 0.")

    def _init_sink(self, config: TransformerConfig, pg_collection) -> None:
        """Megatron's ``softmax_type``: ``learnable`` adds a trained logit per head to every softmax's denominator
        (gpt-oss's attention sinks), ``off-by-one`` a constant 0; as Megatron's local attention holds it
        (``softmax_offset``, this rank's heads, split over TP like them), marked tensor-parallel so the gradient norm
        counts every rank's heads."""
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
            return
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        self.tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        offset = torch.zeros(config.num_attention_heads // self.tp_group.size(), device=device,
                             dtype=config.params_dtype)
        if config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", offset, persistent=False)
            return
        self.softmax_offset = torch.nn.Parameter(offset)
        if config.perform_initialization:
            config.init_method(self.softmax_offset)
        tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The learnable sink logits, split over TP by head (Megatron's local attention's keys)."""
        if not isinstance(self.softmax_offset, torch.nn.Parameter):
            return {}
        return make_sharded_tensors_for_checkpoint(
            {"softmax_offset": self.softmax_offset}, prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"])

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise UserError("attention_bias is not supported by the native attention.")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL
        if self.image_look_ahead and attention_mask is not None:
            return self._image_look_ahead(query, key, value, attention_mask, packed_seq_params)
        if self.image_blocks:
            attention_mask = None  # causal alone here
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if not causal:
                raise ValueError(f"packed (THD) batches need causal attention, got attn_mask_type={mask_type}")
            if self.training and self.dropout_p > 0:
                raise UserError(f"attention_dropout={self.dropout_p} with packed sequences: varlen_attn has no "
                                 "dropout. Set attention_dropout: 0 or turn sequence packing off.")
            out = self._packed(query, key, value, packed_seq_params)
            return out.reshape(out.size(0), -1)
        if self.cp_size > 1:
            if attention_mask is not None or not causal:
                raise ValueError("context parallelism with the native attention needs causal attention without an "
                                 "explicit attention_mask (pass attention_mask=None; padding sits at the end).")
            return self._padded_context_parallel(query, key, value)
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return padded_attention(query, key, value, self.softmax_scale, causal, attention_mask, dropout,
                                        self.window, self.softmax_offset)
        return padded_attention(query, key, value, self.softmax_scale, causal, attention_mask, dropout, self.window,
                                self.softmax_offset)

    def _packed(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        cu_seqlens = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if self.cp_size == 1 and self.window is None and self.softmax_offset is None and cu_seqlens.numel() == 2 \
                and params.max_seqlen_q == query.size(0):  # one sequence (long rows): cuDNN where it takes it
            out = one_sequence(query, key, value, self.softmax_scale)
            if out is not None:
                return out
        if self.cp_size == 1 and varlen_usable(query, self.window):
            # The kernel takes the boundaries as they are, on the device: no host read, so nothing here stops a
            # CUDA graph capture, and empty sequences (a graphed run's unused slots) cost nothing.
            plan = SegmentPlan(cu_q=cu_seqlens, cu_k=cu_seqlens, max_q=params.max_seqlen_q, max_k=params.max_seqlen_kv,
                               q_lens=(), k_lens=())
            return segment_attention(query, key, value, plan, self.softmax_scale, self.window, self.softmax_offset)
        plan = self._cached_plan(params, cu_seqlens, query)
        if self.cp_size > 1:
            key, value = self._gathered(key, value, plan)
        return segment_attention(query, key, value, plan, self.softmax_scale, self.window, self.softmax_offset)

    def _image_look_ahead(self, query, key, value, blocks: torch.Tensor,
                          params: PackedSeqParams | None) -> torch.Tensor:
        """Gemma 3: causal (and windowed) attention, and each image's tokens see the whole image, as transformers'
        mask allows (``blocks`` [b, s]: ``data.multimodal.image_blocks``, what the VL model passes as
        ``attention_mask``). Varlen kernels cannot let a query see a later key, so one SDPA call takes the mask; it is
        built once per micro-batch and kind of layer."""
        if self.softmax_offset is not None or self.cp_size > 1:
            raise ValueError("image look-ahead attention has no sinks and no context parallelism")
        packed = params is not None and params.qkv_format == "thd"
        if packed:  # [t, h, d] -> [1, h, t, d]; each position's packed sequence from the boundaries
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        else:  # [s, b, h, d] -> [b, h, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        masks = blocks.__dict__.setdefault("_mca_masks", {})
        if self.window not in masks:
            seq = None
            if packed:
                cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
                positions = torch.arange(q.size(2), device=q.device)
                seq = torch.searchsorted(cu[1:].to(q.device), positions, right=True).unsqueeze(0)
            allowed = image_look_ahead_mask(blocks.to(q.device), seq, self.window)
            # additive, in the activations' dtype: SDPA would convert a boolean mask in every call, and autograd
            # would keep each layer's copy for the backward; one tensor is shared by all
            masks[self.window] = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~allowed, float("-inf"))
        out = masked_attention(q, k, v, masks[self.window], self.softmax_scale,
                               self.dropout_p if self.training else 0.0)
        if packed:
            return out[0].transpose(0, 1).reshape(q.size(2), -1)
        return out.permute(2, 0, 1, 3).reshape(q.size(2), q.size(0), -1)

    def _padded_context_parallel(self, query, key, value) -> torch.Tensor:
        """A padded CP batch is ``b`` packed sequences of the global length: reuse the THD path."""
        s, b = query.shape[:2]
        plan = _padded_plan(b, s, self.cp_size, self.cp_rank, query.device)
        k, v = self._gathered(sbhd_to_thd(key), sbhd_to_thd(value), plan)
        out = segment_attention(sbhd_to_thd(query), k, v, plan, self.softmax_scale, self.window, self.softmax_offset)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _gathered(self, key, value, plan: SegmentPlan):
        key = cp_utils.gather_kv(key, self.cp_group).index_select(0, plan.kv_index)
        value = cp_utils.gather_kv(value, self.cp_group).index_select(0, plan.kv_index)
        return key, value

    def _cached_plan(self, params: PackedSeqParams, cu_seqlens: torch.Tensor, query: torch.Tensor) -> SegmentPlan:
        """One plan per micro-batch, shared by every layer (building it reads cu_seqlens on the host)."""
        cache = params.__dict__.setdefault("_mca_native_plans", {})
        key = (id(cu_seqlens), self.cp_size, self.cp_rank, str(query.device))
        if key not in cache:
            cache[key] = cp_utils.packed_plan(cu_seqlens, self.cp_rank, self.cp_size, query.size(0), query.device)
        return cache[key]


_PADDED_PLANS: dict[tuple, SegmentPlan] = {}


def _padded_plan(batch: int, local_seq: int, cp_size: int, cp_rank: int, device: torch.device) -> SegmentPlan:
    key = (batch, local_seq, cp_size, cp_rank, str(device))
    if key not in _PADDED_PLANS:
        if len(_PADDED_PLANS) > 64:
            _PADDED_PLANS.clear()
        cu = cp_utils.padded_cu_seqlens(batch, local_seq, cp_size)
        _PADDED_PLANS[key] = cp_utils.packed_plan(cu, cp_rank, cp_size, batch * local_seq, device)
    return _PADDED_PLANS[key]


def check_supported(config: TransformerConfig) -> None:
    """Refuse, before any weight is built, what the native attention does not implement."""
    problems = []
    if getattr(config, "softmax_type", "vanilla") not in ("vanilla", "off-by-one", "learnable"):
        problems.append(f"softmax_type={config.softmax_type!r}")
    window = getattr(config, "window_size", None)
    if window is not None and (len(window) != 2 or window[0] < 0 or window[1] != 0):
        problems.append(f"window_size={window} (only causal sliding windows: (left >= 0, 0))")
    if getattr(config, "qk_clip", False):
        problems.append("qk_clip")
    if problems:
        raise ValueError("the native attention (no Transformer Engine) does not support " + ", ".join(problems)
                         + ". Install Transformer Engine or set attention_backend: local.")
