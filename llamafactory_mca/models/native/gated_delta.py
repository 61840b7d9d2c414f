"""Gated delta-rule linear attention (Qwen3-Next, Qwen3.5) as a Megatron attention module, without TE or fla.

megatron-core 0.16.1's ``GatedDeltaNet`` imports flash-linear-attention (GPU only), allocates on CUDA, refuses packed
sequences and is reachable only through a Transformer Engine spec (docs/qwen3-next-notes.md §5). This module keeps
its parameter names (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``out_norm``, ``out_proj``) and runs the math
of transformers' ``Qwen3NextGatedDeltaNet``:

    q, k, v, z, b, a = in_proj(x)                       (in_proj's rows: [q | k | v | z | beta | alpha] per TP rank)
    q, k, v = silu(causal depthwise conv1d([q | k | v]))
    g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)      (fp32)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, beta)           (value head j reads key head j // (nv / nk))
    out = out_proj(rmsnorm(o) * out_norm.weight * silu(z))

Both the convolution and the recurrence restart at every packed sequence's start (``cu_seqlens``): a packed batch
gives each sequence's own output. The recurrence is transformers' chunked torch implementation, run per sequence
(issue 19 builds this into the Qwen3-Next family; fla's kernels on GPUs are the next step). Tensor parallelism is
meant to split heads (each rank ``nk / tp`` key and ``nv / tp`` value heads) but is not tested yet: it also needs
``out_norm``'s weight gradient summed over TP ranks and a loader op that slices in_proj's six parts per rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class NativeGatedDeltaNet(MegatronModule):
    """Megatron's ``self_attention`` slot of a linear-attention layer: ``(hidden [s, b, h]) -> (out, None)``."""

    def __init__(self, config: TransformerConfig, layer_number: int = 1, **_unused) -> None:
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.layer_number = layer_number
        self.nk, self.nv = config.linear_num_key_heads // tp, config.linear_num_value_heads // tp
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        self.sizes = [self.nk * self.dk, self.nk * self.dk, self.nv * self.dv, self.nv * self.dv, self.nv, self.nv]
        total = tp * sum(self.sizes)
        self.in_proj = ColumnParallelLinear(config.hidden_size, total, config=config, init_method=config.init_method,
                                            bias=False, gather_output=False, skip_bias_add=False)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        local = dict(device=device, dtype=config.params_dtype)
        conv_dim = sum(self.sizes[:3])
        self.conv1d = torch.nn.Parameter(torch.empty(conv_dim, 1, self.kernel, **local))
        torch.nn.init.kaiming_uniform_(self.conv1d, a=5 ** 0.5)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.nv, **local))
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(self.nv, **local).uniform_(1, 16)))
        for param in (self.conv1d, self.dt_bias, self.A_log):  # split by heads along dim 0, as in_proj's rows
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.out_norm = torch.nn.RMSNorm(self.dv, eps=config.layernorm_epsilon, **local)
        self.out_proj = RowParallelLinear(tp * self.nv * self.dv, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                packed_seq_params: PackedSeqParams | None = None, **_unused) -> tuple[torch.Tensor, None]:
        mixed, _ = self.in_proj(hidden_states)  # [s, b, local]
        seq, batch = mixed.shape[:2]
        q, k, v, z, b, a = torch.split(mixed.transpose(0, 1), self.sizes, dim=-1)  # [b, s, .]
        segments = _segments(packed_seq_params, seq) if packed_seq_params is not None else [(0, seq)]
        qkv = F.silu(_causal_conv(torch.cat([q, k, v], dim=-1), self.conv1d, segments))
        q, k, v = torch.split(qkv, self.sizes[:3], dim=-1)
        q, k = (t.reshape(batch, seq, self.nk, self.dk).repeat_interleave(self.nv // self.nk, dim=2) for t in (q, k))
        v = v.reshape(batch, seq, self.nv, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = torch.cat([_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e]) for s, e in segments],
                         dim=1)
        z = z.reshape(batch, seq, self.nv, self.dv)
        gated = (self.out_norm(core.to(z.dtype)).float() * F.silu(z.float())).to(z.dtype)
        out, bias = self.out_proj(gated.reshape(batch, seq, -1).transpose(0, 1).contiguous())
        return out, bias


def _segments(params: PackedSeqParams, length: int) -> list[tuple[int, int]]:
    """Each packed sequence's [start, end) (padded boundaries: a sequence's padding sits at its own end)."""
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    bounds = cu.tolist()
    return [(s, min(e, length)) for s, e in zip(bounds[:-1], bounds[1:]) if s < length]


def _causal_conv(x: torch.Tensor, weight: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """Depthwise causal convolution over [b, s, c] with ``weight`` [c, 1, K], restarting at every segment."""
    pad = weight.shape[-1] - 1
    outs = [F.conv1d(F.pad(x[:, s:e].transpose(1, 2), (pad, 0)), weight, groups=weight.shape[0]).transpose(1, 2)
            for s, e in segments]
    return torch.cat(outs, dim=1)


def _delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """transformers' chunked gated delta rule (l2-normalised q and k), from a zero state: [b, s, h, dv]."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    out, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    return out
