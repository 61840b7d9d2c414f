"""The grouped experts' weight gradients accumulated straight into fp32 ``main_grad``: one Triton kernel.

An expert's weight gradient is ``x_e^T @ g_e`` over the ~256 rows a micro-batch routes to it, so the GEMM is small
and its output large: on the Qwen3-30B-A3B shape 604M values per layer per micro-batch. ``torch._grouped_mm`` can only
write it in bf16 (1.2 GB), which an add then reads again beside the fp32 ``main_grad`` (read and written, 4.8 GB):
6 GB of traffic per layer and micro-batch, 89 ms of a 656 ms step on an H200 at 8 layers. This kernel is the GEMM
with beta = 1 that apex's ``wgrad_gemm_accum_fp32`` is for the dense linears: each program loads a tile of
``main_grad[e]``, adds the expert's rows' product to it in fp32, and stores it — 4.8 GB, no bf16 intermediate (and
no rounding of the gradient to bf16 before it is summed). Experts that got no rows are not touched.

Programs run expert by expert, so the ones on the GPU at a time read the same expert's rows from L2. CUDA only
(``wgrad.add_grouped_wgrad`` computes and adds on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Measured on an H200 over 22 tile shapes at ~256 rows per expert (the two GEMMs of the Qwen3-30B-A3B shape): 64 x 128
# output tiles, 64 rows a step, 4 warps, the main_grad tile loaded before the loop. fc1 1.45 -> 1.20 ms, fc2 0.74 ->
# 0.62 ms against the grouped GEMM and the add; 8-warp and 128 x 128 x 64 tiles were slower than both.
BLOCK_K, BLOCK_N, BLOCK_T, WARPS, STAGES = 64, 128, 64, 4, 3


@triton.jit
def _accumulate_kernel(x_ptr, g_ptr, ends_ptr, out_ptr, K, N, stride_x, stride_g,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    expert = pid // (tiles_k * tiles_n)
    tile = pid % (tiles_k * tiles_n)
    tk, tn = tile // tiles_n, tile % tiles_n
    end = tl.load(ends_ptr + expert).to(tl.int64)
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    if end > start:
        ks = tk * BLOCK_K + tl.arange(0, BLOCK_K)
        ns = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_T)
        where = out_ptr + expert.to(tl.int64) * K * N + ks[:, None] * N + ns[None, :]
        inside = (ks[:, None] < K) & (ns[None, :] < N)
        acc = tl.load(where, mask=inside, other=0.0)
        for t in range(start, end, BLOCK_T):
            r = t + rows
            live = r < end
            xt = tl.load(x_ptr + r[:, None] * stride_x + ks[None, :], mask=live[:, None] & (ks[None, :] < K),
                         other=0.0)
            gt = tl.load(g_ptr + r[:, None] * stride_g + ns[None, :], mask=live[:, None] & (ns[None, :] < N),
                         other=0.0)
            acc = tl.dot(tl.trans(xt), gt, acc)
        tl.store(where, acc, mask=inside)


def grouped_wgrad_accumulate(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad[e] += x[rows of e]^T @ grad[rows of e]``: ``x`` [rows, K], ``grad`` [rows, N] (bf16/fp16, rows
    grouped by expert), ``ends`` int32 [experts] (where each expert's rows end), ``main_grad`` [experts, K, N] fp32."""
    experts, k, n = main_grad.shape
    if not main_grad.is_contiguous() or main_grad.dtype != torch.float32:
        raise ValueError(f"main_grad must be a contiguous fp32 tensor, got {main_grad.dtype}")
    x, grad = x.contiguous(), grad.contiguous()
    grid = (experts * triton.cdiv(k, BLOCK_K) * triton.cdiv(n, BLOCK_N),)
    _accumulate_kernel[grid](x, grad, ends, main_grad, k, n, x.stride(0), grad.stride(0),
                             BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, BLOCK_T=BLOCK_T, num_warps=WARPS, num_stages=STAGES)
