"""Layer norms of the native spec: PyTorch's RMSNorm / LayerNorm, usable with sequence parallelism.

Megatron's ``WrappedTorchNorm`` builds the same torch modules but refuses ``sequence_parallel``: under SP
each TP rank normalises a different slice of the sequence, so the norm weights' gradients are partial and
must be summed over the TP group. Megatron does that in ``finalize_model_grads`` for every parameter
marked ``sequence_parallel`` (TE's norms mark theirs the same way), so marking is all it takes. The
qk-norms are not marked: they see the whole sequence but a slice of the heads, and Megatron already
all-reduces ``q_layernorm``/``k_layernorm`` grads by name. State-dict keys (``weight``, ``bias``) equal the
local spec's, so weights move between the two unchanged. ``F.rms_norm`` / ``F.layer_norm`` dispatch to
PyTorch's fused kernels on GPU. ``layernorm_zero_centered_gamma`` (scale 1 + weight) is an RMSNorm of ours.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_config import TransformerConfig

from ...errors import UserError
from .norm_triton import rms_norm


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.size(-1),), None, eps) * weight


class HeadRMSNorm(torch.nn.Module):
    """RMSNorm over each attention head (the q/k norms): ``F.rms_norm`` without a weight, then ``* weight``.

    torch's fused RMSNorm reduces the weight's gradient over every (token, head) row inside its backward kernel,
    which is slow for a 128-wide norm over 65k rows (perf-notes: q-norm 305 us); the separate multiply leaves that
    reduction to a plain sum (240 us). Same values, same parameter (``weight``) and state-dict key as
    ``torch.nn.RMSNorm``. ``fused`` (the ``qk_norm_fusion`` key): one Triton kernel each way on GPUs
    (``norm_triton.py``), which reads q and k where the QKV split left them."""

    def __init__(self, hidden_size: int, eps: float, device, dtype, fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.is_cuda:
            return rms_norm(x, self.weight, self.eps)
        return _head_rms_norm(x, self.weight, self.eps)


class ProjectionRMSNorm(torch.nn.Module):
    """One RMSNorm over all heads of a token's queries (or keys): MiniMax-M2's q/k norm, which transformers applies to
    q_proj's (k_proj's) whole output, heads x head_dim wide. Megatron builds it where the per-head q/k norms go
    (``kind``: which of the two), on [..., heads, head_dim] after the QKV split.

    Under TP a rank holds a contiguous slice of the heads, so the squares are summed over the TP group (an
    all-reduce whose backward sums the gradient too). The weight is kept whole on every rank, each using its heads'
    slice: checkpoints stay the same under any TP, and Megatron's all-reduce of the q/k norms' gradients by name
    sums the ranks' disjoint slices into the whole gradient. As transformers computes it: fp32 statistics, the
    normalised value rounded to the input's dtype, then times the weight."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, kind: str = "query",
                 **_unused) -> None:
        super().__init__()
        heads = config.num_attention_heads if kind == "query" else config.num_query_groups
        self.width, self.eps = heads * hidden_size, eps
        tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        self.group = ps.get_tensor_model_parallel_group() if tp > 1 else None  # None: every head on this rank
        self.local = self.width // tp
        self.start = self.local * (ps.get_tensor_model_parallel_rank() if tp > 1 else 0)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(self.width, device=device, dtype=config.params_dtype))
        self.fused = compiles_head_norms(config) and self.group is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.narrow(0, self.start, self.local)
        if self.fused and x.is_cuda:  # a token's heads as one row (keys, strided after the QKV split, are copied)
            return rms_norm(x.flatten(-2), weight, self.eps).view_as(x)
        return _across_heads_rms_norm(x, weight, self.width, self.eps, self.group)


def _across_heads_rms_norm(x: torch.Tensor, weight: torch.Tensor, width: int, eps: float,
                           group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
    flat = x.flatten(-2).float()
    squares = flat.square().sum(-1, keepdim=True)
    if group is not None:
        squares = torch.distributed.nn.functional.all_reduce(squares, group=group)
    normed = (flat * torch.rsqrt(squares / width + eps)).to(x.dtype)
    return (weight * normed).view_as(x)


def norms_across_heads(config: TransformerConfig) -> bool:
    """Whether the config's q/k norms are ProjectionRMSNorms (over all heads of a token) rather than per head."""
    return bool(config.qk_layernorm and getattr(config, "qk_norm_across_heads", False))


def _zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = torch.nn.functional.rms_norm(x.float(), (x.size(-1),), None, eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose scale is ``1 + weight`` (weight starting at zero): Megatron's ``layernorm_zero_centered_gamma``,
    the decoder and q/k norms of Qwen3-Next and Qwen3.5 (transformers' ``Qwen3NextRMSNorm``, whose checkpoints store
    the zero-centred weight) and every norm of Gemma 3. Computed in fp32 and cast back, as transformers does; adding
    1 to a bf16 weight at load time instead would round it away. Eagerly that is six kernels each way (casts, norm,
    scale) and an fp32 copy kept for the backward. ``fused`` (the ``qk_norm_fusion`` key): one Triton kernel each
    way on GPUs (``norm_triton.py``), nothing kept but the input and one number per row. Gemma 3 1B on one H200 (six
    such norms per layer), when these were compiled with torch.compile: with CUDA graphs 51.9k -> 60.9k tokens/s, eager
    23.7k -> 21.0k at 3.5 GiB less (``benchmarks/results/h200_gemma3``)."""

    def __init__(self, hidden_size: int, eps: float, device, dtype, fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.is_cuda:
            return rms_norm(x, self.weight, self.eps, offset=1.0)
        return _zero_centred_rms_norm(x, self.weight, self.eps)


def compiles_zero_centred_norms(config: TransformerConfig) -> bool:
    """Whether the (1 + weight) norms NativeNorm builds for ``config`` are fused (``qk_norm_fusion``)."""
    return bool(getattr(config, "layernorm_zero_centered_gamma", False) and getattr(config, "qk_norm_fusion", False))


def compiles_head_norms(config: TransformerConfig) -> bool:
    """Whether the q/k norms NativeNorm builds for ``config`` are fused: plain per-head RMSNorms (not the
    zero-centred ones of Qwen3-Next / Qwen3.5) with ``qk_norm_fusion``."""
    return (bool(getattr(config, "qk_norm_fusion", False)) and config.normalization == "RMSNorm"
            and not config.layernorm_zero_centered_gamma)


class NativeNorm:
    """Builds ``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm`` after ``config.normalization`` (a factory, like
    Megatron's ``WrappedTorchNorm``, so the module and its state dict are PyTorch's own)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                mark_sequence_parallel: bool = True, per_head: bool = False, **_unused) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma and config.normalization != "RMSNorm":
            raise UserError("layernorm_zero_centered_gamma with LayerNorm is not supported by the native norm (it "
                             "does zero-centred RMSNorm); install Transformer Engine for it.")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kwargs = dict(eps=eps, device=device, dtype=config.params_dtype)
        if config.layernorm_zero_centered_gamma:
            norm = ZeroCenteredRMSNorm(hidden_size, fused=compiles_zero_centred_norms(config), **kwargs)
        elif config.normalization == "RMSNorm":
            norm = (HeadRMSNorm(hidden_size, fused=compiles_head_norms(config), **kwargs)
                    if per_head else torch.nn.RMSNorm(hidden_size, **kwargs))
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, **kwargs)
        else:
            raise UserError(f"normalization={config.normalization!r}: the native norm does RMSNorm and LayerNorm.")
        if mark_sequence_parallel and config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm
