"""The FP8 cast as one Triton kernel: scale, saturate and round a bf16 matrix to FP8, written as it is, transposed,
or both in the same pass.

``torch._scaled_mm`` takes its first operand row-major and its second column-major, so each GEMM of a linear layer
wants its operands laid out along the dimension it contracts: the forward contracts the input over its features,
the weight gradient over its tokens. Written with torch ops the cast is four passes over the tensor (upcast, scale,
clamp, round) and a transpose a fifth; here it reads the bf16 tensor once and writes one byte per element for each
layout asked for. The scale is computed beforehand (``fp8.py``), so the rounding is the torch fallback's to the bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK = 64


@triton.jit(do_not_specialize=["m", "m_out"])
def _cast(x_ptr, scale_ptr, out_ptr, out_t_ptr, m, m_out, n, stride_x, stride_batch, FP8_MAX: tl.constexpr,
          AXIS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)  # a stack of matrices (the experts' weights): one after the other
    x_ptr += batch * stride_batch
    out_ptr += batch * m_out * n
    out_t_ptr += batch * m_out * n
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (rm < m)[:, None] & (rn < n)[None, :]
    kept = (rm < m_out)[:, None] & (rn < n)[None, :]  # rows m .. m_out: zeros (the GEMMs' alignment)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rn[None, :], mask=live, other=0.0).to(tl.float32)
    if AXIS == 0:  # one scale for the tensor
        y = x * tl.load(scale_ptr)
    elif AXIS == 1:  # a scale per row
        y = x * tl.load(scale_ptr + batch * m + rm, mask=rm < m, other=1.0)[:, None]
    else:  # a scale per column
        y = x * tl.load(scale_ptr + batch * n + rn, mask=rn < n, other=1.0)[None, :]
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if ROWS:
        tl.store(out_ptr + rm[:, None].to(tl.int64) * n + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=kept)
    if COLS:
        tl.store(out_t_ptr + rn[:, None].to(tl.int64) * m_out + rm[None, :],
                 tl.trans(y).to(out_t_ptr.dtype.element_ty), mask=tl.trans(kept))


def cast(x: torch.Tensor, scale: torch.Tensor, axis: int, dtype: torch.dtype, rows: bool, cols: bool,
         m_out: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``x`` [m, n] or [batch, m, n] (unit stride along n) times ``scale`` (0: one, 1: [(batch,) m], 2: [(batch,)
    n]), saturated and rounded to ``dtype``: ([m_out, n] if ``rows``, [n, m_out] if ``cols``) per matrix,
    contiguous; rows from m to ``m_out`` (default m) are zeros."""
    *batch, m, n = x.shape
    m_out = m if m_out is None else m_out
    count = batch[0] if batch else 1
    out = torch.empty((*batch, m_out, n), dtype=dtype, device=x.device) if rows else None
    out_t = torch.empty((*batch, n, m_out), dtype=dtype, device=x.device) if cols else None
    grid = (triton.cdiv(m_out, BLOCK), triton.cdiv(n, BLOCK), count)
    _cast[grid](x, scale, out if rows else out_t, out_t if cols else out, m, m_out, n, x.stride(-2),
                x.stride(0) if batch else 0, FP8_MAX=torch.finfo(dtype).max, AXIS=axis, ROWS=rows, COLS=cols,
                BLOCK_M=BLOCK, BLOCK_N=BLOCK)
    return out, out_t
