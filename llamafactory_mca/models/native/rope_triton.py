"""Megatron's (non-interleaved) rotary embedding as one Triton kernel per direction, for ``apply_rope_fusion``.

It replaces a torch.compile'd rotation whose graphs (q and k, forward and backward) took 10 s of a MoE run's first
step on an empty compile cache (``norm_triton.py`` says why that matters). Each program takes ``BLOCK_T`` tokens:
it reads each token's frequencies once (row ``positions[token]`` for packed batches, else ``token // div``), rounds
cos and sin to the input's dtype as megatron-core's ``_apply_rotary_pos_emb_bshd`` does, and rotates every head of
those tokens in fp32: ``(x1, x2) -> (x1 cos_a - x2 sin_a, x2 cos_b + x1 sin_b)`` over the first ``rotary`` columns
(``a``, ``b`` the two halves of the frequencies), the rest copied. The backward is the transpose,
``(g1 cos_a + g2 sin_b, g2 cos_b - g1 sin_a)``. The input is read through its (token, head) strides.

The direction and the token and head counts are arguments, not specialisations: one compiled kernel serves q and k
both ways, where Triton would compile four (~0.5 s each, step 1 on a fresh machine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_triton import rows_view


BLOCK_T = 8  # tokens per program


@triton.jit(do_not_specialize=["tokens", "heads", "div", "backward"])
def _rotate(x_ptr, f_ptr, pos_ptr, y_ptr, tokens, heads, stride_tok, stride_head, width, half, div, backward,
            HAS_POSITIONS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    live_t = t < tokens
    if HAS_POSITIONS:
        row = tl.load(pos_ptr + t, mask=live_t, other=0).to(tl.int64)
    else:
        row = t // div
    c = tl.arange(0, BLOCK_H)
    live = live_t[:, None] & (c < half)[None, :]
    fa = tl.load(f_ptr + row[:, None] * (2 * half) + c[None, :], mask=live, other=0.0).to(tl.float32)
    fb = tl.load(f_ptr + row[:, None] * (2 * half) + half + c[None, :], mask=live, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    cos_a, sin_a = tl.cos(fa).to(dtype).to(tl.float32), tl.sin(fa).to(dtype).to(tl.float32)
    cos_b, sin_b = tl.cos(fb).to(dtype).to(tl.float32), tl.sin(fb).to(dtype).to(tl.float32)
    # y1 = x1 cos_a + x2 s1, y2 = x2 cos_b + x1 s2: the rotation, or (backward) its transpose
    s1 = tl.where(backward != 0, sin_b, -sin_a)
    s2 = tl.where(backward != 0, -sin_a, sin_b)
    for h in range(0, heads):
        src = x_ptr + t[:, None] * stride_tok + h * stride_head
        dst = y_ptr + (t[:, None] * heads + h) * width
        x1 = tl.load(src + c[None, :], mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + c[None, :], mask=live, other=0.0).to(tl.float32)
        y1 = x1 * cos_a + x2 * s1
        y2 = x2 * cos_b + x1 * s2
        tl.store(dst + c[None, :], y1.to(dtype), mask=live)
        tl.store(dst + half + c[None, :], y2.to(dtype), mask=live)
        if BLOCK_P > 0:  # the columns past the rotary ones, copied
            p = tl.arange(0, BLOCK_P) + 2 * half
            live_p = live_t[:, None] & (p < width)[None, :]
            tl.store(dst + p[None, :], tl.load(src + p[None, :], mask=live_p, other=0.0), mask=live_p)


def _launch(x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor | None, div: int, backward: bool
            ) -> torch.Tensor:
    view, heads, stride_tok, stride_head = rows_view(x)
    tokens, width = view.size(0), view.size(2)
    rotary = freqs.size(-1)
    table = freqs.reshape(-1, rotary).contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_p = triton.next_power_of_2(width - rotary) if width > rotary else 0
    _rotate[(triton.cdiv(tokens, BLOCK_T),)](
        view, table, positions if positions is not None else table, y, tokens, heads, stride_tok, stride_head, width,
        rotary // 2, div, int(backward), HAS_POSITIONS=positions is not None, BLOCK_T=BLOCK_T,
        BLOCK_H=triton.next_power_of_2(rotary // 2), BLOCK_P=block_p)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, freqs, positions, div):
        ctx.save_for_backward(freqs, positions)
        ctx.div = div
        return _launch(x, freqs, positions, div, backward=False)

    @staticmethod
    def backward(ctx, grad):
        freqs, positions = ctx.saved_tensors
        return _launch(grad, freqs, positions, ctx.div, backward=True), None, None, None


def rotate(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Megatron's rotation of ``t`` by ``freqs``: packed ``t`` [tokens, heads, dim] with the frequency row of each
    token in ``positions``; padded ``t`` [s, b, heads, dim] with ``freqs`` [s, 1 or b, 1, rotary]."""
    div = 1
    if positions is None and freqs.size(1) == 1 and t.size(1) != 1:
        div = t.size(1)  # one frequency row for the b tokens of a position
    return _Rotary.apply(t, freqs, positions, div)
