"""Weight-gradient accumulation into fp32 ``main_grad`` without apex: the kernel Megatron's linears call.

With ``gradient_accumulation_fusion`` Megatron's parallel linears add each micro-batch's weight gradient straight
into the fp32 ``main_grad`` buffer with apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` (one
GEMM with beta = 1), instead of producing a bf16 gradient that DDP's hook then adds to ``main_grad`` (a second
pass over the weight). torch's ``addmm(..., out_dtype=torch.float32)`` is the same GEMM (bf16 inputs, fp32
output and accumulation) on CUDA: perf-notes measured fc1 362 -> 287 us and qkv 218 -> 102 us on an H100 per
micro-batch. ``models.native.install`` puts this module in apex's place when apex is missing.

On CPU there is no ``out_dtype`` addmm; the fallback upcasts and accumulates with ``addmm_`` (CPU runs keep the
fusion off anyway: Megatron's linear allocates its placeholder gradient with ``torch.cuda.current_device()``).

Grouped MoE experts have no accumulating GEMM in torch (``torch._grouped_mm`` writes its own dtype): on CUDA ours
is a Triton kernel into fp32 (``grouped_wgrad.py``); on CPU, and into a bf16 ``main_grad``, their weight gradient is
computed and then added.
"""

from __future__ import annotations

import torch


def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad += grad_output^T @ total_input, accumulated in main_grad's dtype."""
    if main_grad.is_cuda and total_input.dtype != main_grad.dtype:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's signature: inputs ``[tokens, in]`` and ``[tokens, out]`` (2-D), ``main_grad`` ``[out, in]`` fp32."""
    _accumulate(total_input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same for a bf16/fp16 ``main_grad`` (``accumulate_allreduce_grads_in_fp32: false``)."""
    main_grad.addmm_(grad_output.t(), total_input)


def placeholder_grad(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """What a backward returns for a weight whose gradient it added to ``main_grad`` itself, as Megatron's linears
    do: where DDP marks the parameter (``grad_added_to_main_grad``), a placeholder keeps DDP's hook on the main
    backward thread and the flag tells it the gradient is already there; else no gradient."""
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    return (torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty)(param.shape, dtype=dtype,
                                                                                    device=param.device)


def add_grouped_wgrad(main_grad: torch.Tensor, x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor) -> None:
    """``main_grad[e] += x[rows of e]^T @ grad[rows of e]`` for a grouped GEMM's weight (``ends``: its ``offs``)."""
    if main_grad.is_cuda and main_grad.dtype == torch.float32:  # bf16 main grads: accumulate_allreduce_grads_in_fp32
        # here: Triton comes with CUDA builds of torch only
        from .grouped_wgrad import grouped_wgrad_accumulate

        grouped_wgrad_accumulate(x, grad, ends, main_grad)
    else:
        main_grad.add_(torch._grouped_mm(x.t(), grad, offs=ends))


def available() -> bool:
    """Whether the fused accumulation can run here: CUDA, and torch's ``addmm`` with ``out_dtype`` (seen in 2.11)."""
    from packaging.version import Version  # here: only this check needs it

    return torch.cuda.is_available() and Version(torch.__version__.split("+")[0]) >= Version("2.11")
