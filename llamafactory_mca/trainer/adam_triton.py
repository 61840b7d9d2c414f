"""AdamW over a bf16 weight, its 16-bit remainder and 16-bit moments in one pass (``exp_avg_dtype: bf16``).

With fp32 moments the remainders' Adam rebuilds each fp32 master, runs torch's fused AdamW on it and splits it back
(``param_remainders.py``): three passes, 44 bytes moved per parameter, so that the masters stay bit for bit those of
the plain path. Moments kept in bf16 (as DeepSeek-V3 trained; Megatron's ``exp_avg_dtype`` / ``exp_avg_sq_dtype``
with Transformer Engine's FusedAdam) give that up anyway, so their step may as well be one kernel: it reads the weight,
the remainder, the fp32 gradient and both moments, updates in fp32 and writes them back, 20 bytes per parameter
against the plain path's ~38 (fused AdamW and the copy into the bf16 weights). The math is torch's AdamW's, in fp32;
a moment is rounded to nearest-even as it is stored, the master split as ``param_remainders.split`` splits it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK = 2048


@triton.jit
def _adamw(low_ptr, rest_ptr, grad_ptr, m_ptr, v_ptr, step_ptr, n, lr, beta1, beta2, eps, weight_decay,
           DECOUPLED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    t = tl.load(step_ptr).to(tl.float32) + 1.0  # the counter before this step, as torch increments it first
    high = tl.load(low_ptr + i, mask=live, other=0).to(tl.int32)
    rest = tl.load(rest_ptr + i, mask=live, other=0).to(tl.int32)
    master = (high * 65536 + rest).to(tl.float32, bitcast=True)
    g = tl.load(grad_ptr + i, mask=live, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + i, mask=live, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + i, mask=live, other=0.0).to(tl.float32)
    if DECOUPLED:
        master = master * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * master
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    correction1 = 1.0 - tl.exp2(t * tl.log2(beta1))
    correction2 = 1.0 - tl.exp2(t * tl.log2(beta2))
    master = master - (lr / correction1) * m / (tl.sqrt(v) / tl.sqrt(correction2) + eps)
    bits = master.to(tl.int32, bitcast=True)
    rounded = (bits + 32768) >> 16  # arithmetic: floor, as the torch split divides
    tl.store(low_ptr + i, rounded.to(tl.int16), mask=live)
    tl.store(rest_ptr + i, (bits - rounded * 65536).to(tl.int16), mask=live)
    tl.store(m_ptr + i, m.to(m_ptr.dtype.element_ty), mask=live)
    tl.store(v_ptr + i, v.to(v_ptr.dtype.element_ty), mask=live)


def adamw_step(low: torch.Tensor, rest: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, decoupled: bool) -> None:
    """One step on contiguous CUDA tensors of one parameter shard, in place: ``low`` its bf16 weight, ``rest`` the
    int16 remainder, ``grad`` fp32, the moments bf16 or fp32; ``step`` the counter before this step (not advanced)."""
    n = low.numel()
    if n:
        _adamw[(triton.cdiv(n, BLOCK),)](low.view(torch.int16), rest, grad, exp_avg, exp_avg_sq, step, n, lr, beta1,
                                         beta2, eps, weight_decay, DECOUPLED=decoupled, BLOCK=BLOCK, num_warps=8)
