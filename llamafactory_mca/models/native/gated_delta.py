"""Gated delta-rule linear attention (Qwen3-Next, Qwen3.5) as a Megatron attention module, without TE.

megatron-core 0.16.1's ``GatedDeltaNet`` imports flash-linear-attention unconditionally, allocates on CUDA, refuses
packed sequences and is reachable only through a Transformer Engine spec (docs/qwen3-next-notes.md). This module keeps
its parameter names (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``out_norm``, ``out_proj``) and runs the math of
transformers' ``Qwen3NextGatedDeltaNet``:

    q, k, v, z, b, a = in_proj(x)
    q, k, v = silu(causal depthwise conv1d([q | k | v]))
    g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)      (fp32)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, beta)           (value head j reads key head j // (nv / nk))
    out = out_proj(rmsnorm(o) * out_norm.weight * silu(z))

Rows are grouped per key head, as Qwen3-Next's checkpoints group them: ``in_proj`` is, for each key head h,
[q_h | k_h | v_h | z_h | beta_h | alpha_h] (the v, z, beta, alpha of its nv / nk value heads), and ``conv1d``'s
channels are [q_h | k_h | v_h]. Tensor parallelism then splits whole key heads, so every rank's slice of every
parameter is one contiguous block of the world-size-1 tensor: checkpoints reshard by plain TP axes
(``mapping.GroupedRows`` maps Qwen3.5's flat projections into this layout). ``out_norm`` is shared by all heads:
each TP rank sees all tokens but only its own heads, so its weight gradient is summed over the TP group (the weight
passes ``copy_to_tensor_model_parallel_region``).

The convolution and the recurrence restart at every packed sequence's start (``cu_seqlens``): a packed batch gives
each sequence its own output. On GPUs the recurrence is flash-linear-attention's chunked kernel (``fla``, Triton,
with ``cu_seqlens``) where it is installed and correct; elsewhere our torch rule (``delta_rule.py``: transformers'
math, the in-chunk substitution as one triangular solve, each sequence cut into chunks of its own).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ...errors import UserError
from .delta_rule import chunked_delta_rule


# the parameters outside the parallel linears and the norm; all split by heads on dim 0
_OWN_TP_SPLIT = {"conv1d.weight": 0, "dt_bias": 0, "A_log": 0}
FLA_HINT = "pip install flash-linear-attention (Triton kernels for the gated delta rule; GPUs only)"


class NativeGatedDeltaNet(MegatronModule):
    """Megatron's ``self_attention`` slot of a linear-attention layer: ``(hidden [s, b, h]) -> (out, None)``."""

    def __init__(self, config: TransformerConfig, layer_number: int = 1, **_unused) -> None:
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.layer_number = layer_number
        self.nk, self.nv = config.linear_num_key_heads // tp, config.linear_num_value_heads // tp
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.ratio = self.nv // self.nk
        # one key head's rows: its q, k, then its value heads' v, z, beta, alpha
        self.group = [self.dk, self.dk, self.ratio * self.dv, self.ratio * self.dv, self.ratio, self.ratio]
        self.in_proj = ColumnParallelLinear(config.hidden_size, tp * self.nk * sum(self.group), config=config,
                                            init_method=config.init_method, bias=False, gather_output=False,
                                            skip_bias_add=False)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        local = dict(device=device, dtype=config.params_dtype)
        channels = self.nk * sum(self.group[:3])  # depthwise: causal_conv applies its weight [channels, 1, K]
        self.conv1d = torch.nn.Conv1d(channels, channels, config.linear_conv_kernel_dim, groups=channels, bias=False,
                                      **local)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.nv, **local))
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(self.nv, **local).uniform_(1, 16)))
        for name in _OWN_TP_SPLIT:
            param = self.get_parameter(name)
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.out_norm = torch.nn.RMSNorm(self.dv, eps=config.layernorm_epsilon, **local)
        self.out_proj = RowParallelLinear(tp * self.nv * self.dv, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                packed_seq_params: PackedSeqParams | None = None, **_unused) -> tuple[torch.Tensor, None]:
        mixed, _ = self.in_proj(hidden_states)  # [s, b, local]
        seq, batch = mixed.shape[:2]
        grouped = mixed.transpose(0, 1).reshape(batch, seq, self.nk, sum(self.group))
        qkv, z, b, a = torch.split(grouped, [sum(self.group[:3]), *self.group[3:]], dim=-1)
        cu_seqlens = _cu_seqlens(packed_seq_params, seq) if packed_seq_params is not None else None
        qkv = F.silu(causal_conv(qkv.reshape(batch, seq, -1), self.conv1d.weight, cu_seqlens))
        q, k, v = torch.split(qkv.view(batch, seq, self.nk, -1), self.group[:3], dim=-1)
        v = v.reshape(batch, seq, self.nv, self.dv)
        beta = b.reshape(batch, seq, self.nv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(batch, seq, self.nv).float() + self.dt_bias)
        core = delta_rule(q, k, v, g, beta, cu_seqlens)
        z = z.reshape(batch, seq, self.nv, self.dv)
        weight = copy_to_tensor_model_parallel_region(self.out_norm.weight)  # its gradient: summed over TP ranks
        normed = F.rms_norm(core.to(z.dtype), (self.dv,), weight, self.out_norm.eps)
        gated = (normed.float() * F.silu(z.float())).to(z.dtype)
        out, bias = self.out_proj(gated.reshape(batch, seq, -1).transpose(0, 1).contiguous())
        return out, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's default, with the conv, dt_bias and A_log split over TP on dim 0 (the default would take them
        for replicated)."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        own = {name: self.get_parameter(name) for name in _OWN_TP_SPLIT}
        state.update(make_sharded_tensors_for_checkpoint(
            own, prefix, _OWN_TP_SPLIT, sharded_offsets, tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True)))
        return state


