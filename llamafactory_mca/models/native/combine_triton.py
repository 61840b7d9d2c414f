"""The MoE combine (``dispatch.py``): each token's ``topk`` expert rows gathered and summed as they are read, in fp32,
rounded once, as one Triton kernel.

It was torch.compile'd: its graphs (forward and the permute's backward, at two shapes) took 2.7 s of a MoE run's
first step on a fresh machine's empty compile cache (one H200, ``benchmarks/results/h200_first_step_triton``), and
every later launch traced them again. A Triton kernel compiles once per machine in well under a second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK_H = 1024


@triton.jit
def _gather_sum(rows_ptr, index_ptr, out_ptr, width, stride, topk, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = h < width
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(0, topk):
        row = tl.load(index_ptr + token * topk + k).to(tl.int64)
        total += tl.load(rows_ptr + row * stride + h, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * width + h, total.to(out_ptr.dtype.element_ty), mask=live)


def gather_sum(rows: torch.Tensor, rows_of_token: torch.Tensor, topk: int) -> torch.Tensor:
    """``[tokens·topk, h]`` rows → ``[tokens, h]``: token t's rows ``rows_of_token[t·topk : (t+1)·topk]`` summed."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    tokens, width = rows_of_token.numel() // topk, rows.size(-1)
    out = torch.empty(tokens, width, dtype=rows.dtype, device=rows.device)
    if tokens:
        _gather_sum[(tokens, triton.cdiv(width, BLOCK_H))](rows, rows_of_token.contiguous(), out, width,
                                                          rows.stride(0), topk, BLOCK_H=BLOCK_H)
    return out
