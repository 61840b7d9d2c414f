"""RMSNorm over short rows (the q/k norms' heads, and the (1 + weight) norms) as two Triton kernels.

These norms were compiled with torch.compile: one graph per direction and per shape (q and k differ in heads), which on
a fresh machine's empty compile cache cost 12 s of a MoE run's first step (4 graphs, 2.4-4.1 s each, measured on an
H200; ``benchmarks/results/h200_first_step_triton``), and a dynamo trace on every later launch. A Triton kernel
compiles in well under a second, once per machine (Triton's own cache), and launches without a trace.

Forward: each program normalises ``BLOCK_R`` rows in fp32 and keeps each row's 1/rms for the backward. Backward:
``dx = rstd * (w * dy - xhat * mean(w * dy * xhat))``; the weight's gradient ``sum(dy * xhat)`` over all rows is
summed per program into an fp32 partial, and the partials once by torch. Rows are read through the input's strides
(token, head), so the q and k views that Megatron splits out of the fused QKV projection are not copied first. The
math is transformers' (fp32, one rounding at the end): ``offset`` 1.0 makes the scale ``1 + weight``. Row and head
counts are not specialised on, so q and k (16 and 8 heads: divisible by 16 or not) share one compiled kernel.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl


ELEMENTS_PER_PROGRAM = 4096  # rows x row width a program holds at once


@triton.jit(do_not_specialize=["rows", "heads"])
def _forward(x_ptr, w_ptr, y_ptr, rstd_ptr, rows, heads, stride_tok, stride_head, width, eps, offset,
             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    live = (r < rows)[:, None] & (d < width)[None, :]
    src = (r // heads) * stride_tok + (r % heads) * stride_head
    x = tl.load(x_ptr + src[:, None] + d[None, :], mask=live, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / width + eps)
    w = tl.load(w_ptr + d, mask=d < width, other=0.0).to(tl.float32) + offset
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + r[:, None] * width + d[None, :], y.to(y_ptr.dtype.element_ty), mask=live)
    tl.store(rstd_ptr + r, rstd, mask=r < rows)


@triton.jit(do_not_specialize=["rows", "heads", "blocks_per_program"])
def _backward(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, heads, stride_tok, stride_head, width, offset,
              blocks_per_program, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + d, mask=d < width, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, blocks_per_program):
        r = ((pid * blocks_per_program + i) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        live = (r < rows)[:, None] & (d < width)[None, :]
        src = (r // heads) * stride_tok + (r % heads) * stride_head
        x = tl.load(x_ptr + src[:, None] + d[None, :], mask=live, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r[:, None] * width + d[None, :], mask=live, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=r < rows, other=0.0)
        xhat = x * rstd[:, None]
        wdy = dy * w[None, :]
        mean = tl.sum(wdy * xhat, 1) / width
        dx = (wdy - xhat * mean[:, None]) * rstd[:, None]
        tl.store(dx_ptr + r[:, None] * width + d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=live)
        dw += tl.sum(dy * xhat, 0)
    tl.store(dw_ptr + pid * width + d, dw, mask=d < width)


@cache
def _programs_per_device(index: int) -> int:
    return 4 * torch.cuda.get_device_properties(index).multi_processor_count


def rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``x`` as [tokens, heads, width] with its own strides (last one 1): (view, heads, token stride, head stride).
    Also how ``rope_triton.py`` reads q and k."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    view = x.reshape(-1, x.size(-2), x.size(-1)) if x.dim() >= 2 else x.reshape(1, 1, -1)
    return view, view.size(1), view.stride(0), view.stride(1)


def _blocks(width: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(width)
    return max(1, ELEMENTS_PER_PROGRAM // block_d), block_d


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        view, heads, stride_tok, stride_head = rows_view(x)
        width = x.size(-1)
        rows = view.size(0) * heads
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block_r, block_d = _blocks(width)
        _forward[(triton.cdiv(rows, block_r),)](view, weight, y, rstd, rows, heads, stride_tok, stride_head, width,
                                                eps, offset, BLOCK_R=block_r, BLOCK_D=block_d)
        ctx.save_for_backward(view, weight, rstd)
        ctx.offset, ctx.shape = offset, x.shape
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        view, weight, rstd = ctx.saved_tensors
        heads, width = view.size(1), view.size(2)
        rows = view.size(0) * heads
        block_r, block_d = _blocks(width)
        blocks = triton.cdiv(rows, block_r)
        programs = min(blocks, _programs_per_device(dy.device.index or 0) if dy.is_cuda else 8)
        per_program = triton.cdiv(blocks, programs)
        dx = torch.empty(ctx.shape, dtype=dy.dtype, device=dy.device)
        partial = torch.empty(programs, width, dtype=torch.float32, device=dy.device)
        _backward[(programs,)](dy.contiguous(), view, weight, rstd, dx, partial, rows, heads, view.stride(0),
                               view.stride(1), width, ctx.offset, per_program, BLOCK_R=block_r, BLOCK_D=block_d)
        return dx, partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``rms_norm(x) * (offset + weight)`` over the last dimension, in fp32, rounded once to ``x``'s dtype."""
    return _RMSNorm.apply(x, weight, eps, offset)
