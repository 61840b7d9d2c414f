"""Grouped MoE experts on ``torch._grouped_mm``: Megatron's legacy ``GroupedMLP`` without ``grouped_gemm``.

We subclass ``GroupedMLP`` to keep everything but its GEMMs: the parameters (``weight1`` ``[hidden,
local_experts·ffn·2/etp]``, ``weight2`` ``[local_experts·ffn/etp, hidden]``), their TP-aware
initialisation, and ``sharded_state_dict``, which writes per-expert ``linear_fc1/2`` tensors a
``SequentialMLP`` (or TE-grouped) checkpoint can read. What changes:

- no ``grouped_gemm`` package: its availability assert is skipped while the parent builds;
- any dtype: the parent's forward asserts bf16; ours runs bf16 on GPU and fp32 on CPU (tests);
- the GEMMs are ``torch._grouped_mm(x [tokens, k], w [experts, k, n], offs=cumsum(tokens_per_expert))``,
  with autograd; the counts may stay on the device (``dispatch.py``), so no host sync is needed. bf16 groups
  need no padding of their token counts (only 16-byte aligned strides, i.e. ``hidden`` and ``ffn/etp``
  multiples of 8); where that or the kernel is missing, a per-expert matmul loop computes the same thing;
- biases (``add_bias_linear``: gpt-oss), which the parent refuses: ``bias1`` [local_experts, 2·ffn] is added to each
  row's first GEMM output, ``bias2`` [local_experts, hidden] to its second, times the routing probability (as
  Megatron's TE experts do); each expert whole on its rank (``expert_tensor_parallel_size: 1``), written as the
  per-expert ``linear_fc1/2.bias`` a SequentialMLP checkpoint holds;
- with ``gradient_accumulation_fusion`` the weights' gradients go into DDP's fp32 ``main_grad`` inside the
  backward (``_GroupedMMIntoMainGrad``), as Megatron's linears do with that key: on GPUs one Triton GEMM that adds
  into it (``grouped_wgrad.py``) instead of a bf16 gradient that DDP's hook adds in a second pass (on CPU, the
  gradient and an add) — the experts hold most of a MoE model's weights, so this is most of its gradient traffic.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.moe import grouped_gemm_util
from megatron.core.transformer.moe.experts import GroupedMLP

from .fp8 import Fp8Training, WeightCasts, grouped_pays, per_row, stacked_operand
from .fp8 import aligned as fp8_aligned
from .fp8 import grouped_mm as fp8_grouped_mm
from .swiglu_triton import weighted_bias_swiglu_impl
from .wgrad import add_grouped_wgrad, placeholder_grad


logger = logging.getLogger(__name__)


class NativeGroupedMLP(GroupedMLP):
    """All local experts in two grouped GEMMs (``torch._grouped_mm``), parameters and checkpoints as GroupedMLP."""

    fp8: Fp8Training | None = None
    fp8_casts: WeightCasts | None = None

    def __init__(self, num_local_experts: int, config, pg_collection=None) -> None:
        # The parent refuses biases and any GLU but silu's and gelu's; both are ours here (the biases below, the
        # activation in ``_activate``), so it builds from a copy of the config that asks for neither.
        plain = copy.copy(config)
        plain.add_bias_linear, plain.activation_func = False, F.silu
        with _grouped_gemm_package_not_required():
            super().__init__(num_local_experts, plain, pg_collection=pg_collection)
        self.config = config
        self.bias1 = self.bias2 = None
        if config.add_bias_linear:
            if self.tp_group.size() > 1:
                raise ValueError("expert biases need expert_tensor_parallel_size: 1")
            fc1 = self.weight1.shape[1] // num_local_experts
            device = self.weight1.device
            self.bias1 = torch.nn.Parameter(torch.zeros(num_local_experts, fc1, dtype=config.params_dtype,
                                                        device=device))
            self.bias2 = torch.nn.Parameter(torch.zeros(num_local_experts, config.hidden_size,
                                                        dtype=config.params_dtype, device=device))
            for bias in (self.bias1, self.bias2):  # reduced over the weights' data-parallel group (expert or not)
                setattr(bias, "allreduce", not self.expert_parallel)
        self._fused_swiglu = (config.bias_activation_fusion and config.gated_linear_unit
                              and config.activation_func is F.silu and not config.glu_linear_offset
                              and config.activation_func_clamp_value is None)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1.")
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        hidden_size = self.config.hidden_size
        if hidden.nelement() == 0:
            # No token for the local experts: still touch the weights so they get (zero) gradients.
            w1, w2 = self.weight1.view(hidden_size, -1), self.weight2.view(-1, hidden_size)
            out = torch.matmul(self._activate(torch.matmul(hidden, w1), probs), w2)
            return (out if self.bias1 is None else out + 0 * (self.bias1.sum() + self.bias2.sum())), None
        w1 = self.weight1.view(self.num_local_experts, hidden_size, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, hidden_size)
        counts = tokens_per_expert.detach()
        if counts.device.type != "cpu" and not grouped_mm_usable(hidden, w1):
            counts = counts.to("cpu", torch.int64)  # the per-expert loop splits on the host
        rows = None if self.bias1 is None else _expert_of_rows(counts, hidden.size(0), hidden.device)
        fc1_out = self.fc1(hidden, w1, counts)
        if rows is not None:
            fc1_out = fc1_out + self.bias1[rows]
        if self.activation_recompute:
            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            intermediate = self.activation_checkpoint.checkpoint(self._activate, fc1_out, probs)
            out = self.fc2(intermediate, w2, counts)
            self.activation_checkpoint.discard_output_and_register_recompute(out)
        else:
            out = self.fc2(self._activate(fc1_out, probs), w2, counts)
        if rows is not None:
            out = (out + self.bias2[rows] * probs.unsqueeze(-1)).to(out.dtype)
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The parent's (it walks every parameter as a weight, so the biases are out of sight while it runs), and
        the biases as SequentialMLP's per-expert ``linear_fc1/2.bias`` (a tensor per layer with an expert axis)."""
        if self.bias1 is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        biases = {name: self._parameters.pop(name) for name in ("bias1", "bias2")}
        try:
            state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self._parameters.update(biases)
        axis = len(sharded_offsets)
        for name, fc in (("bias1", "linear_fc1"), ("bias2", "linear_fc2")):
            state[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}experts.{fc}.bias", biases[name], *sharded_offsets,
                (axis, self.ep_group.rank(), self.ep_group.size()), replica_id=(0, 0, self.dp_group.rank()),
                prepend_axis_num=axis)
        return state

    def fc1(self, x: torch.Tensor, w1: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The first grouped GEMM (a LoRA subclass adds its adapters' here, ``models/lora/layers.py``)."""
        return self._expert_mm(x, self.weight1, w1, counts)

    def fc2(self, x: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self._expert_mm(x, self.weight2, w2, counts)

    def _expert_mm(self, x: torch.Tensor, param: torch.Tensor, weights: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
        """``grouped_mm`` with ``weights`` (a per-expert view of ``param``); where the config fuses gradient
        accumulation and DDP gave ``param`` a ``main_grad``, its gradient is added there in the backward. In a
        layer FP8 covers (``fp8.use_fp8`` sets ``self.fp8``) the forward and input gradient run in FP8."""
        into = self.config.gradient_accumulation_fusion and param.requires_grad and hasattr(param, "main_grad")
        if self.fp8 is not None and grouped_mm_usable(x, weights) and fp8_aligned(*weights.shape[1:]):
            return _Fp8GroupedMM.apply(x, param, _offsets(x, counts), weights.shape, into, self.fp8_casts)
        if into and grouped_mm_usable(x, weights):
            return _GroupedMMIntoMainGrad.apply(x, param, _offsets(x, counts), weights.shape)
        return grouped_mm(x, weights, counts)

    def _activate(self, fc1_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Activation (GLU-aware, as Megatron's MLP does it) times the routing probability of each token."""
        if self._fused_swiglu:
            return weighted_bias_swiglu_impl(fc1_out, None, probs.unsqueeze(-1),
                                             self.config.activation_func_fp8_input_store)
        config = self.config
        if config.gated_linear_unit:
            gate, linear = torch.chunk(fc1_out, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
            act = config.activation_func(gate) * (linear + config.glu_linear_offset)
        else:
            act = config.activation_func(fc1_out)
        return (act * probs.unsqueeze(-1)).to(fc1_out.dtype)


def _expert_of_rows(counts: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """Each permuted row's local expert, from the rows per expert (on the device: no host sync)."""
    experts = torch.arange(counts.numel(), device=counts.device)
    return torch.repeat_interleave(experts, counts, output_size=rows).to(device, non_blocking=True)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``x`` rows grouped by expert times ``weights[e]`` ``[k, n]``. ``tokens_per_expert`` on the host (Megatron's
    dispatchers) or on the device (``dispatch.py``: never copied to the host, they become the GEMM's offsets)."""
    if grouped_mm_usable(x, weights):
        return _ContiguousGrad.apply(torch._grouped_mm(x, weights, offs=_offsets(x, tokens_per_expert)))
    return _loop_mm(x, weights, tokens_per_expert)


def _offsets(x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``_grouped_mm``'s ``offs``: where each expert's rows end, int32 on ``x``'s device."""
    if tokens_per_expert.device.type == "cpu" and x.size(0) != int(tokens_per_expert.sum()):
        raise ValueError(f"{x.size(0)} permuted tokens but tokens_per_expert sums to {int(tokens_per_expert.sum())}")
    return torch.cumsum(tokens_per_expert, 0).to(torch.int32).to(x.device, non_blocking=True)


def grouped_mm_usable(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands (else the per-expert loop runs)."""
    if not hasattr(torch, "_grouped_mm"):
        _log_once("torch._grouped_mm is missing in this torch; MoE experts run as a per-expert matmul loop.")
        return False
    if x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):
        _log_once(f"torch._grouped_mm on CUDA needs bf16/fp16 (got {x.dtype}); MoE experts run as a loop.")
        return False
    aligned = all((size * x.element_size()) % 16 == 0 for size in (x.size(1), weights.size(-1)))
    if not aligned:
        _log_once(f"torch._grouped_mm needs 16-byte aligned rows; expert GEMM sizes {x.size(1)} x "
                  f"{weights.size(-1)} in {x.dtype} are not, so MoE experts run as a loop.")
    return aligned


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands ``_grouped_mm`` a contiguous gradient (it rejects e.g. expanded ones)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _GroupedMMIntoMainGrad(torch.autograd.Function):
    """``x @ param.view(shape)[e]`` per expert group, whose backward adds the weight gradient to ``param.main_grad``
    and hands autograd Megatron's placeholder (``grad_added_to_main_grad``, so DDP's hook skips its own add)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, param: torch.Tensor, offs: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        ctx.save_for_backward(x, param, offs)
        ctx.shape = shape
        return torch._grouped_mm(x, param.view(shape), offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, param, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, param.view(ctx.shape).transpose(-2, -1), offs=offs)
        add_grouped_wgrad(param.main_grad.view(ctx.shape), x, grad, offs)
        return grad_x, placeholder_grad(param, x.dtype), None, None


class _Fp8GroupedMM(torch.autograd.Function):
    """``x @ param.view(shape)[e]`` per expert group with the forward and the input gradient on
    ``torch._scaled_grouped_mm`` (E4M3, a scale per token row and per expert column: the grouped FP8 GEMM of Hopper
    takes rowwise scales only) where its kernel beats bf16's at these rows per expert (``fp8.grouped_pays``, each
    GEMM apart; else ``torch._grouped_mm``), and the weight gradient in bf16, as ``_GroupedMMIntoMainGrad``
    computes it (its contraction runs over each expert's tokens, whose per-group scaling the grouped GEMM does not
    take)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, param: torch.Tensor, offs: torch.Tensor, shape: torch.Size, into: bool,
                casts: WeightCasts):
        ctx.save_for_backward(x, param, offs)
        ctx.shape, ctx.into, ctx.casts = shape, into, casts
        return _expert_gemm(x, param, shape, offs, casts, contracted=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, param, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _expert_gemm(grad, param, ctx.shape, offs, ctx.casts, contracted=2)
        grad_param = None
        if ctx.into:
            add_grouped_wgrad(param.main_grad.view(ctx.shape), x, grad, offs)
            grad_param = placeholder_grad(param, x.dtype)
        elif param.requires_grad:
            grad_param = torch._grouped_mm(x.t(), grad, offs=offs).view(param.shape)
        return grad_x, grad_param, None, None, None, None


def _expert_gemm(a: torch.Tensor, param: torch.Tensor, shape: torch.Size, offs: torch.Tensor, casts: WeightCasts,
                 contracted: int) -> torch.Tensor:
    """``a`` times each expert's weight (``contracted`` 1: [k, n], the forward; 2: its transpose, the input
    gradient), in FP8 where ``fp8.grouped_pays``."""
    weights = param.view(shape) if contracted == 1 else param.view(shape).transpose(-2, -1)
    if not grouped_pays(a.shape[0] / shape[0], *weights.shape[1:]):
        return torch._grouped_mm(a, weights, offs=offs)
    e4m3 = torch.float8_e4m3fn
    cast = casts.get(param, "rows" if contracted == 1 else "cols",
                     lambda: stacked_operand(param.view(shape), e4m3, contracted))
    return fp8_grouped_mm(per_row(a, e4m3, 1), *cast, offs, a.dtype)[: a.shape[0]]  # the cast's zero rows off


def _loop_mm(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    chunks = torch.split(x, tokens_per_expert.tolist())
    return torch.cat([chunk @ weights[e] for e, chunk in enumerate(chunks)])


@contextlib.contextmanager
def _grouped_gemm_package_not_required():
    """GroupedMLP.__init__ asserts the ``grouped_gemm`` package we replace; skip only that assert, only here."""
    original = grouped_gemm_util.assert_grouped_gemm_is_available
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    try:
        yield
    finally:
        grouped_gemm_util.assert_grouped_gemm_is_available = original


_LOGGED: set[str] = set()


def _log_once(message: str, level: int = logging.WARNING) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.log(level, message)


def describe_experts() -> str | None:
    """The expert kernel in words, for the startup line."""
    return "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "per-expert matmul loop (no torch._grouped_mm)"
