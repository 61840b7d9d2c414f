"""The FP8 cast as one Triton kernel: scale, saturate and round a bf16 matrix to FP8, written as it is, transposed,
or both in the same pass.

``torch._scaled_mm`` takes its first operand row-major and its second column-major, so each GEMM of a linear layer
wants its operands laid out along the dimension it contracts: the forward contracts the input over its features,
the weight gradient over its tokens. Written with torch ops the cast is four passes over the tensor (upcast, scale,
clamp, round) and a transpose a fifth, and the scale and its inverse three more launches; here one kernel reads the
bf16 tensor once, writes one byte per element for each layout asked for and the inverse scales beside, from the
absolute maximum alone. With a scale per row of an activation (the rowwise recipe, the experts' tokens) the maximum
itself is taken in the same kernel (``cast_rows``): a block of rows is read for its maxima and read again for the
cast while it is still in L2, one pass over HBM instead of two. Its divisions round as torch's: its inverse scales
are the torch fallback's (``fp8.cast_torch``) bit for bit, its data within one FP8 step (tests/gpu/test_fp8_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK = 64


@triton.jit(do_not_specialize=["m", "m_out"])
def _cast(x_ptr, amax_ptr, out_ptr, out_t_ptr, inv_ptr, seen_ptr, m, m_out, n, stride_x, stride_batch,
          FP8_MAX: tl.constexpr, EPS: tl.constexpr, AXIS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
          SEEN: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)  # a stack of matrices (the experts' weights): one after the other
    x_ptr += batch * stride_batch
    out_ptr += batch * m_out * n
    out_t_ptr += batch * m_out * n
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (rm < m)[:, None] & (rn < n)[None, :]
    kept = (rm < m_out)[:, None] & (rn < n)[None, :]  # rows m .. m_out: zeros (the GEMMs' alignment)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rn[None, :], mask=live, other=0.0).to(tl.float32)
    if SEEN:  # delayed scaling: this tensor's absolute maximum, for the scales of the steps to come, spread over
        # SLOTS addresses (thousands of blocks on one address wait on each other's atomics)
        slot = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) % SLOTS
        tl.atomic_max(seen_ptr + slot, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    # the scale FP8_MAX / amax and its inverse, correctly rounded as torch divides (the fallback's bits)
    if AXIS == 0:  # one scale for the tensor
        a = tl.maximum(tl.load(amax_ptr).to(tl.float32), EPS)
        y = x * tl.fdiv(a * 0 + FP8_MAX, a, ieee_rounding=True)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (batch == 0):
            tl.store(inv_ptr, tl.fdiv(a, a * 0 + FP8_MAX, ieee_rounding=True))
    elif AXIS == 1:  # a scale per row
        a = tl.maximum(tl.load(amax_ptr + batch * m + rm, mask=rm < m, other=1.0).to(tl.float32), EPS)
        y = x * tl.fdiv(a * 0 + FP8_MAX, a, ieee_rounding=True)[:, None]
        if tl.program_id(1) == 0:  # the zero rows' scale: 1
            inv = tl.where(rm < m, tl.fdiv(a, a * 0 + FP8_MAX, ieee_rounding=True), 1.0)
            tl.store(inv_ptr + batch * m_out + rm, inv, mask=rm < m_out)
    else:  # a scale per column
        a = tl.maximum(tl.load(amax_ptr + batch * n + rn, mask=rn < n, other=1.0).to(tl.float32), EPS)
        y = x * tl.fdiv(a * 0 + FP8_MAX, a, ieee_rounding=True)[None, :]
        if tl.program_id(0) == 0:
            tl.store(inv_ptr + batch * n + rn, tl.fdiv(a, a * 0 + FP8_MAX, ieee_rounding=True), mask=rn < n)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if ROWS:
        tl.store(out_ptr + rm[:, None].to(tl.int64) * n + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=kept)
    if COLS:
        tl.store(out_t_ptr + rn[:, None].to(tl.int64) * m_out + rm[None, :],
                 tl.trans(y).to(out_t_ptr.dtype.element_ty), mask=tl.trans(kept))


def cast(x: torch.Tensor, amax: torch.Tensor, axis: int, dtype: torch.dtype, rows: bool, cols: bool,
         m_out: int | None = None, eps: float = 1e-12, seen: torch.Tensor | None = None
         ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``x`` [m, n] or [batch, m, n] (unit stride along n) scaled to ``dtype``'s range by its absolute maximum
    ``amax`` (axis 0: one, 1: [(batch,) m] per row, 2: [(batch,) n] per column), saturated and rounded:
    ([m_out, n] if ``rows``, [n, m_out] if ``cols``) per matrix, contiguous, rows from m to ``m_out`` (default m)
    zeros; and the inverse scales (0-dim, [(batch,) m_out] or [(batch,) n] fp32). ``seen`` (fp32, contiguous; axis
    0): its elements raised so that their maximum is at least x's own absolute maximum, in the same pass (delayed
    scaling's record)."""
    *batch, m, n = x.shape
    m_out = m if m_out is None else m_out
    count = batch[0] if batch else 1
    out = torch.empty((*batch, m_out, n), dtype=dtype, device=x.device) if rows else None
    out_t = torch.empty((*batch, n, m_out), dtype=dtype, device=x.device) if cols else None
    inv = torch.empty((), dtype=torch.float32, device=x.device) if axis == 0 else \
        torch.empty((*batch, m_out if axis == 1 else n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m_out, BLOCK), triton.cdiv(n, BLOCK), count)
    _cast[grid](x, amax, out if rows else out_t, out_t if cols else out, inv, inv if seen is None else seen, m,
                m_out, n, x.stride(-2), x.stride(0) if batch else 0, FP8_MAX=torch.finfo(dtype).max, EPS=eps,
                AXIS=axis, ROWS=rows, COLS=cols, SEEN=seen is not None, SLOTS=1 if seen is None else seen.numel(),
                BLOCK_M=BLOCK, BLOCK_N=BLOCK)
    return out, out_t, inv


