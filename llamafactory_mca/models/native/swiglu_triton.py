"""SwiGLU, plain (the dense MLP) and weighted by each row's routing probability (the MoE experts), and GeGLU with
GELU's tanh approximation (Gemma's dense MLP), as Triton kernels.

Megatron's fused SwiGLU (``fusions/fused_bias_swiglu.py``) is torch.compile'd: on a fresh machine's empty compile
cache its four graphs (weighted and plain, forward and backward) took 6.1 s of a MoE run's first step and 3.6 s of a
dense one's (one H200, ``benchmarks/results/h200_first_step_triton``), and every later launch traces them again. A
Triton kernel compiles once per machine in well under a second and launches without a trace.

The math is Megatron's, in fp32 and rounded once, as its compiled graphs compute it: ``silu(a) * b`` (times the row's
weight) over the two halves of each row, and in the backward the input's gradient and, weighted, the weight's
``sum(silu(a) * b * g)`` per row. A program holds ``BLOCK_R`` rows and walks their halves ``BLOCK_F`` columns at a
time, so the weight's gradient is summed without a second pass. The row count is not specialised on: an expert's
rows (or a pack's tokens) vary between calls, and each new divisibility would be another compile in step 1.

``bias_swiglu_impl`` and ``weighted_bias_swiglu_impl`` keep Megatron's signatures: ``install`` puts them where its MLP
calls them, and a bias, an FP8 or CPU-offloaded input, or a CPU tensor go to Megatron's own.

``bias_geglu_impl`` does the same for Megatron's GeGLU (``fusions/fused_bias_geglu.py``, its constants): its compiled
backward, which ends in a ``cat`` of the two halves' gradients, took 735 us a call on Gemma 4 E2B's [4096, 2 x 12288]
rows, ~6x what the bytes take (one H200, ``benchmarks/results/h200_gemma4_e2b/profile``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from megatron.core.fusions import fused_bias_geglu, fused_bias_swiglu


MEGATRON_SWIGLU = fused_bias_swiglu.bias_swiglu_impl
MEGATRON_WEIGHTED_SWIGLU = fused_bias_swiglu.weighted_bias_swiglu_impl
MEGATRON_GEGLU = fused_bias_geglu.bias_geglu_impl
ELEMENTS_PER_PROGRAM = 4096  # rows x columns of one half a program holds at once


@triton.jit
def _halves(a_ptr, b_ptr, r, live_r, start, width, stride_a, stride_b, BLOCK_F: tl.constexpr):
    """Columns ``start`` .. ``start + BLOCK_F`` of the gate ``a`` and the other factor ``b`` (a row's two halves, or
    two tensors) of rows ``r``, in fp32; with their columns and mask."""
    f = start + tl.arange(0, BLOCK_F)
    live = live_r[:, None] & (f < width)[None, :]
    a = tl.load(a_ptr + r[:, None] * stride_a + f[None, :], mask=live, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r[:, None] * stride_b + f[None, :], mask=live, other=0.0).to(tl.float32)
    return a, b, f, live


@triton.jit
def _gate(a, GELU: tl.constexpr):
    """(act(a), act'(a)): SiLU, or GELU's tanh approximation with Megatron's constants."""
    if GELU:
        t = 2 * tl.sigmoid(2 * (0.79788456 * a * (1 + 0.044715 * a * a))) - 1  # tanh
        return a * 0.5 * (1.0 + t), 0.5 * a * ((1 - t * t) * (0.79788456 + 0.1070322243 * a * a)) + 0.5 * (1 + t)
    s = tl.sigmoid(a)
    return a * s, s * (1 + a * (1 - s))


@triton.jit(do_not_specialize=["rows"])
def _forward(a_ptr, b_ptr, w_ptr, y_ptr, rows, width, stride_a, stride_b, WEIGHTED: tl.constexpr,
             GELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    live_r = r < rows
    if WEIGHTED:
        w = tl.load(w_ptr + r, mask=live_r, other=0.0).to(tl.float32)
    for start in range(0, width, BLOCK_F):
        a, b, f, live = _halves(a_ptr, b_ptr, r, live_r, start, width, stride_a, stride_b, BLOCK_F)
        act, _ = _gate(a, GELU)
        y = act * b
        if WEIGHTED:
            y = y * w[:, None]
        tl.store(y_ptr + r[:, None] * width + f[None, :], y.to(y_ptr.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["rows"])
def _backward(g_ptr, a_ptr, b_ptr, w_ptr, da_ptr, db_ptr, dw_ptr, rows, width, stride_a, stride_b, stride_d,
              WEIGHTED: tl.constexpr, GELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    live_r = r < rows
    if WEIGHTED:
        w = tl.load(w_ptr + r, mask=live_r, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, width, BLOCK_F):
        a, b, f, live = _halves(a_ptr, b_ptr, r, live_r, start, width, stride_a, stride_b, BLOCK_F)
        g = tl.load(g_ptr + r[:, None] * width + f[None, :], mask=live, other=0.0).to(tl.float32)
        act, slope = _gate(a, GELU)
        if WEIGHTED:
            dw += tl.sum(act * b * g, 1)
            g = g * w[:, None]
        at = r[:, None] * stride_d + f[None, :]
        tl.store(da_ptr + at, (g * slope * b).to(da_ptr.dtype.element_ty), mask=live)
        tl.store(db_ptr + at, (g * act).to(db_ptr.dtype.element_ty), mask=live)
    if WEIGHTED:
        tl.store(dw_ptr + r, dw.to(dw_ptr.dtype.element_ty), mask=live_r)


def _blocks(width: int) -> tuple[int, int]:
    """Columns per step: the largest power of two up to 1024 that divides the half's width (no masked lanes at
    the experts' 768 or a dense 6,144), at least 16; rows to fill the program."""
    block_f = max(16, min(1024, width & -width))
    return max(1, ELEMENTS_PER_PROGRAM // block_f), block_f


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _GLU(torch.autograd.Function):
    """``act(a) * b`` (times a weight per row): ``b`` None takes ``a`` and ``b`` as the two halves of ``x``'s rows,
    and the gradient comes back as one tensor of both."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, b: torch.Tensor | None, weights: torch.Tensor | None, gelu: bool
                ) -> torch.Tensor:
        x, halves = _rows(x), b is None
        width = x.size(1) // 2 if halves else x.size(1)
        a, b = (x[:, :width], x[:, width:]) if halves else (x, _rows(b))
        rows = x.size(0)
        w = None if weights is None else weights.reshape(-1).contiguous()
        y = torch.empty(rows, width, dtype=x.dtype, device=x.device)
        block_r, block_f = _blocks(width)
        _forward[(triton.cdiv(rows, block_r),)](a, b, w, y, rows, width, a.stride(0), b.stride(0),
                                                WEIGHTED=w is not None, GELU=gelu, BLOCK_R=block_r, BLOCK_F=block_f)
        ctx.save_for_backward(a, b, w)
        ctx.gelu, ctx.halves = gelu, halves
        ctx.weights_shape = None if weights is None else (weights.shape, weights.dtype)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, w = ctx.saved_tensors
        rows, width = a.shape
        if ctx.halves:
            dx = torch.empty(rows, 2 * width, dtype=a.dtype, device=a.device)
            da, db = dx[:, :width], dx[:, width:]
        else:
            dx, da = None, torch.empty(rows, width, dtype=a.dtype, device=a.device)
            db = torch.empty_like(da)
        dw = None if w is None else torch.empty(rows, dtype=ctx.weights_shape[1], device=a.device)
        block_r, block_f = _blocks(width)
        _backward[(triton.cdiv(rows, block_r),)](grad.contiguous(), a, b, w, da, db, dw, rows, width, a.stride(0),
                                                 b.stride(0), da.stride(0), WEIGHTED=w is not None, GELU=ctx.gelu,
                                                 BLOCK_R=block_r, BLOCK_F=block_f)
        dw = None if dw is None else dw.view(ctx.weights_shape[0])
        return (dx, None, dw, None) if ctx.halves else (da, db, dw, None)


def swiglu(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(a) * b`` of ``x``'s two halves ``[rows, 2 * width]``, times ``weights`` (one per row) if given."""
    return _GLU.apply(x, None, weights, False)


def geglu(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(a) * b`` of ``x``'s two halves ``[rows, 2 * width]``."""
    return _GLU.apply(x, None, None, True)


def gelu_times(gate: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * other``, both ``[..., width]`` (Gemma 4's per-layer inputs: two launches forward and three
    backward in eager torch, one each here)."""
    return _GLU.apply(gate.reshape(-1, gate.size(-1)), other.reshape(-1, other.size(-1)), None, True).view(gate.shape)


def _in_rows(fn, x: torch.Tensor, *args) -> torch.Tensor:
    """Megatron's impls take [tokens, 2w] or [s, b, 2w] and hand back the same leading shape."""
    return fn(x.view(-1, x.size(-1)), *args).view(*x.shape[:-1], -1)


def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    if bias is not None or fp8_input_store or cpu_offload_input or not input.is_cuda:
        return MEGATRON_SWIGLU(input, bias, fp8_input_store, cpu_offload_input)
    return _in_rows(swiglu, input)


def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False):
    if bias is not None or fp8_input_store or not input.is_cuda:
        return MEGATRON_WEIGHTED_SWIGLU(input, bias, weights, fp8_input_store)
    return _in_rows(swiglu, input, weights)


def bias_geglu_impl(input, bias):
    if bias is not None or not input.is_cuda:
        return MEGATRON_GEGLU(input, bias)
    return _in_rows(geglu, input)