def _cu_seqlens(params: PackedSeqParams, length: int) -> torch.Tensor:
    """Each packed sequence's start and end (padded boundaries: a sequence's padding sits at its own end)."""
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu = cu.clamp(max=length).long()
    return cu if cu[-1] == length else torch.cat([cu, cu.new_tensor([length])])  # trailing padding: its own piece


def causal_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution over [b, s, c] with ``weight`` [c, 1, K]; with ``cu_seqlens`` (b = 1) no output
    reads an input from before its own sequence's start. One shifted multiply-add per tap, on any device."""
    taps, seq = weight.shape[-1], x.shape[1]
    if cu_seqlens is not None:
        starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff(), output_size=seq)
        position = torch.arange(seq, device=x.device) - starts  # each token's index inside its sequence
    out = x * weight[:, 0, -1]
    for shift in range(1, taps):
        shifted = F.pad(x[:, : seq - shift], (0, 0, shift, 0))
        if cu_seqlens is not None:
            shifted = shifted * (position >= shift).unsqueeze(-1).to(x.dtype)
        out = out + shifted * weight[:, 0, taps - 1 - shift]
    return out


def delta_rule(q, k, v, g, beta, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The chunked gated delta rule with l2-normalised q and k, from a zero state per sequence: [b, s, nv, dv]. q and k
    have the key heads [b, s, nk, dk]; value head j reads key head j // (nv / nk) (fla's grouped value attention).

    flash-linear-attention's Triton kernel where it is correct on this GPU (``fla_usable``); else our torch rule
    (``delta_rule.chunked_delta_rule``: transformers' math, a few times faster)."""
    if q.is_cuda and fla_usable():
        out, _ = _fla_rule()(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        return out
    return chunked_delta_rule(q, k, v, g, beta, cu_seqlens)


@functools.cache
def _fla_rule():
    try:
        # here: optional package (flash-linear-attention); its ImportError is the answer
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as err:
        raise UserError(f"flash-linear-attention is not importable ({err}): {FLA_HINT}.") from err
    return chunk_gated_delta_rule


@functools.cache
def fla_usable() -> bool:
    """fla imports, and its gated backward kernel is correct here: fla refuses Hopper GPUs with Triton 3.4 to 3.7.0
    (fla issue #640, a Triton miscompilation) unless tilelang is installed; those runs take the torch rule."""
    try:
        _fla_rule()
    except UserError:
        return False
    import triton  # here: Triton comes with CUDA builds of torch only; reached once fla imported

    version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    return not (hopper and (3, 4, 0) <= version < (3, 7, 1) and importlib.util.find_spec("tilelang") is None)


def describe_kernel() -> str:
    """For the startup summary."""
    if torch.cuda.is_available() and fla_usable():
        return "flash-linear-attention"
    if not torch.cuda.is_available():
        why = ""
    elif importlib.util.find_spec("fla") is None:
        why = f" (GPU: {FLA_HINT})"
    else:
        import triton  # here: as in fla_usable

        why = f" (flash-linear-attention's backward is wrong on Hopper with Triton {triton.__version__}: fla #640)"
    return "torch chunked rule (triangular solve per chunk)" + why