@triton.jit(do_not_specialize=["m", "m_out", "n"])
def _cast_rows(x_ptr, out_ptr, inv_ptr, m, m_out, n, stride_x, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = rm[:, None].to(tl.int64)
    a = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + rows * stride_x + rn[None, :], mask=(rm < m)[:, None] & (rn < n)[None, :], other=0.0)
        a = tl.maximum(a, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    a = tl.maximum(a, EPS)
    scale = tl.fdiv(a * 0 + FP8_MAX, a, ieee_rounding=True)
    tl.store(inv_ptr + rm, tl.where(rm < m, tl.fdiv(a, a * 0 + FP8_MAX, ieee_rounding=True), 1.0), mask=rm < m_out)
    for start in range(0, n, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + rows * stride_x + rn[None, :], mask=(rm < m)[:, None] & (rn < n)[None, :], other=0.0)
        y = tl.minimum(tl.maximum(x.to(tl.float32) * scale[:, None], -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + rows * n + rn[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=(rm < m_out)[:, None] & (rn < n)[None, :])


def cast_rows(x: torch.Tensor, dtype: torch.dtype, m_out: int | None = None, eps: float = 1e-12
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [m, n] (unit stride along n) with a scale per row from the row's own absolute maximum, as ``cast``
    with axis 1 and that maximum: ([m_out, n] FP8, rows m .. m_out zeros; [m_out] fp32 inverse scales, 1 there)."""
    m, n = x.shape
    m_out = m if m_out is None else m_out
    out = torch.empty((m_out, n), dtype=dtype, device=x.device)
    inv = torch.empty((m_out,), dtype=torch.float32, device=x.device)
    block_m = 8
    _cast_rows[(triton.cdiv(m_out, block_m),)](x, out, inv, m, m_out, n, x.stride(0), FP8_MAX=torch.finfo(dtype).max,
                                              EPS=eps, BLOCK_M=block_m, BLOCK_N=512)
    return out, inv
