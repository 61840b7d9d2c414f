"""Kernel launches, host synchronisations and GPU busy share of profiled training steps, counted one way for
``profile_step.py`` and the end-to-end bench, so their numbers can be set side by side."""

from __future__ import annotations


# runtime and driver entry points that put one kernel on a stream: one call is one launch
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
# calls on which the host waits for the GPU
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def step_counts(events, steps: int, seconds: float, cuda: bool) -> dict:
    """Per-step numbers of ``events`` (a finished profile's ``key_averages()``) over ``steps`` steps that took
    ``seconds`` of wall time in all.

    Without the CUDA activity nothing ran on a GPU, so launches and busy share are None rather than a zero that
    would read as a measurement. Kernel time is the self device time of the device events alone: an aten op's self
    device time repeats its kernels'. It sums over streams, so kernels overlapping on several streams (communication
    beside compute) can put the busy share above 1."""
    if not cuda:
        return {"step_ms": round(seconds / steps * 1e3, 3), "launches_per_step": None, "syncs_per_step": None,
                "memcpy_per_step": None, "kernel_ms_per_step": None, "gpu_busy": None}
    import torch

    calls = {e.key: e.count for e in events}
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"step_ms": round(seconds / steps * 1e3, 3),
            "launches_per_step": sum(calls.get(k, 0) for k in LAUNCHES) / steps,
            "syncs_per_step": sum(calls.get(k, 0) for k in SYNCS) / steps,
            "memcpy_per_step": calls.get("cudaMemcpyAsync", 0) / steps,  # device-to-host ones wait for the GPU too
            "kernel_ms_per_step": round(kernel_us / 1e3 / steps, 3),
            "gpu_busy": round(kernel_us / 1e6 / seconds, 4) if seconds > 0 else None}
