"""The cross-entropy's two passes over the logits (``cross_entropy.py``) as Triton kernels: per row the max and the
sum of ``exp(logit - max)``, and the gradient ``(softmax - onehot(target)) * grad``.

They were torch.compile'd: four graphs (each direction, then again when the row count changed) took 2.7 s of a MoE
run's first step on a fresh machine's empty compile cache (one H200, ``benchmarks/results/h200_first_step_triton``),
and every later launch traced them again. A Triton kernel compiles once per machine in well under a second.

One program per row walks the vocabulary ``BLOCK_V`` columns at a time, reading the bf16 logits once per pass. The
forward keeps a running max and rescales the running sum when the max grows (one ``exp`` per logit); a column of
``-inf`` (a tensor-parallel slice's vocabulary padding) adds nothing, and a row of them only is (-inf, 0).

Gemma's soft-capped logits (``cap``: ``cap * tanh(logit / cap)``) are capped here, in fp32, as each block is read:
the capped copy and tanh's output, each as big as the logits, are never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK_V = 4096


@triton.jit
def _tanh(z):
    return 2 * tl.sigmoid(2 * z) - 1


@triton.jit
def _capped(x, CAP: tl.constexpr):
    """The logits as the loss sees them, and their derivative by the raw ones (-inf stays -inf, derivative 0)."""
    if CAP > 0:
        t = _tanh(x / CAP)
        y = tl.where(x == float("-inf"), x, CAP * t)
        slope = 1 - t * t
    else:
        y = x
        slope = tl.full(x.shape, 1.0, tl.float32)
    return y, slope


@triton.jit
def _row_stats(x_ptr, max_ptr, sum_ptr, stride, vocab, CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        x, _ = _capped(tl.load(x_ptr + row * stride + v, mask=v < vocab, other=float("-inf")).to(tl.float32), CAP)
        new_max = tl.maximum(running_max, tl.max(x, 0))
        rescale = tl.where(new_max == float("-inf"), 1.0, tl.exp(running_max - new_max))
        e = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_max))
        running_sum = running_sum * rescale + tl.sum(e, 0)
        running_max = new_max
    tl.store(max_ptr + row, running_max)
    tl.store(sum_ptr + row, running_sum)


@triton.jit
def _grad(x_ptr, lse_ptr, g_ptr, t_ptr, out_ptr, stride, vocab, CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    target = tl.load(t_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        x, slope = _capped(tl.load(x_ptr + row * stride + v, mask=v < vocab, other=float("-inf")).to(tl.float32),
                           CAP)
        p = tl.exp(x - lse) - (v == target).to(tl.float32)
        tl.store(out_ptr + row * vocab + v, (p * g * slope).to(out_ptr.dtype.element_ty), mask=v < vocab)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def row_stats(logits: torch.Tensor, cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``[rows, vocab]``: max and sum of exp(logit - max), in fp32 (of the capped logits, given a cap)."""
    logits = _rows(logits)
    rows, vocab = logits.shape
    row_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
    sum_exp = torch.empty_like(row_max)
    if rows:
        _row_stats[(rows,)](logits, row_max, sum_exp, logits.stride(0), vocab, CAP=float(cap or 0), BLOCK_V=BLOCK_V,
                            num_warps=8)
    return row_max, sum_exp


def grad(logits: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor, target: torch.Tensor,
         cap: float | None = None) -> torch.Tensor:
    """d loss / d logits = (softmax - onehot(target)) * grad per row, in fp32, returned in the logits' dtype;
    ``target`` is a column of this slice or -1; given a cap, by the raw logits through the cap."""
    logits = _rows(logits)
    rows, vocab = logits.shape
    out = torch.empty(rows, vocab, dtype=logits.dtype, device=logits.device)
    if rows:
        _grad[(rows,)](logits, lse.contiguous(), grad_loss.float().contiguous(), target.contiguous(), out,
                       logits.stride(0), vocab, CAP=float(cap or 0), BLOCK_V=BLOCK_V, num_warps=8)
    return out
